"""Whether to trust a translation: signals from the model's own internals, one confidence, and flags.

For each (source, translation) pair, one teacher-forced pass of the model that translates
(``qkv.inspect.contributions``) gives, per target token, its probability and its *source share*
(ALTI+: how much of the prediction comes from the source rather than from the target prefix). From
those and the two texts, per sentence (``FEATURES``):

- ``logprob_mean``, ``logprob_min``, ``logprob_std``: the tokens' log-probabilities (EOS included);
- ``source_mean``, ``source_min``: the source share, the mean over tokens and the lowest mean of
  three consecutive tokens (a detached stretch);
- ``unused``: the fraction of source words that no target token used: a word is used when, for
  some target token, its share of that token's source part is at least ``USED`` of the uniform share;
- ``repeats``: the most consecutive repeats of one n-gram of words (n = 1 to 4) in the translation,
  or of a run of one to five characters, less two (``char_repeats``: a loop inside a word);
- ``recurrence``: how many more times one phrase of three words recurs anywhere in the translation
  than any does in its source (``qkv.inspect.text_signals.recurrence``: an oscillation whose repeats
  are not back to back);
- ``copy``: character F-score (chrF) of the translation against its own source, in [0, 1];
- ``length_ratio``: the absolute log of (translation words + 1) / (source words + 1): too long and too
  short alike;
- ``shortness``: how much shorter the translation is than its source's expected length, max(0,
  a + b log(source words + 1) - log(translation words + 1)), with a and b fitted on the validation
  references (the calibration's ``length``; without one a = 0, b = 1): an omission signal;
- ``longness``: its mirror, how much longer the translation is than that expected length (a fragment
  translated as a whole sentence, an invented clause added): the ``addition`` flag's;
- ``attention_entropy``: the last layer's cross-attention entropy over log S;
- ``loops``: ``repeats`` beyond ``LOOP_FREE`` (0 for fewer);
- ``eos_logprob``: the log-probability of ending where the translation ends: of the end of sentence,
  or of a sentence-final punctuation mark there (a translation without its full stop is not cut short);
- ``uncovered``: how much of the source the alignment head leaves uncovered (``uncovered``; a model
  without a head: its last layer's cross-attention), and ``omission``, the omission score (``omission_score``).

The ``confidence`` in [0, 1] is the checkpoint's own (``calibration_of``): fitted on its translations
of validation data (``qkv.inspect.calibrate``, ``qkv calibrate``, and the end of ``qkv train``), a
logistic function of ``logprob_mean`` with a weight that is never negative, and of other features only
where they ranked the validation translations better; a flag caps it only where its fit chose so. A
checkpoint without a calibration of its own gets ``LOGPROB_ONLY``: the confidence is the geometric mean
of the tokens' probabilities, exp(``logprob_mean``), and only the flags that read the text alone
(repetition, copy); there, and under a calibration of version 2, a ``severe`` loop or copy and the
flags of the calibration's ``capping`` (``CAPPED``) cap the confidence at ``FLAG_CAP``. The flags are
thresholds on single features (``FLAG_FEATURE``); the confidence stays non-decreasing in
``logprob_mean`` with everything else fixed.
"""

from __future__ import annotations

import functools
import json
import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from qkv.data.corpus import collate
from qkv.errors import QkvError
from qkv.io.manifest import CONFIDENCE
from qkv.inspect.contributions import contributions
from qkv.inspect.text_signals import (  # noqa: F401 (the API's names)
    char_repeats, copy_score, copy_scores, max_repeats, recurrence, spearman,
)
from qkv.inspect.visualize import group_words
from qkv.model.transformer import Transformer

FEATURES = ("logprob_mean", "logprob_min", "logprob_std", "source_mean", "source_min", "unused", "repeats", "copy",
            "length_ratio", "shortness", "attention_entropy", "loops", "eos_logprob", "uncovered", "omission", "recurrence",
            "longness")
