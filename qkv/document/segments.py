"""One representation for every document format: segments of plain text with their inline markup as spans.

A reader (``qkv.document.html``, ``markdown``, ``subtitles``, ``po``, ``text``) turns a document into a
``Document``: its ``segments`` (what the translator reads, with the inline elements and placeholders
taken out as ``Span``s over character offsets) and a ``write`` function that puts translated segments
back into the document's skeleton. The translator sees plain segments only; ``qkv.document.placement``
puts each span around the words of the translation that its own words align to, and ``render`` turns
the placed spans into a tree of ``Element`` and ``Void`` nodes with the translated text between them,
which each format's writer knows how to write.

A ``Span`` is either an element with text of its own (``<b>red</b>``, a Markdown link, a subtitle cue)
or a void, which has none: ``<br>``, ``<img>``, a comment, a code span kept verbatim, a placeholder
(``%s``, ``{name}``, a URL). A void sits at a character offset; ``space_before``/``space_after`` say
whether whitespace separated it from the text on either side, so that it comes back glued or spaced
as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import regex

# What a placeholder is, in every format: kept verbatim, out of the text the model reads, and put back
# where the alignment says (qkv.document.placement). Longest alternatives first: a URL before its
# parts, ``%(name)s`` before ``%s``.
PLACEHOLDER = regex.compile(
    r"""(?:https?|ftp)://[^\s<>"'`]*[^\s<>"'`.,;:!?)\]]"""  # a URL, without a sentence's closing punctuation
    r"""|(?<![\w.@/-])www\.[\w-]+(?:\.[\w-]+)+(?:[/?#][^\s<>"'`]*[^\s<>"'`.,;:!?)\]])?"""  # www.example.com, a URL too
    r"|(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+"  # an e-mail address (from the start of its run: linear)
    r"|%\([A-Za-z_]\w*\)[-#0+]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa%]"  # Python's %(name)s
    # C's %s, %1$d, %.2f (not the space flag: "100% sure" is prose)
    r"|%(?:\d+\$)?[-#0+']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|j|z|t|L)?[diouxXeEfFgGcspaA%]"
    r"|\{\{\s*[\w.\[\]|:'\" -]+?\s*\}\}"  # {{ var }}, {{ user.name | upper }}
    r"|\{[A-Za-z_0-9]*(?:[.\[][\w.\[\]]*)?(?:![rsa])?(?::[^{}\n]*)?\}"  # {}, {0}, {name}, {a.b}, {:.2f}, {when:%Y-%m-%d}
    r"|`[^`\n]+`"  # inline code in plain text
    # an emoji: a pictograph with its skin tone, its emoji presentation and the pictographs a zero-width
    # joiner adds to it, a flag's two regional indicators, a keycap (not words the model can read: a
    # Multi30k model's vocabulary has none, and the line lost them without a word)
    r"|\p{Extended_Pictographic}[\p{Emoji_Modifier}\uFE0F]*(?:\u200D\p{Extended_Pictographic}[\p{Emoji_Modifier}\uFE0F]*)*"
    r"|\p{Regional_Indicator}{2}|[0-9#*]\uFE0F?\u20E3"
    r"|[\u2669-\u266C]+"  # music notes, a subtitle's sign of lyrics ("\u266a A girl is singing \u266a"), which the model dropped
)
_SPACE = re.compile(r"[ \t\n\r\f]+")  # HTML's ASCII whitespace: a no-break space is text, not space
_CLOSING = ",.;:!?)]}\u00bb\u201d"  # punctuation that takes no space before it
_GLUE = re.compile(r"[+/|\-=~^&*:@#_\\]{1,3}")  # a symbol that joins two voids: Ctrl+C, {0}/{1}, a|b


