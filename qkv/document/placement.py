"""Inline markup put back onto a translation, where the model's word alignment says its words went.

Given a segment (plain source text with spans over it), its translation, and a word alignment matrix
(``weights``: target words x source words, from the model's alignment head; ``qkv.document.alignment``),
``place`` returns the translation as a tree of text, ``Element`` and ``Void`` nodes:

- An element (``<b>...</b>``, a link) covers the source words its text overlaps (a part of a word
  counts as the word). Each target word gets a score, how much of it aligns into those words: the
  mean of its row share (the part of the target word's alignment mass on them) and its column share
  (the part of its "chosen by source words" mass that comes from them). The element wraps the
  contiguous run of target words with the highest total of (score - 1/2), that is the run where most
  words are mostly inside: a maximum-sum subarray, as Bergamot keeps each tag contiguous.
- Elements are placed from the outside in: a child only within its parent's words, siblings never
  overlapping (the sibling with the most aligned mass chooses first). So the result is always well
  nested and every element comes back, with its attributes, exactly once.
- An element none of whose words align into a free word of its parent's run (its words were dropped
  by the translation, or a sibling took them) comes back empty, at the place a void at its start
  would go. This is the documented rule for an element that cannot be placed.
- A void (``<br>``, an image, a placeholder, a code span kept verbatim) goes next to the translation of
  the source word it was attached to: after the previous word's translation when it followed one,
  before the next word's when it started the segment; glued or spaced as in the source.
- Placeholders keep their order among themselves (``%s`` before ``%d``; gettext's msgfmt checks it).
- Subtitle cues (``Segment.cover``) partition the translation in order: each cue gets the contiguous
  run of target words that best matches its own words (dynamic programming over the cut points), no
  cue empty where the translation has enough words.
"""

from __future__ import annotations

import re

import numpy as np

from qkv.document.segments import Element, Segment, Span, Void

# The weight of the row share against the column share in a target word's score; chosen on the val gold
# set (benchmarks/documents.py --choose; docs/documents.md).
ROW_SHARE = 0.75
# How much a word mostly outside an element costs its run against what a word inside gains: above 1, a
# run does not stretch over outside words to reach one more inside word. Chosen on the val gold set with ROW_SHARE.
OUTSIDE_WEIGHT = 1.0
SINGLE_WORD = 0.05  # the least score that places an element on one word where no run is mostly inside
_WORD = re.compile(r"\S+")
_PUNCT = "\"'.,;:!?()[]{}\u00ab\u00bb\u201c\u201d\u201e\u2018\u2019-"


