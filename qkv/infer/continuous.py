"""Continuous beam search: sentences join a running search as others finish (iteration-level batching).

A server's clients send a sentence and wait for its translation before they send the next, so the
sentences a batch could hold arrive one by one. Searched in batches, a batch runs until its longest
output is done while the sentences that came meanwhile wait, and its last steps decode a few rows
each. Here the search never stops: before each step the sentences that arrived join it (``add``),
and a sentence leaves as soon as its search is done (``step`` returns it), so every step decodes
every sentence there is.

Each sentence holds K rows, as in ``qkv.infer.search.beam_search``, whose rules it follows step for
step: the same candidates, the same finished hypotheses and the same stopping rule; what differs is
where the rows of a sentence stand. The self-attention caches hold one position for each step the
search has taken since the oldest sentence now searched joined; a sentence's rows start at the
position where it joined (its first token, BOS), and a bias of -inf hides the positions before it
(zeros in the cache, so that every product is finite). Each row reads its positional encoding at
its own position (``qkv.model.incremental.ragged_step``). A joining sentence's K rows all start at
BOS with the scores (0, -inf, ...), so only the first extends at its first step, as the batched
search decodes BOS once. The cross-attention caches hold each sentence's source keys and values,
padded to the longest source in the search (-inf past a sentence's own; shortened when it leaves). Positions no sentence reads any
more are dropped from the front of the caches when they would otherwise grow.

What it saves is the steps a batch takes with few rows left. On 2 CPU cores a step's cost grows
with its rows almost in proportion, so those steps cost little and it saved nothing: ``qkv serve
--batching continuous`` answered 32 clients 0.45x as fast as the batched call, the batches 0.48x
(docs/serving.md); it is an option, not the server's default.

Dimension legend: b sentences searched, K beam size, R = b * K rows, T positions cached, S source length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkv.infer.search import (
    DecodeConfig, Hypothesis, can_improve, beam_candidates, length_penalty, max_output_length, split_candidates,
)
from qkv.model.attention import KVCache
from qkv.model.incremental import cross_keys_values, ragged_step
from qkv.infer.translator import collate_sources
from qkv.model.transformer import Transformer


TRIM = 16  # cached positions no sentence reads any more, dropped from the front of the caches at this many


def supports(model: Any, config: DecodeConfig) -> bool:
    """Whether ``ContinuousBeamSearch`` searches ``config`` with ``model``: a ``Transformer`` (not an
    ensemble), beam search (not greedy or sampling), without the n-gram ban."""
    return (isinstance(model, Transformer) and config.beam_size > 1 and not config.sampling
            and not config.no_repeat_ngram_size)


@dataclass
class _Sentence:
    key: Any  # the caller's, returned with the sentence's hypotheses
    start: int  # the cache position of its first input (BOS)
    source: int  # its source tokens, EOS included
    limit: int  # output tokens at most
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most K


class ContinuousBeamSearch:
    """A beam search that sentences join (``add``) and leave (``step`` returns them) while it runs.

    Each sentence's hypotheses are those ``beam_search`` finds for it with the same ``config``
    (tested on a fixed set; the logits of a row can differ in the last bits with the rows beside it,
    as between two batchings of ``beam_search``). ``suppress``: token ids never appended. The model
    must be in eval mode; the search runs without gradients."""

    def __init__(self, model: Transformer, *, bos_id: int, eos_id: int, config: DecodeConfig,
                 suppress: tuple[int, ...] = ()) -> None:
        if not supports(model, config):
            raise ValueError("a continuous search is a Transformer's beam search without the n-gram ban")
        self.model, self.bos_id, self.eos_id, self.config = model, bos_id, eos_id, config
        self.suppress = list(suppress)
        self.K = config.beam_size
        self.sentences: list[_Sentence] = []
        self.length = 0  # T: positions in the self-attention caches
        device = model.device
        self.layers = [{"self": KVCache(64), "cross": KVCache()} for _ in model.decoder_layers]
        self.scores = torch.empty(0, self.K, device=device)  # (b, K) total log-probability of each beam
        self.history = torch.empty(0, self.K, 0, dtype=torch.long, device=device)  # (b, K, T) tokens, at their inputs' positions
        self.last = torch.empty(0, 1, dtype=torch.long, device=device)  # (R, 1) each row's newest token
        self.memory_bias = torch.empty(0, 1, 1, 0, dtype=model.tgt_embed.weight.dtype, device=device)  # (b, 1, 1, S), the model's dtype

    def __len__(self) -> int:
        return len(self.sentences)

    @torch.inference_mode()
    def add(self, sources: list[list[int]], keys: list[Any]) -> None:
        """Let the sentences ``sources`` (token ids, without EOS, none empty) join at the next step;
        ``keys``: what ``step`` returns with each one's hypotheses."""
        if not sources:
            return
        if any(not ids for ids in sources):
            raise ValueError("an empty source is not searched (its translation is empty)")
        model, K, device = self.model, self.K, self.model.device
        n, S_new = len(sources), max(len(ids) for ids in sources) + 1
        src = collate_sources(sources, pad_id=model.config.pad_id, eos_id=self.eos_id).to(device)  # (n, S_new)
        memory, src_mask, _ = model.encode(src)  # (n, S_new, D), (n, S_new)
        bias = torch.zeros(src_mask.shape, dtype=memory.dtype, device=device).masked_fill_(~src_mask, float("-inf"))
        S = max(S_new, self.memory_bias.size(-1))
        self.memory_bias = torch.cat([_pad(self.memory_bias, S, float("-inf")), _pad(bias[:, None, None, :], S, float("-inf"))])
        for layer, cache in zip(model.decoder_layers, self.layers):
            cache["cross"].join_memory(*cross_keys_values(layer.cross_attn, memory))  # (n, H, S_new, d) each
            cache["self"].join(n * K)
        first = torch.full((n, K), float("-inf"), device=device)
        first[:, 0] = 0.0  # only the first row of a new sentence extends at its first step
        self.scores = torch.cat([self.scores, first])
        self.history = torch.cat([self.history, self.history.new_zeros(n, K, self.length)])
        self.last = torch.cat([self.last, torch.full((n * K, 1), self.bos_id, dtype=torch.long, device=device)])
        for ids, key in zip(sources, keys):
            limit = max_output_length(model, len(ids) + 1, self.config)  # its tokens and EOS, as the batched search counts
            self.sentences.append(_Sentence(key, self.length, len(ids) + 1, limit))

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, list[Hypothesis]]]:
        """One decoding step of every sentence; returns (key, its ``n_best`` hypotheses) of those done."""
        if not self.sentences:
            return []
        model, K, config, device = self.model, self.K, self.config, self.model.device
        b = len(self.sentences)
        self._make_room()
        starts = torch.tensor([s.start for s in self.sentences], device=device)  # (b,)
        T = self.length + 1  # the positions once this step's are appended
        row_starts = starts.repeat_interleave(K)  # (R,)
        positions = self.length - row_starts  # (R,) each row's position in its own output
        self_bias = torch.zeros(b * K, T, dtype=self.memory_bias.dtype, device=device).masked_fill_(
            torch.arange(T, device=device) < row_starts[:, None], float("-inf"))[:, None, None, :]  # (R, 1, 1, T), the model's dtype
        hidden = ragged_step(model, self.last, positions, self.memory_bias, self_bias, self.layers)
        self.length = T
        log_probs = model.generator(hidden)[:, -1].float().log_softmax(dim=-1).view(b, K, -1)  # (b, K, V)
        if self.suppress:
            log_probs[:, :, self.suppress] = float("-inf")
        top, beam, token = beam_candidates(self.scores, log_probs, min(2 * K, K * log_probs.size(2)))  # (b, 2K)
        steps = (positions.view(b, K)[:, 0]).tolist()  # (b,) each sentence's step, from 0
        final_step = [t == s.limit - 1 for t, s in zip(steps, self.sentences)]
        finishing, stays = split_candidates(top, token, k=K, eos_id=self.eos_id, last_step=torch.tensor(final_step, device=device))

        rows, ranks = finishing.nonzero(as_tuple=True)  # host work only for the candidates that end this step
        if rows.numel():
            ended = zip(rows.tolist(), ranks.tolist(), top[rows, ranks].tolist(), token[rows, ranks].tolist(),
                        beam[rows, ranks].tolist())
            for row, rank, score, t, j in ended:
                sentence = self.sentences[row]
                hyps = sentence.finished
                normalized = score / length_penalty(steps[row] + 1, config.length_penalty)
                if len(hyps) == K and normalized <= hyps[-1].score:
                    continue
                tokens = self.history[row, j, sentence.start : self.length - 1].tolist() + ([] if t == self.eos_id else [t])
                hyps.append(Hypothesis(tokens, normalized, score))
                hyps.sort(key=lambda h: h.score, reverse=True)
                del hyps[K:]

        slots = (~stays).to(torch.int8).argsort(dim=1, stable=True)[:, :K]  # (b, K) ranks of the live candidates
        live = stays.gather(1, slots)
        new_scores = top.gather(1, slots).masked_fill(~live, float("-inf"))
        new_beam = beam.gather(1, slots).masked_fill(~live, 0)
        new_token = token.gather(1, slots).masked_fill(~live, self.eos_id)
        source_rows = (torch.arange(b, device=device)[:, None] * K + new_beam).view(-1)  # (R,)
        self.history = torch.cat([self.history.view(b * K, -1)[source_rows].view(b, K, -1), new_token[..., None]], dim=2)
        self.scores, self.last = new_scores, new_token.view(-1, 1)

        best_live = new_scores[:, 0].tolist()
        done = [r for r, s in enumerate(self.sentences)
                if final_step[r] or not can_improve(s.finished, best_live[r], s.limit, config)]
        out = [(self.sentences[r].key, self.sentences[r].finished[: config.n_best]) for r in done]
        self._keep([r for r in range(b) if r not in set(done)], source_rows)
        return out

    @torch.inference_mode()
    def remove(self, keys: set) -> None:
        """Stop searching the sentences whose key is in ``keys`` (nobody waits for them any more)."""
        keep = [r for r, s in enumerate(self.sentences) if s.key not in keys]
        if len(keep) < len(self.sentences):
            self._keep(keep, torch.arange(len(self.sentences) * self.K, device=self.model.device))

    def _keep(self, keep: list[int], source_rows: Tensor) -> None:
        """Keep sentences ``keep`` (in order), their self-attention rows taken from ``source_rows`` (R,)."""
        b, K = len(self.sentences), self.K
        if len(keep) < b:
            if not keep:
                self._reset()
                return
            groups = torch.tensor(keep, dtype=torch.long, device=self.model.device)
            self.sentences = [self.sentences[r] for r in keep]
            self.scores, self.history = self.scores[groups], self.history[groups]
            self.last = self.last.view(b, K)[groups].view(-1, 1)
            self.memory_bias = self.memory_bias[groups]
            source_rows = source_rows.view(b, K)[groups].view(-1)
            S = max(s.source for s in self.sentences)  # the longest source left: the memory's positions past it go
            self.memory_bias = self.memory_bias[:, :, :, :S]
            for cache in self.layers:
                cache["cross"].reorder(groups)
                cache["cross"].shorten(S)
        for cache in self.layers:
            cache["self"].reorder(source_rows)

    def _make_room(self) -> None:
        """Drop the cached positions before the oldest sentence's first, once there are ``TRIM`` of them
        or the caches would grow: every row reads (and masks) every cached position."""
        oldest = min(s.start for s in self.sentences)
        if oldest >= TRIM or (oldest and self.length + 1 > self.layers[0]["self"].allocated):
            for layer in self.layers:
                layer["self"].trim(oldest)
            self.history = self.history[:, :, oldest:]
            self.length -= oldest
            for s in self.sentences:
                s.start -= oldest

    def _reset(self) -> None:
        """No sentence left: start the caches afresh (the next sentences need none of their positions)."""
        self.__init__(self.model, bos_id=self.bos_id, eos_id=self.eos_id, config=self.config, suppress=tuple(self.suppress))


def _pad(x: Tensor, size: int, value: float) -> Tensor:
    """``x`` padded with ``value`` along its last dimension to ``size``."""
    missing = size - x.size(-1)
    if missing <= 0:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], missing), value)], dim=-1)
