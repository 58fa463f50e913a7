"""Search: greedy and beam search over a trained ``Transformer`` (or any ``SearchModel``), batched, with the key/value cache.

Dimension legend: B sentences, K beam size, S source length, V vocabulary size, U the ids a shortlist keeps.

Both searches encode the source once, then call ``model.decode`` one token at a time with a
``DecoderState``. Sentences that are finished are dropped from the batch, so the cost of a batch
follows its live sentences, not its longest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from qkv.infer.loop_guard import NumberPieces, loops
from qkv.model.config import ConfigError, ModelConfig, check_types, config_from_dict
from qkv.model.transformer import OutputSubset


class SearchModel(Protocol):
    """What greedy and beam search need of a model: ``qkv.model.transformer.Transformer`` and ``qkv.infer.ensemble.Ensemble``
    are both one. ``encode`` returns the memory, the source mask (B, S) and attention weights;
    ``decode`` the logits (or log-probabilities) of every target position, (B, T, V), with a state
    that caches the keys and values of the positions decoded so far."""

    config: ModelConfig

    @property
    def device(self) -> torch.device: ...

    def encode(self, src: Tensor, *, need_weights: bool = False) -> tuple[Any, Tensor, list[Tensor]]: ...

    def decode(self, tgt: Tensor, memory: Any, src_mask: Tensor, *, state: Any = None, need_weights: bool = False,
               vocab: OutputSubset | None = None) -> tuple[Tensor, Any]: ...

    def new_state(self, capacity: int = 16) -> Any: ...

    def eval(self) -> Any: ...


@dataclass(frozen=True)
class DecodeConfig:
    """How to search. The maximum output length is ``max_len_a * source_length + max_len_b``, where
    ``source_length`` counts a sentence's own tokens and its EOS (not the batch's padding)."""

    beam_size: int = 5  # >= 1; hypotheses kept per sentence at each step (1: greedy search)
    length_penalty: float = 0.6  # >= 0; alpha of GNMT's ((5 + length) / 6) ** alpha; 0 disables it
    max_len_a: float = 1.5  # >= 0; the output length limit is max_len_a * source length + max_len_b
    max_len_b: int = 10  # added to that limit
    n_best: int = 1  # at least 1 and at most beam_size; translations returned per sentence, best first
    # Stop a sentence as soon as it has beam_size finished hypotheses (CTranslate2's and fairseq's
    # rule), instead of when no live beam can still beat them: faster, and not always the best.
    stop_early: bool = False
    # Sampling instead of search: each token drawn from softmax(logits / temperature), restricted to
    # the top_k most likely tokens (0: all) and to the smallest set holding top_p of the probability.
    sampling: bool = False
    temperature: float = 1.0  # > 0; with sampling, the logits are divided by it (below 1: sharper)
    top_k: int = 0  # >= 0; with sampling, only the top_k most likely tokens (0: all)
    top_p: float = 1.0  # in (0, 1]; with sampling, only the smallest set of tokens holding top_p of the probability
    seed: int = 0  # with the same seed, a sentence gets the same sample, however it is batched
    # fairseq's and CTranslate2's no_repeat_ngram_size: no n-gram of this many tokens occurs twice in
    # an output (0: off, the exact search).
    no_repeat_ngram_size: int = 0
    # The loop guard (0: off, the exact search): a sentence whose output loops (``loops``: a run of one
    # to four tokens repeated LOOP_REPEATS times back to back that does not write a number and that its
    # source does not repeat as well, or no EOS before the length limit) is searched again with no repeated n-gram of this size. Outputs that do
    # not loop stay as they were.
    loop_guard: int = 0

    def __post_init__(self) -> None:
        check_types(self, "decode")
        if self.beam_size < 1:
            raise ConfigError(f"beam_size must be >= 1, got {self.beam_size}")
        if self.sampling and self.beam_size != 1:
            raise ConfigError(f"sampling draws one translation per sentence: beam_size must be 1, got {self.beam_size}")
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("need temperature > 0, top_k >= 0 and 0 < top_p <= 1")
        if not 1 <= self.n_best <= self.beam_size:
            raise ConfigError(f"n_best must be between 1 and beam_size ({self.beam_size}), got {self.n_best}")
        if self.length_penalty < 0:
            raise ConfigError(f"length_penalty must be >= 0, got {self.length_penalty}")
        if self.max_len_a < 0:
            raise ConfigError(f"max_len_a must be >= 0, got {self.max_len_a}")
        if self.no_repeat_ngram_size < 0 or self.loop_guard < 0:
            raise ConfigError("no_repeat_ngram_size and loop_guard must be >= 0 (0: off)")

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


def max_output_length(model: SearchModel, src_len: int, config: DecodeConfig) -> int:
    return max(1, min(int(config.max_len_a * src_len + config.max_len_b), model.config.max_len - 1))


def _output_limits(model: SearchModel, src_mask: Tensor, config: DecodeConfig) -> list[int]:
    """Each sentence's maximum output length, from its own length: padding must not lengthen the
    output of a short sentence batched with long ones. src_mask: (B, S), True for real tokens."""
    return [max_output_length(model, n, config) for n in src_mask.sum(dim=1).tolist()]


def block_maxima(x: Tensor, block: int) -> Tensor:
    """The maximum of every run of ``block`` elements along x's last dimension: (..., V) -> (...,
    ceil(V / block)). The last block may be shorter: its maximum is taken apart (no padded copy)."""
    V = x.size(-1)
    full = V // block * block
    maxima = x[..., :full].unflatten(-1, (V // block, block)).amax(dim=-1)  # (..., V // block)
    if full < V:
        maxima = torch.cat([maxima, x[..., full:].amax(dim=-1, keepdim=True)], dim=-1)
    return maxima


def beam_candidates(scores: Tensor, log_probs: Tensor, k: int, block: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` best one-token extensions of each sentence's beams, best first.

    scores: (B, K) total log-probability of each live beam (-inf for an unused slot);
    log_probs: (B, K, V) next-token log-probabilities. Returns the candidates' total scores (B, k),
    the beam each extends (B, k) and the token it appends (B, k).

    The same result as one ``topk`` over all K * V sums, found faster: the vocabulary is cut into
    blocks of ``block`` tokens, and the k best candidates lie in the k blocks with the best maxima
    (a candidate outside them would have k better block maxima above it).
    """
    B, K, V = log_probs.shape
    n_blocks = -(-V // block)
    if n_blocks * K < 4 * k:  # a small vocabulary: one topk is as fast
        total = (scores[:, :, None] + log_probs).view(B, K * V)  # (B, K*V)
        top, flat = total.topk(k, dim=-1)
        return top, flat // V, flat % V
    maxima = block_maxima(log_probs, block) + scores[:, :, None]  # (B, K, n_blocks)
    best = maxima.view(B, K * n_blocks).topk(k, dim=-1).indices  # (B, k) the blocks to search
    beam, first = best // n_blocks, (best % n_blocks) * block  # (B, k)
    tokens = first[:, :, None] + torch.arange(block, device=log_probs.device)  # (B, k, block)
    rows = torch.arange(B, device=log_probs.device)[:, None, None]
    total = log_probs[rows, beam[:, :, None], tokens.clamp(max=V - 1)].masked_fill(tokens >= V, float("-inf"))
    total = total + scores.gather(1, beam)[:, :, None]  # (B, k, block)
    top, flat = total.view(B, k * block).topk(k, dim=-1)  # (B, k)
    return top, beam.gather(1, flat // block), tokens.view(B, k * block).gather(1, flat)


def block_argmax(x: Tensor, block: int = 128) -> Tensor:
    """``x.argmax(dim=-1)`` of x (R, V), the same index (the first of equal maxima), found faster:
    on the CPU ``argmax`` over a greedy step's (64, 8,000) scores took 0.43 ms and ``amax`` 0.03 ms
    (one thread, AMD EPYC, 2026-11-26). The first of a row's maxima lies in the first block of
    ``block`` elements whose own maximum is the row's; ``argmax`` runs over the blocks' maxima, then
    within that block only."""
    R, V = x.shape
    n_blocks = -(-V // block)
    if n_blocks < 4:  # a small vocabulary: argmax alone is as fast
        return x.argmax(dim=-1)
    first = block_maxima(x, block).argmax(dim=-1) * block  # (R,) the first element of each row's block
    index = first[:, None] + torch.arange(block, device=x.device)  # (R, block)
    inside = x.gather(1, index.clamp(max=V - 1)).masked_fill(index >= V, float("-inf"))
    return first + inside.argmax(dim=-1)


def split_candidates(top: Tensor, token: Tensor, *, k: int, eos_id: int, last_step: Tensor) -> tuple[Tensor, Tensor]:
    """One beam step for every sentence at once: which of its best extensions finish, which stay live.

    top, token: (B, 2k) the candidates' scores and tokens, best first, from ``beam_candidates``;
    last_step: (B,) bool, True where a sentence takes its last allowed step. A candidate finishes
    when it appends EOS (or at the last step, whatever it appends) and ranks among the first ``k``;
    an EOS ranked lower is dropped, since ``k`` better continuations exist. The ``k`` best
    candidates that do not end in EOS stay live. ``-inf`` candidates (from unused beam slots) do
    neither. Returns ``finishing`` and ``stays``, both (B, 2k) bool.
    """
    real = top > float("-inf")
    ends = (token == eos_id) | last_step[:, None]  # (B, 2k)
    finishing = ends & real & (torch.arange(top.size(1), device=top.device) < k)
    stays = ~ends & real
    return finishing, stays & (stays.cumsum(dim=1) <= k)


def trace_step(
    step: int, scores: Tensor, history: Tensor, top: Tensor, beam: Tensor, token: Tensor, stays: Tensor,
    finished_ranks: list[int], alpha: float,
) -> dict:
    """One beam step of one sentence, for a reader: the live beams it started from (tokens, score),
    and each of the 2K candidates considered with what became of it: "finished" (a hypothesis, with
    its length-normalised score), "live" (a beam of the next step) or "pruned" (an EOS ranked below K,
    a finish with no room left, or a continuation beyond the K best). scores: (k,), history: (k, t),
    top, beam, token, stays: (2K,)."""
    beams = [{"tokens": t, "score": s} for t, s in zip(history.tolist(), scores.tolist()) if s > float("-inf")]
    candidates = []
    for rank, (score, b, t, live) in enumerate(zip(top.tolist(), beam.tolist(), token.tolist(), stays.tolist())):
        if score == float("-inf"):
            continue
        fate = "finished" if rank in finished_ranks else "live" if live else "pruned"
        entry = {"beam": b, "token": t, "score": score, "fate": fate}
        if fate == "finished":
            entry["normalized"] = score / length_penalty(step + 1, alpha)
        candidates.append(entry)
    return {"step": step, "beams": beams, "candidates": candidates}


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


def repeated_ngram_ban(history: Tensor, n: int, vocab_size: int) -> Tensor:
    """An additive (R, V) mask: -inf for each token that would complete an n-gram already in its row's
    ``history`` (R, t), 0 elsewhere (fairseq's ``no_repeat_ngram_size``). All zeros while t < n."""
    R, t = history.shape
    ban = torch.zeros(R, vocab_size, device=history.device)
    if t < n:
        return ban
    windows = history.unfold(1, n, 1)  # (R, t - n + 1, n) every n-gram so far
    match = (windows[:, :, : n - 1] == history[:, None, t - n + 1 :]).all(dim=2)  # (R, t - n + 1) starts as the last n - 1 do
    blocked = torch.zeros(match.shape, device=history.device).masked_fill_(match, float("-inf"))
    return ban.scatter_add_(1, windows[:, :, -1], blocked)


def _ban_repeats(scores: Tensor, history: Tensor, n: int, subset: OutputSubset | None, per_row: int) -> Tensor:
    """``scores`` (R, V) or (R, U) with ``repeated_ngram_ban`` added; R = sentences x ``per_row`` rows.
    Over a subset, the ban of each row's own ids (a sentence's ``per_row`` beams share its ids)."""
    if n == 0 or history.size(1) < n:
        return scores
    if subset is None:
        return scores + repeated_ngram_ban(history, n, scores.size(-1))
    ban = repeated_ngram_ban(history, n, int(subset.ids.max()) + 1)  # (R, max id + 1)
    ids = subset.ids.repeat_interleave(per_row, dim=0) if subset.ids.size(0) > 1 else subset.ids.expand(ban.size(0), -1)
    return scores + ban.gather(1, ids)


def restricted(
    vocab: list[Tensor] | None, suppress: tuple[int, ...], eos_id: int, device: torch.device, *, shared: bool,
) -> tuple[OutputSubset | None, tuple[int, ...]]:
    """The ``OutputSubset`` a search scores (None: the whole vocabulary) from each sentence's ids, and
    the suppressed ids left to mask: a subset leaves them out itself, and always holds EOS.

    ``shared``: all sentences score the union of their ids, each masked to its own (one matmul; what
    greedy search, one row a sentence, measured faster); else each sentence scores its own rows
    (a batched matmul; what beam search, K rows a sentence, measured faster). Either way a sentence
    can produce exactly its own ids, whatever else is in its batch."""
    if vocab is None:
        return None, suppress
    banned = torch.tensor(list(suppress), dtype=torch.long)
    rows = []
    for ids in vocab:
        ids = torch.cat([ids.long().cpu(), torch.tensor([eos_id])]).unique()  # sorted
        rows.append(ids[~torch.isin(ids, banned)] if suppress else ids)
    if shared:
        union = torch.cat(rows).unique()  # (U,) sorted
        valid = torch.stack([torch.isin(union, r) for r in rows])  # (B, U)
        return OutputSubset.from_valid(union[None].to(device), valid.to(device)), ()
    U = max(len(r) for r in rows)
    padded = torch.full((len(rows), U), eos_id, dtype=torch.long)
    valid = torch.zeros(len(rows), U, dtype=torch.bool)
    for b, r in enumerate(rows):
        padded[b, : len(r)], valid[b, : len(r)] = r, True
    return OutputSubset.from_valid(padded.to(device), valid.to(device)), ()


def _decode(model: SearchModel, last: Tensor, memory: Any, src_mask: Tensor, state: Any, subset: OutputSubset | None):
    """One cached decoder step; ``vocab`` is passed only when there is a subset (a ``SearchModel``
    that has no shortlist support still searches the whole vocabulary)."""
    if subset is None:
        return model.decode(last, memory, src_mask, state=state)
    return model.decode(last, memory, src_mask, state=state, vocab=subset)


def _start(model: SearchModel, src: Tensor, bos_id: int, config: DecodeConfig):
    """Encode ``src``; the first step decodes BOS once per sentence. Also each sentence's output limit."""
    memory, src_mask, _ = model.encode(src)  # (B, S, D), (B, S)
    limits = _output_limits(model, src_mask, config)  # (B,)
    tokens = torch.full((src.size(0), 1), bos_id, dtype=torch.long, device=src.device)
    return memory, src_mask, model.new_state(capacity=max(limits)), tokens, limits


@torch.inference_mode()
def greedy_search(
    model: SearchModel, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig, seeds: list[int] | None = None,
    suppress: tuple[int, ...] = (), vocab: list[Tensor] | None = None,
) -> list[list[int]]:
    """The most likely next token at every step (or, with ``config.sampling``, one drawn at random,
    each sentence from a generator seeded by ``seeds``). src: (B, S). Returns token lists without BOS/EOS.
    ``vocab``: for each sentence, the only target ids to score (a shortlist, ``restricted``)."""
    B = src.size(0)
    if config.sampling:
        generators = [torch.Generator().manual_seed(s) for s in (seeds or [config.seed + b for b in range(B)])]
    memory, src_mask, state, last, limits = _start(model, src, bos_id, config)
    limits = torch.tensor(limits, device=src.device)  # (B,)
    subset, suppress = restricted(vocab, suppress, eos_id, src.device, shared=True)  # one row a sentence: one matmul over the union
    outputs: list[list[int]] = [[] for _ in range(B)]
    alive = torch.arange(B, device=src.device)  # sentence index of each row still being decoded
    for step in range(int(limits.max())):
        logits, _ = _decode(model, last, memory, src_mask, state, subset)  # (b, 1, V), or (b, 1, U)
        if suppress:
            logits[:, -1, list(suppress)] = float("-inf")
        if config.no_repeat_ngram_size:
            history = torch.tensor([outputs[s] for s in alive.tolist()], dtype=torch.long, device=src.device).view(alive.numel(), step)
            logits = _ban_repeats(logits[:, -1], history, config.no_repeat_ngram_size, subset, 1)[:, None]
        if config.sampling:
            next_tokens = sample_tokens(logits[:, -1], [generators[i] for i in alive.tolist()], config)  # (b,)
        else:
            next_tokens = block_argmax(logits[:, -1])  # (b,)
        if subset is not None:
            next_tokens = subset.positions_to_ids(next_tokens[:, None]).squeeze(1)  # positions -> target ids
        for sentence, token in zip(alive.tolist(), next_tokens.tolist()):  # one host read per step
            if token != eos_id:
                outputs[sentence].append(token)
        keep = ((next_tokens != eos_id) & (step + 1 < limits[alive])).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        if keep.numel() < alive.numel():
            alive, memory, src_mask = alive[keep], memory[keep], src_mask[keep]
            subset = None if subset is None else subset[keep]
            state.reorder(keep)
        last = next_tokens[keep, None]  # (b, 1)
    return outputs


@torch.inference_mode()
def beam_search(
    model: SearchModel, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig, trace: list[dict] | None = None,
    suppress: tuple[int, ...] = (), vocab: list[Tensor] | None = None,
) -> list[list[Hypothesis]]:
    """Beam search with GNMT length normalisation. src: (B, S). Returns ``n_best`` hypotheses per sentence.

    Each step takes the 2K best extensions of a sentence's K beams: those ending in EOS among the
    first K become finished hypotheses (a sentence keeps its K best by normalised score), and the
    best K that do not end in EOS stay live. A sentence is done at its maximum length, or when no
    live beam can still beat its ``n_best``-th finished hypothesis: a live beam's log-probability
    only falls as it grows, and the normaliser only rises, so ``score / length_penalty(limit)``
    bounds every hypothesis it can become. The result is the best normalised hypotheses the beam
    finds, not merely the first K to finish (``config.stop_early`` stops at the first K, as
    CTranslate2 does).

    The first step decodes BOS once per sentence (all K beams would be the same), and the K beams
    of a sentence share one copy of its memory and cross-attention keys and values.

    ``trace``: a list that receives, for the first sentence, one record per step (``trace_step``).
    ``suppress``: token ids never appended (their log-probability set to -inf, without renormalising).
    ``vocab``: for each sentence, the only target ids to score (a shortlist): the softmax and top-k run over them alone.
    """
    B, K, device = src.size(0), config.beam_size, src.device
    memory, src_mask, state, last, limits = _start(model, src, bos_id, config)  # (B, S, D), (B, S), state, (B, 1), (B,)
    subset, suppress = restricted(vocab, suppress, eos_id, device, shared=False)  # K rows a sentence share its own ids
    scores = torch.zeros(B, 1, device=device)  # (b, k) total log-probability of each live beam; k = 1 at first
    history = torch.empty(B, 1, 0, dtype=torch.long, device=device)  # (b, k, t) tokens so far
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    alive = list(range(B))  # sentence index of each live row group

    for step in range(max(limits)):
        b, k = scores.shape
        logits, _ = _decode(model, last, memory, src_mask, state, subset)  # (b*k, 1, V), or U for V
        log_probs = logits[:, -1].float().log_softmax(dim=-1).view(b, k, -1)  # (b, k, V)
        if suppress:
            log_probs[:, :, list(suppress)] = float("-inf")
        if config.no_repeat_ngram_size:
            log_probs = _ban_repeats(log_probs.view(b * k, -1), history.view(b * k, step), config.no_repeat_ngram_size,
                                     subset, k).view(b, k, -1)
        top, beam, token = beam_candidates(scores, log_probs, min(2 * K, k * log_probs.size(2)))  # (b, 2K)
        if subset is not None:
            token = subset.positions_to_ids(token)  # (b, 2K) positions in each sentence's ids -> target ids
        final_step = [step == limits[s] - 1 for s in alive]  # (b,) whether each sentence takes its last step
        finishing, stays = split_candidates(top, token, k=K, eos_id=eos_id, last_step=torch.tensor(final_step, device=device))

        # Finished hypotheses: host work only for the (few) candidates that end this step.
        rows, ranks = finishing.nonzero(as_tuple=True)
        accepted = []  # (row, rank) of the candidates that became finished hypotheses
        if rows.numel():
            ended = zip(rows.tolist(), ranks.tolist(), top[rows, ranks].tolist(), token[rows, ranks].tolist(),
                        history[rows, beam[rows, ranks]].tolist())
            for row, rank, score, t, tokens in ended:
                hyps = finished[alive[row]]
                normalized = score / length_penalty(step + 1, config.length_penalty)
                if len(hyps) == K and normalized <= hyps[-1].score:
                    continue  # no better than the K kept
                tokens = tokens + ([] if t == eos_id else [t])
                hyps.append(Hypothesis(tokens, normalized, score))
                hyps.sort(key=lambda h: h.score, reverse=True)
                del hyps[K:]
                accepted.append((row, rank))
        if trace is not None and alive[0] == 0:  # the first sentence is still searched, in row 0
            trace.append(trace_step(step, scores[0], history[0], top[0], beam[0], token[0], stays[0],
                                    [rank for row, rank in accepted if row == 0], config.length_penalty))

        # The live beams, best first: row r, slot j continues beam new_beam[r, j] with new_token[r, j].
        slots = (~stays).to(torch.int8).argsort(dim=1, stable=True)[:, :K]  # (b, K) ranks of the live candidates
        live = stays.gather(1, slots)  # (b, K) False where a sentence has fewer than K
        new_scores = top.gather(1, slots).masked_fill(~live, float("-inf"))
        new_beam = beam.gather(1, slots).masked_fill(~live, 0)
        new_token = token.gather(1, slots).masked_fill(~live, eos_id)
        source_rows = (torch.arange(b, device=device)[:, None] * k + new_beam).view(-1)  # (b*K,)
        history = torch.cat([history.view(b * k, step)[source_rows].view(b, K, step), new_token[..., None]], dim=2)
        scores, last = new_scores, new_token.view(-1, 1)

        best_live = new_scores[:, 0].tolist()  # (b,) -inf where a sentence has no live beam
        done = [r for r, s in enumerate(alive) if final_step[r] or not can_improve(finished[s], best_live[r], limits[s], config)]
        if done:
            keep = [r for r in range(b) if r not in set(done)]
            if not keep:
                break
            groups = torch.tensor(keep, device=device)
            alive = [alive[r] for r in keep]
            scores, history, last = scores[groups], history[groups], last.view(b, K)[groups].view(-1, 1)
            source_rows = source_rows.view(b, K)[groups].view(-1)
            memory, src_mask = memory[groups], src_mask[groups]
            subset = None if subset is None else subset[groups]
            state.reorder(groups, kinds=("cross",))
        # The cross-attention caches hold one row per sentence; the self-attention caches one per beam.
        state.reorder(source_rows, kinds=("self",))
    return [hyps[: config.n_best] for hyps in finished]


def can_improve(hyps: list[Hypothesis], live_score: float, limit: int, config: DecodeConfig) -> bool:
    """Whether a live beam of total log-probability ``live_score`` could still enter a sentence's
    ``n_best`` finished hypotheses (``hyps``, best first): its score can only fall, and its
    normaliser is at most ``length_penalty(limit)``."""
    if live_score == float("-inf") or (config.stop_early and len(hyps) >= config.beam_size):
        return False
    if len(hyps) < config.n_best:
        return True
    return live_score / length_penalty(limit, config.length_penalty) > hyps[config.n_best - 1].score


def loop_retry(config: DecodeConfig) -> DecodeConfig:
    """How the loop guard searches a sentence whose output loops again: no repeated n-gram of its size."""
    return replace(config, no_repeat_ngram_size=config.loop_guard, loop_guard=0)


def search(
    model: SearchModel, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig, seeds: list[int] | None = None,
    suppress: tuple[int, ...] = (), vocab: list[Tensor] | None = None, numbers: NumberPieces | None = None,
) -> list[list[Hypothesis]]:
    """Greedy search (or sampling) when beam_size is 1 (greedy: the same result as beam 1, less work),
    beam search otherwise. ``seeds``: one per sentence, for sampling. ``suppress``: token ids never output.
    ``vocab``: for each sentence, the only target ids to score (``Shortlist.vocab``); None: all.
    With ``config.loop_guard``, the sentences whose best output ``loops`` are searched again (the
    config's comment; ``numbers``: the tokenizer's ``number_pieces``, whose runs are not loops); the
    others keep what the first search found."""
    found = _search_once(model, src, bos_id=bos_id, eos_id=eos_id, config=config, seeds=seeds, suppress=suppress, vocab=vocab)
    if not config.loop_guard:
        return found
    lengths = (src != model.config.pad_id).sum(dim=1).tolist()  # each sentence's tokens and EOS, as _output_limits counts
    sources = [row[row != model.config.pad_id].tolist() for row in src]  # a run the source repeats is copied, not looped
    again = [i for i, hyps in enumerate(found)
             if loops(hyps[0].tokens, max_output_length(model, lengths[i], config), numbers=numbers, source=sources[i])]
    if not again:
        return found
    retry = loop_retry(config)
    rows = torch.tensor(again, device=src.device)
    redone = _search_once(
        model, src[rows], bos_id=bos_id, eos_id=eos_id, config=retry, suppress=suppress,
        seeds=None if seeds is None else [seeds[i] for i in again], vocab=None if vocab is None else [vocab[i] for i in again],
    )
    for i, hyps in zip(again, redone):
        found[i] = hyps
    return found


def _search_once(
    model: SearchModel, src: Tensor, *, bos_id: int, eos_id: int, config: DecodeConfig, seeds: list[int] | None,
    suppress: tuple[int, ...], vocab: list[Tensor] | None,
) -> list[list[Hypothesis]]:
    if config.beam_size == 1:
        outputs = greedy_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config, seeds=seeds, suppress=suppress, vocab=vocab)
        return [[Hypothesis(tokens, math.nan, math.nan)] for tokens in outputs]
    return beam_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config, suppress=suppress, vocab=vocab)
