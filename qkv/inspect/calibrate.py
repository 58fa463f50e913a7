"""Calibrating trust: a model's confidence fitted on its own translations of validation data, the flags'
thresholds on pairs with exact labels, and the measures that say how well a detector ranks.

``calibrate`` translates the validation sources as the command line does (beam search with the loop
guard), and also ``JOIN_EVERY``-th pairs joined two to a line (provoking inputs made from val, with
their references joined: long lines are where the model drops clauses and loops). ``calibrate_checkpoint``
translates and judges each line whole, as ``qkv score --confidence`` and ``--no-split`` read a line:
a caption is one sentence, so only the joined pairs differ from what ``qkv translate --confidence``
judges (each of their sentences alone). Fitted on those pairs cut into sentences instead, the En->De
model's confidence ranked the hand-labelled natural hallucinations at ROC AUC 0.925 against 0.955
whole (docs/trust.md), so whole it is; ``calibrate(text=...)`` cuts them. Each translation
is **acceptable** when its sentence chrF against the reference is at least ``ACCEPTABLE``. ``fit``:

- the confidence: a logistic regression of "acceptable" on the standardised features, whose base is
  ``logprob_mean`` (its weight is kept >= 0, so the confidence never falls as the mean log-probability
  rises), and to which another feature of ``CANDIDATES`` is added, one at a time, up to
  ``MAX_FEATURES`` in all, only where it raises the cross-validated ROC AUC (``FOLDS`` folds) by at least
  ``MIN_GAIN`` without lowering the cross-validated Spearman correlation with sentence chrF. With fewer
  than ``MIN_CLASS`` acceptable or unacceptable translations there is nothing to fit: the calibration is
  log-probability-only (``qkv.inspect.trust.LOGPROB_ONLY``'s confidence), say, for a model that
  translates all of its validation data right.
- the flags: ``synthetic_pairs`` turns (source, reference) pairs into six kinds of (source, target) pairs
  whose label is known by construction: ``correct`` (the reference), ``detached`` (another sentence's
  reference), ``partly-detached`` (the reference's second half replaced by the second half of
  another's), ``oscillation`` (the reference cut and one of its n-grams looped), ``copy`` (the source
  itself) and ``omission`` (the reference's second half dropped); each flag's threshold is the lowest
  cut that flags at most ``MAX_FALSE_ALARMS`` of the references and acceptable translations and more of
  its kind. References shorter than four words make no such pairs: the flags are then
  ``LOGPROB_ONLY``'s, which read the text alone.
- the caps: ``detached`` always caps the confidence at ``FLAG_CAP`` (``ALWAYS_CAPPED``: a translation of
  another sentence is an override, not a matter of ranking; on val it moves too few lines to be
  judged there, 26 to 30 of 1,141, and the choice flipped between two runs of one recipe on changes of
  0.0003 ROC AUC, while on the labelled natural pairs made from val its cap raised the ranking of the
  hallucinations, 0.876 to 0.883: docs/trust.md); each other flag of ``CAPPED`` in turn caps (``capping``) only where,
  with the caps kept before it, capping the validation translations it flags lowers neither the
  out-of-fold ROC AUC of the acceptable ones nor the Spearman correlation with chrF (``choose_capping``:
  a flag that fires on correct names and cognates, as ``copy`` can, keeps its flag but moves no
  confidence; a ``severe`` loop or copy is capped whatever the choice). The reliability diagram and the
  cut table are of the confidence as it is then given.
- ``length``: the expected translation length from the source's, a least-squares line through the
  validation pairs' log word counts (the ``shortness`` feature).
"""

from __future__ import annotations

import math
import random
import sys

import torch

from qkv.errors import QkvError
from qkv.inspect.trust import CAPPED, FLAG_CAP, FLAG_FEATURE, FLAGS, LOGPROB_ONLY, Trust, capped, flags_of, sigmoid, spearman

KINDS = ("correct", "detached", "partly-detached", "oscillation", "copy", "omission")
# Acceptable: sentence chrF at least this against the reference. Chosen on Multi30k val with the En->De
# model of docs/trust.md: translations below it miss or garble a content word or more (read there).
ACCEPTABLE = 50.0
CANDIDATES = ("logprob_min", "logprob_std", "source_mean", "source_min", "unused", "length_ratio", "shortness", "copy")
MAX_FEATURES = 3  # logprob_mean and at most two more
MIN_GAIN = 0.005  # cross-validated ROC AUC a feature must add
FOLDS = 5
MIN_CLASS = 10  # acceptable and unacceptable translations each needed to fit the confidence
ALWAYS_CAPPED = ("detached",)  # flags that cap whatever the validation ranking says (module docstring)
JOIN_EVERY = 8  # every 8th validation pair is also joined with the next into one line
MAX_FALSE_ALARMS = 0.02  # a flag's threshold flags at most this share of the correct pairs (on validation)
# Which flag names which kind, and the single feature it thresholds (sign: +1 flags high values).
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
    """The lowest cut (flag at or above it) that flags at most ``max_false`` of the negatives (the correct
    pairs) and more positives than negatives; infinity (never flag) when there is none."""
    for c in sorted(set(positive) | set(negative)):
        false = sum(s >= c for s in negative) / len(negative)
        if false <= max_false and sum(s >= c for s in positive) / len(positive) > false:
            return c
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


def cross_validated(trusts: list[Trust], acceptable: list[bool], features: list[str], *, folds: int = FOLDS,
                    seed: int = 1) -> list[float]:
    """Each translation's logit from the regression fitted on the other folds (seeded folds)."""
    order = list(range(len(trusts)))
    random.Random(seed).shuffle(order)
    x, y = _matrix(trusts, features), torch.tensor(acceptable, dtype=torch.float64)
    out = [0.0] * len(trusts)
    for k in range(folds):
        held = order[k::folds]
        train = sorted(set(order) - set(held))
        mean, std = x[train].mean(0), x[train].std(0).clamp(min=1e-6)
        w, b = logistic((x[train] - mean) / std, y[train])
        for i, z in zip(held, ((x[held] - mean) / std @ w + b).tolist()):
            out[i] = z
    return out


