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

import bisect
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
    aligned = lo + np.flatnonzero(score[lo:hi] > SINGLE_WORD)  # a run starts and ends on such words: search only there
    if aligned.size == 0:
        return None
    lo, hi = int(aligned[0]), int(aligned[-1]) + 1
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
    candidates = [int(t) for t in aligned if free[t]]  # the aligned words still free
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
    for c in range(1, k + 1):  # best[c, j] = max over i <= j of best[c-1, i] + P[j] - P[i] (- empty_cost if i == j)
        p = prefix[c - 1]
        running, arg = -np.inf, 0  # max over i < j of best[c-1, i] - P[i]
        for j in range(n + 1):
            same = best[c - 1, j] - empty_cost  # i == j: an empty run
            if running + p[j] >= same:
                best[c, j], back[c, j] = running + p[j], arg
            else:
                best[c, j], back[c, j] = same, j
            if best[c - 1, j] - p[j] > running:
                running, arg = best[c - 1, j] - p[j], j
    cuts, j = [], n
    for c in range(k, 0, -1):
        i = back[c, j]
        cuts.append((lo + i, lo + j))
        j = i
    return cuts[::-1]


def _covered(span: Span, source_words: list[tuple[int, int]], ends: list[int]) -> list[int]:
    """The indices of the source words the span's text overlaps (``ends``: the words' end offsets, in
    order, bisected); none for an empty element (``<a href="#n1"></a>`` after a word is a point, as a void is)."""
    if span.start == span.end:
        return []
    first = bisect.bisect_right(ends, span.start)  # the first word ending after the span starts
    out = []
    for i in range(first, len(source_words)):
        if source_words[i][0] >= span.end:
            break
        out.append(i)
    return out


def _insertion(offset: int, span: Span, source: str, source_words: list[tuple[int, int]], target_words: list[tuple[int, int]],
               target: str, scores: _Scores, starts: list[int]) -> int:
    """The character offset in ``target`` where a void at ``offset`` of ``source`` goes."""
    if not target_words:
        return len(target)
    if not source_words:
        return 0 if offset == 0 else len(target)
    k = bisect.bisect_right(starts, offset) - 1  # the last word starting at or before the offset
    if k >= 0 and source_words[k][0] < offset < source_words[k][1]:  # inside a word: the same place in its translation
        a, b = source_words[k]
        ta, tb = target_words[scores.best_target[k]]
        lead, trail = _edges(source[a:b])
        t_lead, t_trail = _edges(target[ta:tb])
        if lead + trail >= b - a:  # a word of punctuation alone, "()": the same share of the target word,
            if t_lead + t_trail >= tb - ta:  # where that is punctuation alone too
                return ta + round((offset - a) / (b - a) * (tb - ta))
            # else beside its letters, never among them ('"%s"' aligned with "Mann": "%sMann", not "Ma%snn")
            return ta + t_lead if 2 * (offset - a) <= b - a else tb - t_trail
        if offset <= a + lead:  # in its leading punctuation
            return ta + min(offset - a, t_lead)
        if offset >= b - trail:  # in its trailing punctuation: as far into the target word's
            return max(ta + t_lead, tb - t_trail) + min(offset - (b - trail), t_trail)
        fraction = (offset - a - lead) / max(1, b - trail - a - lead)
        return ta + t_lead + round(fraction * max(0, tb - t_trail - ta - t_lead))
    after = k if k >= 0 and source_words[k][1] <= offset else k - 1  # the last word ending at or before it
    before = k + 1 if k + 1 < len(source_words) else None  # the first word starting after it
    if k >= 0 and source_words[k][0] == offset:
        before, after = k, k - 1
    glued_next = before is not None and source_words[before][0] == offset and not span.space_after
    if after >= 0 and not glued_next and (span.space_before is False or before is None or offset == len(source)):
        return target_words[scores.best_target[after]][1]  # after the previous word's translation
    if before is not None:
        return target_words[scores.best_target[before]][0]  # before the next word's translation
    return target_words[scores.best_target[after]][1]


