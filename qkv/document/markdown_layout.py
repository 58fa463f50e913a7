"""Markdown written back laid out as its source was, where mdformat's normal form would change how it looks.

mdformat writes one normal form: a paragraph on one line, tables padded to aligned columns, ``-`` for every
bullet, ``1.`` for every item after a list's first, ATX headings (``# Title``) and a thematic break of 70
underscores. A translated README would differ from its source on nearly every line. ``mark_layout`` notes,
on the parsed tokens, what the source did; ``Layout`` (mdformat-gfm's table plugin's renderers, with more)
renders each block that way:

- a paragraph the source wrapped with soft line breaks is wrapped at the width of its source lines
  (``wrap_width``; mdformat's own wrapping, which escapes what would start a list, a heading or a quote at a
  line's start); one it wrote on one line stays on one;
- a table whose source rows are not padded to one width is written unpadded under its own delimiter row;
- a bullet list keeps its marker (``*``, ``+`` or ``-``), an ordered list its delimiter (``.`` or ``)``), and
  one the source numbered consecutively is numbered so (``3. 4. 5.``, without mdformat's zero padding);
- a Setext heading (``Title`` over ``=====``) stays one, and a thematic break is written as the source wrote it.

Each is a choice of its block alone: mdformat's options hold one for the whole document.
"""

from __future__ import annotations

import re

_CONTAINER = re.compile(r"^[ \t>]*")  # a block quote's markers and a list item's indent before a block's line
_ZERO_PADDED = re.compile(r"^0+(?=\d)")  # mdformat's consecutive numbering pads "01." in a list of ten or more
_BREAK = re.compile(r"([-*_])(?:[ \t]*\1){2,}[ \t]*$")  # a thematic break at a line's end (after a list item's marker)
_SETEXT = None  # a CommonMark parser that checks a Setext heading reads back as one (``_setext``)


