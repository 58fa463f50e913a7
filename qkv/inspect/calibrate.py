"""Calibrating trust: pairs with exact labels made from validation data, the confidence fitted on them,
and the measures that say how well a detector separates them.

``synthetic_pairs`` turns (source, reference) pairs into six kinds of (source, target) pairs whose
label is known by construction: ``correct`` (the reference), ``detached`` (another sentence's
reference), ``partly-detached`` (the reference's second half replaced by the second half of
another's), ``oscillation`` (the reference cut and one of its n-grams looped), ``copy`` (the source
itself) and ``omission`` (the reference's second half dropped). ``fit`` chooses the confidence's
weights and each flag's threshold on them, and on the model's own translations of the same sources
scored by sentence chrF against their references: the confidence is a logistic regression with soft
targets (1 for a reference, 0 for a made-up pathology, chrF / 100 for the model's own translation),
so that it ranks the model's real output as its quality does and puts every pathology below.
"""

from __future__ import annotations

import math
import random

import torch

from qkv.errors import QkvError
from qkv.inspect.trust import FEATURES, FLAG_FEATURE, FLAGS, Trust

KINDS = ("correct", "detached", "partly-detached", "oscillation", "copy", "omission")
# Which flag names which kind, and the single feature it thresholds (sign: +1 flags high values).
# How much the model's own translations count against all the made-up pairs together, chosen on the
# natural pairs of val (docs/trust.md): any hallucination at ROC AUC 0.79 with 1, 0.58 with 4.
OWN_WEIGHT = 1.0
MAX_FALSE_ALARMS = 0.02  # a flag's threshold flags at most this share of the correct pairs (on validation)
FLAG_OF = {kind: (flag, FLAG_FEATURE[flag][0], -1 if FLAG_FEATURE[flag][1] else +1) for kind, flag in (
    ("detached", "detached"), ("partly-detached", "partly-detached"), ("oscillation", "repetition"), ("copy", "copy"),
    ("omission", "omission"))}


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


def precision_at_recall(positive: list[float], negative: list[float], recall: float = 0.9) -> float:
    """Precision at the highest threshold that flags at least ``recall`` of the positives."""
    if not positive:
        return math.nan
    threshold = sorted(positive, reverse=True)[max(0, math.ceil(recall * len(positive)) - 1)]
    flagged_pos = sum(s >= threshold for s in positive)
    flagged_neg = sum(s >= threshold for s in negative)
    return flagged_pos / (flagged_pos + flagged_neg)


def _threshold(positive: list[float], negative: list[float], max_false: float = MAX_FALSE_ALARMS) -> float:
    """The lowest cut (flag at or above it) that flags at most ``max_false`` of the negatives (the correct
    pairs) and more positives than negatives; infinity (never flag) when there is none."""
    for c in sorted(set(positive) | set(negative)):
        false = sum(s >= c for s in negative) / len(negative)
        if false <= max_false and sum(s >= c for s in positive) / len(positive) > false:
            return c
    return math.inf


def fit(trusts: list[Trust], kinds: list[str], *, name: str, own: list[Trust] | None = None,
        own_chrf: list[float] | None = None) -> dict:
    """A calibration (``qkv.inspect.trust``'s format) fitted on labelled pairs and, if given, on the
    model's own translations (``own``) with their sentence chrF (0-100): the logistic regression with
    soft targets on the standardised features (module docstring), and each flag's threshold."""
    if set(kinds) != set(KINDS):
        raise QkvError(f"fitting needs pairs of every kind ({', '.join(KINDS)})")
    own, own_chrf = own or [], own_chrf or []
    x = torch.tensor([[t.features[f] for f in FEATURES] for t in [*trusts, *own]], dtype=torch.float64)  # (N, F)
    y = torch.tensor([float(k == "correct") for k in kinds] + [c / 100 for c in own_chrf], dtype=torch.float64)  # (N,)
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mean) / std
    # Weighted so that the references (a sixth of the made-up pairs) count as much as the pathologies
    # together, and the model's own translations, if any, OWN_WEIGHT times as much as all the made-up pairs.
    labelled = torch.tensor([k == "correct" for k in kinds], dtype=torch.float64)
    weight = torch.where(labelled == 1, 0.5 / labelled.mean(), 0.5 / (1 - labelled.mean()))
    if own:
        weight = torch.cat([weight, torch.ones(len(own), dtype=torch.float64) * OWN_WEIGHT * len(trusts) / len(own)])
    w = torch.zeros(len(FEATURES), dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = (weight * torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, reduction="none")).mean()
        loss = loss + 1e-3 * (w**2).sum()  # a little L2: features such as copy and repeats are nearly separable
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    thresholds = {}
    correct = [t for t, k in zip(trusts, kinds) if k == "correct"] + own  # what a flag must leave alone
    for kind, (flag, feature, sign) in FLAG_OF.items():
        pos = [sign * t.features[feature] for t, k in zip(trusts, kinds) if k == kind]
        cut = _threshold(pos, [sign * t.features[feature] for t in correct])
        # flags_of flags value >= threshold (sign +1) or value < threshold (sign -1, here value <= -cut)
        thresholds[flag] = None if cut == math.inf else cut if sign > 0 else math.nextafter(-cut, math.inf)
    assert set(thresholds) == set(FLAGS)
    return {"features": list(FEATURES), "mean": mean.tolist(), "std": std.tolist(), "weights": w.detach().tolist(),
            "bias": float(b.detach()), "thresholds": thresholds, "fitted_on": name, "own_translations": len(own)}
