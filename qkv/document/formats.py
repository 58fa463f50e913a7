"""The formats qkv translates as documents: a reader per format, each returning one ``Document``.

``text``: each line a segment, its placeholders kept (``qkv.document.segments.PLACEHOLDER``), its
indent and line ending as they were; ``html``, ``markdown``, ``srt``, ``vtt`` and ``po``: their own
modules, which read and write line feeds: a document whose every line ends in CR LF (as Windows tools
write subtitles and catalogues) is read with line feeds and written back with CR LF, and a byte order
mark at its start comes back too (``read``). ``format_of`` names a file's format by its extension. Every document is bounded before any
translation: ``MAX_BYTES`` of text, ``MAX_SEGMENT_WORDS`` words and ``MAX_SEGMENT_MARKUP`` pieces of markup a
block (and the HTML reader's element and depth bounds, the Markdown reader's depth bound).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from qkv.errors import QkvError
from qkv.document.segments import Document, flatten, plain_segment

FORMATS = ("text", "html", "markdown", "srt", "vtt", "po")
EXTENSIONS = {".txt": "text", ".html": "html", ".htm": "html", ".md": "markdown",
              ".markdown": "markdown", ".srt": "srt", ".vtt": "vtt", ".po": "po", ".pot": "po"}
# Extensions of formats qkv does not write: named, so that such a file is not read as lines of text
NOT_WRITTEN = dict.fromkeys((".xhtml", ".xht"), "an XHTML file is XML, and qkv writes HTML (<br>, not <br/>; CDATA as "
                                                "a comment): give --format html to have it back as HTML")
# A language tag as BCP 47 writes one (de, pt-BR, sr-Latn-RS) or gettext does (pt_BR, sr@latin): what a document
# may be told its language is (HTML's lang, a PO header's Language, a WebVTT Language header take it as it is)
LANGUAGE_TAG = re.compile(r"[A-Za-z]{2,8}(?:[-_][A-Za-z0-9]{1,8})*(?:@[A-Za-z0-9]{1,16})?")
MAX_BYTES = 5_000_000
# Words of one segment (a paragraph, a cue group, an entry): its markup is placed over a (target words x
# source words) alignment, so a block's cost grows with its words squared; this bounds it (32 MB, seconds).
MAX_SEGMENT_WORDS = 2_000
# Markup of one segment (elements, voids such as <br> and placeholders): each is put back into the document
# by a tree edit that costs as many steps as the block holds nodes, so a block's writing grows with its
# markup squared; this bounds it.
MAX_SEGMENT_MARKUP = 2_000


def format_of(path: str | Path | None) -> str | None:
    """The format a file's extension names, or None; a QkvError for an extension of ``NOT_WRITTEN``."""
    suffix = Path(path).suffix.lower() if path else ""
    if suffix in NOT_WRITTEN:
        raise QkvError(f"{path}: {NOT_WRITTEN[suffix]}")
    return EXTENSIONS.get(suffix)


def check_language_tag(lang: str, name: str = "the target language") -> None:
    """A QkvError unless ``lang`` is a language tag (``LANGUAGE_TAG``): it is written into the document as it is."""
    if not LANGUAGE_TAG.fullmatch(lang):
        raise QkvError(f"{name} {lang!r} is not a language tag (as de, pt-BR or zh_Hant: letters and digits parted by - or _)")


_TEXT_LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")  # a line and its line feed; the last without one