def select_features(trusts: list[Trust], chrf: list[float], acceptable: list[bool]) -> tuple[list[str], list[dict]]:
    """Forward selection (module docstring): the features, and each step's cross-validated numbers."""
    def measure(features: list[str]) -> dict:
        z = cross_validated(trusts, acceptable, features)
        return {"features": list(features), "roc_auc": ranks_acceptable(z, acceptable), "spearman": spearman(z, chrf)}

    chosen = ["logprob_mean"]
    steps = [measure(chosen)]
    while len(chosen) < MAX_FEATURES:
        tried = [measure([*chosen, f]) for f in CANDIDATES if f not in chosen]
        best = max(tried, key=lambda m: m["roc_auc"])
        if best["roc_auc"] < steps[-1]["roc_auc"] + MIN_GAIN or best["spearman"] < steps[-1]["spearman"]:
            break
        chosen, steps = best["features"], [*steps, best]
    return chosen, steps


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


def choose_capping(confidence: list[float], flags: list[list[str]], chrf: list[float], good: list[bool]) -> tuple[list[str], list[dict]]:
    """The flags of ``CAPPED`` that cap (module docstring: ``ALWAYS_CAPPED``'s and those chosen), from each
    translation's out-of-fold ``confidence``, its ``flags`` and sentence ``chrf``; and per flag what
    capping did: the lines it flags and the ROC AUC and Spearman with and without its cap."""
    def measure(values: list[float]) -> tuple[float, float]:
        return ranks_acceptable(values, good), spearman(values, chrf)

    kept, steps, current = [], [], list(confidence)
    for flag in CAPPED:
        with_cap = [min(c, FLAG_CAP) if flag in f else c for c, f in zip(current, flags)]
        (auc, rho), (auc_capped, rho_capped) = measure(current), measure(with_cap)
        caps = flag in ALWAYS_CAPPED or not (auc_capped < auc or rho_capped < rho)  # nan (one kind only) compares False: kept
        steps.append({"flag": flag, "flagged": sum(flag in f for f in flags), "caps": caps, "roc_auc": [auc, auc_capped],
                      "spearman": [rho, rho_capped]})
        if caps:
            kept, current = [*kept, flag], with_cap
    return kept, steps


def fit(own: list[Trust], own_chrf: list[float], *, name: str, made: list[Trust] = (), kinds: list[str] = (),
        length: list[float] | None = None, acceptable: float = ACCEPTABLE) -> dict:
    """A calibration (``qkv.inspect.trust``'s format) from the model's own translations (``own``) with
    their sentence chrF (0-100), and the labelled pairs ``made`` of ``kinds`` (``synthetic_pairs``;
    none: the text-only flags): module docstring."""
    if len(own) != len(own_chrf) or len(made) != len(kinds):
        raise QkvError("fit needs one chrF per translation and one kind per labelled pair")
    good = [c >= acceptable for c in own_chrf]
    n_good = sum(good)
    out: dict = {"version": 2, "acceptable": acceptable, "length": length or [0.0, 1.0],
                 "fitted_on": name, "own_translations": len(own), "acceptable_share": n_good / max(1, len(own))}
    out["thresholds"] = dict(LOGPROB_ONLY["thresholds"])
    if made:
        if set(kinds) != set(KINDS):
            raise QkvError(f"fitting the flags needs pairs of every kind ({', '.join(KINDS)})")
        correct = [t for t, k in zip(made, kinds) if k == "correct"] + [t for t, g in zip(own, good) if g]
        for kind, (flag, feature, sign) in FLAG_OF.items():
            pos = [sign * t.features[feature] for t, k in zip(made, kinds) if k == kind]
            cut = _threshold(pos, [sign * t.features[feature] for t in correct])
            # flags_of flags value >= threshold (sign +1) or value < threshold (sign -1, here value <= -cut)
            out["thresholds"][flag] = None if cut == math.inf else cut if sign > 0 else math.nextafter(-cut, math.inf)
    assert set(out["thresholds"]) == set(FLAGS)
    if min(n_good, len(own) - n_good) < MIN_CLASS:
        out.update(kind="logprob", features=[], mean=[], std=[], weights=[], bias=0.0,
                   why=f"{n_good} of {len(own)} translations acceptable: too few of one kind to fit (log-probability only)")
        return out
    features, steps = select_features(own, own_chrf, good)
    x = _matrix(own, features)
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    w, b = logistic((x - mean) / std, torch.tensor(good, dtype=torch.float64))
    lp = [t.features["logprob_mean"] for t in own]
    # out of fold, a severe loop or copy capped; then with the caps chosen (confidence_of's rule)
    held = [capped(sigmoid(z), t.features, [], ()) for t, z in zip(own, cross_validated(own, good, features))]
    flags = [flags_of(t.features, out["thresholds"]) for t in own]
    capping, capping_steps = choose_capping(held, flags, own_chrf, good)
    given = [capped(c, t.features, fl, capping) for c, t, fl in zip(held, own, flags)]
    out.update(kind="fitted", features=features, mean=mean.tolist(), std=std.tolist(), weights=w.tolist(), bias=b,
               selection=steps, capping=capping, capping_selection=capping_steps,
               logprob={"roc_auc": ranks_acceptable(lp, good), "spearman": spearman(lp, own_chrf)},
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
    lines = Translator(model, tokenizer, config, text=text).translate_lines(inputs)
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
