"""gettext catalogues in and out (.po, .pot), through polib.

Each untranslated entry's ``msgid`` (and ``msgid_plural``) is a segment; its ``msgstr`` is filled, the
``msgid`` and every entry that already has a translation are left as they are, and so are the header,
comments, references, contexts and obsolete entries. Plural entries get as many ``msgstr[n]`` as the
header's ``Plural-Forms`` says (``nplurals``): the first the translation of ``msgid``, the others of
``msgid_plural``. Placeholders (``%s``, ``%(name)s``, ``{name}``, ``{0}``, URLs; ``qkv.document.segments``)
are kept out of the text the model reads and come back verbatim, in their source order, so that
``msgfmt --check`` accepts the catalogue. Inline HTML in a message (a web framework's ``<a href="...">the
park</a>``, ``<b>``, ``<br>``) is markup as in an HTML page: an element whose end tag closes it is a span
over its words, put around their translation by the alignment, its tags written back as the message had
them; any other tag is kept verbatim as a void (read by Python's ``html.parser``). An entry's leading and trailing whitespace (a final ``\\n``)
and its line breaks and tabs are kept. A string polib would read wrong (not closed on its line, or with an
escape polib does not read) and a header with more than ``MAX_NPLURALS`` plural forms are refused. With ``--confidence``, an entry whose translation is flagged is marked ``fuzzy``.
"""

from __future__ import annotations

import re

from html.parser import HTMLParser

from qkv.errors import QkvError
from qkv.document.segments import Document, Segment, SegmentBuilder, flatten, plain_segment

_NPLURALS = re.compile(r"nplurals\s*=\s*(\d+)")
MAX_NPLURALS = 10  # gettext's languages need at most 6 plural forms; each is a segment to translate
# A line that holds a string: a keyword and its string, or a continuation string (behind "#~" in an obsolete
# entry, "#|" in a previous msgid, "#~|" in both).
_OPENING = r'\s*(?:#~?\|?\s*)?(?:msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)?\s*"'
_KEYWORD = re.compile(_OPENING)
_STRING = re.compile(_OPENING + r'((?:[^"\\]|\\.)*)"\s*')
_ESCAPE = re.compile(r"\\([0-7]{1,3}|x[0-9A-Fa-f]+|.)")
_KEPT_ESCAPES = set('\\tnrvbf"')  # what polib reads (polib.unescape); msgfmt also reads \a, octal and hex


def _check_strings(text: str) -> None:
    """Refuse a string polib would read wrong: one not closed on its line (polib reads "A dog as "A do",
    msgfmt says "end-of-line within string"), or holding an escape polib does not read (``\\a``, ``\\101``,
    ``\\x42``: it would write them back as a backslash and letters, and the program's string would never
    find its translation)."""
    for n, line in enumerate(text.splitlines(), 1):
        if not _KEYWORD.match(line) or (line.lstrip().startswith("#") and not line.lstrip().startswith(("#~", "#|"))):
            continue
        string = _STRING.fullmatch(line)
        if string is None:
            raise QkvError(f"line {n}: a string not closed, or text after it")
        odd = next((e for e in _ESCAPE.findall(string.group(1)) if e not in _KEPT_ESCAPES), None)
        if odd is not None:
            raise QkvError(f"line {n}: the escape \\{odd} (qkv reads PO strings with polib, which keeps only "
                           "\\n \\t \\r \\v \\b \\f \\\\ and \\\"; write the character itself)")


def _nplurals(po) -> int | None:
    found = _NPLURALS.search(po.metadata.get("Plural-Forms", ""))
    return int(found.group(1)) if found else None


def _check_complete(text: str, po) -> None:
    """Refuse a catalogue polib read only in part (it skips an entry whose string is not closed): every
    ``msgid`` line of the text must belong to an entry it read (an entry's line number is its first
    line, a comment or ``msgctxt``; its ``msgid`` follows)."""
    lines = text.splitlines()
    read = set()
    for entry in po:
        n = entry.linenum
        while n <= len(lines) and not lines[n - 1].startswith("msgid "):
            n += 1
        read.add(n)
    first = next((n for n, line in enumerate(lines, 1) if line.startswith("msgid ")), None)
    if first is not None and lines[first - 1].strip() == 'msgid ""':  # the header, kept by polib as metadata
        read.add(first)
    for n, line in enumerate(lines, 1):
        if line.startswith("msgid ") and n not in read:
            raise QkvError(f"line {n}: this entry could not be read (a string not closed, or a keyword missing)")


_TAG = re.compile(r"</?[A-Za-z][\w:.-]*(?:\s[^<>]*)?/?>")  # only a message that holds one is read for markup