def wrap_width(lines: list[str]) -> int | None:
    """The width to wrap a paragraph's translation at, from the source lines it broke with a soft line break
    (a hard break, two spaces or a backslash at a line's end, and the paragraph's last line break nothing):
    the longest, leaving out one the source let run long (over 1.2 times their median). None if none, or
    if its last line runs longer than that: the source broke a line where it meant to ("Usage:"), not
    where a width made it."""
    widths = sorted(len(line.rstrip()) for line in lines[:-1] if not line.endswith(("  ", "\\")))
    if not widths:
        return None
    median = widths[len(widths) // 2]
    width = max(w for w in widths if w <= 1.2 * median)
    return None if len(lines[-1].rstrip()) > 1.2 * width else width


def mark_layout(tokens: list, lines: list[str]) -> None:
    """Note on the tokens of ``lines`` (the source, parsed) what mdformat would write otherwise: a table's
    delimiter row where its rows are not padded to one width (``qkv.compact``), an ordered list numbered
    consecutively (``qkv.consecutive``), a thematic break's own line (``qkv.line``). A paragraph's width is
    noted where its inline content is read (``qkv.wrap``, ``wrap_width``)."""
    for i, token in enumerate(tokens):
        if token.map is None:
            continue
        if token.type == "table_open":  # only the blocks it concerns read their source lines: a list or a quote may hold them all
            source = [line.rstrip() for line in lines[token.map[0] : token.map[1]]]
            if len(source) > 1 and len({len(line) for line in source}) > 1:
                token.meta["qkv.compact"] = _CONTAINER.sub("", source[1])
        elif token.type == "hr" and (found := _BREAK.search(lines[token.map[0]])):
            token.meta["qkv.line"] = found.group().strip()
        elif token.type == "ordered_list_open":
            items = []
            for t in tokens[i + 1 :]:
                if t.type == "ordered_list_close" and t.level == token.level:
                    break
                if t.type == "list_item_open" and t.level == token.level + 1:
                    items.append(int(t.info) if t.info.isdigit() else None)
            if len(items) > 1 and items == list(range(items[0], items[0] + len(items))):
                token.meta["qkv.consecutive"] = True


class Layout:
    """A table plugin's renderers (mdformat-gfm enables one), with the renderers that lay blocks out as
    ``mark_layout`` noted: an mdformat parser extension, in that plugin's place."""

    def __init__(self, plugin) -> None:
        from mdformat.renderer import DEFAULT_RENDERERS

        self.POSTPROCESSORS = getattr(plugin, "POSTPROCESSORS", {})
        table, default = plugin.RENDERERS["table"], DEFAULT_RENDERERS

        def paragraph(node, context) -> str:
            width = node.children[0].meta.get("qkv.wrap") if node.children else None
            return default["paragraph"](node, _with(context, wrap=width) if width else context)

        def bullet_list(node, context) -> str:
            text = default["bullet_list"](node, context)
            return text if _beside_another(node) else _markers(text, node.markup)

        def ordered_list(node, context) -> str:
            if node.meta.get("qkv.consecutive"):
                context = _with(context, number=True)
            text = default["ordered_list"](node, context)
            return _markers(text, None if _beside_another(node) else node.markup, numbered=True)

        def heading(node, context) -> str:
            text = default["heading"](node, context)
            if node.markup not in ("=", "-"):  # an ATX heading
                return text
            return _setext(text, node.markup)

        def hr(node, context) -> str:
            return node.meta.get("qkv.line") or default["hr"](node, context)

        def compact_table(node, context) -> str:
            return _compact_table(node, context) if node.meta.get("qkv.compact") else table(node, context)

        self.RENDERERS = {**plugin.RENDERERS, "paragraph": paragraph, "bullet_list": bullet_list,
                          "ordered_list": ordered_list, "heading": heading, "hr": hr, "table": compact_table}


def _with(context, **options):
    """``context`` with mdformat render ``options`` of its own."""
    return context._replace(options={**context.options, "mdformat": {**context.options.get("mdformat", {}), **options}})


def _beside_another(node) -> bool:
    """Whether a list has a list of its kind right before or after it in the output (the source parted them
    with something mdformat moves away, a link reference definition): mdformat's own markers then alternate
    to keep them apart, and the source's would join them."""
    return any(other is not None and other.type == node.type for other in (node.previous_sibling, node.next_sibling))


def _markers(text: str, markup: str | None, numbered: bool = False) -> str:
    """A rendered list with its items' markers as the source wrote them: ``markup`` (a bullet, or an ordered
    list's delimiter; None: mdformat's), numbers without zero padding. An item's first line is the only one
    that does not start with its list's indent."""
    lines = text.split("\n")
    for n, line in enumerate(lines):
        if not line or line[0] == " ":
            continue
        if numbered:
            line = _ZERO_PADDED.sub("", line, count=1)
            digits = len(line) - len(line.lstrip("0123456789"))
            lines[n] = line if markup is None else line[:digits] + markup + line[digits + 1 :]
        elif markup is not None:
            lines[n] = markup + line[1:]
    return "\n".join(lines)


def _setext(atx: str, markup: str) -> str:
    """A heading mdformat wrote as ``atx`` ("# Title"), written as its source's Setext heading (the text over
    a line of ``markup``) where that reads back as the same heading; else as mdformat wrote it. The text was
    escaped for an ATX heading, where "- foo", "> foo" or "1. foo" is safe and at a line's start is not."""
    global _SETEXT
    from markdown_it import MarkdownIt

    text = atx.split(" ", 1)[1] if " " in atx else ""
    setext = text + "\n" + markup * max(3, len(text))
    if _SETEXT is None:
        _SETEXT = MarkdownIt("commonmark")
    tokens = _SETEXT.parse(setext)
    level = "h1" if markup == "=" else "h2"
    same = (text.strip() and len(tokens) == 3 and tokens[0].type == "heading_open" and tokens[0].tag == level
            and tokens[1].content == _SETEXT.parse(atx)[1].content)
    return setext if same else atx


def _compact_table(node, context) -> str:
    """A table's rows as ``| a | b |``, unpadded, under the source's own delimiter row (its cells rendered
    by the table plugin, which escapes a ``|`` in them)."""
    rows: list[list[str]] = []
    for descendant in node.walk(include_self=False):
        if descendant.type == "tr":
            rows.append([])
        elif descendant.type in ("th", "td"):
            rows[-1].append(descendant.render(context))
    lines = ["|" + "|".join(f" {cell} " if cell else " " for cell in row) + "|" for row in rows]
    return "\n".join([lines[0], node.meta["qkv.compact"], *lines[1:]])
