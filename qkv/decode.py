"""Search: greedy and beam search over a trained ``Transformer``, batched, with the key/value cache.

Dimension legend: B sentences, K beam size, S source length, V vocabulary size.

Both searches encode the source once, then call ``model.decode`` one token at a time with a
``DecoderState``. Sentences that are finished are dropped from the batch, so the cost of a batch
follows its live sentences, not its longest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.config import config_from_dict
from qkv.model import Transformer


@dataclass(frozen=True)
class DecodeConfig:
    """How to search. The maximum output length is ``max_len_a * source_length + max_len_b``, where
    ``source_length`` counts a sentence's own tokens and its EOS (not the batch's padding)."""

    beam_size: int = 5
    length_penalty: float = 0.6  # alpha of GNMT's ((5 + length) / 6) ** alpha; 0 disables it
    max_len_a: float = 1.5
    max_len_b: int = 10
    n_best: int = 1
    # Sampling instead of search: each token drawn from softmax(logits / temperature), restricted to
    # the top_k most likely tokens (0: all) and to the smallest set holding top_p of the probability.
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # with the same seed, a sentence gets the same sample, however it is batched

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.sampling and self.beam_size != 1:
            raise ValueError(f"sampling draws one translation per sentence: beam_size must be 1, got {self.beam_size}")
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature > 0, top_k >= 0 and 0 < top_p <= 1")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"n_best must be between 1 and beam_size ({self.beam_size}), got {self.n_best}")
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty must be >= 0, got {self.length_penalty}")

    @classmethod
    def from_dict(cls, data: dict) -> DecodeConfig:
        return config_from_dict(cls, data)


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS, without EOS
    score: float  # length-normalised log-probability (the ranking key)
    log_prob: float  # total log-probability, EOS included


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's length normaliser ((5 + length) / 6) ** alpha (Wu et al., 2016); 1 when alpha is 0."""
    return ((5 + length) / 6) ** alpha


def max_output_length(model: Transformer, src_len: int, config: DecodeConfig) -> int:
    return max(1, min(int(config.max_len_a * src_len + config.max_len_b), model.config.max_len - 1))


def _output_limits(model: Transformer, src_mask: Tensor, config: DecodeConfig) -> list[int]:
    """Each sentence's maximum output length, from its own length: padding must not lengthen the
    output of a short sentence batched with long ones. src_mask: (B, S), True for real tokens."""
    return [max_output_length(model, n, config) for n in src_mask.sum(dim=1).tolist()]