class _Markup(HTMLParser):
    """A message's text and tags, in order, each as written: ("text", s), ("start"/"end"/"void", tag's text, name)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)  # entities stay as written: they are the message's text
        self.events: list[tuple] = []

    def handle_data(self, data: str) -> None:
        self.events.append(("text", data))

    def handle_entityref(self, name: str) -> None:
        self.events.append(("text", f"&{name};"))

    def handle_charref(self, name: str) -> None:
        self.events.append(("text", f"&#{name};"))

    def handle_starttag(self, tag: str, attrs) -> None:
        self.events.append(("start", self.get_starttag_text(), tag))

    def handle_startendtag(self, tag: str, attrs) -> None:
        self.events.append(("void", self.get_starttag_text(), tag))

    def handle_endtag(self, tag: str) -> None:
        self.events.append(("end", None, tag))

    def unknown_decl(self, data: str) -> None:
        self.events.append(("void", f"<![{data}]>", ""))

    def handle_comment(self, data: str) -> None:
        self.events.append(("void", f"<!--{data}-->", ""))


def _marked_segment(text: str, where: str) -> Segment:
    """``text`` with its inline tags as spans (an element closed by its end tag) and voids (any other tag).
    The end tags' own text is read from the message, so that it comes back as written."""
    parser = _Markup()
    parser.feed(text)
    parser.close()
    events = parser.events
    ends = [m.group() for m in _TAG.finditer(text) if m.group().startswith("</")]  # the end tags as written, in order
    closing: dict[int, int] = {}  # a start event's index -> its end event's
    open_at: list[tuple[int, str]] = []
    for i, event in enumerate(events):
        if event[0] == "start":
            open_at.append((i, event[2]))
        elif event[0] == "end" and open_at and open_at[-1][1] == event[2]:
            closing[open_at.pop()[0]] = i
    builder = SegmentBuilder()
    tags: dict[int, list] = {}  # an end event's index -> the span's tag, [start text, end text]
    at = 0  # the next end tag as written that an end event may take

    def written_end(name: str) -> str:  # the next one of this name (one inside a comment is skipped), else </name>
        nonlocal at
        for j in range(at, len(ends)):
            if re.match(rf"</\s*{re.escape(name)}[\s>]", ends[j], re.IGNORECASE):
                at = j + 1
                return ends[j]
        return f"</{name}>"

    for i, event in enumerate(events):
        kind = event[0]
        if kind == "text":
            builder.text(event[1])
        elif kind == "start" and i in closing:
            tags[closing[i]] = [event[1], None]
            builder.open(tags[closing[i]])
        elif kind == "end":
            written = written_end(event[2])
            if i in tags:
                tags[i][1] = written
                builder.close()
            else:
                builder.void(written, separates=False)
        else:  # a start tag never closed (<br>, <img>), a self-closing one, a comment
            builder.void(event[1], separates=event[2] in ("br", "hr"))
    return builder.build(where)


def read_po(text: str, target_lang: str | None = None) -> Document:
    import polib

    if "\n" not in text:  # polib reads a one-line string that names a file as that file
        text += "\n"
    try:
        po = polib.pofile(text)
    except Exception as error:  # noqa: BLE001 polib's errors (OSError, ValueError, ...) are all "not a catalogue"
        found = re.search(r"line (\d+)", str(error))
        where = f"line {found.group(1)}: " if found else ""
        raise QkvError(f"{where}not a gettext catalogue ({str(error).strip()})") from None
    _check_strings(text)
    _check_complete(text, po)
    segments, slots = [], []  # slot: (entry, plural index or None, [(lead, trail, segment index, what follows) a piece])

    def add(entry, plural, text: str, where: str) -> None:
        pieces = []  # each line of a message, and each tab-separated cell of a line, a segment
        lines = text.split("\n")
        for i, line in enumerate(lines):
            cells = line.split("\t")  # a tab is layout the program relies on ("Name:\t%s"): kept
            for j, cell in enumerate(cells):
                segment, lead, trail = plain_segment(cell, where)
                if _TAG.search(cell):
                    segment = _marked_segment(cell.strip(), where)
                after = "\t" if j < len(cells) - 1 else "\n" if i < len(lines) - 1 else ""
                pieces.append((lead, trail, len(segments), after))
                segments.append(segment)
        slots.append((entry, plural, pieces))

    plural_count = None
    source_lines = text.split("\n")

    def msgid_line(entry) -> int:  # polib's linenum is the entry's first line, its comments' (a review)
        for n in range(max(entry.linenum, 1), min(len(source_lines), entry.linenum + 10_000) + 1):
            if source_lines[n - 1].lstrip().startswith("msgid"):
                return n
        return entry.linenum

    for entry in po:
        if entry.obsolete or not entry.msgid or "fuzzy" in entry.flags or (entry.msgstr and not entry.msgid_plural):
            continue
        where = f"msgid line {msgid_line(entry)}"
        if entry.msgid_plural:
            if plural_count is None:
                plural_count = _nplurals(po)
                if plural_count is None or plural_count < 1:
                    raise QkvError("the catalogue's header has no Plural-Forms with nplurals: set it for the target "
                                   "language (e.g. 'nplurals=2; plural=(n != 1);') to fill its plural entries")
                if plural_count > MAX_NPLURALS:
                    raise QkvError(f"the catalogue's header says nplurals={plural_count}: qkv fills at most "
                                   f"{MAX_NPLURALS} plural forms (gettext's languages have at most 6)")
            for n in list(entry.msgstr_plural):  # a .pot's extra forms go: msgfmt wants exactly nplurals
                if n >= plural_count and not entry.msgstr_plural[n]:
                    del entry.msgstr_plural[n]
            for n in range(plural_count):
                if not entry.msgstr_plural.get(n):  # a form already translated is kept
                    add(entry, n, entry.msgid if n == 0 else entry.msgid_plural, where)
        else:
            add(entry, None, entry.msgid, where)
    if target_lang and not po.metadata.get("Language"):
        po.metadata["Language"] = target_lang

    def write(placed: list[list], reports=None) -> str:
        for entry, plural, pieces in slots:
            translation = "".join(lead + flatten(placed[k], void=lambda tag: tag, element=lambda tag, inner: tag[0] + inner + tag[1])
                                  + trail + after for lead, trail, k, after in pieces)
            if plural is None:
                entry.msgstr = translation
            else:
                entry.msgstr_plural[plural] = translation
            if reports is not None and any(reports[k].flags for _, _, k, _ in pieces) and "fuzzy" not in entry.flags:
                entry.flags.append("fuzzy")
        if slots:  # written as UTF-8, so said to be
            po.metadata["Content-Type"] = "text/plain; charset=UTF-8"
        written = str(po)
        if written.startswith("#\n") and not text.startswith("#"):  # polib's empty header comment, not the user's
            written = written[2:]
        return written

    return Document(segments, write, "po")
