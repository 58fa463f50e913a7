"""Markdown in, Markdown out (CommonMark, with GitHub's extensions and front matter), through markdown-it-py and mdformat.

markdown-it-py parses the document as CommonMark says, with GitHub's extensions (mdformat-gfm: tables,
strikethrough, task lists, bare www. and http links), footnotes and a YAML front matter block between
``---`` lines; each block's inline content (a paragraph, a heading, a table cell, a list item's text) is one
segment, its emphasis, strong emphasis, strikethrough, links and inline HTML elements (a start tag and
its end tag in the block: ``_html_pairs``) spans over it; code spans, inline HTML code and keys
(``<code>...</code>``), a lone HTML tag, hard breaks, autolinks and footnote references (mdformat-footnote;
a footnote's text is a segment of its own) are voids kept verbatim, and a task's box and an alert's
marker (``> [!NOTE]``) stay at their block's start; an image is a void whose alt text is translated on
its own. Fenced and indented code and HTML blocks are kept as they are, the front matter as the source
wrote it (not as mdformat-frontmatter would dump its YAML again). mdformat's
renderer writes the tokens back, so the output is the same document in mdformat's normal form (its
emphasis markers, escapes and code fences), laid out as the source was (``qkv.document.markdown_layout``:
its paragraphs' wrapping, its tables' padding, its list markers and numbering, its headings' and thematic
breaks' style).
"""

from __future__ import annotations

import re

from qkv.errors import QkvError
from qkv.document.html import VERBATIM
from qkv.document.markdown_layout import Layout, mark_layout, wrap_width
from qkv.document.segments import Document, Element, SegmentBuilder, Void, plain_segment

# mdformat-gfm (its tables are mdformat-tables), mdformat-footnote and mdformat-frontmatter
_EXTENSIONS = ("gfm", "footnote", "frontmatter")
# An alert's marker at a block quote's start ("> [!NOTE]", GitHub's; CommonMark's text), kept verbatim:
# taken out of the segment and put back first, its line break after it, as a task's box is.
_LEADING_MARK = re.compile(r"\[![A-Za-z]+\]\s*$")
# Inline HTML: a start tag and its end tag in one block's text are an element placed around its words'
# translation (as the html format places them); a tag without its partner is a void. An element the html
# format keeps verbatim (qkv.document.html.VERBATIM: code, keys) is one void with its text.
_START_TAG = re.compile(r"<([A-Za-z][A-Za-z0-9-]*)(?:\s[^>]*)?>\Z", re.S)
_END_TAG = re.compile(r"</([A-Za-z][A-Za-z0-9-]*)\s*>\Z")
_EMPTY_ELEMENTS = frozenset("area base br col embed hr img input link meta source track wbr".split())  # no end tag
MAX_NESTING = 100  # block levels (a list level is two: the list and its item); markdown-it's CommonMark preset stops at 20


def _refuse_deeper(md) -> None:
    """Make ``md`` refuse a document nested deeper than ``MAX_NESTING`` blocks. markdown-it drops what lies
    beyond its ``maxNesting`` without a word (the rest of the document with it); a nested call of its block
    tokenizer at that level is where it would, so there this raises."""
    md.options["maxNesting"] = MAX_NESTING + 1  # its own stop comes a level after ours
    tokenize = md.block.tokenize

    def bounded(state, start: int, end: int, *args, **kwargs):
        if state.level > MAX_NESTING and state.skipEmptyLines(start) < end:
            raise QkvError(f"line {start + 1}: blocks nested more than {MAX_NESTING} deep (a list level counts two); "
                           "qkv translates Markdown up to that depth")
        return tokenize(state, start, end, *args, **kwargs)

    md.block.tokenize = bounded  # this parser's own block parser: an instance attribute, no other parser changes


