"""`qkv demo`: a CI-sized run of the dates task learns far above chance; the command reports,
draws and reuses its model; token alignment reads the cross-attention it claims to."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import torch

from qkv.io import checkpoint
from qkv.cli.main import main
from qkv.inspect.demo import DEMO_TRAIN, run_demo
from dataclasses import replace
from qkv.inspect.visualize import AttentionCapture, attention_of, token_alignment

# The full demo trains 1000 steps; 200 are enough to be far above chance (a random ISO date is
# right with probability ~1e-5) in a CI-sized run.
CI_TRAIN = replace(DEMO_TRAIN, max_steps=200, eval_every=100, threads=1)


def test_a_ci_sized_demo_learns_far_above_chance_and_draws_its_attention(tmp_path):
    result = run_demo(tmp_path / "demo", n_train=4000, n_test=200, train=CI_TRAIN, progress=False)
    assert result.trained and result.n_test == 200
    print(f"CI-sized demo: exact match {result.accuracy:.3f}")
    assert result.accuracy >= 0.2, result.accuracy  # measured 0.41 here
    assert result.picture.stat().st_size > 10_000 and result.page.read_text().count("<") > 10
    # Each output piece of "Tuesday, 9th of May 2017" -> 2017-05-09 names a source piece.
    pieces = [t for t, _, _ in result.alignment]
    assert "".join(pieces) == result.examples[0][1].replace("\u2581", "")
    assert all(0.0 <= w <= 1.0 for _, _, w in result.alignment)
    # Read with the right answer as its translation, the month's digits look at the month's name,
    # in four languages' formats (measured: also on the full demo model).
    cases = {"Tuesday, 9th of May 2017": ("2017-05-09", "May"), "9 mai 2017": ("2017-05-09", "mai"),
             "le 14 juillet 1989": ("1989-07-14", "juillet"), "3. Oktober 1990": ("1990-10-03", "Oktober")}
    for sentence, (iso_date, month) in cases.items():
        assert field_alignment(result.run_dir / "final", sentence, iso_date)[iso_date[5:7]] == month, sentence
    # The same through `qkv align --pieces`, reading what the picture shows (the last layer's weights where
    # each piece is predicted): each of the month's digits aligns with the month's name.
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("".join(s + "\n" for s in cases), encoding="utf-8")
    ref.write_text("".join(iso + "\n" for iso, _ in cases.values()), encoding="utf-8")
    aligned = subprocess.run([sys.executable, "-m", "qkv", "align", "--checkpoint", str(result.run_dir / "final"),
                              "-i", str(src), "-r", str(ref), "--pieces", "--method", "attention", "--read", "predict",
                              "--layer", "-1"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert aligned.returncode == 0, aligned.stderr
    tok = checkpoint.load(result.run_dir / "final").tokenizer
    lines = aligned.stdout.splitlines()
    assert len(lines) == len(cases)
    for line, (sentence, (iso_date, month)) in zip(lines, cases.items()):
        src_pieces, tgt_pieces = tok.pieces(tok.encode(sentence)), tok.pieces(tok.encode_target(iso_date))
        pairs = dict((t, s) for s, t in (map(int, pair.split("-")) for pair in line.split()))
        assert sorted(pairs) == list(range(len(tgt_pieces)))  # every target piece once, EOS left out
        digits = [t for t, piece in enumerate(tgt_pieces) if piece.isdigit()][4:6]  # after the year's four
        assert [src_pieces[pairs[t]] for t in digits] == ["\u2581" + month] * 2, (sentence, line)

def field_alignment(model_dir, sentence: str, iso_date: str) -> dict[str, str]:
    """For each field of ``iso_date`` (year, month, day), the source piece its digits attend to most
    when the model reads that date as its translation of ``sentence``: the last layer's cross-attention,
    heads averaged, the field's pieces together (as `qkv align` merges a word's pieces)."""
    loaded = checkpoint.load(model_dir)
    tok = loaded.tokenizer
    capture = attention_of(loaded.model, tok, sentence, tok.encode(sentence), tok.encode_target(iso_date))
    weights = capture.cross[-1].mean(dim=0)  # (H, T, S) -> (T, S)
    owner, text = [], ""  # the piece index of every character of the translation
    for t, piece in enumerate(capture.tgt_tokens[:-1]):  # EOS left out
        chars = piece.replace("\u2581", "")
        owner += [t] * len(chars)
        text += chars
    assert text == iso_date
    fields, start = {}, 0
    for field in iso_date.split("-"):
        rows = sorted(set(owner[start : start + len(field)]))
        best = int(weights[rows].mean(dim=0).argmax())
        fields[field] = capture.src_tokens[best].replace("\u2581", "")
        start += len(field) + 1
    return fields


def test_the_demo_command_reports_and_then_reuses_its_model(tmp_path, capsys, monkeypatch):
    import qkv.inspect.demo

    quick = replace(CI_TRAIN, max_steps=40, eval_every=40)  # this test checks the reporting, not the learning
    monkeypatch.setattr(qkv.inspect.demo.run_demo, "__kwdefaults__", {**qkv.inspect.demo.run_demo.__kwdefaults__, "train": quick, "n_train": 1000, "n_test": 50})
    out_dir = tmp_path / "demo"
    assert main(["demo", "--out", str(out_dir), "--no-progress"]) == 0
    first = capsys.readouterr().out
    assert "exact match on 50 held-out dates:" in first and "trained in" in first
    assert "attention picture:" in first and (out_dir / "attention.png").exists()
    stamp = (out_dir / "final" / checkpoint.WEIGHTS).stat().st_mtime_ns
    assert main(["demo", "--out", str(out_dir), "--no-progress"]) == 0
    second = capsys.readouterr().out
    assert "reused the cached model" in second
    assert (out_dir / "final" / checkpoint.WEIGHTS).stat().st_mtime_ns == stamp
    # Copied or moved elsewhere (the run recorded its absolute paths), it is still the demo's run and reused;
    # with another train.tsv in it, it is not.
    copied, moved, altered = tmp_path / "copy" / "demo", tmp_path / "moved", tmp_path / "altered"
    shutil.copytree(out_dir, copied)
    shutil.copytree(out_dir, altered)
    (altered / "train.tsv").write_text((altered / "train.tsv").read_text()[:-1] + "x\n")
    out_dir.rename(moved)
    for elsewhere in (copied, moved):
        assert main(["demo", "--out", str(elsewhere), "--no-progress"]) == 0, elsewhere
        assert "reused the cached model" in capsys.readouterr().out
    moved.rename(out_dir)
    assert main(["demo", "--out", str(altered), "--no-progress"]) == 2
    assert "holds no run of the demo" in capsys.readouterr().err
    # --retrain starts a clean run: one start event in the log, not the old run's appended to
    assert main(["demo", "--out", str(out_dir), "--no-progress", "--retrain"]) == 0
    assert "trained in" in capsys.readouterr().out
    events = [json.loads(line)["event"] for line in (out_dir / "log.jsonl").read_text().splitlines()]
    assert events.count("start") == 1


def test_the_demo_never_writes_into_a_directory_of_other_files(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.tsv").write_text("my own data\tmeine Daten\n")
    (mine / "thesis.tex").write_text("years of work")
    assert main(["demo", "--out", str(mine), "--no-progress"]) == 2
    assert "holds files the demo did not write (thesis.tex)" in capsys.readouterr().err
    assert (mine / "train.tsv").read_text() == "my own data\tmeine Daten\n" and len(list(mine.iterdir())) == 2
    (mine / "thesis.tex").unlink()  # only a file with a name the demo uses: still the user's
    assert main(["demo", "--out", str(mine), "--no-progress"]) == 2
    assert "holds no run of the demo" in capsys.readouterr().err
    assert (mine / "train.tsv").read_text() == "my own data\tmeine Daten\n"


def test_token_alignment_picks_the_most_attended_source_piece():
    cross = torch.zeros(1, 2, 3, 4)  # (L, H, T, S)
    cross[0, :, 0] = torch.tensor([0.1, 0.7, 0.1, 0.1])
    cross[0, 0, 1] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    cross[0, 1, 1] = torch.tensor([0.0, 0.6, 0.4, 0.0])  # averaged: 0.3 vs 0.7 -> piece 2
    cross[0, :, 2] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    capture = AttentionCapture(
        "9 May", "05", ["\u2581", "9", "\u2581May", "</s>"], ["0", "5", "</s>"],
        torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 3, 3), cross,
    )
    assert token_alignment(capture) == [("0", "9", 0.699999988079071), ("5", "\u2581May", 0.699999988079071)]


def test_the_demo_never_deletes_a_training_run(tiny_run, tmp_path, capsys):
    """An interrupted (or finished) `qkv train` run is a qkv run, but not the demo's: left alone."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    shutil.rmtree(run / "final")  # as if stopped before the end, resumable
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for extra in ([], ["--retrain"]):
        assert main(["demo", "--out", str(run), "--no-progress", *extra]) == 2
        assert "holds no run of the demo" in capsys.readouterr().err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
