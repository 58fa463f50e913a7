"""Numbers carried through, end to end: ``translate_with_glossary(numbers=True)`` and ``qkv translate
--numbers`` force a number a translation misses into it and report it, and leave a line without
numbers exactly as it was translated without the option."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.infer.glossary import missing
from qkv.infer.numbers import Numbers
from qkv.infer.search import DecodeConfig
from qkv.infer.terms import translate_with_glossary
from qkv.infer.translator import Translator
from qkv.io import checkpoint
from tests.conftest import RANDOM_MODEL_SENTENCES

SOURCES = ["A dog runs across the green field at 10:30.", "Two children play with a red ball.",
           "2 children play with a ball for $5 on 3/4/2024."]


def qkv(*args, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory) -> Path:
    """A random tiny model whose 80-piece vocabulary has digits (one piece each) and ":" "/" "$": it
    writes nonsense, so its translations miss their numbers unless the constrained search puts them in."""
    import torch

    from qkv.data.tokenizer import Tokenizer
    from qkv.model.config import model_preset
    from qkv.model.transformer import Transformer

    where = tmp_path_factory.mktemp("digits-model")
    texts = RANDOM_MODEL_SENTENCES + ["At 10:30 on 3/4/2024 for $5 and 1,000.5 or 67 89."] * 4
    tok = Tokenizer.train(texts, vocab_size=80, path=where / "spm.model", split_digits=True)
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    return checkpoint.save(where / "model", Transformer(config), tok, configs={"data": {"src_lang": "en", "tgt_lang": "de"}})


def test_a_missing_number_is_forced_in_and_reported_and_a_line_without_numbers_is_unchanged(digits_checkpoint):
    loaded = checkpoint.load(digits_checkpoint)
    translator = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=2))
    plain = translator.translate(SOURCES)
    numbers = Numbers()
    # The random model's own translations miss their numbers: what the option must repair.
    assert missing(numbers, numbers.matches(SOURCES[0]), plain[0]) and missing(numbers, numbers.matches(SOURCES[2]), plain[2])
    results = translate_with_glossary(translator, SOURCES, numbers=True)
    assert results[1].text == plain[1] and results[1].terms() == []  # no number: as without the option
    assert not results[1].sentences[0].constrained
    for i, asked in ((0, ["10:30"]), (2, ["2", "5", "3/4/2024"])):
        terms = results[i].terms()
        assert [t["source"] for t in terms] == asked
        assert all(t["number"] and t["found"] == t["source"] and t["constrained"] for t in terms), terms
        assert not missing(numbers, numbers.matches(SOURCES[i]), results[i].text)
        words = results[i].text.split()
        assert all(t["source"] in words[t["target_words"][0]] for t in terms)
    with pytest.raises(ValueError, match="numbers=True"):
        translate_with_glossary(translator, SOURCES)


def test_translate_numbers_with_a_glossary_and_the_report(digits_checkpoint, tmp_path):
    stdin = "".join(s + "\n" for s in SOURCES)
    base = ("translate", "--checkpoint", digits_checkpoint, "--beam", "2")
    plain = qkv(*base, cwd=tmp_path, stdin=stdin)
    result = qkv(*base, "--numbers", cwd=tmp_path, stdin=stdin)
    assert result.returncode == 0, result.stderr
    lines, before = result.stdout.splitlines(), plain.stdout.splitlines()
    assert len(lines) == len(SOURCES) and lines[1] == before[1] and lines[0] != before[0]
    assert "10:30" in lines[0] and "3/4/2024" in lines[2]
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("dog\tHund\n", encoding="utf-8")
    report = qkv(*base, "--numbers", "--glossary", glossary, "--glossary-report", cwd=tmp_path, stdin=stdin)
    assert report.returncode == 0, report.stderr
    first = json.loads(report.stdout.splitlines()[0])
    assert [(t["source"], t.get("number", False), t["found"]) for t in first["terms"]] == [("dog", False, "Hund"), ("10:30", True, "10:30")]
    assert all(isinstance(t["placed"], bool) for t in first["terms"])
    assert json.loads(report.stdout.splitlines()[1])["terms"] == []
    refused = qkv(*base, "--glossary-report", cwd=tmp_path, stdin=stdin)
    assert refused.returncode != 0 and "--glossary FILE or --numbers" in refused.stderr
    assert "--numbers puts its terms" in qkv(*base, "--numbers", "--n-best", "2", cwd=tmp_path, stdin=stdin).stderr


def test_evaluate_prints_the_numbers_found(digits_checkpoint, tmp_path):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("".join(s + "\n" for s in SOURCES), encoding="utf-8")
    ref.write_text("Ein Hund um 10:30.\nZwei Kinder.\n2 Kinder für 5 $ am 3/4/2024.\n", encoding="utf-8")
    result = qkv("evaluate", "--checkpoint", digits_checkpoint, "--src-file", src, "--ref-file", ref, "--beam", "2", "--numbers",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "numbers: 4 numbers asked for; 4 found (100.0%)" in result.stdout, result.stdout
    assert "glossary:" not in result.stdout


def test_the_server_carries_numbers_as_qkv_translate_numbers_does(digits_checkpoint, tmp_path):
    """``"numbers": true`` answers the translations and terms of ``qkv translate --numbers``; refused with n_best."""
    from qkv.cli.common import LOOP_GUARD
    from qkv.serve.app import create_app
    from tests.e2e.test_server_signals import exchange

    report = qkv("translate", "--checkpoint", digits_checkpoint, "--beam", "2", "--numbers", "--glossary-report",
                 cwd=tmp_path, stdin="".join(s + "\n" for s in SOURCES))
    assert report.returncode == 0, report.stderr
    expected = [json.loads(line) for line in report.stdout.splitlines()]
    app = create_app(digits_checkpoint, loop_guard=LOOP_GUARD, request_timeout=600)  # qkv serve's loop guard; a slow host
    (served, plain, refused), stats = exchange(app, [
        {"texts": SOURCES, "beam_size": 2, "numbers": True}, {"texts": SOURCES, "beam_size": 2},
        {"texts": SOURCES, "beam_size": 2, "numbers": True, "n_best": 1}], timeout=600)
    assert served.status_code == 200 and stats["failed"] == 0, served.text[:300]
    answer = served.json()
    assert answer["translations"] == [e["translation"] for e in expected]
    assert answer["terms"] == [e["terms"] for e in expected]
    assert [t["source"] for t in answer["terms"][2]] == ["2", "5", "3/4/2024"] and all(t["number"] for t in answer["terms"][2])
    assert "3/4/2024" in answer["translations"][2] and "3/4/2024" not in plain.json()["translations"][2]
    assert refused.status_code == 422 and "numbers" in refused.text


# What a model that reads dates writes (the demo's task, with "/" as this vocabulary's separator): each
# source number stands in its translation, inside a date or in another form (issue 84).
CARRIED = {"9 mai 2017": "2017/05/09", "le 14 juillet 1989": "1989/07/14", "at 10:30": "um 10.30"}


class _Writes(Translator):
    """A Translator whose first search writes ``CARRIED``'s translation of each source (the random
    model's own search still runs the constrained one)."""

    def translate_ids(self, src_ids):
        from qkv.infer.search import Hypothesis

        written = {tuple(self.encode(s)): t for s, t in CARRIED.items()}
        targets = [written[tuple(ids)] for ids in src_ids]
        return [[Hypothesis(self.tokenizer.encode_target(t), 0.0, 0.0)] for t in targets]