FLAGS = ("detached", "partly-detached", "repetition", "recurrence", "copy", "omission", "addition")
# Flags added after calibrations were written: a calibration may lack any of them, and then never raises it
# (``recurrence`` since 2026-12-06, ``addition`` since 2026-12-07) until ``qkv calibrate --force`` fits a cut.
LATER_FLAGS = ("recurrence", "addition")
OLDER_FLAGS = tuple(f for f in FLAGS if f not in LATER_FLAGS)  # what every calibration of versions 2 and 3 has
USED = 0.5  # a source word is used by a target token that gives it half the uniform share or more
WORD_SOURCE, WORD_PROB = 0.25, 0.05  # a target word is marked below these source share or probability
LOGPROB_FLOOR = -100.0  # a token the model rules out (-inf) counts as e^-100, so every feature stays finite

LOOP_FREE = 3.0  # repeats up to this many are not a loop for ``loops``: the model's own acceptable Multi30k val outputs hold such stutters
FLAG_CAP = 0.05  # a translation with a capping flag has at most this confidence (LOGPROB_ONLY, version 2)
CAP_FACTOR = 0.001  # version 3: a capping flag multiplies the confidence by this (below the others, in their own order)
CAPPED = ("repetition", "detached", "copy")  # the flags that may cap (a calibration's "capping"; all of them without one)

# A checkpoint without a calibration of its own: the confidence is exp(logprob_mean), the geometric mean of
# the tokens' probabilities (never another model's fit), and only the flags that read the text alone:
# a run of one to four words four times back to back, or a character run of six ("EEEEEE"), and a
# translation whose chrF against its own source is 0.9 or more.
LOGPROB_ONLY: dict = {
    "version": 2, "kind": "logprob", "features": [], "mean": [], "std": [], "weights": [], "bias": 0.0,
    "thresholds": {"detached": None, "partly-detached": None, "repetition": 4.0, "recurrence": None, "copy": 0.9,
                   "omission": None, "addition": None},
    "fitted_on": "nothing: no confidence.json of its own (the confidence is exp(logprob_mean); run qkv calibrate)",
}
LOGPROB_NOTICE = ("note: {path}'s calibration (confidence.json) is log-probability only (its validation translations "
                  "could not fit a confidence): the confidence is the mean token probability exp(logprob_mean); the flags are "
                  "the ones it fitted")
UNCALIBRATED_NOTICE = ("note: {path} has no calibration of its own (confidence.json): the confidence is the mean token "
                       "probability exp(logprob_mean) and only the repetition and copy flags fire; qkv calibrate fits one")


@dataclass
class Trust:
    """One pair's verdict: ``confidence`` (higher is more trustworthy), ``flags`` (names from FLAGS),
    the ``features``, the source words no target token used (``unused_words``, 0-based word
    indices), and per target word its lowest token probability and source share (``words``) with
    ``marked`` true where either collapses."""

    confidence: float
    flags: list[str]
    features: dict[str, float]
    unused_words: list[int] = field(default_factory=list)
    words: list[dict] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # each flag's reason: its feature against its threshold

    def to_json(self, *, words: bool = True) -> dict:
        out = {"confidence": round(self.confidence, 4), "omission": round(self.features.get("omission", 0.0), 4),
               "flags": self.flags, "why": self.why,
               "features": {k: round(v, 4) for k, v in self.features.items()}, "unused_source_words": self.unused_words}
        if words:
            out["words"] = self.words
        return out


def load_calibration(path: str | Path | None) -> dict:
    """A calibration file's contents (``confidence.json``), checked; None: ``LOGPROB_ONLY``."""
    if path is None:
        return LOGPROB_ONLY
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise QkvError(f"{path}: not a readable calibration ({error})") from None
    check_calibration(data, str(path))
    if data.get("version", 2) < 3:  # its omission threshold was on ``unused``, not on the omission score
        data["thresholds"]["omission"] = None
    for flag in LATER_FLAGS:
        data["thresholds"].setdefault(flag, None)  # fitted before the flag was: it never flags
    return data


def calibration_of(directory: str | Path) -> dict:
    """A checkpoint's own calibration (its ``confidence.json``, verified with the rest of the checkpoint
    when it was loaded), else ``LOGPROB_ONLY``: never another model's."""
    path = Path(directory) / CONFIDENCE
    return load_calibration(path) if path.is_file() else LOGPROB_ONLY


