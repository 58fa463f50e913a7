"""Trust (qkv.inspect.trust, qkv.inspect.calibrate): the signals, the calibration, and --confidence on
translate, score and calibrate through the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.inspect.calibrate import KINDS, fit, precision_at_recall, roc_auc, synthetic_pairs
from qkv.inspect.trust import (
    FEATURES, LOGPROB_ONLY, Trust, assess, assess_lines, calibration_of, char_repeats, copy_score, flags_of, load_calibration,
    max_repeats, spearman,
)
from qkv.io import checkpoint
from qkv.model.config import model_preset
from qkv.model.transformer import Transformer

SOURCES = ["a man rides a red bike", "two dogs play in the snow", "a woman reads a book", "children run on the beach"]
REFERENCES = ["ein Mann fährt ein rotes Rad", "zwei Hunde spielen im Schnee", "eine Frau liest ein Buch",
              "Kinder rennen am Strand"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("trust")
    tokenizer = Tokenizer.train((SOURCES + REFERENCES) * 5, 80, directory / "tok.model")
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    return checkpoint.save(directory / "model", Transformer(config), tokenizer)


def test_repeats_copies_and_the_measures_on_hand_made_cases():
    assert max_repeats("a b a b a b c".split()) == 3
    assert max_repeats("the dog the cat".split()) == 1
    assert max_repeats("Hund hund HUND".split()) == 3  # case does not hide a loop
    assert max_repeats([]) == 0
    assert char_repeats("Schifffahrt") == 1 and char_repeats("EEEEEEEE") == 6 and char_repeats("19999999") == 5
    assert copy_score("a red bike", "a red bike") == 1.0 and copy_score("a red bike", "ein rotes Rad") < 0.3
    assert roc_auc([3, 2], [1, 0]) == 1.0 and roc_auc([1, 0], [3, 2]) == 0.0
    assert roc_auc([1, 1], [1, 1]) == 0.5  # ties count half
    # 90% recall of 10 positives needs the 9 highest: the threshold 2 also flags one negative of 3
    assert precision_at_recall([10, 9, 8, 7, 6, 5, 4, 3, 2, 1], [2, 1.5, 0]) == 9 / 10
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / 22.5**0.5)  # ties at mean ranks: 1, 2.5, 2.5, 4


def test_synthetic_pairs_have_every_kind_and_the_construction_they_name():
    made = synthetic_pairs(SOURCES, REFERENCES)
    assert [k for k, _, _ in made[:7]] == list(KINDS) and len(made) == 7 * len(SOURCES)
    by_kind = {k: [(s, t) for kind, s, t in made if kind == k] for k in KINDS}
    assert by_kind["correct"] == list(zip(SOURCES, REFERENCES))
    assert all(t not in REFERENCES[i : i + 1] and t in REFERENCES for i, (_, t) in enumerate(by_kind["detached"]))
    assert all(s == t for s, t in by_kind["copy"])
    assert all(max_repeats(t.split()) >= 4 for _, t in by_kind["oscillation"])
    assert all(len(t.split()) == len(r.split()) // 2 for (_, t), r in zip(by_kind["omission"], REFERENCES))
    for (_, t), r, (_, other) in zip(by_kind["addition"], REFERENCES, by_kind["detached"]):  # another's reference added
        assert t == f"{r} {other}" and other != r


def _trust(**features) -> Trust:
    return Trust(0.5, [], {f: features.get(f, 0.0) for f in FEATURES})


def test_fit_chooses_each_threshold_between_the_kinds_and_ranks_own_translations_by_their_quality():
    kinds = [k for k in KINDS for _ in range(20)]
    made = []
    for i, kind in enumerate(kinds):
        noise = (i % 7) / 100
        made.append(_trust(
            source_mean=0.2 + noise if kind == "detached" else 0.6 + noise,
            source_min=0.1 + noise if kind == "partly-detached" else 0.5 + noise,
            repeats=5.0 if kind == "oscillation" else 1.0, copy=0.95 if kind == "copy" else 0.2 + noise,
            uncovered=0.5 if kind == "omission" else noise / 2, eos_logprob=-3.0 if kind == "omission" else -0.1 - noise,
            longness=0.9 if kind == "addition" else noise, logprob_mean=-0.5 - noise))
    # The model's own translations: chrF falls as the log-probability does (with noise in between)
    own = [_trust(source_mean=0.6, source_min=0.5, copy=0.2, logprob_mean=-0.3 - i / 20 + (i % 3) / 10,
                  uncovered=(i % 5) / 100, eos_logprob=-0.1 - (i % 4) / 50) for i in range(60)]
    chrf = [95 - 1.5 * i for i in range(60)]
    calibration = fit(own, chrf, name="hand-made", made=made, kinds=kinds)
    for trust, kind in zip(made, kinds):
        expected = {"correct": [], "detached": ["detached"], "partly-detached": ["partly-detached"],
                    "oscillation": ["repetition"], "copy": ["copy"], "omission": ["omission"], "addition": ["addition"]}[kind]
        assert flags_of(trust.features, calibration["thresholds"]) == expected, kind
    from qkv.inspect.trust import confidence_of

    assert calibration["kind"] == "fitted" and calibration["features"][0] == "logprob_mean"
    ranked = [confidence_of(t.features, calibration) for t in own]
    assert spearman(ranked, chrf) > 0.8 and calibration["own_translations"] == 60
    assert calibration["given"]["roc_auc"] >= calibration["logprob"]["roc_auc"] > 0.8
    assert [r["n"] for r in calibration["reliability"]] and sum(r["n"] for r in calibration["reliability"]) == 60


def test_a_broken_calibration_file_is_one_line(tmp_path):
    path = tmp_path / "confidence.json"
    path.write_text(json.dumps({"features": ["logprob_mean"], "mean": [0], "std": [1], "weights": [1], "bias": 0}))  # no thresholds
    with pytest.raises(QkvError, match="not a calibration of these features"):
        load_calibration(path)
    path.write_text("{")
    with pytest.raises(QkvError, match="not a readable calibration"):
        load_calibration(path)


def test_assess_is_batch_invariant_and_marks_copies_and_loops(model_dir):
    loaded = checkpoint.load(model_dir)
    targets = [REFERENCES[0], "zwei Hunde Hunde Hunde Hunde", SOURCES[2], ""]
    together = assess(loaded.model, loaded.tokenizer, SOURCES, targets)
    alone = [assess(loaded.model, loaded.tokenizer, [s], [t])[0] for s, t in zip(SOURCES, targets)]
    for a, b in zip(together, alone):
        assert a.features == pytest.approx(b.features, abs=1e-5) and a.flags == b.flags
    assert "repetition" in together[1].flags and "copy" in together[2].flags
    assert [w["word"] for w in together[0].words] == REFERENCES[0].split()
    assert all(0 <= t.confidence <= 1 and math.isfinite(t.confidence) for t in together)
    assert together[3].words == []  # an empty translation has no words, and no crash


def test_the_light_pass_reads_the_encoder_outputs_the_search_made(model_dir, monkeypatch):
    from qkv.infer.encodings import kept_encodings
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator

    loaded = checkpoint.load(model_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    texts = SOURCES + [SOURCES[1] + " and " + SOURCES[2]]
    translator = Translator(model, tokenizer, DecodeConfig(beam_size=2))
    encodings = kept_encodings(translator, model)
    with encodings:
        lines = translator.translate_lines(texts)
    args = ([line.sentences for line in lines], [line.outputs for line in lines])
    encoded = assess_lines(model, tokenizer, *args, calibration=LOGPROB_ONLY, words=False)
    calls = []
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    read = assess_lines(model, tokenizer, *args, calibration=LOGPROB_ONLY, words=False, encode=encodings.encode)
    assert calls == []  # the sources were not encoded again
    for a, b in zip(encoded, read, strict=True):
        assert a.features == pytest.approx(b.features, abs=1e-5) and a.flags == b.flags
        assert a.confidence == pytest.approx(b.confidence, abs=1e-6)
    # a sentence the search did not read: its batch is encoded, the same verdicts
    more = ([*args[0], ["a dog"]], [*args[1], ["ein Hund"]])
    again = assess_lines(model, tokenizer, *more, calibration=LOGPROB_ONLY, words=False, encode=encodings.encode)
    assert calls and [t.confidence for t in again[:-1]] == pytest.approx([t.confidence for t in encoded], abs=1e-6)
    assert kept_encodings(Translator(model, tokenizer, workers=2), model) is None  # workers fork: no hooks to inherit
    assert kept_encodings(translator, checkpoint.load(model_dir).model) is None  # another model's outputs do not fit


def test_encodings_entered_again_keep_one_set_of_hooks(model_dir):
    from qkv.infer.encodings import kept_encodings
    from qkv.infer.translator import Translator

    loaded = checkpoint.load(model_dir)
    model = loaded.model
    translator = Translator(model, loaded.tokenizer)
    outer = kept_encodings(translator, model)
    with outer:
        inner = kept_encodings(translator, model)  # a glossary's mending inside the trust pass's
        assert inner is outer
        with inner:
            assert len(model.src_embed._forward_pre_hooks) == 1
        assert len(model.src_embed._forward_pre_hooks) == 1  # still the outer's
    assert not model.src_embed._forward_pre_hooks and kept_encodings(translator, model) is not outer


def qkv(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_confidence_through_translate_score_and_calibrate(model_dir, tmp_path, monkeypatch):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("".join(s + "\n" for s in SOURCES), encoding="utf-8")
    ref.write_text("".join(r + "\n" for r in [REFERENCES[0], "zwei Hunde Hunde Hunde Hunde", SOURCES[2], REFERENCES[3]]), encoding="utf-8")
    result = qkv("translate", "--checkpoint", model_dir, "-i", src, "--confidence", "--beam", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(SOURCES) and all(len(line.split("\t")) == 3 for line in lines)
    assert all(0 <= float(line.split("\t")[1]) <= 1 for line in lines)
    result = qkv("translate", "--checkpoint", model_dir, "-i", src, "--confidence", "json", "--beam", "2", cwd=tmp_path)
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert [o["translation"] for o in objects] == [line.split("\t")[0] for line in lines]
    assert {"confidence", "flags", "features", "words", "unused_source_words"} <= set(objects[0])

    result = qkv("score", "--checkpoint", model_dir, "-i", src, "-r", ref, "--confidence", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    judged = [json.loads(line) for line in result.stdout.splitlines()]
    assert "repetition" in judged[1]["flags"] and "copy" in judged[2]["flags"]

    valid_src, valid_tgt = tmp_path / "valid.en", tmp_path / "valid.de"
    valid_src.write_text("".join(s + "\n" for s in SOURCES * 3), encoding="utf-8")
    valid_tgt.write_text("".join(r + "\n" for r in REFERENCES * 3), encoding="utf-8")
    run = lambda *a: qkv("calibrate", "--checkpoint", model_dir, "--valid-src", valid_src, "--valid-tgt", valid_tgt, *a, cwd=tmp_path)  # noqa: E731
    result = run()
    assert result.returncode == 0, result.stderr
    calibration = calibration_of(model_dir)
    # 12 translations of the pairs (and 1 of two joined), too few to fit a confidence: log-probability only,
    # the flags fitted on the 84 labelled pairs (seven kinds of 12)
    n = calibration["own_translations"]  # the 12 pairs' translations and those of the joined pairs
    assert n > 12 and calibration["fitted_on"].startswith(f"{n} translations ({n - 12} of joined pairs) of")
    assert calibration["kind"] == "logprob" and "84 labelled pairs" in calibration["fitted_on"]
    checkpoint.load(model_dir)  # the manifest covers the new file
    assert "already holds confidence.json: give --force" in run().stderr
    result = qkv("score", "--checkpoint", model_dir, "-i", src, "-r", ref, "--confidence", cwd=tmp_path)
    loaded = checkpoint.load(model_dir)
    expected = assess(loaded.model, loaded.tokenizer, SOURCES, ref.read_text(encoding="utf-8").splitlines(), calibration=calibration)
    assert [json.loads(line)["confidence"] for line in result.stdout.splitlines()] == [round(t.confidence, 4) for t in expected]
    assert "calibration (confidence.json) is log-probability only" in result.stderr  # its own file, said as such
    assert "no calibration of its own" not in result.stderr
    result = qkv("evaluate", "--checkpoint", model_dir, "--src-file", src, "--ref-file", ref, "--beam", "1", "--confidence", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "confidence: Spearman" in result.stdout and f"of {len(SOURCES)} lines flagged" in result.stdout
    assert "not with --n-best" in qkv("translate", "--checkpoint", model_dir, "-i", src, "--confidence", "--n-best", "2", cwd=tmp_path).stderr


def test_contributions_sum_back_on_a_trained_model(tiny_run):
    """On weights a training made (the tiny preset's run), every block's parts still sum to its output."""
    from conftest import assert_blocks_sum_back
    from qkv.data.corpus import collate

    loaded = checkpoint.load(tiny_run / "final")
    model, tok = loaded.model.double().eval(), loaded.tokenizer
    src, tgt_in, _ = collate([tok.encode(s) for s in SOURCES], [tok.encode_target(r) for r in REFERENCES],
                             pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)
    assert_blocks_sum_back(model, src, tgt_in)


def test_calibrate_refuses_an_imported_model_without_data_and_resolves_a_symlink_first(model_dir, tmp_path):
    """Issue 72 #7 and #17: a config that names no corpus is refused before any scoring (it was fitted
    on Multi30k val); a symlinked checkpoint is calibrated where it points, the link left a link."""
    loaded = checkpoint.load(model_dir)
    real = checkpoint.save(tmp_path / "real", loaded.model, loaded.tokenizer)  # no data config, no calibration
    result = qkv("calibrate", "--checkpoint", real, cwd=tmp_path)
    assert result.returncode == 2 and "names no corpus" in result.stderr and "Traceback" not in result.stderr
    assert not (real / "confidence.json").exists()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    valid_src, valid_tgt = tmp_path / "valid.en", tmp_path / "valid.de"
    valid_src.write_text("".join(s + "\n" for s in SOURCES * 3), encoding="utf-8")
    valid_tgt.write_text("".join(r + "\n" for r in REFERENCES * 3), encoding="utf-8")
    result = qkv("calibrate", "--checkpoint", link, "--valid-src", valid_src, "--valid-tgt", valid_tgt, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and (real / "confidence.json").is_file()
    checkpoint.load(link)  # verified, the new file under its manifest




def test_evaluate_judges_each_sentence_as_translate_does(tiny_run, tmp_path, capsys):
    """evaluate --confidence on lines of two sentences, the first in capitals, judges each line as
    qkv.translate_with_confidence does (its sentences as the model read and wrote them), not as one
    sequence: the Spearman it prints is that of those confidences (and with a tiny model's confidences
    all alike, "nan"). The references are every other line's own translation, so that sentence chrF
    separates the lines whatever the model's quality."""
    from qkv.cli.main import main
    from qkv.data.sentences import TextOptions
    from qkv.infer.bleu import sentence_chrf
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.inspect.trust import translate_with_confidence

    pairs = [(i, j) for i in range(4) for j in range(4) if i != j]  # 12 lines of two sentences
    lines = [f"{SOURCES[i].upper()}. {SOURCES[j]}." for i, j in pairs]
    model_dir = tiny_run / "final"
    loaded, calibration = checkpoint.load(model_dir), calibration_of(model_dir)
    translator = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=1), text=TextOptions(split="en", recase=True))
    judged = translate_with_confidence(translator, lines, calibration=calibration)
    hypotheses = [x for x, _ in judged]
    refs = [x if k % 2 == 0 else "ganz anders ." for k, x in enumerate(hypotheses)]
    src, ref = tmp_path / "two.en", tmp_path / "two.de"
    src.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    ref.write_text("".join(x + "\n" for x in refs), encoding="utf-8")
    chrf = sentence_chrf(hypotheses, refs)
    per_sentence = f"{spearman([t.confidence for _, t in judged], chrf):.3f}"
    whole = f"{spearman([t.confidence for t in assess(loaded.model, loaded.tokenizer, lines, hypotheses, calibration=calibration)], chrf):.3f}"
    if per_sentence == whole:  # a ranking as one sequence would print the same: nothing to tell apart on this host
        pytest.skip(f"both readings give Spearman {whole} on this host's tiny model")
    assert main(["evaluate", "--checkpoint", str(model_dir), "--src-file", str(src), "--ref-file", str(ref), "--beam", "1",
                 "--loop-guard", "0", "--confidence"]) == 0
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("confidence: Spearman"))
    assert printed.startswith(f"confidence: Spearman {per_sentence} with sentence chrF"), (printed, per_sentence, whole)


def test_translate_with_a_glossary_judges_each_sentence_as_without_one(tiny_run, tmp_path, capsys):
    """translate --glossary --confidence judges what the model translated (each sentence as it read and
    wrote it), as translate --confidence does without a glossary: with a glossary whose term no line
    holds, the translations and their confidences are the plain command's, line for line."""
    from qkv.cli.main import main

    lines = [f"{SOURCES[i].upper()}. {SOURCES[j]}." for i, j in ((0, 1), (2, 3), (1, 2))]
    src, terms = tmp_path / "two.en", tmp_path / "terms.tsv"
    src.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    terms.write_text("zeppelin\tZeppelin\n", encoding="utf-8")
    common = ["translate", "--checkpoint", str(tiny_run / "final"), "-i", str(src), "--beam", "1", "--confidence", "json"]
    assert main(common) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*common, "--glossary", str(terms)]) == 0
    with_glossary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["translation"], x["confidence"], x["flags"]) for x in with_glossary] == \
        [(x["translation"], x["confidence"], x["flags"]) for x in plain]
