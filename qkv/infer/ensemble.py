"""Ensembles: several models with one vocabulary translate together.

At every step each model reads the same target prefix (with its own key/value cache) and gives
its log-probabilities over the vocabulary; the ensemble's scores are their average. An
``Ensemble`` has the interface the searches use (``encode``, ``decode``, ``new_state``, ``config``,
``device``), so greedy search, beam search and sampling run on it unchanged; beam search's
``log_softmax`` renormalises the averaged log-probabilities (a geometric mean of the models'
distributions).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.io import checkpoint
from qkv.model.transformer import OutputSubset, Transformer
from qkv.data.text_tokenizer import TextTokenizer


class EnsembleMemory:
    """Each model's encoder output, (B, S, D_i); indexing selects the same sentences in all."""

    def __init__(self, parts: list[Tensor]) -> None:
        self.parts = parts

    def __getitem__(self, index) -> EnsembleMemory:
        return EnsembleMemory([memory[index] for memory in self.parts])


class EnsembleState:
    """Each model's ``DecoderState``, reordered together."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def reorder(self, index: Tensor, kinds: tuple[str, ...] = ("self", "cross")) -> None:
        for state in self.parts:
            state.reorder(index, kinds)


class Ensemble(nn.Module):
    """Models that share a vocabulary (checked), searched as one."""

    def __init__(self, models: list[Transformer]) -> None:
        super().__init__()
        first = models[0].config
        for i, model in enumerate(models[1:], 2):
            c = model.config
            if (c.src_vocab_size, c.tgt_vocab_size, c.pad_id) != (first.src_vocab_size, first.tgt_vocab_size, first.pad_id):
                raise QkvError(
                    f"model {i} has vocabularies of {c.src_vocab_size}/{c.tgt_vocab_size} (pad {c.pad_id}), model 1 "
                    f"{first.src_vocab_size}/{first.tgt_vocab_size} (pad {first.pad_id}): an ensemble needs one vocabulary"
                )
        self.models = nn.ModuleList(models)
        self.config = first.replace(max_len=min(m.config.max_len for m in models))  # what the searches read

    @property
    def device(self) -> torch.device:
        return self.models[0].device

    def encode(self, src: Tensor, *, need_weights: bool = False) -> tuple[EnsembleMemory, Tensor, list[Tensor]]:
        """src: (B, S). Every model's memory, the source mask (B, S) and no weights."""
        if need_weights:
            raise QkvError("an ensemble has no single set of attention weights: inspect one model at a time")
        outputs = [model.encode(src) for model in self.models]
        return EnsembleMemory([memory for memory, _, _ in outputs]), outputs[0][1], []

    def decode(
        self, tgt: Tensor, memory: EnsembleMemory, src_mask: Tensor, *, state: EnsembleState | None = None,
        need_weights: bool = False, vocab: OutputSubset | None = None,
    ) -> tuple[Tensor, None]:
        """The mean of the models' log-probabilities (B, T, V), in place of logits; with ``vocab``,
        each model's log-probabilities over those U ids alone (B, T, U)."""
        if need_weights:
            raise QkvError("an ensemble has no single set of attention weights: inspect one model at a time")
        states = [None] * len(self.models) if state is None else state.parts
        log_probs = [
            model.decode(tgt, part, src_mask, state=model_state, vocab=vocab)[0].float().log_softmax(dim=-1)
            for model, part, model_state in zip(self.models, memory.parts, states)
        ]  # M x (B, T, V)
        return torch.stack(log_probs).mean(dim=0), None

    def new_state(self, capacity: int = 16) -> EnsembleState:
        return EnsembleState([model.new_state(capacity) for model in self.models])


def load_ensemble(paths: list[str | Path], *, device: str | torch.device = "cpu") -> tuple[Transformer | Ensemble, TextTokenizer]:
    """One checkpoint as it is, or several as an ``Ensemble``: their tokenizers must be the same file."""
    loaded = [checkpoint.load(path, device=device) for path in paths]
    if len(loaded) == 1:
        return loaded[0].model, loaded[0].tokenizer
    first = (loaded[0].path / checkpoint.TOKENIZER).read_bytes()
    for other in loaded[1:]:
        if (other.path / checkpoint.TOKENIZER).read_bytes() != first:
            raise QkvError(
                f"{other.path} and {loaded[0].path} have different tokenizers: an ensemble needs one vocabulary "
                "(models trained on the same tokenizer, for example with --init-from or from one run's checkpoints)"
            )
    return Ensemble([item.model for item in loaded]), loaded[0].tokenizer