@dataclass
class Span:
    """Markup over ``text[start:end]`` of a segment (character offsets); a void when it holds no text."""

    start: int
    end: int
    tag: Any  # what the writer writes back (an emptied HTML element, a Markdown token pair, a cue)
    parent: int | None = None  # index of the enclosing span in the segment's list
    void: bool = False
    placeholder: bool = False  # placeholders keep their order among themselves (msgfmt checks %s %d)
    space_before: bool = True
    space_after: bool = True
    separates: bool = False  # a void that parts words (<br>): the space the model read there is its own
    # a placeholder glued to a letter or digit in the source ("%sfoo", "x{n}"): glued to one in the translation
    # too; one that was not ("%s." at a sentence's end) gets a space where it lands before or after a word
    word_before: bool = False
    word_after: bool = False


@dataclass
class Segment:
    """A piece of a document translated as one: ``text`` is what the model reads (whitespace collapsed,
    markup taken out), ``spans`` its markup, ``where`` says where it is (for reports and errors).
    ``cover``: the top-level spans partition the text in order (subtitle cues)."""

    text: str
    spans: list[Span] = field(default_factory=list)
    where: str = ""
    cover: bool = False


@dataclass
class Element:
    """A placed element: its tag and what it holds (``str``, ``Element`` and ``Void`` nodes)."""

    tag: Any
    children: list


@dataclass
class Void:
    """A placed void (``<br>``, a placeholder): its tag."""

    tag: Any


@dataclass
class Document:
    """A read document: its segments and the writer that puts a rendered node list per segment back."""

    segments: list[Segment]
    write: Callable[[list[list]], str]
    format: str = ""


