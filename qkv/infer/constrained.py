"""Beam search with hard lexical constraints: every constraint's tokens appear in the output, as whole words.

Dynamic beam allocation (Post and Vilar, 2018): at each step a beam's candidates are the sentence's
best continuations, the beam's own best token, and for every constraint the beam has not met the token
that starts or continues one of its forms. The candidates are grouped in banks by how many constraint
tokens they have produced, and the K slots of the next step are shared among the banks (the fullest
first), so that hypotheses that have placed a term are not crowded out by ones that score better only
because they have not yet paid for it. EOS is allowed only once every constraint is met.

A constraint is a list of forms, each a list of target ids: producing any one of them meets it (the
forms of a glossary term: "Hund", "Hunde"). A form is met only as whole words: the token after its
last one must not continue the word (``joins``: the ids of pieces that do, such as "en" after "▁Hund").

Dimension legend: B sentences, K beams, V vocabulary size. The sentences of a batch are searched
together (one decoder call a step for all their beams); the banks are formed for each sentence on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.infer.search import (
    DecodeConfig, Hypothesis, SearchModel, beam_candidates, block_argmax, length_penalty, max_output_length, repeated_ngram_ban,
)

Constraints = list[list[list[int]]]  # constraint -> form -> target ids


@dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...]
    score: float  # total log-probability
    met: tuple[bool, ...]  # each constraint met
    # (constraint, form, tokens of it produced so far); pos == len(form): complete, met at the next word boundary
    partial: frozenset[tuple[int, int, int]]


@dataclass
class ConstrainedHypothesis(Hypothesis):
    met: list[bool] | None = None  # which constraints the output meets (all, unless the length limit came first)


def _met_at_end(beam: _Beam, constraints: Constraints) -> tuple[bool, ...]:
    """What ``beam`` meets if it ends here (the end of the output is a word boundary)."""
    met, completed = list(beam.met), set()
    for c, f, pos in sorted(beam.partial):
        form = tuple(constraints[c][f])
        if pos == len(form) and not met[c] and form not in completed:  # one output of a form meets one constraint
            met[c] = True
            completed.add(form)
    return tuple(met)


def _advance(beam: _Beam, token: int, constraints: Constraints, joins: frozenset[int]) -> tuple[tuple[bool, ...], frozenset]:
    """The constraint state after ``beam`` appends ``token``: a complete form is met if ``token``
    starts a new word (a constraint met once however many of its forms complete), partial forms
    continue or drop, and the forms of unmet constraints that start with ``token`` start."""
    met = list(beam.met)
    boundary = token not in joins
    partial, completed = set(), set()
    for c, f, pos in sorted(beam.partial):
        form = constraints[c][f]
        if pos == len(form):
            if boundary and not met[c] and tuple(form) not in completed:  # a term asked for twice needs it twice
                met[c] = True
                completed.add(tuple(form))
    starts = {(c, f, 0) for c, forms in enumerate(constraints) if not met[c] for f in range(len(forms))} if boundary else set()
    for c, f, pos in sorted({p for p in beam.partial if p[2] < len(constraints[p[0]][p[1]])} | starts):
        if not met[c] and constraints[c][f][pos] == token:
            partial.add((c, f, pos + 1))
    return tuple(met), frozenset(partial)


def _next_tokens(beam: _Beam, constraints: Constraints) -> set[int]:
    """The tokens that start a form of a constraint ``beam`` has not met, or continue one of its partial forms."""
    out = {form[0] for c, forms in enumerate(constraints) if not beam.met[c] for form in forms}
    return out | {constraints[c][f][pos] for c, f, pos in beam.partial if pos < len(constraints[c][f])}


def _needed(met: tuple[bool, ...], partial: frozenset, constraints: Constraints) -> int:
    """The fewest tokens still to write to meet every constraint: each unmet one's shortest way on,
    from one of its partial forms or from the start of a form."""
    need = 0
    for c, forms in enumerate(constraints):
        if not met[c]:
            need += min([len(f) for f in forms] + [len(forms[f]) - pos for cc, f, pos in partial if cc == c])
    return need


def _progress(met: tuple[bool, ...], partial: frozenset, constraints: Constraints) -> int:
    """Constraint tokens produced: a met constraint counts its shortest form, an unmet one the
    furthest any of its partial forms got."""
    done = sum(min(len(f) for f in constraints[c]) for c, m in enumerate(met) if m)
    return done + max((pos for c, _, pos in partial if not met[c]), default=0)


@torch.inference_mode()
def constrained_beam_search(
    model: SearchModel, src: torch.Tensor, constraints: list[Constraints], *, bos_id: int, eos_id: int,
    config: DecodeConfig, joins: frozenset[int] = frozenset(), suppress: tuple[int, ...] = (), beam_size: int | None = None,
    max_lengths: list[int] | None = None,
) -> list[ConstrainedHypothesis]:
    """The best output of each sentence of ``src`` (B, S) that meets all of its ``constraints`` (module
    docstring), searched with ``beam_size`` beams (default: the config's; at least one more than the
    batch's most constraints). A sentence's length limit is the config's (or its ``max_lengths`` entry
    where that is lower) plus its constraints' longest forms, and a candidate that could no longer write its remaining terms within it is dropped, so every
    constraint that can be written is met (a form whose first piece continues a word never starts).
    Should none the less no output meet them all, the best one found is returned, ``met`` saying which
    it does not meet. ``config.no_repeat_ngram_size`` bans repeated n-grams, as in ``beam_search``, but
    not a token that starts or continues a term's form (a term that repeats an n-gram of the output, or
    itself, is still written); ``config.stop_early`` stops a sentence at K finished hypotheses."""
    B, device, alpha = src.size(0), src.device, config.length_penalty
    K = max(beam_size or config.beam_size, 1 + max(len(c) for c in constraints))
    memory, src_mask, _ = model.encode(src)  # (B, S, D), (B, S)
    own = [max_output_length(model, int(n), config) for n in src_mask.sum(dim=1).tolist()]  # before the terms
    if max_lengths is not None:
        own = [min(n, cap) for n, cap in zip(own, max_lengths)]
    limits = [max(1, min(n + sum(max(len(f) for f in forms) for forms in cs), model.config.max_len - 1))
              for n, cs in zip(own, constraints)]
    state = model.new_state(capacity=max(limits) + 1)
    beams = [[_Beam((), 0.0, tuple(False for _ in cs), frozenset())] for cs in constraints]  # one live beam at first
    finished: list[list[ConstrainedHypothesis]] = [[] for _ in range(B)]
    alive = list(range(B))  # sentence of each row group
    last = torch.full((B, 1), bos_id, dtype=torch.long, device=device)
    for step in range(max(limits)):
        k = len(beams[alive[0]])  # 1 at the first step, K after
        logits, _ = model.decode(last, memory, src_mask, state=state)  # (b*k, 1, V)
        log_probs = logits[:, -1].float().log_softmax(dim=-1)  # (b*k, V)
        if suppress:
            log_probs[:, list(suppress)] = float("-inf")
        b, V = len(alive), log_probs.size(-1)
        base = torch.tensor([[beam.score for beam in beams[s]] for s in alive], device=device)  # (b, k)
        log_probs = log_probs.view(b, k, V)  # an extension's total log-probability is base + log_probs, never formed whole
        unmet = [(r, j) for r, s in enumerate(alive) for j, beam in enumerate(beams[s]) if not all(_met_at_end(beam, constraints[s]))]
        if unmet:
            rows, slots = zip(*unmet)
            log_probs[list(rows), list(slots), eos_id] = float("-inf")  # EOS only once every constraint is met
        free = log_probs  # (b, k, V) the same with repeated n-grams banned: a term's own tokens are exempt (below)
        if config.no_repeat_ngram_size and step >= config.no_repeat_ngram_size:
            history = torch.tensor([beam.tokens for s in alive for beam in beams[s]], device=device)  # (b*k, step)
            free = log_probs + repeated_ngram_ban(history, config.no_repeat_ngram_size, V).view(b, k, V)
        # The 2K best extensions of each sentence and each beam's best token, by blocks of the vocabulary
        # (beam_candidates, block_argmax: the same as a topk and an argmax over all of them)
        _, top_beam, top_token = beam_candidates(base, free, min(2 * K, k * V))  # (b, 2K) each
        top = list(zip(top_beam.tolist(), top_token.tolist()))
        best = block_argmax(free.view(b * k, V)).view(b, k).tolist()  # (b, k)
        wanted, forced = [], []  # per row group: the (beam, token) candidates; those that write a term
        for r, s in enumerate(alive):
            pairs = set(zip(*top[r])) | {(j, t) for j, t in enumerate(best[r])}
            terms = {(j, t) for j, beam in enumerate(beams[s]) for t in _next_tokens(beam, constraints[s])}
            wanted.append(sorted(pairs | terms))
            forced.append(terms)
        flat_r = [r for r, pairs in enumerate(wanted) for _ in pairs]
        flat_j, flat_t = [j for pairs in wanted for j, _ in pairs], [t for pairs in wanted for _, t in pairs]
        values = (base[flat_r, flat_j] + free[flat_r, flat_j, flat_t]).tolist()
        if free is not log_probs:  # a token that writes a term is not banned as a repeat: the term asked for it
            exempt = [i for i, (r, j, t) in enumerate(zip(flat_r, flat_j, flat_t)) if (j, t) in forced[r]]
            if exempt:
                at_r, at_j, at_t = [flat_r[i] for i in exempt], [flat_j[i] for i in exempt], [flat_t[i] for i in exempt]
                kept = (base[at_r, at_j] + log_probs[at_r, at_j, at_t]).tolist()
                for i, v in zip(exempt, kept):
                    values[i] = v
        at = 0
        new_beams = []
        for r, s in enumerate(alive):
            cs = constraints[s]
            banks: dict[int, list] = {}
            # A token no unmet form starts or continues, after a beam with no complete form, leaves the
            # beam's constraints as they were but for its partial forms, which drop: no need to _advance.
            quiet = [(frozenset(_next_tokens(beam, cs)), _progress(beam.met, frozenset(), cs), _needed(beam.met, frozenset(), cs))
                     if not any(pos == len(cs[c][f]) for c, f, pos in beam.partial) else None for beam in beams[s]]
            room = limits[s] - step - 1  # tokens the output may still take after this one: a candidate that
            # could no longer write all its terms in them is dropped, so that the limit never comes first
            for j, t in wanted[r]:
                value, at = values[at], at + 1
                if value == float("-inf"):
                    continue
                beam = beams[s][j]
                if t == eos_id:
                    hyps = finished[s]
                    hyps.append(ConstrainedHypothesis(list(beam.tokens), value / length_penalty(step + 1, alpha), value,
                                                      list(_met_at_end(beam, cs))))
                    continue
                if quiet[j] is not None and t not in quiet[j][0]:
                    if quiet[j][2] <= room:
                        banks.setdefault(quiet[j][1], []).append((value, j, t, beam.met, frozenset()))
                    continue
                met, partial = _advance(beam, t, cs, joins)
                if _needed(met, partial, cs) <= room:
                    banks.setdefault(_progress(met, partial, cs), []).append((value, j, t, met, partial))
            finished[s].sort(key=lambda h: h.score, reverse=True)
            del finished[s][K:]
            chosen = _allocate(banks, K)
            live = [_Beam(beams[s][j].tokens + (t,), v, met, partial) for v, j, t, met, partial in chosen]
            stop = not live or step + 1 >= limits[s] or (config.stop_early and len(finished[s]) >= K) or (
                finished[s] and max(v for v, *_ in chosen) / length_penalty(limits[s], alpha) <= finished[s][0].score)
            if not live:
                live = beams[s]  # nothing could continue: the sentence ends with what it had
            if stop:
                beams[s] = live
                continue
            while len(live) < K:  # fixed K rows a sentence after the first step: dead slots never win
                live.append(_Beam(live[0].tokens, float("-inf"), live[0].met, live[0].partial))
                chosen.append((float("-inf"), chosen[0][1], eos_id, None, None))
            new_beams.append((r, s, live, chosen))
        if not new_beams:
            break
        keep = [r for r, *_ in new_beams]
        rows = [r * k + chosen[i][1] for r, _, _, chosen in new_beams for i in range(K)]
        tokens = [[c[2]] for _, _, _, chosen in new_beams for c in chosen]
        for _, s, live, _ in new_beams:
            beams[s] = live
        if len(keep) < b:
            groups = torch.tensor(keep, device=device)
            memory, src_mask = memory[groups], src_mask[groups]
            state.reorder(groups, kinds=("cross",))
        state.reorder(torch.tensor(rows, device=device), kinds=("self",))
        alive = [s for _, s, _, _ in new_beams]
        last = torch.tensor(tokens, device=device)
    out = []
    for s in range(B):
        if finished[s]:
            out.append(finished[s][0])
            continue
        # No output met every constraint within the limit: the live beam that met the most, then scored best.
        cs = constraints[s]
        best_beam = max(beams[s], key=lambda beam: (sum(_met_at_end(beam, cs)), beam.score))
        out.append(ConstrainedHypothesis(list(best_beam.tokens), best_beam.score / length_penalty(len(best_beam.tokens) + 1, alpha),
                                         best_beam.score, list(_met_at_end(best_beam, cs))))
    return out


def _allocate(banks: dict[int, list], K: int) -> list:
    """Up to K candidates shared among the banks that have any: each gets K // banks slots (the
    remainder to the fullest), filled with its best candidates; slots a bank cannot fill go to the
    best candidates left in any bank. Only banks with candidates share: with a fixed share for every
    level of progress, a term of many pieces would get no slot at its middle levels and never be finished."""
    if not banks:
        return []
    for candidates in banks.values():
        candidates.sort(key=lambda c: c[0], reverse=True)
    levels = sorted(banks, reverse=True)  # the most progress first
    share, extra = divmod(K, len(levels))
    chosen, rest = [], []
    for i, progress in enumerate(levels):
        quota = share + (1 if i < extra else 0)
        chosen += banks[progress][:quota]
        rest += banks[progress][quota:]
    rest.sort(key=lambda c: c[0], reverse=True)
    return chosen + rest[: K - len(chosen)]
