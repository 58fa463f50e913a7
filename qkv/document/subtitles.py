"""Subtitles in, subtitles out: SubRip (.srt, through ``srt``) and WebVTT (.vtt, through ``webvtt-py``).

Cue numbers, identifiers, timings, cue settings and notes are written back as the libraries read them;
only the cue text changes. A sentence often runs across cues ("I think that" / "we should go."):
consecutive cues are read as one segment until a cue ends a sentence (``.``, ``!``, ``?``, ``…``, a
closing quote after them, or a music note), ``MAX_CUES`` cues are read, or a pause of ``MAX_GAP_S``
seconds comes. The segment is translated whole and each cue's words are put back by the alignment
(``qkv.document.placement``, ``Segment.cover``: the translation is cut into as many runs as there were
cues, in order, each run where its cue's words went). A cue's inline tags (``<i>``, ``<b>``, ``<u>``,
``<font ...>``, WebVTT's ``<v Speaker>`` and ``<c.class>``) are its elements; a cue that had two lines
comes back cut into two at the space nearest its middle.
"""

from __future__ import annotations

import html
import re
from bisect import bisect_left

from qkv.errors import QkvError
from qkv.document.segments import Document, Element, SegmentBuilder, Void

MAX_CUES = 4
MAX_GAP_S = 3.0
# a cue's inline tag (or a WebVTT timestamp, or an override block such as {\i1}: a void)
_TAG = re.compile(r"<(/?)([A-Za-z][\w.-]*)?[^<>]*>|<\d[\d:.]*>|\{\\[^{}\n]*\}")
# override blocks at a cue's start ({\an8}: the cue at the top of the screen), put back first as they were
_LEAD = re.compile(r"(?:\s*\{\\[^{}\n]*\})+")
# what a cue's timing line starts with, even a broken one (at the start: a cue's text may hold "at 1:30:00 ->")
_TIMING = re.compile(r"\s*(?:\d+:)+\d+[.,:]\d+\s*-{1,2}>")
_VTT_TIMING = re.compile(r"\s*(?:\d+:)?\d\d:\d\d\.\d{3}\s+-->\s+(?:\d+:)?\d\d:\d\d\.\d{3}(?:\s|$)")  # WebVTT's own form
_END = re.compile(r"""[.!?\u2026\u266a]["'\u201d\u00bb)\]]*$""")


def _cue_text(builder: SegmentBuilder, text: str, escaped: bool = False) -> int:
    """Add a cue's text to ``builder``, its tags as elements (an unpaired one as a void, ``("raw", tag)``);
    returns its line count. ``escaped``: the text writes ``&amp;``, ``&lt;``, ``&gt;`` (WebVTT), read as the
    characters they stand for (the model read "A dog &amp; a cat")."""
    stack: list[str] = []
    at = 0
    plain = html.unescape if escaped else str
    matches = list(_TAG.finditer(text))
    pairs = _override_pairs(matches)
    offs = set(pairs.values())
    for k, match in enumerate(matches):
        builder.text(plain(text[at : match.start()].replace("\n", " ")))
        closing, name = match.group(1), match.group(2)
        if k in pairs:  # {\i1} ... {\i0}: an element, placed as <i> is
            builder.open(match.group())
        elif k in offs:
            builder.close()
        elif name and not closing:
            builder.open(match.group())
            stack.append(name.split(".")[0].lower())
        elif name and stack and stack[-1] == name.split(".")[0].lower():
            stack.pop()
            builder.close()
        else:
            builder.void(("raw", match.group()))
        at = match.end()
    builder.text(plain(text[at:].replace("\n", " ")))
    while stack:
        stack.pop()
        builder.close()
    return sum(1 for line in text.split("\n") if line.strip()) or 1  # blank lines srt kept after a cue are not its lines


_SWITCH = re.compile(r"\{\\([ibus])([01])\}")  # an override that turns italics, bold, underline or strike-out on or off


