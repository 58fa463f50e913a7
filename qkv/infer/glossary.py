"""Glossaries: source terms and the target forms a translation must use for them.

A glossary file is UTF-8 text, one entry a line, its columns separated by tabs:

    source term <TAB> target term [<TAB> another accepted target form ...]

The first target form is the one asked for (a constrained search writes it); the further forms are
also accepted (a German noun's plural or genitive: "dog<TAB>Hund<TAB>Hunde<TAB>Hundes"). Blank lines
and lines starting with "#" are skipped. Each column is stripped of surrounding spaces.

Matching on a source sentence (``Glossary.matches``):

- a term matches whole words only: "cat" is not found in "category", and a term's inner spaces match
  any run of spaces;
- a term written all in lower case matches any case ("apple" finds "Apple" at a sentence's start); a
  term with a capital letter matches only as written ("Apple" does not find "apple");
- where terms overlap, the longest wins, then the leftmost ("New York City" before "New York");
- a term found twice is asked for twice: the translation must hold its form twice; and two terms
  with the same form ("man" and "guy", both "Mann") need it twice: a place in the translation
  answers one term (``answers``).

Matching on a translation (``found``): a target form is found where it stands as whole words, exactly
as written, except that a form that starts in lower case is also found with a capital first letter
(German capitalises the first word of a sentence).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from qkv.errors import QkvError

MAX_TERM_CHARS = 200  # a longer term is refused: no glossary term is a paragraph


@dataclass(frozen=True)
class Term:
    """One glossary entry: ``source`` and its target ``forms`` (the first is the one asked for);
    ``line`` is where it stands in its file (1-based; 0 for entries not read from a file)."""

    source: str
    forms: tuple[str, ...]
    line: int = 0


@dataclass(frozen=True)
class TermMatch:
    """One place a term was found in a source sentence: characters ``start``..``end`` and the
    ``words`` (0-based indices of the sentence's whitespace-separated words) they cover."""

    term: Term
    start: int
    end: int
    words: tuple[int, ...]


def _pattern(text: str, ignore_case: bool) -> re.Pattern:
    """``text`` as whole words, inner spaces matching any run of spaces."""
    body = r"\s+".join(re.escape(w) for w in text.split())
    return re.compile(rf"(?<!\w){body}(?!\w)", re.IGNORECASE if ignore_case else 0)


def word_indices(text: str, start: int, end: int) -> tuple[int, ...]:
    """The 0-based indices of the whitespace-separated words of ``text`` that characters
    ``start``..``end`` touch."""
    out = []
    for i, m in enumerate(re.finditer(r"\S+", text)):
        if m.start() < end and m.end() > start:
            out.append(i)
    return tuple(out)


class Glossary:
    """Terms to enforce, in the order given. Build one with ``Glossary.read`` (a file),
    ``Glossary.parse`` (lines) or ``Glossary(terms)``."""

    def __init__(self, terms: Iterable[Term], name: str = "glossary", unit: str = "line") -> None:
        self.terms = list(terms)
        seen: dict[str, Term] = {}
        for term in self.terms:
            if not term.source.strip() or not term.forms or not all(f.strip() for f in term.forms):
                raise QkvError(f"{name} entry {term.source!r}: a term needs a source and at least one target form, none empty")
            key = " ".join(term.source.split()).casefold()
            if key in seen:
                where = f"{unit} {seen[key].line}" if seen[key].line else "an earlier entry"
                raise QkvError(f"{name} {unit} {term.line}: {term.source!r} is already listed on {where}"
                               if term.line else f"{name}: {term.source!r} is listed twice")
            seen[key] = term
        # The patterns are compiled when first matched, not here: a request's glossary of 1,000 long
        # entries took seconds to compile, which the server does in its model thread and charges
        # (qkv.serve.work.GLOSSARY_CHARS_PER_UNIT), never while it validates the request.
        self._patterns: list[tuple[Term, re.Pattern]] | None = None
        self._forms: dict[Term, list[tuple[str, re.Pattern, re.Pattern]]] = {}

    def __len__(self) -> int:
        return len(self.terms)

    @classmethod
    def read(cls, path: str | Path) -> Glossary:
        """The glossary file at ``path``; a malformed line is a one-line ``QkvError`` naming it."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise QkvError(f"cannot read the glossary {path}: {error.strerror or error}") from None
        return cls.parse(data.split(b"\n"), name=str(path))

    @classmethod
    def parse(cls, lines: Iterable[str | bytes], name: str = "glossary") -> Glossary:
        """Entries from ``lines`` (the file format of the module docstring)."""
        terms = []
        for number, raw in enumerate(lines, 1):
            if isinstance(raw, bytes):
                try:
                    raw = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise QkvError(f"{name} line {number} is not valid UTF-8 (byte {error.start + 1})") from None
            line = raw.removesuffix("\r").removeprefix("\ufeff" if number == 1 else "")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            columns = [c.strip() for c in line.split("\t")]
            if len(columns) < 2:
                raise QkvError(f"{name} line {number}: needs a source term and a target term separated by a tab")
            for i, column in enumerate(columns, 1):
                if not column:
                    raise QkvError(f"{name} line {number}: column {i} is empty")
                if len(column) > MAX_TERM_CHARS:
                    raise QkvError(f"{name} line {number}: column {i} has {len(column)} characters (at most {MAX_TERM_CHARS})")
            terms.append(Term(columns[0], tuple(dict.fromkeys(columns[1:])), number))
        return cls(terms, name)

    @classmethod
    def from_pairs(cls, entries: Iterable[Iterable[str]]) -> Glossary:
        """Entries given as lists [source, target, further forms...] (the server's request field)."""
        terms = []
        for number, entry in enumerate(entries, 1):
            columns = [str(c).strip() for c in entry]
            if len(columns) < 2 or not all(columns):
                raise QkvError(f"glossary entry {number}: needs a source term and at least one target form, none empty")
            if any(len(c) > MAX_TERM_CHARS for c in columns):
                raise QkvError(f"glossary entry {number}: a term has more than {MAX_TERM_CHARS} characters")
            terms.append(Term(columns[0], tuple(dict.fromkeys(columns[1:])), number))
        return cls(terms, "glossary", "entry")

    def matches(self, sentence: str) -> list[TermMatch]:
        """Where the glossary's terms occur in ``sentence``, left to right, never overlapping."""
        if self._patterns is None:  # longest first: where terms overlap the longest wins (then the leftmost)
            self._patterns = sorted(((term, _pattern(term.source, term.source == term.source.lower())) for term in self.terms),
                                    key=lambda tp: -len(tp[0].source))
        taken: list[tuple[int, int]] = []
        found = []
        for term, pattern in self._patterns:
            for m in pattern.finditer(sentence):
                if any(m.start() < e and m.end() > s for s, e in taken):
                    continue
                taken.append((m.start(), m.end()))
                found.append(TermMatch(term, m.start(), m.end(), word_indices(sentence, m.start(), m.end())))
        return sorted(found, key=lambda t: t.start)

    def found(self, term: Term, translation: str) -> list[tuple[str, int, int]]:
        """Each place one of ``term``'s forms stands in ``translation``: (form, start, end), left to
        right, longest form first where two overlap."""
        if term not in self._forms:  # each form as written and, where it starts in lower case, with a capital first letter; longest first
            self._forms[term] = [(f, _pattern(f, False), _pattern(f[:1].upper() + f[1:], False))
                                 for f in sorted(term.forms, key=len, reverse=True)]
        hits = []
        for form, *patterns in self._forms[term]:
            for pattern in patterns:
                for m in pattern.finditer(translation):
                    if not any(m.start() < e and m.end() > s for _, s, e in hits):
                        hits.append((form, m.start(), m.end()))
        return sorted(hits, key=lambda h: h[1])


def answers(glossary: Glossary, matches: list[TermMatch], translation: str) -> list[tuple[str, int, int] | None]:
    """For each match, the place in ``translation`` that answers it: (form, start, end), or None. One
    place answers one match: a term found twice in the source needs two of its forms, and two terms
    with the same form ("man" and "guy", both "Mann") need it twice. As many matches are answered as
    can be (a maximum matching, found by augmenting paths); where that leaves a choice, the k-th match
    in the source takes the k-th place left in the translation."""
    hits = {m.term: glossary.found(m.term, translation) for m in matches}
    owner: dict[tuple[str, int, int], int] = {}  # a place -> the match it answers

    def claim(i: int, seen: set) -> bool:
        # a place overlapping another that answers a match is taken (forms of different lengths)
        places = [h for h in hits[matches[i].term]
                  if h not in seen and not any(o != h and o[1] < h[2] and o[2] > h[1] for o in owner)]
        for hit in places:  # a free place first, leftmost: the k-th match takes the k-th place left
            if hit not in owner:
                owner[hit] = i
                return True
        for hit in places:  # else move the match that holds one to another place, if it has one
            if hit not in seen:
                seen.add(hit)
                if claim(owner[hit], seen):
                    owner[hit] = i
                    return True
        return False

    for i in range(len(matches)):
        claim(i, set())
    out: list[tuple[str, int, int] | None] = [None] * len(matches)
    for hit, i in owner.items():
        out[i] = hit
    return out


def missing(glossary: Glossary, matches: list[TermMatch], translation: str) -> list[TermMatch]:
    """The matches no place of ``translation`` answers (``answers``): a term found twice in the source
    needs two of its forms in the translation, and two terms with one form need it twice."""
    return [m for m, hit in zip(matches, answers(glossary, matches, translation)) if hit is None]
