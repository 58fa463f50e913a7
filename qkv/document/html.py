"""HTML in, HTML out: text blocks translated with their inline elements placed by the alignment.

Parsed by html5lib through Beautiful Soup: html5lib implements the HTML standard's parsing algorithm, so
malformed HTML is repaired as a browser repairs it (an unclosed ``<p>`` closed, a stray ``</b>``
dropped, a misnested ``<b><i></b></i>`` rebuilt), and what comes back is what a browser would have
shown. A page (with ``<html>``, ``<body>`` or a doctype) comes back as a page; a fragment as a fragment.

- Each run of text and inline elements (``INLINE``) between block elements is one segment; block
  elements, comments between blocks, and every attribute are kept as they are.
- ``VERBATIM`` elements (``code``, ``pre``, ``script``, ``style``, ...), any element with
  ``translate="no"`` or the class ``notranslate``, comments inside text, void elements (``<br>``,
  ``<img>``) and placeholders in the text are kept verbatim and put where the alignment says.
- ``alt``, ``title``, ``placeholder`` and ``label`` attributes are translated; the ``lang`` of ``<html>`` is set to the
  target language. An ``<option>`` without a ``value`` gets its source text as one (what its form sends).
- Written out with ``&``, ``<`` and ``>`` escaped in text (Beautiful Soup's "minimal" substitution), any
  other character (a no-break space, an accent) as itself, attributes in their source order and void
  elements as HTML writes them (``<br>``, not ``<br/>``).
"""

from __future__ import annotations

import re
import warnings

from qkv.errors import QkvError
from qkv.document.segments import Document, Element, SegmentBuilder, Void, plain_segment

INLINE = frozenset("a abbr acronym b bdi bdo big cite data del dfn em font i ins label mark q ruby s small span strike "
                   "strong sub sup time tt u".split())
VOID = frozenset("br img wbr input area embed source track".split())
VERBATIM = frozenset("code kbd samp var pre script style textarea svg math template noscript iframe object xmp noembed noframes "
                     "plaintext rt rp".split())
# verbatim, but inside a sentence (a ruby's reading and its fallback brackets: the ruby's text is translated)
INLINE_VERBATIM = frozenset("code kbd samp var svg math rt rp".split())
TRANSLATED_ATTRIBUTES = ("alt", "title", "placeholder", "label")  # label: an <option>'s, an <optgroup>'s, a <track>'s
# Elements whose text the HTML standard's parser reads raw (no tags, no entities): written back unescaped,
# as Beautiful Soup writes script and style ("<xmp><b>" came back as "<xmp>&lt;b&gt;").
RAW_TEXT = frozenset("script style xmp iframe noembed noframes plaintext".split())
# Elements whose first newline the HTML standard's parser drops ("<pre>\n\nA" holds "\nA"); its serializer
# writes one back where the text starts with a newline, and so does this writer.
PRE_NEWLINE = ("pre", "textarea", "listing")
# Bounds checked before any translation (``qkv.document.formats.check_size`` bounds the bytes).
MAX_ELEMENTS = 100_000
MAX_DEPTH = 200
_PAGE = re.compile(r"<!doctype|<html[\s>]|<body[\s>]|<head[\s>]", re.IGNORECASE)
# What a page tag inside is not one: a comment, and the text the parser reads raw (RAW_TEXT, and the
# escapable raw text of <textarea> and <title>), up to its end tag
_TEXT_ONLY = RAW_TEXT | {"textarea", "title"}
_SKIPPED = re.compile(rf"<!--|<({'|'.join(sorted(_TEXT_ONLY))})[\s>/]", re.IGNORECASE)
_END_OF = {name: re.compile(rf"</{name}\s*>", re.IGNORECASE) for name in _TEXT_ONLY}


def _is_page(text: str) -> bool:
    """Whether ``text`` writes a page's own tags (a doctype, ``<html>``, ``<head>`` or ``<body>``) outside
    comments and raw text ("<script>var s = '<body>'</script>" is a fragment's), in one pass."""
    at, page = 0, _PAGE.search(text)
    while page is not None:
        skip = _SKIPPED.search(text, at, page.start() + 1)
        if skip is None:
            return True
        if skip.group(1) is None:  # a comment: to its end
            end = text.find("-->", skip.end())
        else:  # raw text: to its end tag
            close = _END_OF[skip.group(1).lower()].search(text, skip.end())
            end = -1 if close is None else close.start()
        if end < 0:
            return False
        at = end + 1
        if page.start() < at:  # that one was inside: the next
            page = _PAGE.search(text, at)
    return False


def _formatter():
    """Beautiful Soup's minimal escaping, with attributes in their source order (its default sorts them)."""
    from bs4.formatter import HTMLFormatter

    class SourceOrder(HTMLFormatter):
        def attributes(self, tag):
            return list(tag.attrs.items())

    return SourceOrder(entity_substitution=HTMLFormatter.REGISTRY["minimal"].entity_substitution, void_element_close_prefix=None,
                       cdata_containing_tags=RAW_TEXT)