def beam_candidates(scores: Tensor, log_probs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` best one-token extensions of each sentence's beams, best first.

    scores: (B, K) total log-probability of each live beam (-inf for an unused slot);
    log_probs: (B, K, V) next-token log-probabilities. Returns the candidates' total scores (B, k),
    the beam each extends (B, k) and the token it appends (B, k).
    """
    B, K, V = log_probs.shape
    total = (scores[:, :, None] + log_probs).view(B, K * V)  # (B, K*V)
    top, flat = total.topk(k, dim=-1)
    return top, flat // V, flat % V


def split_candidates(
    candidates: list[tuple[float, int, int]], *, k: int, eos_id: int, last_step: bool, room: int
) -> tuple[list[tuple[float, int, int]], list[tuple[float, int, int]]]:
    """One sentence's beam step: split its best extensions (score, beam, token), best first, into
    those that finish and those that stay live.

    A candidate finishes when it appends EOS (or at the last allowed step, whatever it appends) and
    ranks among the first ``k``, and the sentence still has ``room`` for finished hypotheses; an EOS
    ranked lower is dropped, since ``k`` better continuations exist. The ``k`` best candidates that
    do not end in EOS stay live. ``-inf`` candidates (from unused beam slots) are ignored.
    """
    finishing, live = [], []
    for rank, (score, beam, token) in enumerate(candidates):
        if score == float("-inf"):
            break
        if token == eos_id or last_step:
            if rank < k and len(finishing) < room:
                finishing.append((score, beam, token))
        elif len(live) < k:
            live.append((score, beam, token))
    return finishing, live


def sample_tokens(logits: Tensor, generators: list[torch.Generator], config: DecodeConfig) -> Tensor:
    """Draw one token per row from softmax(logits / temperature), within the top-k and the top-p
    nucleus. logits: (b, V); generators: one per row, so a row's draws do not depend on the others."""
    logits = logits.float() / config.temperature  # (b, V)
    V = logits.size(-1)
    if config.top_k and config.top_k < V:
        kth = logits.topk(config.top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)  # (b, V)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p  # mass before it already >= p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    cumulative = probs.cumsum(dim=-1)  # (b, V)
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(probs.device) * cumulative[:, -1]  # (b,)
    # The first token whose cumulative probability exceeds u: a zero-probability token never is.
    return torch.searchsorted(cumulative, u[:, None], right=True).squeeze(1).clamp(max=V - 1)


def _start(model: Transformer, src: Tensor, bos_id: int, repeat: int):
    """Encode ``src`` and repeat each sentence's memory ``repeat`` times (one row per beam)."""
    memory, src_mask, _ = model.encode(src)
    memory = memory.repeat_interleave(repeat, dim=0)  # (B, S, D) -> (B*K, S, D)
    src_mask = src_mask.repeat_interleave(repeat, dim=0)
    tokens = torch.full((src.size(0) * repeat, 1), bos_id, dtype=torch.long, device=src.device)
    return memory, src_mask, model.new_state(), tokens


@torch.inference_mode()
def greedy_search(
    model: Transformer, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig, seeds: list[int] | None = None
) -> list[list[int]]:
    """The most likely next token at every step (or, with ``config.sampling``, one drawn at random,
    each sentence from a generator seeded by ``seeds``). src: (B, S). Returns token lists without BOS/EOS."""
    B = src.size(0)
    if config.sampling:
        generators = [torch.Generator().manual_seed(s) for s in (seeds or [config.seed + b for b in range(B)])]
    memory, src_mask, state, last = _start(model, src, bos_id, 1)
    limits = torch.tensor(_output_limits(model, src_mask, config), device=src.device)  # (B,)
    outputs: list[list[int]] = [[] for _ in range(B)]
    alive = torch.arange(B, device=src.device)  # sentence index of each row still being decoded
    for step in range(int(limits.max())):
        logits, _ = model.decode(last, memory, src_mask, state=state)  # (b, 1, V)
        if config.sampling:
            next_tokens = sample_tokens(logits[:, -1], [generators[i] for i in alive.tolist()], config)  # (b,)
        else:
            next_tokens = logits[:, -1].argmax(dim=-1)  # (b,)
        for row, sentence in enumerate(alive.tolist()):
            if next_tokens[row] != eos_id:
                outputs[sentence].append(int(next_tokens[row]))
        keep = ((next_tokens != eos_id) & (step + 1 < limits[alive])).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        if keep.numel() < alive.numel():
            alive, memory, src_mask = alive[keep], memory[keep], src_mask[keep]
            state.reorder(keep)
        last = next_tokens[keep, None]  # (b, 1)
    return outputs


@torch.inference_mode()
def beam_search(
    model: Transformer, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig
) -> list[list[Hypothesis]]:
    """Beam search with GNMT length normalisation. src: (B, S). Returns ``n_best`` hypotheses per sentence.

    Each step takes the 2K best extensions of a sentence's K beams: those ending in EOS among the
    first K become finished hypotheses, and the best K that do not end in EOS stay live. A sentence
    is done when it has K finished hypotheses or reaches the maximum length.
    """
    B, K = src.size(0), config.beam_size
    memory, src_mask, state, last = _start(model, src, bos_id, K)
    limits = _output_limits(model, src_mask[::K], config)  # (B,) one per sentence
    scores = torch.full((B, K), float("-inf"), device=src.device)
    scores[:, 0] = 0.0  # all beams start identical: only the first may extend, or they would repeat
    history = torch.empty(B, K, 0, dtype=torch.long, device=src.device)  # (b, K, t) tokens so far
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    alive = list(range(B))  # sentence index of each live row group

    for step in range(max(limits)):
        logits, _ = model.decode(last, memory, src_mask, state=state)  # (b*K, 1, V)
        log_probs = logits[:, -1].float().log_softmax(dim=-1).view(len(alive), K, -1)  # (b, K, V)
        top, beam, token = beam_candidates(scores, log_probs, min(2 * K, log_probs.size(1) * log_probs.size(2)))
        new_scores = torch.full_like(scores, float("-inf"))
        new_beam = torch.zeros_like(scores, dtype=torch.long)
        new_token = torch.full_like(new_beam, eos_id)
        done_rows = []
        top_l, beam_l, token_l = top.tolist(), beam.tolist(), token.tolist()
        for row, sentence in enumerate(alive):
            last_step = step == limits[sentence] - 1
            finishing, live = split_candidates(
                list(zip(top_l[row], beam_l[row], token_l[row])), k=K, eos_id=eos_id, last_step=last_step,
                room=K - len(finished[sentence]),
            )
            for s, b, t in finishing:
                tokens = history[row, b].tolist() + ([] if t == eos_id else [t])
                finished[sentence].append(Hypothesis(tokens, s / length_penalty(step + 1, config.length_penalty), s))
            for slot, (s, b, t) in enumerate(live):
                new_scores[row, slot], new_beam[row, slot], new_token[row, slot] = s, b, t
            if len(finished[sentence]) >= K or last_step or not live:
                done_rows.append(row)
        # Reorder the surviving beams: row-group r, slot j continues beam new_beam[r, j].
        source_rows = (torch.arange(len(alive), device=src.device)[:, None] * K + new_beam).view(-1)  # (b*K,)
        history = history.reshape(len(alive) * K, step)[source_rows].view(len(alive), K, step)  # (b, K, t)
        history = torch.cat([history, new_token[..., None]], dim=2)  # (b, K, t + 1)
        scores, last = new_scores, new_token.view(-1, 1)
        if done_rows:
            keep_groups = [r for r in range(len(alive)) if r not in set(done_rows)]
            if not keep_groups:
                break
            groups = torch.tensor(keep_groups, device=src.device)
            rows = (groups[:, None] * K + torch.arange(K, device=src.device)).view(-1)  # (b'*K,)
            alive = [alive[r] for r in keep_groups]
            scores, history, last = scores[groups], history[groups], last.view(-1, K)[groups].view(-1, 1)
            source_rows = source_rows.view(-1, K)[groups].view(-1)
            memory, src_mask = memory[rows], src_mask[rows]
            state.reorder(rows, kinds=("cross",))
        # The K beams of a sentence share its source, so their cross-attention caches are equal:
        # moving beams within a sentence changes only the self-attention caches.
        state.reorder(source_rows, kinds=("self",))
    results = []
    for hyps in finished:
        hyps.sort(key=lambda h: h.score, reverse=True)
        results.append(hyps[: config.n_best])
    return results


def search(
    model: Transformer, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig, seeds: list[int] | None = None
) -> list[list[Hypothesis]]:
    """Greedy search (or sampling) when beam_size is 1 (greedy: the same result as beam 1, less work),
    beam search otherwise. ``seeds``: one per sentence, for sampling."""
    if config.beam_size == 1:
        outputs = greedy_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config, seeds=seeds)
        return [[Hypothesis(tokens, math.nan, math.nan)] for tokens in outputs]
    return beam_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config)
