"""Calibrating trust: a model's confidence fitted on its own translations of validation data, the flags'
thresholds on pairs with exact labels, and the measures that say how well a detector ranks.

``calibrate`` translates the validation sources as the command line does (beam search with the loop
guard), and also ``JOIN_EVERY``-th pairs joined two to a line (provoking inputs made from val, with
their references joined: long lines are where the model drops clauses and loops), those without the
loop guard, as an engine that lets a model loop would (what ``qkv score --confidence`` may be given):
searched with it, the En->De model's own validation translations held no loop at all, and a
calibration cannot weigh what it never sees (docs/trust.md). ``calibrate_checkpoint``
translates and judges each line whole, as ``qkv score --confidence`` and ``--no-split`` read a line:
a caption is one sentence, so only the joined pairs differ from what ``qkv translate --confidence``
judges (each of their sentences alone). Fitted on those pairs cut into sentences instead, the En->De
model's confidence ranked the hand-labelled natural hallucinations at ROC AUC 0.925 against 0.955
whole (docs/trust.md), so whole it is; ``calibrate(text=...)`` cuts them. Each translation
is **acceptable** when its sentence chrF against the reference is at least ``ACCEPTABLE``. ``fit``
(a calibration of version 3):

- the confidence: a logistic function of one combined score, ``logprob_mean`` less each feature of
  ``COMBINED`` (the attention entropy, the loops) times a weight from ``WEIGHTS``, every feature in
  standard units of the model's own validation translations (the features normalised on the run's own
  outputs and summed, as STARE combines detectors; no label by hand). The weights are the cell of the
  grid that ranks the acceptable translations highest (ROC AUC) among the cells that rank the
  references over each made-up pathology of ``GUARDED`` no worse than ``logprob_mean`` alone; a cell
  other than all zeros only where it ranks them strictly better, in the fit and out of fold (chosen on
  ``FOLDS`` - 1 folds, measured on the one left). Where nothing beats the mean log-probability the
  confidence is the calibrated log-probability, sigmoid(a + b logprob_mean), b >= 0, and
  ``qkv calibrate`` says so. A flag of ``CAPPED`` caps it (multiplies it by
  ``CAP_FACTOR``) only where that ranks the acceptable translations strictly better, in the fit and out
  of fold, and the references over no ``GUARDED`` kind worse (``choose_capping``): the always-on caps
  of version 2 put correct lines with the hallucinations. With
  fewer than ``MIN_CLASS`` acceptable or unacceptable translations there is nothing to fit: the
  calibration is log-probability-only (``qkv.inspect.trust.LOGPROB_ONLY``'s confidence), say, for a
  model that translates all of its validation data right.
- the omission score (``qkv.inspect.trust.omission_score``): its reference, ``QUANTILES`` quantiles of
  ``uncovered`` (source words the alignment head leaves uncovered) and of minus ``eos_logprob`` over
  the model's own validation translations (``omission_table``).
- the flags: ``synthetic_pairs`` turns (source, reference) pairs into seven kinds of (source, target) pairs
  whose label is known by construction: ``correct`` (the reference), ``detached`` (another sentence's
  reference), ``partly-detached`` (the reference's second half replaced by the second half of
  another's), ``oscillation`` (the reference cut and one of its n-grams looped), ``copy`` (the source
  itself), ``omission`` (the reference's second half dropped) and ``addition`` (another sentence's
  reference added after the reference: a sentence the source does not hold); ``repetition`` and ``recurrence`` both
  name the looped kind. Each flag's threshold is the lowest
  cut that trips on at most ``MAX_FALSE_ALARMS`` of the model's own acceptable translations and at most
  ``MAX_FALSE_REFERENCES`` of the references, and flags more of its kind than of either, each bound's
  cut moved halfway down to the highest value below it of the pairs that bound counts (so the bound
  still holds) and the higher of the two taken; a flag that
  catches less than ``MIN_CAUGHT`` of its kind there never flags (its false alarms would buy nothing).
  Each flag's measured rates are in the calibration's ``false_alarms``. References shorter than four
  words make no such pairs: the flags are then ``LOGPROB_ONLY``'s, which read the text alone.
- ``length``: the expected translation length from the source's, a least-squares line through the
  validation pairs' log word counts (the ``shortness`` feature).
"""

from __future__ import annotations