def _kept(tag) -> bool:
    """Whether an element is kept verbatim: its name, ``translate="no"`` or the class ``notranslate``."""
    return tag.name in VERBATIM or _untranslated(tag)


def _untranslated(tag) -> bool:
    """``translate="no"`` or the class ``notranslate``: the element's text and attributes are kept."""
    classes = tag.get("class") or []
    return (str(tag.get("translate", "")).lower() == "no"
            or "notranslate" in (classes if isinstance(classes, list) else str(classes).split()))


def _marker(tag) -> bool:
    """A footnote marker (``cat<sup><a href="#f1">1</a></sup>``): an inline element whose short text has no
    letter, glued to the text before it and not inside a word. It is kept whole, as a void: as an element
    it wrapped the word its word became, and its number was lost."""
    from bs4 import NavigableString, Tag

    text = tag.get_text()
    if not text.strip() or len(text) > 8 or any(c.isalpha() for c in text):
        return False

    def side(node, last: bool) -> str:
        words = str(node) if isinstance(node, NavigableString) else node.get_text() if isinstance(node, Tag) else ""
        return words[-1:] if last else words[:1]

    before, after = side(tag.previous_sibling, True), side(tag.next_sibling, False)
    return bool(before) and not before.isspace() and not after.isalnum()


def _is_inline(node) -> bool:
    from bs4 import NavigableString, Tag

    if isinstance(node, NavigableString):
        return True
    return isinstance(node, Tag) and (node.name in INLINE or node.name in VOID or node.name in INLINE_VERBATIM)