def _edges(word: str) -> tuple[int, int]:
    """How many punctuation characters a word starts and ends with."""
    lead = len(word) - len(word.lstrip(_PUNCT))
    return lead, (len(word) - len(word.rstrip(_PUNCT))) if lead < len(word) else 0


def place(segment: Segment, target: str, weights: np.ndarray | None, row_share: float | None = None) -> list:
    """``target`` (a translation of ``segment.text``) with ``segment.spans`` placed on it, as a node list
    (module docstring). ``weights``: (target words, source words) alignment weights, or None."""
    source_words, target_words = words(segment.text), words(target)
    n_t, n_s = len(target_words), len(source_words)
    if weights is None or np.shape(weights) != (n_t, n_s) or n_t == 0 or n_s == 0:
        weights = fallback_weights(n_t, n_s) if n_t and n_s else np.zeros((n_t, n_s))
    scores = _Scores(weights, ROW_SHARE if row_share is None else row_share) if n_t and n_s else None
    spans = segment.spans
    children: dict[int | None, list[int]] = {}
    for i, span in enumerate(spans):
        children.setdefault(span.parent, []).append(i)
    placed: dict[int, tuple[int, int] | None] = {}  # element -> target word run, None when it cannot be placed
    target_starts = [a for a, _ in target_words]
    source_starts, source_ends = [a for a, _ in source_words], [b for _, b in source_words]
    covered = [_covered(span, source_words, source_ends) for span in spans]  # the source words of each span
    exact: dict[int, tuple[int, int]] = {}  # an element inside a word the translation kept as it was
    for i, span in enumerate(spans):  # (H<sub>2</sub>O, E=mc<sup>2</sup>) -> its character range there
        if not span.void and (found := _in_kept_word(span, covered[i], segment.text, source_words, target, target_words, scores)):
            exact[i] = found

    def place_within(parent: int | None, lo: int, hi: int) -> None:
        kids = [i for i in children.get(parent, []) if not spans[i].void and covered[i]]
        if scores is None:
            for i in kids:
                placed[i] = None
        elif parent is None and segment.cover and kids:
            for i, run in zip(kids, _partition([scores.inside(covered[i]) for i in kids], lo, hi)):
                placed[i] = run if run[0] < run[1] else None
        else:
            free = np.ones(n_t, dtype=bool)
            for i in kids:
                if i in exact:  # its word is taken
                    free[bisect.bisect_right(target_starts, exact[i][0]) - 1] = False
            kids = [i for i in kids if i not in exact]
            inside = {i: scores.inside(covered[i]) for i in kids}
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
        if i in exact and (span.parent is None or span.parent in ranges):
            a, b = exact[i]
            ranges[i] = (max(a, lo), min(b, hi)) if max(a, lo) < min(b, hi) else (max(a, lo), max(a, lo))
            continue
        if run is not None and (span.parent is None or span.parent in ranges):
            ranges[i] = _trimmed(target, target_words[run[0]][0], target_words[run[1] - 1][1],
                                 segment.text[span.start : span.end], lo, hi)
            continue
        previous = spans[i - 1] if i else None
        if span.void and previous is not None and previous.void and previous.parent == span.parent \
                and previous.start == span.start and not previous.space_after:  # glued voids ("%d%%") stay together
            ranges[i] = ranges[i - 1]
            continue
        point = _insertion(span.start, span, segment.text, source_words, target_words, target, scores, source_starts) if scores else \
            (0 if span.start == 0 else len(target))
        ranges[i] = (min(max(point, lo), hi),) * 2  # a point inside a placed sibling is written after it (_render)
    _keep_placeholder_order(spans, ranges)
    return _render(target, spans, ranges, children, None)