def read_text(text: str, target_lang: str | None = None) -> Document:
    """Plain text: each non-blank line a segment, a line's tab-separated parts each a segment of their own
    (the columns of a table: a tab is never a space inside a sentence); blank lines, indents, tabs and
    line endings kept. A line ends at a line feed (``\n`` or ``\r\n``) only, as the line mode reads
    lines: a lone carriage return, a form feed, U+0085, U+2028 or U+2029 stays inside its line
    (``str.splitlines`` would cut there)."""
    lines = _TEXT_LINE.findall(text)
    segments, slots = [], []  # slots: (line, part, lead, trail) of each segment
    parts_of: dict[int, list[str]] = {}
    for n, line in enumerate(lines):
        body = line.rstrip("\r\n")
        parts = parts_of[n] = body.split("\t")
        for k, part in enumerate(parts):
            if part.strip():
                segment, lead, trail = plain_segment(part, f"line {n + 1}")
                slots.append((n, k, lead, trail))
                segments.append(segment)

    def write(placed: list[list], reports=None) -> str:
        written = {n: list(parts) for n, parts in parts_of.items()}
        for (n, k, lead, trail), nodes in zip(slots, placed):
            written[n][k] = lead + flatten(nodes, void=lambda tag: tag) + trail
        out = list(lines)
        for n in {n for n, *_ in slots}:
            out[n] = "\t".join(written[n]) + lines[n][len(lines[n].rstrip("\r\n")) :]
        return "".join(out)

    return Document(segments, write, "text")


def read(text: str, format: str, *, target_lang: str | None = None) -> Document:
    """``text`` read as a ``format`` document (one of ``FORMATS``); a QkvError where it is broken or
    beyond the bounds (``MAX_BYTES``, ``MAX_SEGMENT_WORDS``), or where ``target_lang`` is not a language tag.
    The document is written as it was stored: a byte order mark at its start is no text but comes back, and
    a document whose lines all end in CR LF is read with line feeds and written with CR LF again (the text
    format keeps each line's own ending)."""
    if target_lang:
        check_language_tag(target_lang)
    bom = text.startswith("\ufeff")
    text = text.removeprefix("\ufeff")  # a byte order mark (open(..., encoding="utf-8") keeps it) is no text
    crlf = format != "text" and "\n" in text and text.count("\r\n") == text.count("\n")
    if crlf:
        text = text.replace("\r\n", "\n")
    document = _read(text, format, target_lang)
    for segment in document.segments:
        if len(segment.text.split()) > MAX_SEGMENT_WORDS:
            raise QkvError(f"{segment.where}: a block of {len(segment.text.split()):,} words; qkv translates blocks of up "
                           f"to {MAX_SEGMENT_WORDS:,} words (split it into paragraphs)")
        if len(segment.spans) > MAX_SEGMENT_MARKUP:
            raise QkvError(f"{segment.where}: a block with {len(segment.spans):,} pieces of markup (tags, line breaks, "
                           f"placeholders); qkv translates blocks of up to {MAX_SEGMENT_MARKUP:,} (split it into paragraphs)")
    if bom or crlf:
        document = replace(document, write=_as_stored(document.write, bom=bom, crlf=crlf))
    return document


def _as_stored(write, *, bom: bool, crlf: bool):
    """``write`` giving the document back with the byte order mark and the CR LF line endings it was read with."""

    def stored(*args, **kwargs) -> str:
        out = write(*args, **kwargs)
        return ("\ufeff" if bom else "") + (out.replace("\n", "\r\n") if crlf else out)

    return stored


def _read(text: str, format: str, target_lang: str | None) -> Document:
    if format not in FORMATS:
        raise QkvError(f"unknown document format {format!r}: one of {', '.join(FORMATS)}")
    if len(text) > MAX_BYTES:
        raise QkvError(f"the document has {len(text):,} characters: qkv translates documents of up to {MAX_BYTES:,} (split it)")
    if format == "text":
        return read_text(text, target_lang)
    if format == "html":
        from qkv.document.html import read_html

        return read_html(text, target_lang)
    if format == "markdown":
        from qkv.document.markdown import read_markdown

        return read_markdown(text, target_lang)
    if format in ("srt", "vtt"):
        from qkv.document.subtitles import read_srt, read_vtt

        return (read_srt if format == "srt" else read_vtt)(text, target_lang)
    from qkv.document.po import read_po

    return read_po(text, target_lang)
