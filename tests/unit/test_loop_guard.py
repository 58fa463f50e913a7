"""What the loop guard counts as a loop (qkv.infer.loop_guard): a number is never one, a word written
twice is not one, a word or a phrase written over and over is. The tokenizer writes one digit a
piece, as the demo's does, so that 2000 is "2 0 0 0" (issue 84: the guard searched such dates again
with no repeated bigram and wrote 01/01/00 as "2")."""

from __future__ import annotations

import pytest

from qkv.data.tasks import date_pairs
from qkv.data.tokenizer import Tokenizer
from qkv.infer.loop_guard import NumberPieces, loops, number_pieces

LIMIT = 100  # far beyond every output here: only a repeated run can make one loop


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    pairs = date_pairs(400, seed=5)
    texts = [s for s, _ in pairs] + [t for _, t in pairs] + ["das ist das das Haus der Fahrer - 10:30 12:12:12"] * 20
    return Tokenizer.train(texts, 200, tmp_path_factory.mktemp("tok") / "spm.model", split_digits=True, seed=1)


@pytest.mark.parametrize("text", ["2000-01-01", "1999-11-12", "2000", "1999", "2011-11-11", "1000000", "01/01/00",
                                  "12:12:12", "1.000.000.000.000", "das das", "das ist das das Haus"])
def test_numbers_and_a_doubled_word_are_not_loops(tok, text):
    ids = tok.encode(text)
    assert not loops(ids, LIMIT, numbers=number_pieces(tok))


@pytest.mark.parametrize("text", ["2000", "1999", "2000-01-01", "1.000.000.000.000"])
def test_without_the_vocabulary_a_run_of_digits_looks_like_a_loop(tok, text):
    # what the guard did before it read the number pieces (issue 84): the case the rule must tell apart
    assert loops(tok.encode(text), LIMIT)


@pytest.mark.parametrize("text", ["das das das das das das das das", "a a a a a a a a",
                                  "der Fahrer der Fahrer der Fahrer der Fahrer der Fahrer",
                                  "der 9 der 9 der 9", "- - - - - -"])
def test_a_word_a_phrase_or_a_mark_written_over_and_over_is_a_loop(tok, text):
    assert loops(tok.encode(text), LIMIT, numbers=number_pieces(tok))


def test_a_number_that_runs_to_the_length_limit_still_loops(tok):
    ids = tok.encode("1" * 30)
    assert not loops(ids, LIMIT, numbers=number_pieces(tok)) and loops(ids, len(ids), numbers=number_pieces(tok))


def test_number_pieces_are_digits_and_the_marks_between_them(tok):
    numbers = number_pieces(tok)
    assert number_pieces(tok) is numbers  # read once per tokenizer
    piece = dict(zip(tok.pieces(range(tok.vocab_size)), range(tok.vocab_size)))
    assert {piece[d] for d in "0123456789"} <= numbers.digits
    assert piece["-"] in numbers.marks and piece["-"] not in numbers.digits
    assert not numbers.write_a_number([piece["-"], piece["-"]]) and numbers.write_a_number([piece["0"], piece["-"]])
    assert not (numbers.digits | numbers.marks) & set(tok.encode("das Haus der Fahrer"))
    assert not NumberPieces().write_a_number([piece["0"]])  # the empty default: no piece is a number's