def _in_kept_word(span: Span, covered: list[int], source: str, source_words, target: str, target_words, scores):
    """The character range of an element that covers part of one source word (``covered``: the source
    words it overlaps), in that word's translation where the translation wrote the word as it was (case
    aside); None otherwise."""
    if scores is None or len(covered) != 1:
        return None
    a, b = source_words[covered[0]]
    if span.start <= a and span.end >= b:
        return None
    t = int(scores.best_target[covered[0]])
    ta, tb = target_words[t]
    if target[ta:tb].lower() != source[a:b].lower():
        return None
    return ta + max(0, span.start - a), ta + min(b, span.end) - a


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
    """Placeholders of one parent in source order: their points sorted and handed back in that order, a
    run of glued ones ("%(pct)d%%") as one, so that it stays together."""
    groups: dict[int | None, list[int]] = {}
    for i, span in enumerate(spans):
        if span.placeholder:
            groups.setdefault(span.parent, []).append(i)
    for members in groups.values():
        runs: list[list[int]] = []
        for i in members:
            if runs and runs[-1][-1] == i - 1 and spans[i - 1].start == spans[i].start and not spans[i - 1].space_after:
                runs[-1].append(i)
            else:
                runs.append([i])
        points = sorted(ranges[run[0]] for run in runs)
        for run, point in zip(runs, points):
            for i in run:
                ranges[i] = point


def _render(target: str, spans: list[Span], ranges: dict[int, tuple[int, int]], children: dict, parent: int | None) -> list:
    lo, hi = (0, len(target)) if parent is None else ranges[parent]
    kids = sorted(children.get(parent, []), key=lambda i: (ranges[i][0], ranges[i][1] > ranges[i][0], i))
    nodes: list = []
    at = lo
    for n, i in enumerate(kids):
        a, b = ranges[i]
        if a > at:
            nodes.append(target[at:a])
            at = a
        span = spans[i]
        if a == b:  # a void, or an element that could not be placed: its spacing as in the source
            more_here = n + 1 < len(kids) and ranges[kids[n + 1]][0] == a  # another void at this point
            # a void at the very start or end of an element with no text of its own (``**a@b.de**``): where
            # that element is spaced on that side itself, the space goes outside it ("**a@b.de** now", not
            # "**a@b.de **"), else inside, as the source had it ("at<a> a@b.de</a>")
            outside = parent is not None and lo == hi
            edge_before = outside and at == lo and not nodes and spans[parent].space_before
            edge_after = outside and at == hi and not more_here and spans[parent].space_after
            # a placeholder that was not glued to a word is not glued to one here ("%(name)s." before "Laster")
            apart_before = (span.placeholder and not span.word_before and bool(nodes) and isinstance(nodes[-1], str)
                            and nodes[-1][-1:].isalnum())
            apart_after = span.placeholder and not span.word_after and target[at : at + 1].isalnum() and not more_here
            # right after a void it was glued to in the source, nothing between them ("%(pct)d%%"): glued here too
            previous = spans[kids[n - 1]] if n else None
            glued = (bool(nodes) and isinstance(nodes[-1], Void) and previous is not None and previous.start == span.start
                     and not previous.space_after)
            # the target's space before this point is the space before a void already written here, not this one's
            spaced = target[at - 1 : at].isspace() and not (nodes and isinstance(nodes[-1], Void))
            before = " " if (span.space_before or apart_before) and not edge_before and not glued and (at > 0 or nodes) and not spaced and not _ends_with_space(nodes) else ""
            after = " " if (span.space_after or apart_after) and not edge_after and (at < len(target) or more_here) and not target[at : at + 1].isspace() else ""
            node = Void(span.tag) if span.void else Element(span.tag, _render(target, spans, ranges, children, i))
            nodes.extend(x for x in (before, node, after) if x != "")
            if span.separates and not span.space_after and target[at : at + 1] == " " and a < hi - 1:  # <br>'s own space
                at += 1
        else:
            nodes.append(Element(span.tag, _render(target, spans, ranges, children, i)))
            at = max(at, b)
    if hi > at:
        nodes.append(target[at:hi])
    return nodes


def _ends_with_space(nodes: list) -> bool:
    return bool(nodes) and isinstance(nodes[-1], str) and nodes[-1].endswith(" ")
