"""Signals a translation's text gives by itself, and a rank correlation: what ``qkv.inspect.trust`` reads
beside the model's internals.

- ``max_repeats``: the most times one n-gram of words occurs back to back;
- ``char_repeats``: the most times one run of characters does, less two (a loop inside a word);
- ``recurrence``: how many more times one phrase of three words recurs anywhere in the translation than
  any does in its source (an oscillation that wanders between its repeats);
- ``copy_score`` / ``copy_scores``: chrF of a translation against its own source;
- ``spearman``: Spearman's rank correlation (ties at mean ranks).
"""

from __future__ import annotations

import math
import re
from collections import Counter

from qkv.infer.bleu import sentence_chrf

RECURRENCE_N = 3  # ``recurrence`` counts phrases of this many words
_WORD = re.compile(r"\w+")


def max_repeats(words: list[str], max_n: int = 4) -> int:
    """The most times one n-gram (n <= ``max_n``) occurs back to back: "a b a b a b" -> 3 (case ignored).
    Linear in the words: n-grams repeat from position k exactly while word k equals word k + n, so a
    run of L such equal pairs holds 1 + L // n repeats."""
    best = 1 if words else 0
    lowered = [w.lower() for w in words]
    for n in range(1, max_n + 1):
        run = 0
        for a, b in zip(lowered, lowered[n:]):
            run = run + 1 if a == b else 0
            best = max(best, 1 + run // n)
    return best


def char_repeats(text: str, max_n: int = 5) -> int:
    """The most times one run of 1 to ``max_n`` characters occurs back to back, less two (so that German's
    "fff" counts 1 and a loop inside a word, "EEEEEEEE", "19999999" or "Motorrollrollrollroll", counts as
    many as it runs); linear in the text, as ``max_repeats``. Runs of four and five characters since
    2026-12-06: on the natural pairs of docs/trust.md they let the repetition flag catch 102 of the 129
    hallucinations instead of 97, the model's own acceptable validation translations unchanged."""
    best = 0
    for n in range(1, max_n + 1):
        run = 0
        for a, b in zip(text, text[n:]):
            run = run + 1 if a == b else 0
            best = max(best, 1 + run // n)
    return max(1, best - 2) if text else 0


def top_ngram_count(text: str, n: int = RECURRENCE_N) -> int:
    """The most times one n-gram of words (letters and digits; case ignored) occurs anywhere in ``text``."""
    words = _WORD.findall(text.lower())
    counts = Counter(zip(*(words[k:] for k in range(n))))
    return max(counts.values(), default=0)


def recurrence(source: str, translation: str, n: int = RECURRENCE_N) -> int:
    """How many more times the translation's most frequent n-gram of words occurs than its source's does
    (than once, for a source without a repeat or shorter than n words), 0 at least: the top n-gram count of Raunak et al. (2021) and Guerreiro et al. (2023), a detector of
    oscillatory hallucinations, whose repeats need not be back to back ("... mit einem schwarzen T-Shirt
    und ... mit einem schwarzen T-Shirt ..."). A source that repeats a phrase allows its translation as
    many. Linear in the words."""
    return max(0, top_ngram_count(translation, n) - max(1, top_ngram_count(source, n)))


def copy_score(source: str, translation: str) -> float:
    """chrF (sacreBLEU's, in [0, 1]) of the translation against the source itself."""
    return copy_scores([source], [translation])[0]


def copy_scores(sources: list[str], translations: list[str]) -> list[float]:
    """``copy_score`` of each pair, one chrF metric for all: 0 where either side is blank."""
    blank = [not s.strip() or not t.strip() for s, t in zip(sources, translations)]
    scores = iter(sentence_chrf([t for t, b in zip(translations, blank) if not b], [s for s, b in zip(sources, blank) if not b]))
    return [0.0 if b else next(scores) / 100 for b in blank]


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j < len(order) and values[order[j]] == values[order[i]]:
            j += 1
        for k in order[i:j]:
            out[k] = (i + j - 1) / 2
        i = j
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties at mean ranks); nan if either is constant."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    norm = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / norm if norm else math.nan
