"""gettext catalogues in and out (.po, .pot), through polib.

Each untranslated entry's ``msgid`` (and ``msgid_plural``) is a segment; its ``msgstr`` is filled, the
``msgid`` and every entry that already has a translation are left as they are, and so are the header,
comments, references, contexts and obsolete entries. Plural entries get as many ``msgstr[n]`` as the
header's ``Plural-Forms`` says (``nplurals``): the first the translation of ``msgid``, the others of
``msgid_plural``. Placeholders (``%s``, ``%(name)s``, ``{name}``, ``{0}``, URLs; ``qkv.document.segments``)
are kept out of the text the model reads and come back verbatim, in their source order, so that
``msgfmt --check`` accepts the catalogue. An entry's leading and trailing whitespace (a final ``\\n``)
is kept. With ``--confidence``, an entry whose translation is flagged is marked ``fuzzy``.
"""

from __future__ import annotations

import re

from qkv.errors import QkvError
from qkv.document.segments import Document, flatten, plain_segment

_NPLURALS = re.compile(r"nplurals\s*=\s*(\d+)")


def _nplurals(po) -> int | None:
    found = _NPLURALS.search(po.metadata.get("Plural-Forms", ""))
    return int(found.group(1)) if found else None


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
    segments, slots = [], []  # slot: (entry, plural index or None, lead, trail)

    def add(entry, plural, text: str, where: str) -> None:
        segment, lead, trail = plain_segment(text, where)
        slots.append((entry, plural, lead, trail))
        segments.append(segment)

    plural_count = None
    for entry in po:
        if entry.obsolete or not entry.msgid or entry.translated() or "fuzzy" in entry.flags:
            continue
        where = f"msgid line {entry.linenum}"
        if entry.msgid_plural:
            if plural_count is None:
                plural_count = _nplurals(po)
                if plural_count is None or plural_count < 1:
                    raise QkvError("the catalogue's header has no Plural-Forms with nplurals: set it for the target "
                                   "language (e.g. 'nplurals=2; plural=(n != 1);') to fill its plural entries")
            for n in range(plural_count):
                add(entry, n, entry.msgid if n == 0 else entry.msgid_plural, where)
        else:
            add(entry, None, entry.msgid, where)
    if target_lang and not po.metadata.get("Language"):
        po.metadata["Language"] = target_lang

    def write(placed: list[list], reports=None) -> str:
        for k, ((entry, plural, lead, trail), nodes) in enumerate(zip(slots, placed)):
            translation = lead + flatten(nodes, void=lambda tag: tag) + trail
            if plural is None:
                entry.msgstr = translation
            else:
                entry.msgstr_plural[plural] = translation
            if reports is not None and reports[k].flags:
                if "fuzzy" not in entry.flags:
                    entry.flags.append("fuzzy")
        written = str(po)
        if written.startswith("#\n") and not text.startswith("#"):  # polib's empty header comment, not the user's
            written = written[2:]
        return written

    return Document(segments, write, "po")