def _parser():
    import mdformat.plugins
    from markdown_it import MarkdownIt
    from mdformat.renderer import MDRenderer

    md = MarkdownIt("commonmark", renderer_cls=MDRenderer)
    md.options["mdformat"] = {}
    md.options["store_labels"] = True  # reference links keep their labels
    md.options["parser_extension"] = []
    for name in _EXTENSIONS:  # their parser rules and renderers
        plugin = mdformat.plugins.PARSER_EXTENSIONS[name]
        md.options["parser_extension"].append(plugin)
        plugin.update_mdit(md)
    extensions = md.options["parser_extension"]  # mdformat-gfm added its table plugin: its renderers take the layout
    tables = next(plugin for plugin in extensions if "table" in plugin.RENDERERS)
    extensions[extensions.index(tables)] = Layout(tables)
    md.options["codeformatters"] = {}
    _refuse_deeper(md)
    return md


def read_markdown(text: str, target_lang: str | None = None) -> Document:
    """A Markdown document as segments and a writer (module docstring)."""
    from markdown_it.token import Token

    md = _parser()
    env: dict = {}
    tokens = md.parse(text, env)
    lines = re.split(r"\r\n|\r|\n", text)  # as markdown-it counts them: a lone CR ends a line too
    mark_layout(tokens, lines)
    # The front matter comes back as the source wrote it (mdformat-frontmatter would dump its YAML anew:
    # "{{ page.title }}", a template's, is not YAML's mapping)
    front = next((t for t in tokens if t.type == "front_matter"), None)
    if front is not None:
        front_text = "\n".join(lines[front.map[0] : front.map[1]]) + "\n"
        tokens = [t for t in tokens if t is not front]
    segments, inlines, alts, leads = [], [], [], {}  # leads: what stays first in its block
    for n, token in enumerate(tokens):
        if token.type != "inline" or not token.children:
            continue
        builder = SegmentBuilder()
        children = token.children
        if children[0].type == "html_inline" and "task-list-item-checkbox" in children[0].content:
            leads[id(token)] = [children[0]]  # a task's box: put back first, where mdformat-gfm's renderer reads it
            children = children[1:]
        elif children[0].type == "text" and (mark := _LEADING_MARK.match(children[0].content)):
            rest = children[0].content[mark.end() :]
            lead = [Token("text", "", 0, content=mark.group())]
            children = ([Token("text", "", 0, content=rest)] if rest else []) + children[1:]
            if not rest and children and children[0].type == "softbreak":  # "> [!NOTE]" on a line of its own
                lead.append(children[0])
                children = children[1:]
            leads[id(token)] = lead
            if not children:
                continue
        stack: list[list] = []
        partner = _html_pairs(children)  # a start tag's index -> its end tag's index and the element's name
        ends = {end for end, _ in partner.values()}
        i = 0
        while i < len(children):
            child = children[i]
            if i in partner and partner[i][1] in VERBATIM:  # <code>...</code>, <kbd>...</kbd>: kept whole
                builder.void(children[i : partner[i][0] + 1])
                i = partner[i][0] + 1
                continue
            if i in partner:  # an inline HTML element: placed as emphasis is
                tag = [child, None]
                stack.append(tag)
                builder.open(tag)
                i += 1
                continue
            if i in ends:
                stack.pop()[1] = child
                builder.close()
                i += 1
                continue
            if (child.type == "link_open" and child.markup == "autolink") or child.type == "gfm_autolink_open":
                # <https://...>, and GitHub's bare www.x.org and https://x.org: kept whole
                close = "gfm_autolink_close" if child.type == "gfm_autolink_open" else "link_close"
                end = next(j for j in range(i, len(children)) if children[j].type == close)
                builder.void(children[i : end + 1])
                i = end + 1
                continue
            if child.type in ("text", "text_special"):
                builder.text(child.content)
            elif child.type == "softbreak" and i + 1 < len(children) and children[i + 1].type in ("text", "text_special"):
                builder.text(" " + children[i + 1].content)  # one text: a space alone after a void would not count as its own
                i += 1
            elif child.type == "softbreak":
                builder.text(" ")
            elif child.type.endswith("_open"):
                tag = [child, None]
                stack.append(tag)
                builder.open(tag)
            elif child.type.endswith("_close") and stack:
                stack.pop()[1] = child
                builder.close()
            else:  # code_inline, html_inline, hardbreak, image: verbatim
                if child.type == "image" and child.content.strip():
                    segment, lead, trail = plain_segment(child.content, f"image line {(token.map or [0])[0] + 1}")
                    alts.append((len(segments), child, lead, trail))
                    segments.append(segment)
                builder.void([child], separates=child.type == "hardbreak" or (child.type == "html_inline" and
                                                                              child.content.lower().startswith("<br")))
            i += 1
        if n and tokens[n - 1].type == "paragraph_open" and token.map and id(token) not in leads \
                and any(c.type == "softbreak" for c in children):  # a task's box or an alert's marker: not wrapped
            width = wrap_width(lines[token.map[0] : token.map[1]])  # the source wrapped it: so is its translation
            if width:
                token.meta["qkv.wrap"] = width
        segment = builder.build(f"line {(token.map or [0])[0] + 1}")
        if segment.text.strip():
            inlines.append((len(segments), token))
            segments.append(segment)

    def write(placed: list[list], reports=None) -> str:
        from markdown_it.token import Token

        for index, child, lead, trail in alts:
            alt = lead + _plain(placed[index]) + trail
            child.children = [Token("text", "", 0, content=alt)]
            child.content = alt
        for index, token in inlines:
            token.children = _tokens(placed[index], Token)
            if id(token) in leads:
                token.children[:0] = leads[id(token)]
            texts = [t for t in token.children if t.type == "text"]
            for t in texts:
                t.content = t.content.replace("  ", " ")
            if token.children and token.children[0].type == "text":  # a block's text starts and ends with a word
                token.children[0].content = token.children[0].content.lstrip(" ")
            if token.children and token.children[-1].type == "text":
                token.children[-1].content = token.children[-1].content.rstrip(" ")
        body = md.renderer.render(tokens, md.options, env)
        if front is None:
            return body
        return front_text + ("\n" + body if body.strip() else "")

    return Document(segments, write, "markdown")


