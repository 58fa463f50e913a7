"""Forced decoding: how probable does the model find a given translation?

For a source x and a target y = (y_1 .. y_n), the model's log-probability of y is the sum over the
target tokens, EOS included, of log p(y_t | y_<t, x): one teacher-forced pass, no search. Uses:
re-ranking candidate translations, filtering noisy corpora (pairs the model finds improbable),
checking a model on references (corpus perplexity = exp(-total log-probability / total tokens)).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from qkv.errors import QkvError
from qkv.data.corpus import collate
from qkv.model.transformer import Transformer
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import length_batches


@dataclass
class PairScore:
    log_prob: float  # natural log of p(target | source), EOS included
    token_log_probs: list[float]  # one per target token, the last for EOS
    pieces: list[str]  # the target's subword pieces, then EOS

    @property
    def n_tokens(self) -> int:
        return len(self.token_log_probs)

    def line(self, *, tokens: bool = False) -> str:
        """``qkv score``'s output line: log-probability, tokens, log-probability per token, tab-separated;
        with ``tokens``, then each token's log-probability and the tokens, space-separated."""
        line = f"{self.log_prob:.4f}\t{self.n_tokens}\t{self.log_prob / self.n_tokens:.4f}"
        if tokens:
            line += "\t" + " ".join(f"{lp:.4f}" for lp in self.token_log_probs) + "\t" + " ".join(self.pieces)
        return line


def perplexity(scores: list[PairScore]) -> float:
    """exp(-(sum of log-probabilities) / (number of target tokens, EOS included)) over a corpus."""
    tokens = sum(s.n_tokens for s in scores)
    return math.exp(-sum(s.log_prob for s in scores) / tokens) if tokens else math.nan


def _truncated(ids: list[int], limit: int, side: str, line: int) -> list[int]:
    if len(ids) > limit:
        warnings.warn(f"line {line}: the {side} has {len(ids)} tokens; scored on its first {limit} (the model's positions)", stacklevel=3)
        return ids[:limit]
    return ids


def score_pairs(
    model: Transformer, tokenizer: TextTokenizer, sources: list[str], targets: list[str], *, max_tokens: int = 4096
) -> list[PairScore]:
    """The log-probability of each target given its source, in input order. One teacher-forced pass per
    batch of similar lengths; padding does not change a score. Longer sentences than the model's
    positions are cut to fit, with a warning."""
    if len(sources) != len(targets):
        raise QkvError(f"{len(sources)} sources but {len(targets)} targets: score needs one target per source")
    limit = model.config.max_len - 1  # room for EOS (source) and BOS/EOS (target)
    src_ids = [_truncated(tokenizer.encode(s), limit, "source", i + 1) for i, s in enumerate(sources)]
    tgt_ids = [_truncated(tokenizer.encode_target(t), limit, "target", i + 1) for i, t in enumerate(targets)]
    results = []
    for ids, token_log_probs in zip(tgt_ids, target_log_probs(model, tokenizer, src_ids, tgt_ids, max_tokens=max_tokens)):
        pieces = tokenizer.pieces([*ids, tokenizer.eos_id])
        results.append(PairScore(math.fsum(token_log_probs), token_log_probs, pieces))
    return results


@torch.inference_mode()
def target_log_probs(
    model: Transformer, tokenizer: TextTokenizer, src_ids: list[list[int]], tgt_ids: list[list[int]], *, max_tokens: int = 4096
) -> list[list[float]]:
    """For each pair of token ids, log p(y_t | y_<t, x) of each target token and then of EOS, in input
    order: one teacher-forced pass per batch of similar lengths. Both sides must fit the model's positions."""
    model.eval()
    device = next(model.parameters()).device
    lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
    results: list[list[float]] = [[] for _ in src_ids]
    for batch in length_batches(lengths, max_tokens=max_tokens, max_sentences=256):
        src, tgt_in, tgt_out = (t.to(device) for t in collate(
            [src_ids[i] for i in batch], [tgt_ids[i] for i in batch],
            pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        ))  # (B, S), (B, T), (B, T)
        log_probs = model(src, tgt_in).float().log_softmax(dim=-1)  # (B, T, V)
        chosen = log_probs.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)  # (B, T): log p(y_t | y_<t, x)
        for row, i in enumerate(batch):
            results[i] = chosen[row, : len(tgt_ids[i]) + 1].tolist()  # the target's tokens and EOS; then padding
    return results
