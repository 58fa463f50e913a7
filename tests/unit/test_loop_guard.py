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


@pytest.mark.parametrize("source, output", [("- - - das Haus", "das Haus - - -"), ("der Fahrer der Fahrer der Fahrer", "der Fahrer der Fahrer der Fahrer")])
def test_a_run_the_source_repeats_as_often_is_copied_not_looped(tok, source, output):
    numbers = number_pieces(tok)
    assert loops(tok.encode(output), LIMIT, numbers=numbers)  # alone, a loop
    assert not loops(tok.encode(output), LIMIT, numbers=numbers, source=tok.encode(source))
    # a source that repeats it fewer times, or another run, does not excuse it
    assert loops(tok.encode(output), LIMIT, numbers=numbers, source=tok.encode(source.replace("- - -", "- -").replace("der Fahrer der Fahrer der Fahrer", "der Fahrer der Fahrer")))
    assert loops(tok.encode(output + " das das das"), LIMIT, numbers=numbers, source=tok.encode(source))
    assert loops(tok.encode(output), len(tok.encode(output)), numbers=numbers, source=tok.encode(source))  # the length limit still is


def test_the_guard_keeps_a_run_the_source_has(random_checkpoint, monkeypatch):
    """The search itself: an output that copies the source's run is not searched again."""
    from qkv.infer.search import DecodeConfig, search
    from qkv.infer.translator import collate_sources
    from qkv.io import checkpoint

    loaded = checkpoint.load(random_checkpoint)
    model, tk = loaded.model, loaded.tokenizer
    ids = tk.encode("O O O")
    assert loops(ids, LIMIT)  # a run of three
    config = DecodeConfig(beam_size=2, loop_guard=2, max_len_a=0.0, max_len_b=50)
    calls = []

    import qkv.infer.search as searching
    once = searching._search_once

    def forced(model_, src, **kw):  # the first search "writes" the source's run; the guard would search again
        calls.append(kw["config"].loop_guard)
        if kw["config"].no_repeat_ngram_size:
            return once(model_, src, **kw)
        return [[searching.Hypothesis(list(ids), 0.0, 0.0)] for _ in range(src.size(0))]

    monkeypatch.setattr(searching, "_search_once", forced)
    src = collate_sources([ids, tk.encode("A dog runs.")], pad_id=tk.pad_id, eos_id=tk.eos_id)
    found = search(model, src, bos_id=tk.bos_id, eos_id=tk.eos_id, config=config)
    assert found[0][0].tokens == ids  # the source repeats it: kept
    assert len(calls) == 2  # the second sentence (whose source has no run) was searched again
