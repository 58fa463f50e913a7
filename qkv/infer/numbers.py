"""Numbers as glossary terms: every number a source sentence writes in digits must stand in its translation.

What counts as a number (``numbers_in``; the same rule reads the source and the translation):

- a run of ASCII digits 0-9, and runs of them joined by one of ``. , : / -`` between two digits:
  ``42``, ``3.5``, ``1,000``, ``1,000.5``, ``10:30``, ``3/4/2024``, ``2024-03-04``, ``1990-2000``;
- it stands apart from other digits: a number next to any other digit (Arabic-Indic ``٣``, fullwidth
  ``３``) is not one, and other scripts' digits are not numbers (a translation may rightly write them
  otherwise, and a model's vocabulary seldom has them);
- letters and signs around it are not part of it: ``$5`` and ``5€`` ask for ``5`` (the currency may be
  written as a word), ``-5`` for ``5``, ``A320`` for ``320``, ``5th`` for ``5``, ``50%`` for ``50``;
  a separator with no digit after it ends the number (``5.`` is ``5``);
- a number of more than ``MAX_NUMBER_CHARS`` characters is left out (an identifier, not a quantity:
  make it a glossary term), and a sentence asks for its first ``MAX_NUMBERS`` numbers only.

A number is found in a translation where a number read by the same rule equals it, or equals it in
the other decimal convention: a number with one separator (``1.5``, ``1,000``) or thousands groups with
an optional decimal part (``1,000,000``, ``1,000.5``) is also accepted with ``.`` and ``,`` swapped
(``1,5``, ``1.000``, ``1.000.000``, ``1.000,5``: English to German and back). The form asked for, which
the constrained search writes, is the number as the source writes it. "15" does not answer "5", and
"5.5" does not answer "5".

``Numbers`` has the glossary's ``matches`` and ``found``, so ``translate_with_glossary`` checks
numbers, searches again for the missing ones and reports them as it does glossary terms; it may wrap a
glossary, whose terms win where a term and a number overlap ("Route 66").
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

from qkv.infer.glossary import Glossary, Term, TermMatch

MAX_NUMBER_CHARS = 40  # a longer run of digits is an identifier, not a quantity
MAX_NUMBERS = 16  # numbers a sentence asks for: the constrained search takes one more beam than it has terms

# Linear: the separators are not digits, so each character is read once by the repetition; a start
# inside a number fails at once on the look-behinds; a run that ends next to another script's digit
# gives back one piece at a time and fails.
_NUMBER = re.compile(r"(?<!\d)(?<![0-9][.,:/-])[0-9]+(?:[.,:/-][0-9]+)*(?!\d)(?![.,:/-][0-9])")
_ONE_SEPARATOR = re.compile(r"[0-9]+[.,][0-9]+")
_GROUPED = re.compile(r"[0-9]{1,3}([.,])[0-9]{3}(?:\1[0-9]{3})*(?:(?!\1)[.,][0-9]+)?")
_SWAP = str.maketrans(".,", ",.")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class NumberTerm(Term):
    """A number of a source sentence as a glossary term: ``source`` the number, ``forms`` the number
    and, where it has one, its form in the other decimal convention (module docstring)."""


def numbers_in(text: str) -> list[tuple[str, int, int]]:
    """Each number of ``text`` (module docstring): (number, start, end), left to right."""
    return list(_numbers(text))


def _numbers(text: str) -> Iterator[tuple[str, int, int]]:
    return ((m.group(), m.start(), m.end()) for m in _NUMBER.finditer(text) if m.end() - m.start() <= MAX_NUMBER_CHARS)


def number_forms(number: str) -> tuple[str, ...]:
    """``number`` and, for one separator or thousands groups, the same with "." and "," swapped."""
    if _ONE_SEPARATOR.fullmatch(number) or _GROUPED.fullmatch(number):
        return (number, number.translate(_SWAP))
    return (number,)


class Numbers:
    """The numbers of each sentence as terms, with an optional ``glossary``'s terms: what
    ``translate_with_glossary`` takes as its glossary (``numbers=True`` builds one)."""

    def __init__(self, glossary: Glossary | None = None) -> None:
        self.glossary = glossary
        self._seen: tuple[str, dict[str, list[tuple[int, int]]]] | None = None  # the last translation's numbers

    @property
    def terms(self) -> list[Term]:
        """The glossary's terms (the numbers' depend on each sentence)."""
        return self.glossary.terms if self.glossary is not None else []

    def __len__(self) -> int:
        return len(self.terms)

    def matches(self, sentence: str) -> list[TermMatch]:
        """The glossary's matches, then the sentence's first ``MAX_NUMBERS`` numbers that none overlaps."""
        found = self.glossary.matches(sentence) if self.glossary is not None else []
        taken = sorted((m.start, m.end) for m in found)
        starts = [s for s, _ in taken]
        words = [m.start() for m in _WORD.finditer(sentence)]  # a number holds no space: it lies in one word
        numbers = []
        for number, start, end in _numbers(sentence):
            if len(numbers) == MAX_NUMBERS:
                break
            i = bisect_right(starts, start)  # the glossary's matches never overlap: check the neighbours
            if (i and taken[i - 1][1] > start) or (i < len(taken) and taken[i][0] < end):
                continue
            numbers.append(TermMatch(NumberTerm(number, number_forms(number)), start, end, (bisect_right(words, start) - 1,)))
        return sorted(found + numbers, key=lambda m: m.start)

    def found(self, term: Term, translation: str) -> list[tuple[str, int, int]]:
        """Each place ``term`` stands in ``translation``: (form, start, end), left to right."""
        if not isinstance(term, NumberTerm):
            return self.glossary.found(term, translation) if self.glossary is not None else []
        if self._seen is None or self._seen[0] != translation:
            index: dict[str, list[tuple[int, int]]] = {}
            for number, start, end in numbers_in(translation):
                index.setdefault(number, []).append((start, end))
            self._seen = (translation, index)
        index = self._seen[1]
        return sorted(((form, s, e) for form in term.forms for s, e in index.get(form, [])), key=lambda h: h[1])