def is_calibrated(calibration: dict) -> bool:
    """False for ``LOGPROB_ONLY`` (and any log-probability-only calibration)."""
    return calibration.get("kind", "fitted") == "fitted"


def check_calibration(data: object, name: str) -> None:
    """A calibration written by ``qkv calibrate`` (this version's, or the nine-feature one before it)."""
    def finite(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    ok = isinstance(data, dict) and data.get("kind", "fitted") in ("fitted", "logprob")
    if ok:
        features = data.get("features")
        ok = (isinstance(features, list) and len(set(features)) == len(features) and set(features) <= set(FEATURES)
              and (data.get("kind", "fitted") == "logprob" or "logprob_mean" in features)
              and all(isinstance(data.get(k), list) and len(data[k]) == len(features) and all(map(finite, data[k]))
                      for k in ("mean", "std", "weights"))
              and all(x > 0 for x in data["std"]) and finite(data.get("bias"))
              and isinstance(data.get("thresholds"), dict) and set(OLDER_FLAGS) <= set(data["thresholds"]) <= set(FLAGS)
              and all(v is None or finite(v) for v in data["thresholds"].values())
              and (data.get("capping") is None or isinstance(data["capping"], list) and set(data["capping"]) <= set(CAPPED))
              and (data.get("length") is None or isinstance(data["length"], list) and len(data["length"]) == 2
                   and all(map(finite, data["length"])))
              and (data.get("omission") is None or isinstance(data["omission"], dict)
                   and set(data["omission"]) == {"uncovered", "eos_logprob"}
                   and all(isinstance(v, list) and v and all(map(finite, v)) and v == sorted(v) for v in data["omission"].values())))
    if ok and "logprob_mean" in data["features"]:  # the base: the confidence never falls as it rises
        ok = data["weights"][data["features"].index("logprob_mean")] >= 0
    if not ok:
        raise QkvError(f"{name}: not a calibration of these features ({', '.join(FEATURES)}): run qkv calibrate again")


def severe(features: dict[str, float]) -> bool:
    """A loop or a copy that caps the confidence under any calibration: the text-only flags of
    ``LOGPROB_ONLY`` (a run of one to four words four times back to back, chrF 0.9 against the source)."""
    text_only = LOGPROB_ONLY["thresholds"]
    return features["repeats"] >= text_only["repetition"] or features["copy"] >= text_only["copy"]


def sigmoid(z: float) -> float:
    """The logistic function, its argument clipped to [-50, 50]."""
    return 1 / (1 + math.exp(-max(-50.0, min(50.0, z))))


def capped(value: float, features: dict[str, float], flags: list[str], capping) -> float:
    """``value`` at most ``FLAG_CAP`` when one of ``flags`` is in ``capping`` or the translation is ``severe``."""
    return min(value, FLAG_CAP) if severe(features) or any(f in capping for f in flags) else value


def confidence_of(features: dict[str, float], calibration: dict, flags: list[str] = ()) -> float:
    """The confidence: exp(logprob_mean) for a log-probability-only calibration, else the logistic
    regression's. Under a calibration of ``qkv calibrate`` (version 3) it is multiplied by ``CAP_FACTOR``
    when one of ``flags`` is in the calibration's ``capping``, the flags whose cap ranked the run's own
    validation translations better (``qkv.inspect.calibrate.choose_capping``). The log-probability-only confidence
    of an uncalibrated checkpoint (``LOGPROB_ONLY``) and a version 2 calibration are also capped where
    the translation is a ``severe`` loop or copy (a version 2 calibration without ``capping``: at every flag
    of ``CAPPED``).
    """
    if calibration.get("kind", "fitted") == "logprob":
        value = math.exp(min(0.0, features["logprob_mean"]))
    else:
        z = calibration["bias"] + sum(
            w * (features[k] - m) / s
            for k, m, s, w in zip(calibration["features"], calibration["mean"], calibration["std"], calibration["weights"]))
        value = sigmoid(z)
    if calibration.get("version", 2) >= 3:  # only the caps its fit chose
        return value * CAP_FACTOR if any(f in calibration.get("capping", ()) for f in flags) else value
    return capped(value, features, flags, calibration.get("capping", CAPPED))


def uncovered(coverage: list[float], content: list[bool]) -> float:
    """How much of the source no target word aligns to: the mean over the source words that hold a letter
    or a digit of max(0, 1 - the word's alignment mass), its weights summed over the target words (a word
    translated once has about 1; a dropped clause's words about 0). 0 for a source without such words."""
    missing = [max(0.0, 1.0 - c) for c, keep in zip(coverage, content) if keep]
    return sum(missing) / len(missing) if missing else 0.0


def omission_score(features: dict[str, float], calibration: dict) -> float:
    """The omission score in [0, 1]: the mean of two ranks among the run's own validation translations
    (the calibration's ``omission`` quantiles; ties at their middle), that of ``uncovered`` and that of minus ``eos_logprob``
    (how unlikely the model found ending where the translation ends). 0.9: more suspect of an omission
    than nine in ten of the model's own validation translations on both counts, on average. 0 without
    a calibration that has the quantiles."""
    table = calibration.get("omission")
    if not table:
        return 0.0
    ranks = [(bisect_left(table[name], sign * features[name]) + bisect_right(table[name], sign * features[name])) / 2 / len(table[name])
             for name, sign in (("uncovered", 1.0), ("eos_logprob", -1.0))]  # ties at their middle rank
    return sum(ranks) / len(ranks)


def expected_length(source_words: int, length: list[float] | None) -> float:
    """The log of (expected translation words + 1) for a source of ``source_words`` words: a + b log(n + 1)."""
    a, b = length or (0.0, 1.0)
    return a + b * math.log(source_words + 1)


# Each flag's feature, and whether it flags below (True) or at and above (False) its threshold.
FLAG_FEATURE = {"detached": ("source_mean", True), "partly-detached": ("source_min", True),
                "repetition": ("repeats", False), "recurrence": ("recurrence", False), "copy": ("copy", False),
                "omission": ("omission", False), "addition": ("longness", False)}
_SAYS = {"source_mean": "the source's mean share of the predictions", "source_min": "the source's share over its weakest three tokens",
         "repeats": "an n-gram's repeats in a row, less two",
         "recurrence": "how many more times a three-word phrase recurs than in the source", "copy": "the translation's chrF against its own source",
         "unused": "the fraction of source words no target word used",
         "longness": "how much longer the translation is than its source's length leads to expect (log words)",
         "omission": "the omission score (the source the alignment leaves uncovered, and how unlikely ending there was)"}


def flags_of(features: dict[str, float], thresholds: dict[str, float | None]) -> list[str]:
    """The flags whose feature crosses its threshold (a None threshold never flags: calibration found
    no cut that flags more of its kind than of the correct pairs). A detached translation is not also
    partly detached."""
    def crosses(flag: str) -> bool:
        feature, below = FLAG_FEATURE[flag]
        limit = thresholds.get(flag)  # a calibration fitted before a flag was has none for it
        return limit is not None and (features[feature] < limit if below else features[feature] >= limit)

    flags = [flag for flag in FLAGS if crosses(flag)]
    return [f for f in flags if not (f == "partly-detached" and "detached" in flags)]


def why_flagged(flags: list[str], features: dict[str, float], thresholds: dict[str, float | None]) -> dict[str, str]:
    """Each flag's reason in words: its feature, its value and the threshold it crossed."""
    out = {}
    for flag in flags:
        feature, below = FLAG_FEATURE[flag]
        out[flag] = f"{_SAYS[feature]} ({feature}) is {features[feature]:.3f}, {'below' if below else 'at or above'} {thresholds[flag]:.3f}"
    return out


def batch_features(log_probs: torch.Tensor, share: torch.Tensor, attention: torch.Tensor, n_tgt: torch.Tensor,
                   n_src: torch.Tensor) -> list[dict[str, float]]:
    """The features a batch computes at once, one dict a pair: log_probs (B, T), each target token's
    log-probability; share (B, T), its source share; attention (B, T, S), the last layer's cross-attention,
    heads averaged; n_tgt, n_src (B,): each pair's target tokens and source tokens, EOS included (what lies
    beyond them is padding). In float64."""
    B, T = log_probs.shape
    real = torch.arange(T, device=log_probs.device)[None, :] < n_tgt[:, None]  # (B, T)
    count = n_tgt.to(torch.float64)
    lp = log_probs.double()
    mean = lp.masked_fill(~real, 0).sum(-1) / count  # (B,)
    std = ((lp - mean[:, None]).square().masked_fill(~real, 0).sum(-1) / count).sqrt()  # population std
    lp_min = lp.masked_fill(~real, math.inf).amin(-1)
    share = share.double()
    source_mean = share.masked_fill(~real, 0).sum(-1) / count
    # The lowest mean of three consecutive tokens (a detached stretch); a pair of fewer tokens, its lowest token.
    if T >= 3:
        window = share.unfold(1, 3, 1).mean(-1)  # (B, T - 2)
        whole = torch.arange(T - 2, device=share.device)[None, :] + 2 < n_tgt[:, None]
        source_min = torch.where(n_tgt >= 3, window.masked_fill(~whole, math.inf).amin(-1), share.masked_fill(~real, math.inf).amin(-1))
    else:
        source_min = share.masked_fill(~real, math.inf).amin(-1)
    # The mean entropy of the attention rows over log S (padding has weight 0 and adds 0).
    a = attention.double()
    entropy = -(a * a.clamp(min=1e-12).log()).sum(-1).masked_fill(~real, 0).sum(-1) / count  # (B,)
    entropy = entropy / n_src.clamp(min=2).double().log()
    columns = [mean, lp_min, std, source_mean, source_min, entropy]
    names = ["logprob_mean", "logprob_min", "logprob_std", "source_mean", "source_min", "attention_entropy"]
    rows = torch.stack(columns, dim=1).tolist()  # (B, 6): one transfer
    return [dict(zip(names, row)) for row in rows]


def _sentence(src_pieces: list[str], tgt_pieces: list[str], log_probs: list[float], shares: list[float] | None,
              source_rows: np.ndarray, aligned_rows: np.ndarray, computed: dict[str, float], source: str,
              translation: str, copy: float, calibration: dict) -> Trust:
    """One pair. log_probs and shares (T): each target token's log-probability and source share (None: the
    light pass of ``assess``, which reads no source shares); source_rows (T, S): each token's source part
    (in the light pass, the last layer's cross-attention); aligned_rows (T, S): what coverage reads, the
    alignment head's weights (a model without a head: the last layer's cross-attention, heads averaged);
    computed: ``batch_features``'s; copy: ``copy_score``."""
    grouped = [(w, cols) for w, cols in group_words(src_pieces) if w != "</s>"]
    src_words = [cols for _, cols in grouped]
    content = [any(ch.isalnum() for ch in w) for w, _ in grouped]  # punctuation weighs nothing
    coverage: list[float] = []
    used: list[bool] = []
    if src_words:
        word_of = np.full(aligned_rows.shape[1], len(src_words), dtype=np.int64)  # (S,): each piece's word; EOS's last

        def by_word(rows: np.ndarray) -> np.ndarray:  # (T, S) -> (T, W + 1): each word's weight, its pieces summed
            out = np.zeros((rows.shape[0], len(src_words) + 1))
            np.add.at(out.T, word_of, rows.T)
            return out

        for j, cols in enumerate(src_words):
            word_of[cols] = j
        if shares is not None:  # the light pass reads no source part
            normalised = source_rows / np.maximum(source_rows.sum(-1, keepdims=True), 1e-12)  # (T, S): over the source
            used = (by_word(normalised)[:, :-1].max(0) * len(src_words) >= USED).tolist()
        coverage = by_word(aligned_rows)[:-1, :-1].sum(0).tolist()  # (W,): over the target tokens, the EOS's row left out
    unused = [j for j, u in enumerate(used) if not u]
    src_n, tgt_words = len(source.split()), translation.split()
    longer = math.log(len(tgt_words) + 1) - expected_length(src_n, calibration.get("length"))  # log words beyond the expected
    features = {
        "logprob_mean": computed["logprob_mean"], "logprob_min": computed["logprob_min"], "logprob_std": computed["logprob_std"],
        "source_mean": computed["source_mean"], "source_min": computed["source_min"],
        "unused": len(unused) / max(1, len(src_words)),
        "repeats": float(max(max_repeats(tgt_words), char_repeats(translation))), "copy": copy,
        "recurrence": float(recurrence(source, translation)),
        "length_ratio": abs(math.log((len(tgt_words) + 1) / (src_n + 1))),
        "shortness": max(0.0, -longer), "longness": max(0.0, longer),
        # the mean entropy of the last layer's cross-attention rows over log S (1: spread evenly; detached output spreads it)
        "attention_entropy": computed["attention_entropy"],
        "eos_logprob": computed["ending"],
        "uncovered": uncovered(coverage, content),
    }
    words = []
    if shares is None:  # the light pass: no source shares, no words
        for name in ("source_mean", "source_min", "unused"):
            del features[name]
    for word, rows in group_words(tgt_pieces) if shares is not None else ():
        if word == "</s>":
            continue
        prob, src_share = math.exp(min(log_probs[r] for r in rows)), min(shares[r] for r in rows)
        words.append({"word": word, "prob": round(prob, 4), "source": round(src_share, 4),
                      "marked": prob < WORD_PROB or src_share < WORD_SOURCE})
    features["loops"] = max(0.0, features["repeats"] - LOOP_FREE)
    features["omission"] = omission_score(features, calibration)
    flags = flags_of(features, calibration["thresholds"])
    return Trust(confidence_of(features, calibration, flags), flags, features, unused, words,
                 why_flagged(flags, features, calibration["thresholds"]))


SHARE_FEATURES = ("source_mean", "source_min", "unused")  # the features that need ALTI+'s source shares
FINAL_PUNCTUATION = (".", "!", "?", "…", "。", "！", "？")


@functools.lru_cache(maxsize=8)
def ending_ids(tokenizer) -> list[int]:
    """The ids a translation may end with (``eos_logprob``): the end of sentence and every piece that is a
    sentence-final punctuation mark alone (SentencePiece's word marker ignored)."""
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    return [tokenizer.eos_id] + [i for i, piece in enumerate(pieces)
                                 if piece.lstrip("\u2581 ") in FINAL_PUNCTUATION and i != tokenizer.eos_id]


def needs_shares(calibration: dict) -> bool:
    """Whether ``calibration``'s confidence or one of its flags reads a source share (``SHARE_FEATURES``)."""
    flags = [flag for flag, limit in calibration["thresholds"].items() if limit is not None]
    return any(f in SHARE_FEATURES for f in calibration["features"]) or any(FLAG_FEATURE[f][0] in SHARE_FEATURES for f in flags)


@torch.inference_mode()
def assess(
    model: Transformer, tokenizer, sources: list[str], translations: list[str], *, calibration: dict | None = None,
    max_tokens: int = 2048, words: bool = True, encode=None,
) -> list[Trust]:
    """A ``Trust`` for each (source, translation) pair, in input order: one teacher-forced pass with
    contributions per batch of similar lengths. Sides longer than the model's positions are cut to fit.
    An empty (or blank) source with an empty translation is trusted: confidence 1, no flags; an empty
    translation of anything else is flagged ``omission``, at most ``FLAG_CAP``.

    ``calibration``: the confidence and flags to apply, ``calibration_of(checkpoint directory)``; None:
    the calibration of the checkpoint the model was loaded from (``qkv.load_checkpoint``,
    ``Translator.from_checkpoint``), else ``LOGPROB_ONLY``. The sources are what the model read: to
    judge a line that a ``Translator`` with ``text`` options split or recased, use
    ``translate_with_confidence``, which judges each sentence as it was translated.

    ``words`` False: where the calibration reads no source share (``needs_shares``), the **light pass**:
    the model's plain teacher-forced pass and its alignment head, no ALTI+ (what ``qkv translate
    --confidence`` prints, the confidence and the flags, in about half the time): the features lack
    ``source_mean``, ``source_min`` and ``unused``, and ``words`` and ``unused_words`` are empty. The
    confidence, the flags and every other feature are those of the full pass.

    ``encode``: in place of ``model.encode`` in the light pass (``qkv.infer.encodings.Encodings.encode``:
    the encoder outputs the search that made the translations computed)."""
    from qkv.infer.translator import length_batches

    if len(sources) != len(translations):
        raise QkvError(f"{len(sources)} sources but {len(translations)} translations")
    if calibration is None:  # the checkpoint's own (qkv.io.checkpoint.load records where the model came from)
        origin = getattr(model, "checkpoint_dir", None)
        calibration = calibration_of(origin) if origin is not None else LOGPROB_ONLY
    model.eval()
    light = not words and not needs_shares(calibration)
    limit = model.config.max_len - 1
    src_ids = [tokenizer.encode(s)[:limit] for s in sources]
    tgt_ids = [tokenizer.encode_target(t)[:limit] for t in translations]
    results: list[Trust | None] = [None] * len(sources)
    lengths = [max(len(s), len(t)) + 1 for s, t in zip(src_ids, tgt_ids)]
    for batch in length_batches(lengths, max_tokens=max_tokens, max_sentences=128):
        src, tgt_in, tgt_out = (t.to(model.device) for t in collate(
            [src_ids[i] for i in batch], [tgt_ids[i] for i in batch],
            pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        ))  # (B, S), (B, T), (B, T)
        if light:
            memory, src_mask, _ = (encode or model.encode)(src)  # (B, S, D), (B, S)
            hidden, weights = model.decode_hidden(tgt_in, memory, src_mask, need_weights=True)  # (B, T, D)
            cross = weights.cross[-1].mean(dim=1)  # (B, T, S): the last layer's, heads averaged
        else:
            found = contributions(model, src, tgt_in, norms=False)  # ALTI and the weights: no value norms
            memory, hidden, cross = found.memory, found.hidden, found.weights[-1].mean(dim=1)
        aligned = (cross if model.config.alignment_layer is None else
                   model.alignment_head(tgt_in, memory, src != tokenizer.pad_id)).float().cpu().numpy()  # (B, T, S)
        real = tgt_out != tokenizer.pad_id  # (B, T): the output projection only where a token is scored
        logits = model.generator(hidden[real]).float()  # (N, V)
        log_probs = hidden.new_zeros(real.shape, dtype=torch.float32)  # (B, T)
        log_probs[real] = logits.gather(-1, tgt_out[real][:, None])[:, 0] - logits.logsumexp(-1)  # log-softmax at the target
        at_end = logits[tgt_out[real] == tokenizer.eos_id]  # (B, V): each pair's last position, where EOS is its target
        ending = (at_end[:, ending_ids(tokenizer)].logsumexp(-1) - at_end.logsumexp(-1)).clamp(min=LOGPROB_FLOOR).tolist()
        copies = copy_scores([sources[i] for i in batch], [translations[i] for i in batch])
        log_probs = log_probs.clamp(min=LOGPROB_FLOOR)
        S = src.size(1)
        # (B, T, S): each token's source part (padding columns hold exactly 0); the light pass: the attention
        source_part = cross.double() if light else found.alti[-1][..., :S].double()
        share = source_part.sum(-1)  # (B, T); not a source share in the light pass (read by nothing there)
        n_src = torch.tensor([len(src_ids[i]) + 1 for i in batch])  # with EOS
        n_tgt = torch.tensor([len(tgt_ids[i]) + 1 for i in batch])
        computed = batch_features(log_probs, share, cross, n_tgt.to(share.device), n_src.to(share.device))
        for features, end in zip(computed, ending, strict=True):
            features["ending"] = end
        rows_of, lps, shares = source_part.cpu().numpy(), log_probs.tolist(), share.tolist()
        for b, i in enumerate(batch):
            s, t = int(n_src[b]), int(n_tgt[b])
            results[i] = _sentence(
                tokenizer.pieces([*src_ids[i], tokenizer.eos_id]), tokenizer.pieces([*tgt_ids[i], tokenizer.eos_id]),
                lps[b][:t], None if light else shares[b][:t], rows_of[b, :t, :s], aligned[b, :t, :s], computed[b],
                sources[i], translations[i], copies[b], calibration)
    for i, (source, translation) in enumerate(zip(sources, translations)):
        if not source.strip() and not translation.strip():  # an empty line's empty translation misses nothing
            results[i] = Trust(1.0, [], results[i].features)  # type: ignore[union-attr]
        elif not translation.strip():  # a line's empty translation misses all of it
            found = results[i]
            assert found is not None
            flags = [f for f in FLAGS if f in found.flags or f == "omission"]
            why = found.why | {"omission": "the translation is empty"}
            results[i] = Trust(min(found.confidence, FLAG_CAP), flags, found.features, found.unused_words, found.words, why)
    return results  # type: ignore[return-value]


def combined(trusts: list[Trust], source_words: list[int]) -> Trust:
    """One line's verdict from its sentences' (``source_words``: each sentence's source word count): the
    least confident sentence's confidence and features (the omission score: the highest), every sentence's flags (and their reasons), the
    unused source words numbered across the line's sentences, and every word."""
    if len(trusts) == 1:
        return trusts[0]
    weakest = min(trusts, key=lambda t: t.confidence)
    flags = [f for f in FLAGS if any(f in t.flags for t in trusts)]
    why = {f: next(t.why[f] for t in trusts if f in t.why) for f in flags}
    offsets = [sum(source_words[:k]) for k in range(len(trusts))]
    unused = [o + j for t, o in zip(trusts, offsets) for j in t.unused_words]
    features = weakest.features | {"omission": max(t.features.get("omission", 0.0) for t in trusts)}
    return Trust(weakest.confidence, flags, features, unused, [w for t in trusts for w in t.words], why)


def assess_lines(model: Transformer, tokenizer, sources: list[list[str]], translations: list[list[str]], *,
                 calibration: dict | None = None, max_tokens: int = 2048, words: bool = True, encode=None) -> list[Trust]:
    """One ``Trust`` a line for lines cut into sentences: ``sources[i]`` are the sentences of line i as the
    model read them (split, recased), ``translations[i]`` its translations of them, before they were
    recased and joined. Each sentence is judged as it was translated (``assess``, ``encode`` as there), then
    the line (``combined``)."""
    flat_src = [s for line in sources for s in line]
    flat_tgt = [t for line in translations for t in line]
    if len(flat_src) != len(flat_tgt) or any(len(a) != len(b) for a, b in zip(sources, translations)):
        raise QkvError("each sentence needs one translation")
    trusts = assess(model, tokenizer, flat_src, flat_tgt, calibration=calibration, max_tokens=max_tokens, words=words,
                    encode=encode)
    out, start = [], 0
    for line in sources:
        out.append(combined(trusts[start : start + len(line)], [len(s.split()) for s in line]))
        start += len(line)
    return out


def translate_with_confidence(translator, texts: list[str], *, calibration: dict | None = None) -> list[tuple[str, Trust]]:
    """Each text's translation by ``translator`` (a ``qkv.Translator``) and whether to trust it (a ``Trust``:
    ``confidence``, ``flags``, ``why``, ``features``, per-word marks), as ``qkv translate --confidence``
    gives them: each sentence judged as the model read and wrote it (the translator's ``text`` options
    split and recase; the command line's defaults do, a Translator's do not: ``qkv.Translator``).
    ``calibration``: None, the checkpoint's own (its ``confidence.json``), else ``LOGPROB_ONLY``."""
    if not isinstance(translator.model, Transformer):
        raise QkvError("a confidence reads one model's internals: translate with a qkv Transformer (not an ensemble)")
    lines = translator.translate_lines(texts)
    trusts = assess_lines(translator.model, translator.tokenizer, [line.sentences for line in lines],
                          [line.outputs for line in lines], calibration=calibration)
    return [(line.text, trust) for line, trust in zip(lines, trusts)]