def words(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the whitespace-separated words of ``text``."""
    return [m.span() for m in _WORD.finditer(text)]


def fallback_weights(n_target: int, n_source: int) -> np.ndarray:
    """(Tw, Sw) weights with each target word on the source word at the same relative position: used
    where no alignment is at hand (an empty side, or words that do not match the model's)."""
    weights = np.full((n_target, n_source), 1e-3)
    for t in range(n_target):
        weights[t, min(n_source - 1, int((t + 0.5) * n_source / n_target))] = 1.0
    return weights


class _Scores:
    """Each target word's share in a set of source words, from (Tw, Sw) weights."""

    def __init__(self, weights: np.ndarray, row_share: float) -> None:
        w = np.maximum(np.asarray(weights, dtype=np.float64), 0.0) + 1e-9
        self.rows = w / w.sum(axis=1, keepdims=True)  # each target word's mass over the source words
        mass = w.sum(axis=0, keepdims=True)  # (1, Sw): how much the target words attend to each source word
        # each source word's mass over the target words, worth less where the word drew little attention at all
        columns = w / mass * np.minimum(1.0, mass / mass.mean())
        self.columns = columns / np.maximum(columns.sum(axis=1, keepdims=True), 1e-9)
        self.row_share = row_share
        self.best_target = w.argmax(axis=0)  # (Sw,): the target word each source word chooses

    def inside(self, source: list[int]) -> np.ndarray:
        """(Tw,) how much of each target word aligns into ``source``."""
        if not source:
            return np.zeros(self.rows.shape[0])
        return self.row_share * self.rows[:, source].sum(axis=1) + (1 - self.row_share) * self.columns[:, source].sum(axis=1)


def _best_run(score: np.ndarray, free: np.ndarray, lo: int, hi: int) -> tuple[int, int] | None:
    """The contiguous run of free positions in [lo, hi) with the largest sum of ``score - 0.5`` (a
    negative term weighted by ``OUTSIDE_WEIGHT``; Kadane's algorithm); failing a positive sum, the single free word with the largest score above
    ``SINGLE_WORD``;
    None when nothing fits."""
    best, best_run, total, start = 0.0, None, 0.0, lo
    for t in range(lo, hi):
        if not free[t]:
            total, start = 0.0, t + 1
            continue
        if total <= 0:
            total, start = 0.0, t
        gain = score[t] - 0.5
        total += gain if gain >= 0 else OUTSIDE_WEIGHT * gain
        if total > best:
            best, best_run = total, (start, t + 1)
    if best_run is not None:
        return best_run
    candidates = [t for t in range(lo, hi) if free[t] and score[t] > SINGLE_WORD]
    if not candidates:
        return None
    t = max(candidates, key=lambda t: score[t])
    return t, t + 1


def _partition(scores: list[np.ndarray], lo: int, hi: int) -> list[tuple[int, int]]:
    """Cut [lo, hi) into len(scores) contiguous runs in order, maximising each run's summed score; an
    empty run costs more than any word could gain where there are enough words for all."""
    k, n = len(scores), hi - lo
    empty_cost = 1e3 if n >= k else 0.0
    prefix = [np.concatenate([[0.0], np.cumsum(s[lo:hi])]) for s in scores]
    best = np.full((k + 1, n + 1), -np.inf)
    back = np.zeros((k + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for c in range(1, k + 1):
        for j in range(n + 1):
            for i in range(j + 1):
                if best[c - 1, i] == -np.inf:
                    continue
                value = best[c - 1, i] + prefix[c - 1][j] - prefix[c - 1][i] - (empty_cost if i == j else 0.0)
                if value > best[c, j]:
                    best[c, j], back[c, j] = value, i
    cuts, j = [], n
    for c in range(k, 0, -1):
        i = back[c, j]
        cuts.append((lo + i, lo + j))
        j = i
    return cuts[::-1]


def _covered(span: Span, source_words: list[tuple[int, int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(source_words) if a < span.end and b > span.start]


def _insertion(offset: int, span: Span, source: str, source_words: list[tuple[int, int]], target_words: list[tuple[int, int]],
               target: str, scores: _Scores) -> int:
    """The character offset in ``target`` where a void at ``offset`` of ``source`` goes."""
    if not target_words:
        return len(target)
    if not source_words:
        return 0 if offset == 0 else len(target)
    inside = next((i for i, (a, b) in enumerate(source_words) if a < offset < b), None)
    if inside is not None:  # inside a word: the same place in its translation's core (before its punctuation)
        a, b = source_words[inside]
        word = source[a:b]
        core_a, core_b = a + len(word) - len(word.lstrip(_PUNCT)), b - (len(word) - len(word.rstrip(_PUNCT)))
        ta, tb = target_words[scores.best_target[inside]]
        tword = target[ta:tb]
        tcore_a, tcore_b = ta + len(tword) - len(tword.lstrip(_PUNCT)), tb - (len(tword) - len(tword.rstrip(_PUNCT)))
        if offset <= core_a:
            return tcore_a
        if offset >= core_b:
            return max(tcore_a, tcore_b)
        fraction = (offset - core_a) / max(1, core_b - core_a)
        return tcore_a + round(fraction * max(0, tcore_b - tcore_a))
    after = [i for i, (a, b) in enumerate(source_words) if b <= offset]
    before = [i for i, (a, b) in enumerate(source_words) if a >= offset]
    glued_next = before and source_words[before[0]][0] == offset and not span.space_after
    if after and not glued_next and (span.space_before is False or not before or offset == len(source)):
        return target_words[scores.best_target[after[-1]]][1]  # after the previous word's translation
    if before:
        return target_words[scores.best_target[before[0]]][0]  # before the next word's translation
    return target_words[scores.best_target[after[-1]]][1]


def place(segment: Segment, target: str, weights: np.ndarray | None, row_share: float | None = None) -> list:
    """``target`` (a translation of ``segment.text``) with ``segment.spans`` placed on it, as a node list
    (module docstring). ``weights``: (target words, source words) alignment weights, or None."""
    source_words, target_words = words(segment.text), words(target)
    n_t, n_s = len(target_words), len(source_words)
    if weights is None or np.shape(weights) != (n_t, n_s) or n_t == 0 or n_s == 0:
        weights = fallback_weights(max(n_t, 1), max(n_s, 1))[:n_t or 1, : n_s or 1] if n_t and n_s else np.zeros((n_t, n_s))
    scores = _Scores(weights, ROW_SHARE if row_share is None else row_share) if n_t and n_s else None
    spans = segment.spans
    children: dict[int | None, list[int]] = {}
    for i, span in enumerate(spans):
        children.setdefault(span.parent, []).append(i)
    placed: dict[int, tuple[int, int] | None] = {}  # element -> target word run, None when it cannot be placed

    def place_within(parent: int | None, lo: int, hi: int) -> None:
        kids = [i for i in children.get(parent, []) if not spans[i].void and _covered(spans[i], source_words)]
        if scores is None:
            for i in kids:
                placed[i] = None
        elif parent is None and segment.cover and kids:
            for i, run in zip(kids, _partition([scores.inside(_covered(spans[i], source_words)) for i in kids], lo, hi)):
                placed[i] = run if run[0] < run[1] else None
        else:
            free = np.ones(n_t, dtype=bool)
            inside = {i: scores.inside(_covered(spans[i], source_words)) for i in kids}
            for i in sorted(kids, key=lambda i: -float(inside[i][lo:hi].sum())):
                run = _best_run(inside[i], free, lo, hi)
                placed[i] = run
                if run is not None:
                    free[run[0] : run[1]] = False
        for i in kids:
            run = placed[i]
            if run is not None:
                place_within(i, *run)

    place_within(None, 0, n_t)
    # Character ranges: an element over its words, a void (or an element that could not be placed) at a point.
    ranges: dict[int, tuple[int, int]] = {}

    def bounds(i: int | None) -> tuple[int, int]:
        return (0, len(target)) if i is None else ranges[i]

    for i, span in enumerate(spans):  # parents come before their children in document order
        lo, hi = bounds(span.parent)
        run = placed.get(i)
        if run is not None and (span.parent is None or span.parent in ranges):
            ranges[i] = _trimmed(target, target_words[run[0]][0], target_words[run[1] - 1][1],
                                 segment.text[span.start : span.end], lo, hi)
            continue
        point = _insertion(span.start, span, segment.text, source_words, target_words, target, scores) if scores else \
            (0 if span.start == 0 else len(target))
        point = min(max(point, lo), hi)
        for j in children.get(span.parent, []):  # never inside a placed sibling
            if j < i and j in ranges and ranges[j][0] < point < ranges[j][1]:
                point = ranges[j][1]
        ranges[i] = (point, point)
    _keep_placeholder_order(spans, ranges)
    return _render(target, spans, ranges, children, None)


def _trimmed(target: str, a: int, b: int, source: str, lo: int, hi: int) -> tuple[int, int]:
    """An element's range without the punctuation its target words carry at an edge where its source
    text has none ("<a>beach</a>." stays so, not "<a>Strand.</a>"), within its parent's range."""
    if source and source[-1] not in _PUNCT:
        while b > a + 1 and target[b - 1] in _PUNCT:
            b -= 1
    if source and source[0] not in _PUNCT:
        while a < b - 1 and target[a] in _PUNCT:
            a += 1
    a, b = max(a, lo), min(b, hi)
    return (a, b) if a < b else (a, a)


def _keep_placeholder_order(spans: list[Span], ranges: dict[int, tuple[int, int]]) -> None:
    """Placeholders of one parent in source order: their points sorted and handed back in that order."""
    groups: dict[int | None, list[int]] = {}
    for i, span in enumerate(spans):
        if span.placeholder:
            groups.setdefault(span.parent, []).append(i)
    for members in groups.values():
        points = sorted(ranges[i] for i in members)
        for i, point in zip(members, points):
            ranges[i] = point


def _render(target: str, spans: list[Span], ranges: dict[int, tuple[int, int]], children: dict, parent: int | None) -> list:
    lo, hi = (0, len(target)) if parent is None else ranges[parent]
    kids = sorted(children.get(parent, []), key=lambda i: (ranges[i][0], ranges[i][1] > ranges[i][0], i))
    nodes: list = []
    at = lo
    for i in kids:
        a, b = ranges[i]
        if a > at:
            nodes.append(target[at:a])
            at = a
        span = spans[i]
        if a == b:  # a void, or an element that could not be placed: its spacing as in the source
            before = " " if span.space_before and at > 0 and not target[at - 1 : at].isspace() and not _ends_with_space(nodes) else ""
            after = " " if span.space_after and at < len(target) and not target[at : at + 1].isspace() else ""
            node = Void(span.tag) if span.void else Element(span.tag, _render(target, spans, ranges, children, i))
            nodes.extend(x for x in (before, node, after) if x != "")
            if not span.space_after and target[at : at + 1] == " " and (a < hi - 1):  # glued: the model's space goes
                at += 1
        else:
            nodes.append(Element(span.tag, _render(target, spans, ranges, children, i)))
            at = b
    if hi > at:
        nodes.append(target[at:hi])
    return nodes


def _ends_with_space(nodes: list) -> bool:
    return bool(nodes) and isinstance(nodes[-1], str) and nodes[-1].endswith(" ")
