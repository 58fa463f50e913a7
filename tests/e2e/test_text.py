"""Text as people write it, through ``qkv translate`` on the trained tiny model (issue 66): a line of
several sentences comes back as one line with every sentence translated, a line in capitals does
not loop, and ``--no-split`` (with the loop guard off and capitals kept) gives today's translations."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.robustness_text import looping
from qkv.cli.main import main
from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.io import checkpoint

SENTENCES = ["A man in a blue shirt is standing on a ladder.", "Two dogs play in the snow.", "A woman reads a book."]
CAPS = "A MAN IN A BLUE SHIRT IS STANDING ON A LADDER CLEANING WINDOWS."


def translate(capsys, tmp_path: Path, run: Path, lines: list[str], *flags: str) -> list[str]:
    source = tmp_path / "in.en"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(run), "--workers", "1", "-i", str(source), *flags]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_line_of_several_sentences_comes_back_as_one_line_with_every_sentence_translated(tiny_run, tmp_path, capsys):
    lines = [" ".join(SENTENCES), "", "A dog."]
    out = translate(capsys, tmp_path, tiny_run, lines)
    alone = translate(capsys, tmp_path, tiny_run, SENTENCES)
    assert len(out) == 3 and out[1] == ""
    assert all(alone) and out[0] == " ".join(alone)  # each sentence translated as it is alone, in order
    whole = translate(capsys, tmp_path, tiny_run, lines, "--no-split")
    assert whole[0] != out[0]  # without the splitter the line is one search


def test_a_line_in_capitals_does_not_loop_on_a_trained_model(tiny_run, tmp_path, capsys):
    (today,) = translate(capsys, tmp_path, tiny_run, [CAPS], "--keep-case", "--loop-guard", "0")
    assert looping(today)  # what the model does with capitals it never saw
    (out,) = translate(capsys, tmp_path, tiny_run, [CAPS])
    assert out and not looping(out) and out == out.upper()


def test_no_split_with_the_guard_off_reproduces_todays_translations(tiny_run, tmp_path, capsys):
    lines = [" ".join(SENTENCES), CAPS, "", "A dog.", SENTENCES[1]]
    loaded = checkpoint.load(tiny_run)
    config = DecodeConfig(**loaded.model.decode_defaults)
    today = Translator(loaded.model, loaded.tokenizer, config).translate(lines)  # what qkv translate did before issue 66
    assert translate(capsys, tmp_path, tiny_run, lines, "--no-split", "--keep-case", "--loop-guard", "0") == today
    # --no-split alone: each line is one sentence, searched with the loop guard
    guarded = Translator(loaded.model, loaded.tokenizer, DecodeConfig(**loaded.model.decode_defaults, loop_guard=2)).translate(lines)
    assert translate(capsys, tmp_path, tiny_run, lines, "--no-split", "--keep-case") == guarded


def test_the_server_splits_recases_and_guards_as_qkv_translate_does(tiny_run, tmp_path, capsys):
    import asyncio

    import httpx

    from qkv.serve.app import create_app

    texts = [" ".join(SENTENCES), CAPS, "", "A dog."]
    app = create_app(tiny_run, loop_guard=2)  # what qkv serve runs by default

    async def post(bodies):
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://qkv", timeout=60) as client:
                return [(await client.post("/v1/translate", json=body)).json() for body in bodies]

    broken = SENTENCES[0].rstrip(".") + "\n" + CAPS.rstrip(".") + "\nA dog"  # no full stop: one sentence to sentencex
    nbest = {"texts": [texts[0], CAPS], "n_best": 2, "beam_size": 2}
    split, whole, lines, ranked = asyncio.run(post([{"texts": texts}, {"texts": texts, "split": False, "keep_case": True},
                                                   {"texts": [broken]}, nbest]))
    assert split["translations"] == translate(capsys, tmp_path, tiny_run, texts)  # the command line's defaults
    assert whole["translations"] == translate(capsys, tmp_path, tiny_run, texts, "--no-split", "--keep-case")
    assert split["translations"][0] != whole["translations"][0] and not looping(split["translations"][1])
    # a text's lines are translated as the command translates lines, and its line breaks come back (a review)
    one, two, three = translate(capsys, tmp_path, tiny_run, [SENTENCES[0].rstrip("."), CAPS.rstrip("."), "A dog"])
    assert lines["translations"] == [f"{one}\n{two}\n{three}"]
    # n_best too: a text's sentences searched apart and their k-th bests joined, as qkv translate --n-best does (a review)
    rows = [line.split("\t") for line in translate(capsys, tmp_path, tiny_run, nbest["texts"], "--n-best", "2", "--beam", "2")]
    assert [[(h["translation"], f"{h['score']:.4f}") for h in hs] for hs in ranked["n_best"]] == [
        list(zip(row[0::2], row[1::2])) for row in rows]
    assert [hs[0]["translation"] for hs in ranked["n_best"]] == ranked["translations"]
