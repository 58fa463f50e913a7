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

A number is found in a translation (``Numbers.found``, the check ``translate_with_glossary`` runs before and
after its constrained search) where a number of the translation, read by the same rule,

- equals it, or equals it in the other decimal convention: a number with one separator (``1.5``,
  ``1,000``) or thousands groups with an optional decimal part (``1,000,000``, ``1,000.5``) is also
  accepted with ``.`` and ``,`` swapped (``1,5``, ``1.000``, ``1.000.000``, ``1.000,5``: English to
  German and back);
- has the same digit runs in the same order, whatever separates them (``10:30`` in ``10.30 Uhr``);
- or is a date or a time (a number with a separator that is neither a decimal nor thousands groups:
  ``2017-05-09``, ``10:30``, ``9.5.2017``) each of whose runs answers at most one of the source
  number's runs, where a run answers an equal run, zero-padding aside (``9`` and ``09``), and a
  two-digit run also a four-digit year that ends with it (``17`` in ``2017``). So ``9 mai 2017``'s
  ``9`` and ``2017`` are both found in ``2017-05-09``, each at its own run, and ``09/05/17`` is found
  there as a whole.

A number standing alone is also found zero-padded (``9`` in ``09``). The form asked for, which the
constrained search writes, is the number as the source writes it. "15" does not answer "5", and the
decimal "5.5" does not answer "5".

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
_RUN = re.compile(r"[0-9]+")


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
        """Each place ``term`` stands in ``translation``: (form, start, end), left to right. A number's
        place is the translation's number that answers it (module docstring), or, for a number of one
        run found in a date or a time, that run alone (so the day and the year of ``9 mai 2017`` are two
        places of ``2017-05-09``)."""
        if not isinstance(term, NumberTerm):
            return self.glossary.found(term, translation) if self.glossary is not None else []
        if self._seen is None or self._seen[0] != translation:
            self._seen = (translation, _NumberIndex(translation))
        return self._seen[1].places(term)


def _run_keys(run: str) -> tuple[str, ...]:
    """What a digit run of a date or a time answers: its value (zero-padding aside) and, for a year of
    four digits from 1900 to 2099, its last two digits as a two-digit year."""
    keys = (run.lstrip("0") or "0",)
    return keys + (f"yy{run[2:]}",) if len(run) == 4 and run[:2] in ("19", "20") else keys


def _asks(run: str) -> tuple[str, ...]:
    """The keys (``_run_keys``) that answer a source run: its value, and a two-digit run as a year."""
    keys = (run.lstrip("0") or "0",)
    return keys + (f"yy{run}",) if len(run) == 2 else keys


class _NumberIndex:
    """A translation's numbers, read once, for ``Numbers.found``. Hostile text may hold 100,000 numbers:
    the index keeps one entry a number where it can (an index, not a list of one), so that building it
    allocates little and the garbage collector's passes stay few."""

    def __init__(self, translation: str) -> None:
        self.numbers = numbers_in(translation)  # (number, start, end)
        self.runs: dict[int, list[tuple[str, int, int]]] = {}  # a number of several runs -> its runs as (run, start, end)
        self.by_form: dict[str, _Indices] = {}  # a number as written -> its indices
        self.by_runs: dict[tuple[str, ...], _Indices] = {}  # the digit runs of a number of several -> its indices
        self.alone: dict[str, _Indices] = {}  # the value of a number of one run, zero-padding aside -> its indices
        self.by_key: dict[str, list[tuple[int, int]]] = {}  # a run's key -> (number index, run index) of dates and times
        for n, (number, start, end) in enumerate(self.numbers):
            _add(self.by_form, number, n)
            if number.isdigit():  # one run (numbers_in reads ASCII digits only)
                _add(self.alone, _run_keys(number)[0], n)
                continue
            runs = self.runs[n] = [(r.group(), start + r.start(), start + r.end()) for r in _RUN.finditer(number)]
            _add(self.by_runs, tuple(r for r, _, _ in runs), n)
            if len(number_forms(number)) == 1:  # a date or a time, not a decimal or thousands
                for i, (run, _, _) in enumerate(runs):
                    for key in _run_keys(run):
                        self.by_key.setdefault(key, []).append((n, i))

    def places(self, term: NumberTerm) -> list[tuple[str, int, int]]:
        number = term.forms[0]
        runs = _RUN.findall(number)
        whole = {n for form in term.forms for n in _get(self.by_form, form)}
        if len(runs) > 1:
            whole |= set(_get(self.by_runs, tuple(runs)))
        hits = {self.numbers[n] for n in whole}
        if len(runs) == 1:  # a number standing alone zero-padded, or one run of a date or a time
            hits |= {self.numbers[n] for n in _get(self.alone, _asks(number)[0])}
            hits |= {self.runs[n][i] for key in _asks(number) for n, i in self.by_key.get(key, [])}
        elif len(number_forms(number)) == 1:  # a date or a time: all its runs in one date or time, in any order
            for n in {n for key in _asks(runs[0]) for n, _ in self.by_key.get(key, [])}:
                if _holds(runs, [r for r, _, _ in self.runs[n]]):
                    hits.add(self.numbers[n])
        return sorted(hits, key=lambda h: (h[1], -h[2]))


_Indices = int | list[int]  # one number's index, or the indices of several


def _add(index: dict, key: object, n: int) -> None:
    held = index.get(key)
    if held is None:
        index[key] = n
    elif isinstance(held, list):
        held.append(n)
    else:
        index[key] = [held, n]


def _get(index: dict, key: object) -> list[int] | tuple[int, ...]:
    held = index.get(key, ())
    return (held,) if isinstance(held, int) else held


def _holds(runs: list[str], others: list[str]) -> bool:
    """Whether each of ``runs`` answers a different one of ``others`` (``_asks`` against ``_run_keys``)."""
    left = [set(_run_keys(r)) for r in others]
    for run in sorted(runs, key=len, reverse=True):  # a four-digit year before the runs it might take
        i = next((i for i, keys in enumerate(left) if keys & set(_asks(run))), None)
        if i is None:
            return False
        left[i] = set()
    return True