class SegmentBuilder:
    """Builds one segment from a reader's stream of text, element opens and closes, and voids, in document
    order: whitespace collapsed as HTML does, leading and trailing whitespace dropped."""

    def __init__(self, placeholders: bool = True) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.spans: list[Span] = []
        self.stack: list[int] = []
        self.placeholders = placeholders
        self.last_void: list[int] = []  # voids written since the last text
        self.synthetic_space_at = -1  # where a separating void (<br>) put a space of its own
        self.space_since_void = False  # whitespace came after the last void
        self.pending: str | None = None  # a symbol glued to the void before it ("+" in Ctrl+C): a void if one follows

    @property
    def _ends_in_space(self) -> bool:
        return bool(self.parts) and self.parts[-1].endswith(" ")

    def text(self, text: str) -> None:
        """Add text; placeholders in it become voids (when the builder was asked for them)."""
        if not self.placeholders:
            self._text(text)
            return
        at = 0
        for match in PLACEHOLDER.finditer(text):
            self._text(text[at : match.start()])
            self.void(match.group(), placeholder=True, before=text[: match.start()], after=text[match.end() :])
            at = match.end()
        self._text(text[at:])

    def _text(self, text: str, hold: bool = True) -> None:
        if not text:
            return
        self._flush()
        if hold and self.last_void and _GLUE.fullmatch(text):  # "<kbd>Ctrl</kbd>+": a void too, if a void follows it
            self.pending = text
            return
        text = _SPACE.sub(" ", text)
        spaced = text.startswith(" ")
        if spaced:
            self.space_since_void = True
        if self.last_void:  # the last void before this text is spaced after when whitespace follows it
            i = self.last_void[-1]
            self.spans[i].space_after = spaced or (self.length > self.spans[i].start and self._ends_in_space
                                                   and self.synthetic_space_at != self.length)
        if spaced and (not self.parts or self._ends_in_space):
            text = text[1:]  # no double space, and none at the segment's start
        if not text:
            return
        if self.last_void and self._ends_in_space and text[0] in _CLOSING:  # "Hello {name}, you" reads "Hello, you"
            self.parts[-1] = self.parts[-1][:-1]
            self.length -= 1
            for i in self.last_void:
                self.spans[i].start = self.spans[i].end = min(self.spans[i].start, self.length)
        self.last_void = []
        self.parts.append(text)
        self.length += len(text)

    def _flush(self) -> None:
        """The symbol held back after a void, as text: no void followed it."""
        if self.pending is not None:
            text, self.pending = self.pending, None
            self._text(text, hold=False)

    def open(self, tag: Any) -> None:
        self._flush()
        if self.last_void:  # a void before an element is spaced after where whitespace came between them
            self.spans[self.last_void[-1]].space_after = self.space_since_void
            self.last_void = []
        self.spans.append(Span(self.length, self.length, tag, parent=self.stack[-1] if self.stack else None,
                               space_before=self._ends_in_space or not self.parts))
        self.stack.append(len(self.spans) - 1)

    def close(self) -> None:
        self._flush()
        index = self.stack.pop()
        span = self.spans[index]
        span.end = self.length
        if span.start == span.end:  # an element with no text (<a name="x"></a>): spaced as a void is
            self.last_void.append(index)

    def void(self, tag: Any, *, placeholder: bool = False, before: str | None = None, after: str | None = None,
             separates: bool = False) -> None:
        """A void at the current offset; ``before``/``after``: the raw text around it where the reader has it;
        ``separates``: the void parts words (``<br>``), so the text the model reads has a space there."""
        if self.pending is not None:  # "Ctrl" "+" "C": the symbol between two glued voids is one of them
            if before is None or not before[-1:].isspace():
                symbol, self.pending = self.pending, None
                self.void(symbol, before=symbol, after=symbol)  # glued to the void before it and to this one
            else:
                self._flush()
        if before:
            spaced_before = before[-1:].isspace()
        elif self.last_void:  # right after another void: spaced where whitespace came between them
            spaced_before = self.space_since_void
        else:
            spaced_before = self._ends_in_space or not self.parts
        self.space_since_void = False
        if self.last_void:  # right after another void, with no text between: that one is spaced as this one is
            self.spans[self.last_void[-1]].space_after = spaced_before
        span = Span(self.length, self.length, tag, parent=self.stack[-1] if self.stack else None, void=True,
                    placeholder=placeholder, space_before=spaced_before or not self.parts,
                    space_after=True if after is None else (not after or after[0].isspace()), separates=separates,
                    word_before=bool(before) and before[-1].isalnum(), word_after=bool(after) and after[0].isalnum())
        self.spans.append(span)
        self.last_void.append(len(self.spans) - 1)
        if separates and self.parts and not self._ends_in_space:
            self.parts.append(" ")
            self.length += 1
            self.synthetic_space_at = self.length

    def build(self, where: str = "", cover: bool = False) -> Segment:
        """The segment: trailing space dropped, offsets clipped to the text."""
        self._flush()
        while self.stack:  # an element the reader did not close ends with the segment
            self.close()
        text = "".join(self.parts)
        stripped = text.rstrip(" ")
        for span in self.spans:
            span.start, span.end = min(span.start, len(stripped)), min(span.end, len(stripped))
        return Segment(stripped, self.spans, where, cover)


def plain_segment(text: str, where: str = "", placeholders: bool = True) -> tuple[Segment, str, str]:
    """A segment of one string with no markup but its placeholders, and the whitespace around it (kept
    by the writer: a PO entry's trailing newline, a line's indent)."""
    lead = text[: len(text) - len(text.lstrip())]
    trail = text[len(text.rstrip()) :] if text.strip() else ""  # all whitespace: kept once, as the lead
    builder = SegmentBuilder(placeholders)
    builder.text(text.strip())
    return builder.build(where), lead, trail


def flatten(nodes: list, void: Callable[[Any], str] = str, element: Callable[[Any, str], str] | None = None) -> str:
    """A rendered node list as a string: text as it is, a void as ``void(tag)``, an element as
    ``element(tag, inner)`` (default: its inner text alone)."""
    out = []
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, Void):
            out.append(void(node.tag))
        else:
            inner = flatten(node.children, void, element)
            out.append(element(node.tag, inner) if element else inner)
    return "".join(out)
