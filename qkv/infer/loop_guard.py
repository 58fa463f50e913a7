"""What counts as a loop, for the loop guard (``DecodeConfig.loop_guard``): the outputs it searches again.

A guard must never change a translation that is not a loop, so the rule is narrow. An output loops when

- a run of one to four tokens stands ``LOOP_REPEATS`` (3) times back to back ("▁A ▁A ▁A",
  "▁der ▁Fahrer ▁der ▁Fahrer ▁der ▁Fahrer"), unless that run writes a number: its pieces are digits
  and number marks (``. , : / -``), at least one of them a digit. A tokenizer that writes one digit
  a piece writes ``2000`` as ``2 0 0 0`` and ``1999`` as ``1 9 9 9``: a number is never a loop by
  itself. A word written twice ("das das") is two copies, not three, and stays as the model wrote it.
  Nor is a run the source repeats as often (a sign's "OOO", a shouted "Stop!!!"): the output copies it.
- or it reached the length limit without an EOS (a loop that runs out of room; digits included).

Which pieces write numbers is read from the tokenizer's vocabulary (``number_pieces``); without it
(``numbers=None``) no run is taken for a number.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from qkv.data.text_tokenizer import TextTokenizer

LOOP_REPEATS = 3  # back-to-back copies of a run of one to four tokens that make an output a loop
NUMBER_MARKS = frozenset(".,:/-")  # what stands between a number's digits (dates, times, thousands)
WORD_START = "\u2581"  # SentencePiece's mark of a piece that starts a word


@dataclass(frozen=True)
class NumberPieces:
    """A vocabulary's pieces that write numbers: ``digits`` hold a decimal digit and nothing but digits
    and ``NUMBER_MARKS`` (``2``, ``▁19``, ``1.5``); ``marks`` are number marks alone (``.``, ``▁-``)."""

    digits: frozenset[int] = frozenset()
    marks: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: TextTokenizer) -> NumberPieces:
        digits, marks = set(), set()
        for i, piece in enumerate(tokenizer.pieces(range(tokenizer.vocab_size))):
            text = piece.replace(WORD_START, "")
            if text and all(c.isdecimal() or c in NUMBER_MARKS for c in text):
                (digits if any(c.isdecimal() for c in text) else marks).add(i)
        return cls(frozenset(digits), frozenset(marks))

    def write_a_number(self, run: list[int]) -> bool:
        """Whether the tokens of ``run`` are all digits or marks, with a digit among them."""
        return any(t in self.digits for t in run) and all(t in self.digits or t in self.marks for t in run)


_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def number_pieces(tokenizer: TextTokenizer) -> NumberPieces:
    """``NumberPieces.of(tokenizer)``, read once per tokenizer (the server makes a Translator per batch)."""
    try:
        return _KNOWN[tokenizer]
    except KeyError:
        found = _KNOWN[tokenizer] = NumberPieces.of(tokenizer)
        return found


def repeated_runs(tokens: list[int], max_n: int = 4) -> Iterator[tuple[int, ...]]:
    """Each run of one to ``max_n`` tokens that stands ``LOOP_REPEATS`` times back to back in ``tokens``,
    as found (a run found at several places, each time)."""
    for n in range(1, max_n + 1):
        for start in range(len(tokens) - LOOP_REPEATS * n + 1):
            gram = tokens[start : start + n]
            if all(tokens[start + r * n : start + (r + 1) * n] == gram for r in range(1, LOOP_REPEATS)):
                yield tuple(gram)


def loops(tokens: list[int], limit: int, max_n: int = 4, *, numbers: NumberPieces | None = None,
          source: list[int] | None = None) -> bool:
    """Whether an output loops (the module docstring): a run of one to ``max_n`` tokens ``LOOP_REPEATS``
    times back to back that does not write a number (``numbers``: the vocabulary's number pieces) and
    that the ``source`` ids do not repeat as well (a sign reading "OOO", a shouted "Stop!!!": a copy, not a loop;
    with a vocabulary shared by both sides the same ids), or ``limit`` tokens or more (the search's
    length limit, reached without an EOS)."""
    if len(tokens) >= limit:
        return True
    copied = None  # the source's runs, read only once the output has one
    for gram in repeated_runs(tokens, max_n):  # the first that counts ends the search
        if numbers is not None and numbers.write_a_number(list(gram)):
            continue
        if copied is None:
            copied = set(repeated_runs(source, max_n)) if source else set()
        if gram not in copied:
            return True
    return False