def _override_pairs(matches: list) -> dict[int, int]:
    """The override blocks that switch a style on and, later in the same cue with no HTML-like tag between,
    off again (``{\\i1}...{\\i0}``): the index of each "on" among ``matches`` -> its "off"'s."""
    pairs, stack = {}, []
    for k, match in enumerate(matches):
        switch = _SWITCH.fullmatch(match.group())
        if switch is None:
            if match.group().startswith("<"):  # never paired across a tag: the elements must nest
                stack.clear()
        elif switch.group(2) == "1":
            stack.append((switch.group(1), k))
        elif stack and stack[-1][0] == switch.group(1):
            pairs[stack.pop()[1]] = k
    return pairs


def _closing_tag(opening: str) -> str:
    if switch := _SWITCH.fullmatch(opening):
        return "{\\" + switch.group(1) + "0}"
    name = re.match(r"<([A-Za-z][\w]*)", opening)
    return f"</{name.group(1)}>" if name else ""


def _string(nodes: list, escaped: bool = False) -> str:
    """Placed cue text as written: a tag as it was, text (and a placeholder, text too) escaped where ``escaped``."""
    text = (lambda t: html.escape(t, quote=False)) if escaped else str  # noqa: E731
    out = []
    for node in nodes:
        if isinstance(node, str):
            out.append(text(node))
        elif isinstance(node, Void):
            out.append(node.tag[1] if isinstance(node.tag, tuple) else text(node.tag))
        elif isinstance(node, Element):
            out.append(node.tag + _string(node.children, escaped) + _closing_tag(node.tag))
    return "".join(out)


def _lines(text: str, n: int) -> str:
    """``text`` cut into ``n`` lines at the spaces nearest equal shares (never inside a tag), in one pass
    over the text and a binary search a cut."""
    text = text.strip()
    if n <= 1:
        return text
    spaces, last_open, last_close = [], -1, -1
    for i, char in enumerate(text):
        if char == "<":
            last_open = i
        elif char == ">":
            last_close = i
        elif char == " " and last_open <= last_close:  # outside a tag
            spaces.append(i)
    cuts, first = [], 0  # first: the first space after the last cut
    for k in range(1, n):
        if first >= len(spaces):
            break
        goal = len(text) * k / n
        j = bisect_left(spaces, goal, lo=first)
        nearest = min((x for x in (j - 1, j) if first <= x < len(spaces)), key=lambda x: abs(spaces[x] - goal))  # ties: the earlier
        cuts.append(spaces[nearest])
        first = nearest + 1
    pieces, at = [], 0
    for c in cuts:
        pieces.append(text[at:c])
        at = c + 1
    pieces.append(text[at:])
    return "\n".join(pieces)


def _groups(cues: list[tuple[str, float, float]]) -> list[list[int]]:
    """Consecutive cue indices read as one segment (module docstring). ``cues``: (text, start s, end s)."""
    groups, group = [], []
    for i, (text, start, end) in enumerate(cues):
        if group and (start - cues[group[-1]][2] > MAX_GAP_S):
            groups.append(group)
            group = []
        group.append(i)
        plain = _TAG.sub("", text).strip()
        if not plain or _END.search(plain) or len(group) >= MAX_CUES:
            groups.append(group)
            group = []
    if group:
        groups.append(group)
    return groups


def _segments(texts: list[str], times: list[tuple[float, float]], escaped: bool = False):
    """The cues' segments (``_groups``), the cue indices of each, and each cue's shape: its count of lines
    and its leading override blocks (``_LEAD``)."""
    segments, members, lines = [], [], [1] * len(texts)
    leads = [m.group() if (m := _LEAD.match(t)) else "" for t in texts]
    for group in _groups([(t, a, b) for t, (a, b) in zip(texts, times)]):
        builder = SegmentBuilder()
        for i in group:
            builder.text(" ")  # cues part words
            builder.open(("cue", i))
            lines[i] = _cue_text(builder, texts[i][len(leads[i]) :], escaped)
            builder.close()
        segments.append(builder.build(f"cue {group[0] + 1}", cover=True))
        members.append(group)
    return segments, members, (lines, leads)


def _cue_texts(placed: list[list], members: list[list[int]], shape: tuple[list[int], list[str]], originals: list[str],
               escaped: bool = False) -> list[str]:
    """Each cue's new text: its words as placed, in its count of lines, after its leading override blocks."""
    (lines, leads), out = shape, list(originals)
    for nodes, group in zip(placed, members):
        found = {}
        for node in nodes:
            if isinstance(node, Element) and isinstance(node.tag, tuple) and node.tag[0] == "cue":
                found[node.tag[1]] = _string(node.children, escaped).strip()
        for i in group:
            if not originals[i].strip():  # a cue with no text stays so
                continue
            text = found.get(i) or "\u2026"  # a cue the translation left no word for (too few words): an ellipsis
            out[i] = leads[i].lstrip() + _lines(text, lines[i])
    return out