import itertools
import math
import random
import sys

import torch

from qkv.errors import QkvError
from qkv.inspect.trust import (
    CAP_FACTOR, CAPPED, FLAG_FEATURE, FLAGS, LOGPROB_ONLY, Trust, confidence_of, flags_of, omission_score, spearman,
)

KINDS = ("correct", "detached", "partly-detached", "oscillation", "copy", "omission", "addition")
# Acceptable: sentence chrF at least this against the reference. Chosen on Multi30k val with the En->De
# model of docs/trust.md: translations below it miss or garble a content word or more (read there).
ACCEPTABLE = 50.0
COMBINED = ("attention_entropy", "loops")  # the features that may join logprob_mean in the confidence
WEIGHTS = (0.0, 0.25, 0.5, 1.0)  # each one's weights tried, in standard units against logprob_mean's 1
GUARDED = ("detached", "oscillation", "copy")  # made-up pathologies a combination must rank no worse than logprob_mean
FOLDS = 5
MIN_CLASS = 10  # acceptable and unacceptable translations each needed to fit the confidence
JOIN_EVERY = 8  # every 8th validation pair is also joined with the next into one line
MAX_FALSE_ALARMS = 0.01  # a flag trips on at most this share of the model's own acceptable validation translations
MAX_FALSE_REFERENCES = 0.005  # and of the validation references (seven flags: at most 3.5% of them in all)
MIN_CAUGHT = 0.5  # a flag that catches less than this share of its made-up kind at that threshold never flags
QUANTILES = 201  # the omission score's reference: this many quantiles of each of its two features
# Each flag: the made-up kind it names, and the single feature it thresholds (sign: +1 flags high values).
# ``repetition`` (back to back) and ``recurrence`` (anywhere) both name the looped references.
FLAG_OF = {flag: (kind, FLAG_FEATURE[flag][0], -1 if FLAG_FEATURE[flag][1] else +1) for flag, kind in (
    ("detached", "detached"), ("partly-detached", "partly-detached"), ("repetition", "oscillation"),
    ("recurrence", "oscillation"), ("copy", "copy"), ("omission", "omission"), ("addition", "addition"))}