def test_numbers_change_no_translation_that_carries_its_numbers_in_another_form(digits_checkpoint):
    loaded = checkpoint.load(digits_checkpoint)
    translator = _Writes(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=2))
    sources = list(CARRIED)
    assert translator.translate(sources) == list(CARRIED.values())  # the vocabulary writes them
    results = translate_with_glossary(translator, sources, numbers=True)
    assert [r.text for r in results] == list(CARRIED.values())  # issue 84: "2017-05-09 9", "1989-07 14"
    for r in results:
        assert all(t["found"] is not None and not t["constrained"] and not t["unplaceable"] for t in r.terms()), r.terms()
    assert [t["found"] for t in results[0].terms()] == ["09", "2017"]


def test_a_constrained_output_that_fails_the_check_keeps_the_first_translation(digits_checkpoint, monkeypatch):
    """The constrained search places the tokens of "5" but runs them into "5.5": the check does not find
    5 there, so the first translation is kept and the sentence is unplaceable, with "found": null."""
    import qkv.infer.terms as terms
    from qkv.infer.constrained import ConstrainedHypothesis

    loaded = checkpoint.load(digits_checkpoint)
    tok = loaded.tokenizer
    translator = Translator(loaded.model, tok, DecodeConfig(beam_size=2))
    source = "Two children play with a red ball for $5."
    (first,) = translator.translate([source])
    assert "5" not in first  # the random model misses it: the sentence goes to the constrained search
    placed = tok.encode_target("5.5")
    monkeypatch.setattr(terms, "_constrained", lambda t, src_ids, constraints, joins, config, beam, firsts: [
        ConstrainedHypothesis(placed, 0.0, 0.0, met=[True] * len(c)) for c in constraints])
    (result,) = translate_with_glossary(translator, [source], numbers=True)
    assert result.text == first
    (term,) = result.terms()
    assert term["found"] is None and term["unplaceable"] and not term["constrained"], term
