"""Text as people write it: a line of several sentences, and sentences in capitals.

A model trained on one caption a line (Multi30k) has never seen a paragraph or an all-caps sentence,
and loops on both (issue 66; docs/robustness.md). ``split_sentences`` cuts a line where its sentences
end, with sentencex (Wikimedia's rule-based segmenter: per-language abbreviation lists for some 300
languages with fallbacks between them, pure rules, no model to download, released 2026; pysbd and
sentence-splitter, the usual alternatives, have had no release since 2021 and 2019). ``case_of`` /
``lowercased`` / ``recased`` turn an ALL-CAPS or Title Case sentence into the case the model knows,
and the translation of one in capitals back into capitals.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import sentencex

# A piece with no letter (a list's "1." or a stray "--") is not a sentence: it stays with the next one.
_LETTER = re.compile(r"[^\W\d_]")
_SPACE = re.compile(r"\s")  # a word is a run of non-spaces with a letter in it (counted run by run: a regex
# for it, \S*[^\W\d_]\S*, reads a run without a letter once from each of its characters)
# sentencex ends a sentence after a number that follows a comma or semicolon: a list's ("a dog runs; 2.
# A cat sleeps") belongs to the next item; a date's ("Montag, 12. Mai 1952") is not a sentence end at all.
# At most 32 spaces between the comma and the number, so that the match lies within the last
# _NUMBER_REACH characters before a line's trailing spaces: looked for in those, each piece costs its own length.
_NUMBER = re.compile(r"(?<=[;,:])(\s{0,32}\d{1,3}[.)]\s*)$")
_NUMBER_REACH = 40
# sentencex 1.0.32 panics (a Rust slice inside a character) on a letter, a non-ASCII space and a full stop
# ("Plan B\u00a0."): sentencex is given such a space as an ASCII one (only between a letter and a full
# stop: elsewhere, as before; on 60,000 random lines of letters, spaces and stops, no cut changed).
_WIDE = "\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\x85"
_WIDE_BEFORE_STOP = re.compile(rf"(?<=[^\W\d_])\s*[{_WIDE}]\s*(?=\.)")
_AS_ASCII = {ord(c): " " for c in _WIDE}


# Abbreviations that sentencex's lists lack and that do not end a sentence (a newcomer's review, 2026-12-07:
# "A man and Ms. Smith are walking." was cut after "Ms.", and a glossary term across the cut was lost):
# a title before a capitalized word, and a reference word before a number. English only; other languages
# keep sentencex's cuts alone.
_TITLES = {"en": ("Mr", "Mrs", "Ms", "Mx", "Dr", "Prof", "Rev", "Hon", "Messrs")}  # German's are in sentencex's list
_BEFORE_NUMBERS = {"en": ("approx", "ca", "tel", "no", "nos", "vol", "fig", "p", "pp", "ch", "sec", "art")}
_NO_END = {lang: (re.compile(rf"(?<![^\W_])(?:{'|'.join(_TITLES[lang])})\.\s*$"),
                  re.compile(rf"(?<![^\W_])(?:{'|'.join(_BEFORE_NUMBERS[lang])})\.\s*$", re.IGNORECASE))
           for lang in _TITLES}
_ABBREVIATION_REACH = 16  # characters before a piece's end that hold the abbreviation and its spaces


def _rejoined(pieces: list[str], lang: str) -> list[str]:
    """``pieces`` with those that end in one of ``lang``'s abbreviations above joined to the next: a title
    before a piece that starts with a capital, a reference word before one that starts with a digit."""
    rules = _NO_END.get(lang.split("-")[0].lower())
    if rules is None or len(pieces) < 2:
        return pieces
    title, before_number = rules
    out = [pieces[0]]
    for piece in pieces[1:]:
        end, start = out[-1][-_ABBREVIATION_REACH:], piece.lstrip()[:1]
        if (start.isupper() and title.search(end)) or (start.isdecimal() and before_number.search(end)):
            out[-1] += piece
        else:
            out.append(piece)
    return out


class SplitterWarning(UserWarning):
    """sentencex failed on a line: the line is translated as one sentence."""


def _segment(line: str, lang: str) -> list[str]:
    """sentencex's pieces of ``line`` (they join back into it), or the whole line as one piece, with a
    one-line warning, if sentencex fails on it: a third-party library's failure costs this line its
    split, never the other lines (issue 72)."""
    try:
        pieces = sentencex.segment(lang, _WIDE_BEFORE_STOP.sub(lambda m: m.group().translate(_AS_ASCII), line))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # a Rust panic arrives as pyo3's PanicException, a BaseException
        warnings.warn(f"the sentence splitter failed on a line of {len(line)} characters ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else 'no message'}); it is translated as one sentence",
                      SplitterWarning, stacklevel=3)
        return [line]
    out, at = [], 0
    for piece in pieces:  # the same characters as ``line`` (a space replaced is one character)
        out.append(line[at : at + len(piece)])
        at += len(piece)
    if at != len(line):  # never seen: sentencex's pieces always join back into its input
        warnings.warn("the sentence splitter's pieces do not join back into the line; it is translated as one sentence",
                      SplitterWarning, stacklevel=3)
        return [line]
    return _rejoined(out, lang)


def split_sentences(line: str, lang: str) -> tuple[list[str], list[str]]:
    """The sentences of ``line`` (each stripped, none empty) and the whitespace between them (one fewer),
    by sentencex's rules for ``lang`` (an ISO 639 code; an unknown one falls back to its English rules).
    A line feed ends a sentence, as ``qkv translate`` reads each line apart (the server's texts: "A day
    at the beach\nA family ..." was one sentence, the model's output a blend of both); the whitespace
    around it, the line feed included, is what joins the two. Within a line: a piece without a letter
    goes with the sentence after it (or, last, before it). A piece that ends in a number after a comma
    or semicolon gives the number to the next piece when what stays is at least two words (a list
    item), else is no sentence of its own (a date). A blank line has none. Linear in the line's length:
    each piece is read once, however many wait for a sentence."""
    if "\n" not in line:
        return _split_line(line, lang)
    sentences: list[str] = []
    spaces: list[str] = []
    gap = ""  # the whitespace since the last sentence: its line's end, line feeds, blank lines
    for i, part in enumerate(line.split("\n")):  # (str methods only: a regex over the spaces could backtrack)
        if i and sentences:
            gap += "\n"
        found, between = _split_line(part, lang)
        if not found:  # a blank line
            gap += part if sentences else ""
            continue
        if sentences:
            spaces.append(gap + part[: len(part) - len(part.lstrip())])
        sentences += found
        spaces += between
        gap = part[len(part.rstrip()) :]
    return sentences, spaces


def _split_line(line: str, lang: str) -> tuple[list[str], list[str]]:
    """``split_sentences`` of a line without a line feed."""
    groups: list[str] = []  # each sentence's text with its whitespace
    pending: list[str] = []  # pieces waiting for a sentence (joined only once a sentence takes them)
    letters = False  # whether the pending pieces hold a letter
    words = 0  # the words of the pending pieces (runs of non-spaces with a letter)
    open_word = False  # whether they end inside a run of non-spaces that holds a letter
    ends_in_run = False  # whether they end in a non-space
    tail = ""  # their last _NUMBER_REACH characters
    for piece in _segment(line, lang):
        runs = _SPACE.split(piece)  # its runs of non-spaces, the first and last empty where it starts or ends in a space
        crossing = ends_in_run and runs[0] != "" and open_word and bool(_LETTER.search(runs[0]))
        words += sum(bool(_LETTER.search(r)) for r in runs) - crossing  # a run that crosses into this piece is one word, not two
        letters = letters or bool(_LETTER.search(piece))
        open_word = bool(_LETTER.search(runs[-1])) or (len(runs) == 1 and ends_in_run and open_word)
        ends_in_run = runs[-1] != "" or (len(runs) == 1 and ends_in_run)
        pending.append(piece)
        window, tail = tail + piece, (tail + piece)[-_NUMBER_REACH:]
        if not letters or not piece.strip():  # no sentence yet; spaces alone change nothing the piece before decided
            continue
        number = _NUMBER.search(window)  # within reach: the piece holds the line's end but for spaces
        if number and words < 2:  # a date's day, or a lone word and its number: no sentence end
            continue
        text = "".join(pending)
        cut = len(text) - len(number.group(1)) if number else len(text)
        groups.append(text[:cut])
        rest = text[cut:]  # a list's number, which goes with the next sentence
        pending, letters, words, open_word, tail = [rest] if rest else [], False, 0, False, rest[-_NUMBER_REACH:]
        ends_in_run = rest != "" and not rest[-1].isspace()
    rest = "".join(pending)
    if rest:
        if groups:
            groups[-1] += rest
        else:
            groups.append(rest)
    groups = [g for g in groups if g.strip()]
    spaces = [(a[len(a.rstrip()) :] + b[: len(b) - len(b.lstrip())]) or " " for a, b in zip(groups, groups[1:])]
    return [g.strip() for g in groups], spaces


UPPER = "upper"  # every cased letter of the sentence is a capital (and it has at least MIN_CAPITALS)
TITLE = "title"  # Every Word Of Three Letters Or More Capitalized, As In A Headline (at least MIN_TITLE_WORDS of them)
AS_IS = "as-is"
MIN_CAPITALS = 4  # "USA", "OK" or "NASA" alone are words, not a sentence in capitals
MIN_TITLE_WORDS = 3  # "Red Dog" is a name as much as a title


def case_of(sentence: str) -> str:
    """``UPPER`` for a sentence in capitals (at least ``MIN_CAPITALS`` letters, none lower case); ``TITLE``
    for one whose every word of three letters or more starts with a capital, at least
    ``MIN_TITLE_WORDS`` of them ("John Smith met Mary Jones." is no title: "met"; a German sentence has
    lower-case verbs and adjectives beside its capitalized nouns); else ``AS_IS``."""
    letters = [c for c in sentence if c.isalpha() and c.lower() != c.upper()]
    if len(letters) >= MIN_CAPITALS and all(c.isupper() for c in letters):
        return UPPER
    words = [m.group() for m in map(_LETTER_RUN.search, sentence.split()) if m and len(m.group()) >= 3]
    if len(words) >= MIN_TITLE_WORDS and all(w[0].isupper() for w in words):
        return TITLE
    return AS_IS


_LETTER_RUN = re.compile(r"[^\W\d_]+")


def lowercased(sentence: str, case: str) -> str:
    """What the model translates: a sentence in capitals or in title case in sentence case
    ("TWO DOGS RUN." and "Two Dogs Run." -> "Two dogs run."; names lose their capital too)."""
    if case == AS_IS:
        return sentence
    lower = sentence.lower()
    first = _LETTER.search(lower)
    return lower if first is None else lower[: first.start()] + lower[first.start()].upper() + lower[first.start() + 1 :]


def recased(translation: str, case: str) -> str:
    """The translation in the source's case: in capitals for a sentence in capitals (a title's is left
    in the sentence case the model writes: the target language's rules of capitals are its own)."""
    return translation.upper() if case == UPPER else translation


@dataclass(frozen=True)
class TextOptions:
    """How a translator treats a line before and after the search. ``split``: the source language
    whose sentence rules cut a line into sentences (None: a line is one sentence); ``recase``: a
    sentence in capitals or in title case is translated in sentence case, and the translation of one
    in capitals is written in capitals."""

    split: str | None = None
    recase: bool = False


@dataclass
class Line:
    """One input line as the search sees it: ``sentences`` to translate, and how to put their
    translations back: the ``spaces`` between them, each sentence's ``cases`` and list ``markers``."""

    sentences: list[str]
    spaces: list[str]
    cases: list[str]
    markers: list[str] | None = None  # each sentence's leading "1. ", "2) " or "- " ("": none), kept out of the search

    def join(self, translations: list[str]) -> str:
        markers = self.markers or [""] * len(translations)
        out = [m + recased(t, c) for t, c, m in zip(translations, self.cases, markers)]
        return "".join(t + s for t, s in zip(out, [*self.spaces, ""]))


# A list item's number or bullet: the model would translate "2." as "Zwei" or drop it; it is put back as written.
_MARKER = re.compile(r"(?:\d{1,3}[.)]|[-*\u2022\u2013])\s+(?=\S)")


def prepare_line(line: str, options: TextOptions) -> Line:
    """``line`` cut and cased as ``options`` ask. With ``split``, a sentence's leading bullet, or its list
    number where two or more of the line's sentences have one, is kept out of the search and put back
    before its translation. A line that is one
    sentence without one is translated as it was written (not stripped), so that clean input is
    searched exactly as without the options."""
    sentences, spaces = split_sentences(line, options.split) if options.split else ([line], [])
    if len(sentences) <= 1:
        sentences, spaces = [line], []
    found = [_MARKER.match(s) if options.split else None for s in sentences]
    if sum(bool(m) and m.group()[0].isdigit() for m in found) < 2:  # one "3." is not a list: "3. Oktober 1990" is a date
        found = [m if m and not m.group()[0].isdigit() else None for m in found]
    markers = [m.group() if m else "" for m in found]
    sentences = [s[len(m) :] for s, m in zip(sentences, markers)]
    cases = [case_of(s) if options.recase else AS_IS for s in sentences]
    return Line([lowercased(s, c) for s, c in zip(sentences, cases)], spaces, cases, markers)


def case_augmented(src: list[str], tgt: list[str], share: float, seed: int) -> tuple[list[str], list[str]]:
    """Training pairs with ``share`` of them recased, drawn from ``seed`` (``--data case_augment``; as
    Marian's ``--all-caps-every`` and ``--english-title-case-every``): half of those in capitals on both
    sides, the other half with the source in Title Case (every word capitalised) and the target as it is.
    The rest, and the order, are unchanged."""
    import random

    rng = random.Random(seed)
    src, tgt = list(src), list(tgt)
    for i in range(len(src)):
        if rng.random() < share:
            if rng.random() < 0.5:
                src[i], tgt[i] = src[i].upper(), tgt[i].upper()
            else:
                src[i] = " ".join(w[:1].upper() + w[1:] for w in src[i].split(" "))
    return src, tgt