def synthetic_pairs(sources: list[str], references: list[str], *, seed: int = 1) -> list[tuple[str, str, str]]:
    """(kind, source, target) for every kind of ``KINDS`` and every pair whose reference has at least
    four words (shorter ones have no halves), in a seeded order."""
    keep = [i for i, r in enumerate(references) if len(r.split()) >= 4]
    if len(keep) < 2:
        raise QkvError("synthetic pairs need at least two references of four words or more")
    rng = random.Random(seed)
    out = []
    for position, i in enumerate(keep):
        other = keep[(position + len(keep) // 2) % len(keep)]  # a derangement: never the pair itself
        src, words, other_words = sources[i], references[i].split(), references[other].split()
        half = len(words) // 2
        n = rng.randint(1, 3)
        start = rng.randint(0, max(0, half - n))
        loop = words[start : start + n]
        out += [
            ("correct", src, references[i]),
            ("detached", src, references[other]),
            ("partly-detached", src, " ".join(words[:half] + other_words[len(other_words) // 2 :])),
            ("oscillation", src, " ".join(words[: start + n] + loop * 4)),
            ("copy", src, src),
            ("omission", src, " ".join(words[:half])),
            ("addition", src, " ".join(words + other_words)),
        ]
    return out


def roc_auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive scores above a negative), ties counting half (the Mann-Whitney U statistic)."""
    if not positive or not negative:
        return math.nan
    scores = sorted([(s, 1) for s in positive] + [(s, 0) for s in negative])
    rank_sum, i = 0.0, 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j < len(scores) and scores[j][0] == scores[i][0]:
            j += 1
        rank = (i + 1 + j) / 2
        rank_sum += rank * sum(label for _, label in scores[i:j])
        i = j
    n_pos, n_neg = len(positive), len(negative)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def ranks_acceptable(scores: list[float], good: list[bool]) -> float:
    """ROC AUC of ``scores`` (higher: more trustworthy) for the acceptable translations against the rest."""
    return roc_auc([s for s, g in zip(scores, good) if g], [s for s, g in zip(scores, good) if not g])


def precision_at_recall(positive: list[float], negative: list[float], recall: float = 0.9) -> float:
    """Precision at the highest threshold that flags at least ``recall`` of the positives."""
    if not positive:
        return math.nan
    threshold = sorted(positive, reverse=True)[max(0, math.ceil(recall * len(positive)) - 1)]
    flagged_pos = sum(s >= threshold for s in positive)
    flagged_neg = sum(s >= threshold for s in negative)
    return flagged_pos / (flagged_pos + flagged_neg)


def _threshold(positive: list[float], negative: list[float], max_false: float = MAX_FALSE_ALARMS) -> float:
    """A cut (flag at or above it) that flags at most ``max_false`` of the negatives (the correct pairs)
    and more positives than negatives, placed halfway between the lowest value that does so and the
    highest negative below it (the widest margin: between the two the fit has no value, so either
    flags the same pairs; at the value itself, a feature that takes few values, such as a count of
    repeats, would miss its kind one step short of what the made-up pairs hold); infinity (never flag)
    when there is none."""
    for c in sorted(set(positive) | set(negative)):
        false = sum(s >= c for s in negative) / len(negative)
        if false <= max_false and sum(s >= c for s in positive) / len(positive) > false:
            below = [s for s in negative if s < c]
            return (c + max(below)) / 2 if below else c
    return math.inf


def fit_length(sources: list[str], references: list[str]) -> list[float]:
    """[a, b] of log(reference words + 1) ~ a + b log(source words + 1), least squares (b = 1, a the mean
    log ratio, when every source has the same length)."""
    x = torch.tensor([math.log(len(s.split()) + 1) for s in sources], dtype=torch.float64)
    y = torch.tensor([math.log(len(r.split()) + 1) for r in references], dtype=torch.float64)
    if len(x) == 0:
        return [0.0, 1.0]
    spread = ((x - x.mean()) ** 2).sum()
    b = float(((x - x.mean()) * (y - y.mean())).sum() / spread) if spread > 1e-9 else 1.0
    return [float(y.mean() - b * x.mean()), b]


def logistic(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Weights and bias of a logistic regression of y (N,) on x (N, F), standardised features, a little
    L2; the first feature's weight is kept >= 0 (fitted again without it where it came out negative)."""
    def solve(columns: list[int]) -> tuple[torch.Tensor, float]:
        w = torch.zeros(len(columns), dtype=torch.float64, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")
        z = x[:, columns]

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + 1e-3 * (w**2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            optimizer.step(closure)
        full = torch.zeros(x.size(1), dtype=torch.float64)
        full[columns] = w.detach()
        return full, float(b.detach())

    w, b = solve(list(range(x.size(1))))
    if w[0] < 0:
        w, b = solve(list(range(1, x.size(1))))
    return w, b


def _matrix(trusts: list[Trust], features: list[str]) -> torch.Tensor:
    return torch.tensor([[t.features[f] for f in features] for t in trusts], dtype=torch.float64)  # (N, F)


def fold_indices(n: int, k: int = FOLDS, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """(the other indices, the fold's indices) of each of ``k`` seeded folds over ``n`` items."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [(sorted(set(order) - set(order[j::k])), sorted(order[j::k])) for j in range(k)]


def _mean_gain(gains: list[float]) -> float:
    """The mean of the folds' gains that are numbers (a fold of one kind has no ROC AUC)."""
    known = [g for g in gains if not math.isnan(g)]
    return sum(known) / max(1, len(known))


def cross_validated(trusts: list[Trust], acceptable: list[bool], features: list[str], *, folds: int = FOLDS,
                    seed: int = 1) -> list[float]:
    """Each translation's logit from the regression fitted on the other folds (seeded folds)."""
    x, y = _matrix(trusts, features), torch.tensor(acceptable, dtype=torch.float64)
    out = [0.0] * len(trusts)
    for train, held in fold_indices(len(trusts), folds, seed):
        mean, std = x[train].mean(0), x[train].std(0).clamp(min=1e-6)
        w, b = logistic((x[train] - mean) / std, y[train])
        for i, z in zip(held, ((x[held] - mean) / std @ w + b).tolist()):
            out[i] = z
    return out


def reliability(confidence: list[float], good: list[bool], bins: int = 5) -> list[dict]:
    """Per confidence bin of width 1 / ``bins``: how many translations, their mean stated confidence and
    the share that is acceptable (the reliability diagram)."""
    out = []
    for k in range(bins):
        inside = [(c, g) for c, g in zip(confidence, good) if k / bins <= c < (k + 1) / bins or (k == bins - 1 and c == 1)]
        if inside:
            out.append({"bin": [k / bins, (k + 1) / bins], "n": len(inside), "confidence": sum(c for c, _ in inside) / len(inside),
                        "acceptable": sum(g for _, g in inside) / len(inside)})
    return out


def cut_table(confidence: list[float], good: list[bool], cuts: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)) -> list[dict]:
    """Per threshold t (flag a translation below it): the share of the acceptable translations kept, of the
    unacceptable ones flagged, and of all flagged."""
    n_good, n_bad = max(1, sum(good)), max(1, len(good) - sum(good))
    return [{"below": t, "acceptable_kept": sum(c >= t for c, g in zip(confidence, good) if g) / n_good,
             "unacceptable_flagged": sum(c < t for c, g in zip(confidence, good) if not g) / n_bad,
             "flagged": sum(c < t for c in confidence) / max(1, len(confidence))} for t in cuts]


def omission_table(own: list[Trust]) -> dict[str, list[float]]:
    """The omission score's reference (``qkv.inspect.trust.omission_score``): ``QUANTILES`` quantiles of
    ``uncovered`` and of minus ``eos_logprob`` over the model's own validation translations."""
    def quantiles(values: list[float]) -> list[float]:
        ordered = sorted(values)
        return [ordered[round(q * (len(ordered) - 1) / (QUANTILES - 1))] for q in range(QUANTILES)]

    return {"uncovered": quantiles([t.features["uncovered"] for t in own]),
            "eos_logprob": quantiles([-t.features["eos_logprob"] for t in own])}


def _cells() -> list[tuple[float, ...]]:
    return [cell for cell in itertools.product(WEIGHTS, repeat=len(COMBINED))]


def combined_scores(trusts: list[Trust], mean: torch.Tensor, std: torch.Tensor, cell: tuple[float, ...]) -> list[float]:
    """Each translation's combined score (higher: more trustworthy): its ``logprob_mean`` less each feature of
    ``COMBINED`` times its weight in ``cell``, every feature in standard units of the model's own
    validation translations (``mean``, ``std``)."""
    weights = torch.tensor([1.0, *(-w for w in cell)], dtype=torch.float64)
    return (((_matrix(trusts, ["logprob_mean", *COMBINED]) - mean) / std) @ weights).tolist()


def _guard(made: list[Trust], kinds: list[str], scores: list[float]) -> dict[str, float]:
    """ROC AUC of the references over each ``GUARDED`` kind of labelled pairs, by ``scores``."""
    correct = [s for s, k in zip(scores, kinds) if k == "correct"]
    return {kind: roc_auc(correct, [s for s, k in zip(scores, kinds) if k == kind]) for kind in GUARDED}


def choose_combination(own: list[Trust], good: list[bool], made: list[Trust] = (), kinds: list[str] = ()) -> tuple[tuple[float, ...], dict]:
    """The weights of ``COMBINED`` beside ``logprob_mean`` (module docstring): the cell of ``WEIGHTS`` that
    ranks the acceptable translations of ``own`` highest among those that rank the references over each
    ``GUARDED`` kind of ``made`` no worse than ``logprob_mean`` alone; all zero (the log-probability)
    unless it ranks them strictly better, and better out of fold too (the choice made on ``FOLDS`` - 1
    folds, measured on the one left). Returns the cell and what was measured."""
    base = tuple(0.0 for _ in COMBINED)
    x = _matrix(own, ["logprob_mean", *COMBINED])
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    guards = {cell: _guard(made, kinds, combined_scores(made, mean, std, cell)) for cell in _cells()} if made else {}
    allowed = [cell for cell in _cells() if all(guards[cell][k] >= guards[base][k] for k in GUARDED)] if made else _cells()
    scores = {cell: combined_scores(own, mean, std, cell) for cell in allowed}

    def pick(indices: list[int]) -> tuple[float, ...]:
        rank = {cell: ranks_acceptable([scores[cell][i] for i in indices], [good[i] for i in indices]) for cell in allowed}
        best = max(allowed, key=lambda cell: (rank[cell], cell == base))  # a tie goes to the log-probability
        return best if rank[best] > rank[base] else base

    chosen = pick(list(range(len(own))))
    gains = []
    for others, held in fold_indices(len(own)):
        cell = pick(others)
        gains.append(ranks_acceptable([scores[cell][i] for i in held], [good[i] for i in held])
                     - ranks_acceptable([scores[base][i] for i in held], [good[i] for i in held]))
    held_out_gain = _mean_gain(gains)
    if not held_out_gain > 0:
        chosen = base
    report = {"weights": dict(zip(COMBINED, chosen)), "held_out_gain": held_out_gain,
              "grid": [{"weights": dict(zip(COMBINED, cell)), "roc_auc": ranks_acceptable(scores[cell], good)}
                       | ({"references_over": guards[cell]} if made else {}) for cell in allowed]}
    return chosen, report | {"mean": mean.tolist(), "std": std.tolist()}


def flag_threshold(flag: str, made: list[Trust], kinds: list[str], accepted: list[Trust], references: list[Trust]) -> float | None:
    """The threshold of ``flag`` (``flags_of``'s form; None: it never flags) on the kind it names: the lowest
    cut that trips on at most ``MAX_FALSE_ALARMS`` of the ``accepted`` translations and
    ``MAX_FALSE_REFERENCES`` of the ``references``, and on more of its kind, moved halfway down to the
    highest value below it that those bounds keep unflagged (``_threshold``); None where that cut
    catches less than ``MIN_CAUGHT`` of its kind."""
    kind, feature, sign = FLAG_OF[flag]
    pos = [sign * t.features[feature] for t, k in zip(made, kinds) if k == kind]
    cut = max(_threshold(pos, [sign * t.features[feature] for t in negatives], share)
              for negatives, share in ((accepted, MAX_FALSE_ALARMS), (references, MAX_FALSE_REFERENCES)) if negatives)
    if cut == math.inf or sum(p >= cut for p in pos) < MIN_CAUGHT * len(pos):
        return None
    # flags_of flags value >= threshold (sign +1) or value < threshold (sign -1, here value <= -cut)
    return cut if sign > 0 else math.nextafter(-cut, math.inf)


def choose_capping(calibration: dict, own: list[Trust], good: list[bool], made: list[Trust], kinds: list[str]) -> tuple[list[str], list[dict]]:
    """The flags of ``CAPPED`` that cap the confidence of ``calibration`` (fitted, capping nothing yet: a cap
    multiplies it by ``CAP_FACTOR``), tried in turn with the caps kept before: a flag caps only where capping the translations
    of ``own`` it flags ranks the acceptable ones strictly better, in the fit and out of fold (its threshold
    fitted again on the other folds' acceptable translations, the cap measured on the fold left), and
    capping the ``made`` pairs it flags ranks the references over no ``GUARDED`` kind worse. Returns the
    flags and what was measured for each."""
    def capped_by(trusts: list[Trust], values: list[float], flag: str, thresholds: dict) -> list[float]:
        return [v * CAP_FACTOR if flag in flags_of(t.features, thresholds) else v for t, v in zip(trusts, values)]

    own_values = [confidence_of(t.features, calibration) for t in own]
    made_values = [confidence_of(t.features, calibration) for t in made]
    references = [t for t, k in zip(made, kinds) if k == "correct"]
    kept, steps = [], []
    for flag in CAPPED:
        thresholds = calibration["thresholds"]
        if thresholds[flag] is None:
            steps.append({"flag": flag, "caps": False, "why": "it never flags"})
            continue
        with_cap = capped_by(own, own_values, flag, thresholds)
        gain = ranks_acceptable(with_cap, good) - ranks_acceptable(own_values, good)
        made_capped = capped_by(made, made_values, flag, thresholds)
        before, after = _guard(made, kinds, made_values), _guard(made, kinds, made_capped)
        held = []
        for others, part in fold_indices(len(own)):
            refit = thresholds | {flag: flag_threshold(flag, made, kinds, [own[i] for i in others if good[i]], references)}
            values, labels = [own_values[i] for i in part], [good[i] for i in part]
            held.append(ranks_acceptable(capped_by([own[i] for i in part], values, flag, refit), labels)
                        - ranks_acceptable(values, labels))
        held_gain = _mean_gain(held)
        caps = gain > 0 and held_gain > 0 and all(after[g] >= before[g] for g in GUARDED)
        steps.append({"flag": flag, "caps": caps, "flagged": sum(v != w for v, w in zip(own_values, with_cap)),
                      "gain": gain, "held_out_gain": held_gain, "references_over": [before, after]})
        if caps:
            kept.append(flag)
            own_values, made_values = with_cap, made_capped
    return kept, steps


def fit(own: list[Trust], own_chrf: list[float], *, name: str, made: list[Trust] = (), kinds: list[str] = (),
        length: list[float] | None = None, acceptable: float = ACCEPTABLE) -> dict:
    """A calibration (``qkv.inspect.trust``'s format, version 3) from the model's own translations (``own``)
    with their sentence chrF (0-100), and the labelled pairs ``made`` of ``kinds`` (``synthetic_pairs``;
    none: the text-only flags): module docstring."""
    if len(own) != len(own_chrf) or len(made) != len(kinds):
        raise QkvError("fit needs one chrF per translation and one kind per labelled pair")
    good = [c >= acceptable for c in own_chrf]
    n_good = sum(good)
    out: dict = {"version": 3, "acceptable": acceptable, "length": length or [0.0, 1.0],
                 "fitted_on": name, "own_translations": len(own), "acceptable_share": n_good / max(1, len(own))}
    if own:
        out["omission"] = omission_table(own)
        for t in [*own, *made]:
            t.features["omission"] = omission_score(t.features, out)
    out["thresholds"] = dict(LOGPROB_ONLY["thresholds"])
    if made:
        if set(kinds) != set(KINDS):
            raise QkvError(f"fitting the flags needs pairs of every kind ({', '.join(KINDS)})")
        references = [t for t, k in zip(made, kinds) if k == "correct"]
        accepted = [t for t, g in zip(own, good) if g]
        out["false_alarms"] = {}
        for flag, (kind, _, _) in FLAG_OF.items():
            out["thresholds"][flag] = flag_threshold(flag, made, kinds, accepted, references)
            trips = lambda ts: sum(flag in flags_of(t.features, out["thresholds"]) for t in ts) / max(1, len(ts))  # noqa: E731
            out["false_alarms"][flag] = {"own_acceptable": trips(accepted), "references": trips(references),
                                         "caught": trips([t for t, k in zip(made, kinds) if k == kind])}
    assert set(out["thresholds"]) == set(FLAGS)
    if min(n_good, len(own) - n_good) < MIN_CLASS:
        out.update(kind="logprob", features=[], mean=[], std=[], weights=[], bias=0.0,
                   why=f"{n_good} of {len(own)} translations acceptable: too few of one kind to fit (log-probability only)")
        return out
    cell, report = choose_combination(own, good, made, kinds)
    mean, std = torch.tensor(report.pop("mean"), dtype=torch.float64), torch.tensor(report.pop("std"), dtype=torch.float64)
    h = torch.tensor(combined_scores(own, mean, std, cell), dtype=torch.float64)[:, None]  # (N, 1)
    h_mean, h_std = float(h.mean()), float(h.std().clamp(min=1e-6))
    w, b = logistic((h - h_mean) / h_std, torch.tensor(good, dtype=torch.float64))
    scale = float(w[0]) / h_std  # >= 0: the confidence never falls as the combined score rises
    names = ["logprob_mean", *COMBINED]
    signed = [1.0, *(-c for c in cell)]
    keep = [i for i, v in enumerate(signed) if v != 0]
    lp = [t.features["logprob_mean"] for t in own]
    out.update(kind="fitted", features=[names[i] for i in keep], mean=[float(mean[i]) for i in keep],
               std=[float(std[i]) for i in keep], weights=[scale * signed[i] for i in keep],
               bias=b - scale * h_mean, combination=report, capping=[])
    out["capping"], out["capping_selection"] = choose_capping(out, own, good, made, kinds) if made else ([], [])
    given = [confidence_of(t.features, out, flags_of(t.features, out["thresholds"])) for t in own]
    out.update(logprob={"roc_auc": ranks_acceptable(lp, good), "spearman": spearman(lp, own_chrf)},
               given={"roc_auc": ranks_acceptable(given, good), "spearman": spearman(given, own_chrf)},
               reliability=reliability(given, good), cuts=cut_table(given, good))
    return out


def provoking_pairs(sources: list[str], references: list[str]) -> tuple[list[str], list[str]]:
    """Every ``JOIN_EVERY``-th pair joined with the next into one line (sources and references alike)."""
    picked = range(0, len(sources) - 1, JOIN_EVERY)
    return [f"{sources[i]} {sources[i + 1]}" for i in picked], [f"{references[i]} {references[i + 1]}" for i in picked]


def calibrate(model, tokenizer, sources: list[str], references: list[str], *, name: str, config=None, text=None,
              log=lambda text: print(text, file=sys.stderr)) -> dict:
    """The model's calibration on validation pairs (module docstring): its translations with ``config``
    (a ``qkv.DecodeConfig``; None: the checkpoint's settings, as ``qkv.Translator``) and ``text`` (a
    ``qkv.TextOptions``: a line cut into sentences and recased as the command line does; None: each
    line one sentence), scored by sentence chrF, the features of each line as ``--confidence`` judges
    it (each sentence as the model read and wrote it, the line by its weakest: ``assess_lines``), and
    the labelled pairs for the flags where the references allow."""
    from dataclasses import replace

    from qkv.infer.bleu import sentence_chrf
    from qkv.infer.translator import Translator
    from qkv.inspect.trust import assess, assess_lines

    keep = [i for i, (s, r) in enumerate(zip(sources, references)) if s.strip() and r.strip()]
    if not keep:
        raise QkvError(f"{name}: no validation pairs to calibrate on")
    sources, references = [sources[i] for i in keep], [references[i] for i in keep]
    joined_src, joined_ref = provoking_pairs(sources, references)
    inputs, refs = sources + joined_src, references + joined_ref
    try:
        made = synthetic_pairs(sources, references)
    except QkvError:  # short references (dates, words): the flags read the text alone
        made = []
    log(f"calibrating on {name}: translating {len(sources)} sources and {len(joined_src)} joined pairs, then scoring "
        f"them{f' and {len(made)} labelled pairs' if made else ''} ...")
    # The joined pairs without the loop guard: lines made to provoke loops, translated as an engine that lets a
    # model loop would (what qkv score --confidence may be given), so that the fit sees the loops it must rank
    unguarded = replace(config, loop_guard=0) if config is not None else None
    lines = (Translator(model, tokenizer, config, text=text).translate_lines(sources)
             + Translator(model, tokenizer, unguarded, text=text).translate_lines(joined_src))
    translations = [line.text for line in lines]
    chrf = sentence_chrf(translations, refs)
    length = fit_length(sources, references)
    probe = {**LOGPROB_ONLY, "length": length}
    own = assess_lines(model, tokenizer, [line.sentences for line in lines], [line.outputs for line in lines], calibration=probe)
    made_trusts = assess(model, tokenizer, [s for _, s, _ in made], [t for _, _, t in made], calibration=probe) if made else []
    out = fit(own, chrf, name=f"{len(inputs)} translations ({len(joined_src)} of joined pairs) of {name}"
              + (f" and {len(made)} labelled pairs" if made else ""),
              made=made_trusts, kinds=[k for k, _, _ in made], length=length)
    return out | {"text": {"split": text.split, "recase": text.recase} if text is not None else None}


def calibrate_checkpoint(directory, sources: list[str], references: list[str], *, name: str, loop_guard: int = 0,
                         replace: bool = False, log=lambda text: print(text, file=sys.stderr)) -> dict:
    """Calibrate the checkpoint at ``directory`` on validation pairs (``calibrate``, searching with the
    checkpoint's settings and ``loop_guard``, each line whole: module docstring) and add the result to it
    as ``confidence.json`` (``qkv.io.checkpoint.add_file``: verified, and put in place whole)."""
    import json
    from dataclasses import replace as with_

    from qkv.infer.search import DecodeConfig
    from qkv.io import checkpoint
    from qkv.io.manifest import CONFIDENCE

    directory = checkpoint.check_add_file(directory, CONFIDENCE, replace=replace)
    loaded = checkpoint.load(directory)
    config = with_(DecodeConfig(**getattr(loaded.model, "decode_defaults", {})), loop_guard=loop_guard)
    calibration = calibrate(loaded.model, loaded.tokenizer, sources, references, name=name, config=config, log=log)
    checkpoint.add_file(directory, CONFIDENCE, lambda path: path.write_text(json.dumps(calibration, indent=1) + "\n"),
                        replace=replace)
    return calibration