def _html_pairs(children: list) -> dict[int, tuple[int, str]]:
    """The inline HTML start tags of one block's tokens that have their end tag, nested with the Markdown
    spans around them (``<b>*x*</b>``, not ``<b>*x</b>*``): start index -> (end index, element name)."""
    pairs, stack = {}, []  # stack: ("md", None, i) for a Markdown span's open token, ("html", name, i) for a start tag
    for i, child in enumerate(children):
        if child.type == "html_inline":
            if (start := _START_TAG.match(child.content)) and not child.content.endswith("/>") \
                    and start.group(1).lower() not in _EMPTY_ELEMENTS:
                stack.append(("html", start.group(1).lower(), i))
            elif (end := _END_TAG.match(child.content)) and stack and stack[-1][:2] == ("html", end.group(1).lower()):
                _, name, start = stack.pop()
                pairs[start] = (i, name)
        elif child.type.endswith("_open") and child.type != "gfm_autolink_open" and child.markup != "autolink":
            stack.append(("md", None, i))
        elif child.type.endswith("_close") and child.type != "gfm_autolink_close" and child.markup != "autolink":
            while stack and stack[-1][0] == "html":  # start tags left open inside the span: voids
                stack.pop()
            if stack:
                stack.pop()
    return pairs


def _plain(nodes: list) -> str:
    from qkv.document.segments import flatten

    return flatten(nodes, void=lambda tag: tag if isinstance(tag, str) else "".join(t.content for t in tag))


def _tokens(nodes: list, Token) -> list:
    out = []
    for node in nodes:
        if isinstance(node, str):
            out.append(Token("text", "", 0, content=node))
        elif isinstance(node, Void) and isinstance(node.tag, str):  # a placeholder: text again
            out.append(Token("text", "", 0, content=node.tag))
        elif isinstance(node, Void):
            out.extend(node.tag)
        elif isinstance(node, Element):
            opening, closing = node.tag
            if not node.children and opening.type not in ("link_open", "html_inline"):  # an empty emphasis cannot be written: nothing
                continue
            out.append(opening)
            out.extend(_tokens(node.children, Token))
            if closing is not None:
                out.append(closing)
    return out