def read_srt(text: str, target_lang: str | None = None) -> Document:
    import srt

    try:
        subtitles = list(srt.parse(text))
    except srt.SRTParseError as error:
        line = text.count("\n", 0, error.expected_start) + 1
        raise QkvError(f"line {line}: not a SubRip cue (number, 'start --> end', text)") from None
    except (ValueError, OverflowError) as error:  # a timing srt matched but cannot hold (minutes past 59, ...)
        raise QkvError(f"not a SubRip file: {error}") from None
    texts = [s.content for s in subtitles]
    if any(_TIMING.match(line) for content in texts for line in content.splitlines()):
        # a cue that lacks its blank line and number: srt read the next timing line as text. Its line: the first
        # timing line that no cue number stands above
        lines = text.splitlines()
        n = next((i for i, line in enumerate(lines) if _TIMING.match(line) and not (i and lines[i - 1].strip().isdigit())), None)
        where = f"line {n + 1}: " if n is not None else ""
        raise QkvError(f"{where}a timing line inside a cue's text (a blank line and a cue number missing before it?)")
    segments, members, shape = _segments(texts, [(s.start.total_seconds(), s.end.total_seconds()) for s in subtitles])

    def write(placed: list[list], reports=None) -> str:
        for subtitle, content in zip(subtitles, _cue_texts(placed, members, shape, texts)):
            subtitle.content = content
        return srt.compose(subtitles, reindex=False, strict=False)

    return Document(segments, write, "srt")


def _check_arrows(lines: list[str]) -> None:
    """Refuse "-->" in a cue's text or identifier: WebVTT forbids it there, and webvtt-py drops such a line
    without a word. A NOTE, STYLE or REGION block may hold one (kept as it is)."""
    block_start = True
    kept = False  # inside a NOTE, STYLE or REGION block
    for n, line in enumerate(lines, 1):
        if not line.strip():
            block_start, kept = True, False
            continue
        if block_start:
            kept = line.split(maxsplit=1)[0] in ("NOTE", "STYLE", "REGION") or line.startswith("WEBVTT")
            block_start = False
        if not kept and "-->" in line and not _TIMING.match(line):
            raise QkvError(f"line {n}: '-->' in a cue's text or identifier, which WebVTT forbids (write '\u2192' or '-- >')")


def read_vtt(text: str, target_lang: str | None = None) -> Document:
    import webvtt

    try:
        vtt = webvtt.from_string(text)
    except Exception as error:  # noqa: BLE001 webvtt-py's errors (MalformedFileError, ValueError, ...) all mean this
        raise QkvError(f"not a WebVTT file: {error}") from None
    captions = vtt.captions
    source_lines = text.splitlines()
    timings = [n for n, line in enumerate(source_lines, 1) if _TIMING.match(line)]
    if len(timings) != len(captions):  # webvtt-py skips a block it cannot read: refuse rather than lose a cue
        bad = next((n for n in timings if not _VTT_TIMING.match(source_lines[n - 1])), timings[-1] if timings else 1)
        raise QkvError(f"line {bad}: not a WebVTT cue timing ('start --> end' with times as hh:mm:ss.ttt)")
    _check_arrows(source_lines)
    texts = [c.raw_text for c in captions]
    segments, members, shape = _segments(texts, [(c.start_in_seconds, c.end_in_seconds) for c in captions], escaped=True)

    def write(placed: list[list], reports=None) -> str:
        for caption, content in zip(captions, _cue_texts(placed, members, shape, texts, escaped=True)):
            caption.text = content
        if target_lang and segments:  # a "Language:" header line (HLS's, and many players') names the target's
            metadata = vtt.metadata
            for k, line in enumerate(metadata):
                if line.split(":", 1)[0].strip().lower() == "language":
                    metadata[k] = f"{line.split(':', 1)[0]}: {target_lang}"
        return vtt.content

    return Document(segments, write, "vtt")