def _check_shape(soup) -> None:
    """Refuse a document with more elements or deeper nesting than ``MAX_ELEMENTS``/``MAX_DEPTH``."""
    from bs4 import Tag

    count, stack = 0, [(soup, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise QkvError(f"the HTML nests elements more than {MAX_DEPTH} deep: qkv translates documents up to that depth")
        for child in node.children:
            if isinstance(child, Tag):
                count += 1
                if count > MAX_ELEMENTS:
                    raise QkvError(f"the HTML has more than {MAX_ELEMENTS:,} elements: split it")
                stack.append((child, depth + 1))


def read_html(text: str, target_lang: str | None = None) -> Document:
    """An HTML document or fragment as segments and a writer (module docstring)."""
    from bs4 import BeautifulSoup, Comment, NavigableString, Tag, XMLParsedAsHTMLWarning

    try:
        with warnings.catch_warnings():  # an XHTML page (<?xml ...?>) is read as HTML, as the docs say: no warning
            warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
            soup = BeautifulSoup(text, "html5lib")
    except Exception as error:  # noqa: BLE001 html5lib asserts on a few foreign-content nestings (<table><svg><html>)
        raise QkvError(f"html5lib could not build this HTML ({type(error).__name__}): simplify its nesting") from None
    _check_shape(soup)
    segments, runs, attributes = [], [], []

    def attributes_of(tag) -> None:
        for name in TRANSLATED_ATTRIBUTES:
            value = tag.get(name)
            if isinstance(value, str) and value.strip():
                segment, lead, trail = plain_segment(value, f"line {tag.sourceline} <{tag.name} {name}>" if tag.sourceline
                                                     else f"<{tag.name} {name}>")
                attributes.append((len(segments), tag, name, lead, trail))
                segments.append(segment)

    def add(builder: SegmentBuilder, node) -> None:
        if isinstance(node, Comment) or (isinstance(node, NavigableString) and type(node) is not NavigableString):
            builder.void(node)  # a comment, CDATA or processing instruction: kept where it was
        elif isinstance(node, NavigableString):
            builder.text(str(node))
        elif node.name in VOID or _kept(node) or _marker(node):
            if not _untranslated(node):  # a void's, or a verbatim element's own (<textarea placeholder>, <iframe title>)
                attributes_of(node)
            builder.void(node, separates=node.name == "br")
        else:
            attributes_of(node)
            builder.open(node)
            for child in list(node.children):
                add(builder, child)
            builder.close()

    def flush(run: list, parent) -> None:
        if not any(isinstance(n, Tag) or str(n).strip() for n in run if not isinstance(n, Comment)):
            return  # whitespace and comments between blocks: left as they are
        builder = SegmentBuilder()
        for node in run:
            add(builder, node)
        first = run[0]  # the line of the run's first element where it starts the run, else its block's
        line = (first.sourceline if isinstance(first, Tag) else None) or parent.sourceline
        segment = builder.build(f"line {line} <{parent.name}>" if line else f"<{parent.name}> {len(segments) + 1}")
        if not segment.text.strip():  # only markup (an image alone): its attributes were taken, the rest stays
            return
        runs.append((len(segments), run))
        segments.append(segment)

    def walk(node) -> None:
        if isinstance(node, Tag) and node.name != "[document]":
            attributes_of(node)
        run: list = []
        for child in list(node.children):
            if _is_inline(child):
                run.append(child)
                continue
            flush(run, node)
            run = []
            if isinstance(child, Tag) and not _kept(child):
                walk(child)
            elif isinstance(child, Tag) and not _untranslated(child):  # verbatim by name: its text kept, its attributes read
                attributes_of(child)
        flush(run, node)

    for tag in soup.find_all("option"):  # a form sends an option's text where it has no value: keep what it sends
        if not tag.has_attr("value") and not _untranslated(tag):
            tag["value"] = tag.get_text()
    for tag in soup.find_all(PRE_NEWLINE):  # the parser drops a newline right after <pre>: the writer puts one back
        first = next(iter(tag.children), None)
        if type(first) is NavigableString and first.startswith("\n"):
            first.replace_with("\n" + first)
    kept = soup.html is not None and _untranslated(soup.html)  # <html translate="no">: nothing is translated
    body = soup.body if soup.body is not None else soup
    if not kept and not (body is soup.body and _untranslated(body)):
        walk(body)
    if soup.head is not None and not kept and not _untranslated(soup.head):
        for tag in soup.head.find_all("title"):
            if not _untranslated(tag):
                walk(tag)
    page = _is_page(text)  # a page comes back as a page, a fragment as a fragment
    if target_lang and soup.html is not None and page and not kept and segments:  # a page with nothing translated keeps its lang
        soup.html["lang"] = target_lang

    def write(placed: list[list], reports=None) -> str:
        for index, tag, name, lead, trail in attributes:  # before the runs: a run's elements are copied with them
            tag[name] = lead + _text(placed[index]) + trail
        for index, run in runs:
            anchor = soup.new_string("")
            run[0].insert_before(anchor)
            lead = _edge(run, first=True)
            trail = _edge(run, first=False)
            for node in run:
                node.extract()
            new = ([soup.new_string(lead)] if lead else []) + _nodes(soup, placed[index]) + ([soup.new_string(trail)] if trail else [])
            for node in new:
                anchor.insert_before(node)
            anchor.extract()
        formatter = _formatter()
        if page:
            return _with_outer_whitespace(soup, text, formatter)
        out = []
        for node in soup.contents:  # a fragment: its comments, then what html5lib put in head and body
            if node is soup.html:
                out += [part.decode_contents(formatter=formatter) for part in (soup.head, soup.body) if part is not None]
            else:
                out.append(node.output_ready(formatter=formatter) if hasattr(node, "output_ready") else str(node))
        return "".join(out)

    return Document(segments, write, "html")


_HEAD_GAP = re.compile(r"(<html\b[^<>]*>)(\s*)<head\b", re.IGNORECASE)  # [^<>]: linear on "<html <html ..."
_TAIL = re.compile(r"</body\s*>(\s*)</html\s*>(\s*)$", re.IGNORECASE)


def _with_outer_whitespace(soup, text: str, formatter) -> str:
    """A page written with the whitespace the HTML standard's parser moves or drops where the source had
    it: between ``<html>`` and ``<head>`` (dropped), and after ``</body>`` and ``</html>`` (moved to the end
    of the body)."""
    from bs4 import NavigableString

    tail = _TAIL.search(text)
    moved = tail.group(1) + tail.group(2) if tail else ""
    last = soup.body.contents[-1] if soup.body is not None and soup.body.contents else None
    if moved and type(last) is NavigableString and str(last).endswith(moved):
        last.replace_with(str(last)[: -len(moved)])
    else:
        tail = None
    out = soup.decode(formatter=formatter)
    if tail and out.endswith("</body></html>"):
        out = out[: -len("</body></html>")] + "</body>" + tail.group(1) + "</html>" + tail.group(2)
    gap, found = _HEAD_GAP.search(text), _HEAD_GAP.search(out)
    if gap and gap.group(2) and found and not found.group(2):
        out = out[: found.end(1)] + gap.group(2) + out[found.end(1) :]
    return out


def _edge(run: list, first: bool) -> str:
    """The whitespace a run starts (or ends) with, kept outside the translation."""
    from bs4 import NavigableString

    node = run[0] if first else run[-1]
    if type(node) is not NavigableString:
        return ""
    text = str(node)
    if not text.strip():
        return text if first else ("" if len(run) == 1 else text)
    return text[: len(text) - len(text.lstrip())] if first else text[len(text.rstrip()) :]


def _text(nodes: list) -> str:
    from qkv.document.segments import flatten

    return flatten(nodes, void=lambda tag: str(tag))


def _nodes(soup, nodes: list) -> list:
    """Placed nodes as Beautiful Soup nodes: text as strings, a void as its own (original) node, an
    element as a new element of the same name and attributes holding its placed children."""
    out = []
    for node in nodes:
        if isinstance(node, str) or (isinstance(node, Void) and type(node.tag) is str):  # text, a placeholder (not a comment)
            out.append(soup.new_string(node if isinstance(node, str) else node.tag))
        elif isinstance(node, Void):
            out.append(node.tag)
        elif isinstance(node, Element):
            tag = soup.new_tag(node.tag.name, attrs=dict(node.tag.attrs))
            for child in _nodes(soup, node.children):
                tag.append(child)
            out.append(tag)
    return out
