"""`qkv distill` on the dates task with tiny models: the teacher's translations are `qkv translate`'s,
an ensemble teacher is an ensemble, a killed distillation ends with the files of an uninterrupted one,
and bad inputs are one line before any work."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli.main import main
from qkv.io import checkpoint
from qkv.io.outputs import current_umask
from qkv.data.tasks import date_pairs
from qkv.train import distill
from qkv.train.recipes import build_configs
from qkv.train.trainer import Trainer


@pytest.fixture(scope="module")
def dates(tmp_path_factory) -> dict[str, Path]:
    """Train (400 pairs), validation (40) and test (40) files of the dates task."""
    where = tmp_path_factory.mktemp("dates")
    pairs = date_pairs(480, seed=21)
    files = {}
    for split, part in (("train", pairs[:400]), ("valid", pairs[400:440]), ("test", pairs[440:])):
        for side, k in (("src", 0), ("tgt", 1)):
            files[f"{split}_{side}"] = where / f"{split}.{side}"
            files[f"{split}_{side}"].write_text("".join(p[k] + "\n" for p in part), encoding="utf-8")
    return files


@pytest.fixture(scope="module")
def teacher(dates, tmp_path_factory) -> Path:
    """A tiny model trained 200 updates on the dates (checkpoints at 100 and 200, and final/)."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    configs = build_configs("tiny", model={}, train={"max_steps": 200, "eval_every": 100, "threads": 1, "tune_length_penalty": False},
                            data={"corpus": "files", "train_src": str(dates["train_src"]), "train_tgt": str(dates["train_tgt"]),
                                  "valid_src": str(dates["valid_src"]), "valid_tgt": str(dates["valid_tgt"]),
                                  "vocab_size": 120, "train_limit": 0, "valid_limit": 0})
    Trainer(run, *configs).run(progress=False)
    return run


CALIBRATED = ("--train", "calibrate=true")  # the tiny preset leaves calibration out


def distill_args(dates, teachers: list[Path], out: Path, *extra: str) -> list[str]:
    return [
        "distill", *[a for t in teachers for a in ("--teacher", str(t))], "--out", str(out),
        "--train-src", str(dates["train_src"]), "--train-tgt", str(dates["train_tgt"]),
        "--valid-src", str(dates["valid_src"]), "--valid-tgt", str(dates["valid_tgt"]),
        "--test-src", str(dates["test_src"]), "--test-tgt", str(dates["test_tgt"]),
        "--beam", "3", "--part-size", "64", "--preset", "tiny", "--max-steps", "6",
        "--train", "eval_every=3", "threads=1", "tune_length_penalty=false", "--data", "vocab_size=120", "--no-progress", *extra,
    ]


def translate(teachers: list[Path], source: Path, out: Path) -> list[str]:
    assert main(["translate", *[a for t in teachers for a in ("--checkpoint", str(t))], "-i", str(source), "-o", str(out),
                 "--beam", "3"]) == 0
    return out.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def distilled(dates, teacher, tmp_path_factory) -> Path:
    """An uninterrupted distillation with an ensemble of two of the teacher's checkpoints."""
    out = tmp_path_factory.mktemp("distill") / "d"
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        assert main(distill_args(dates, [teacher / "step-000100", teacher / "final"], out, *CALIBRATED)) == 0
    (out.parent / "stderr.txt").write_text(said.getvalue())
    return out


def test_the_student_is_calibrated_as_qkv_train_calibrates_a_run(distilled):
    """The student's final/ gets its own confidence (qkv.cli.trust.calibrate_after_training), or the
    one-line note that it could not: dates of a few words are too short references to fit one."""
    said = (distilled.parent / "stderr.txt").read_text()
    final = distilled / "student" / "final"
    if (final / "confidence.json").is_file():
        assert f"calibrated {final}: confidence.json" in said
    else:
        assert f"note: {final} was not calibrated" in said


def test_the_students_corpus_is_the_ensembles_qkv_translate_output(dates, teacher, distilled, tmp_path):
    expected = translate([teacher / "step-000100", teacher / "final"], dates["train_src"], tmp_path / "ensemble.txt")
    assert (distilled / "distilled" / "train.tgt").read_text(encoding="utf-8").splitlines() == expected
    assert (distilled / "distilled" / "train.src").read_text() == dates["train_src"].read_text()
    alone = translate([teacher / "final"], dates["train_src"], tmp_path / "alone.txt")
    assert alone != expected  # the ensemble was used as an ensemble, not its first member alone
    parts = sorted((distilled / "distilled").glob("part-*.tsv"))
    assert len(parts) == 7  # 400 sources in parts of 64


def test_the_report_puts_teacher_and_student_side_by_side(teacher, distilled):
    report = json.loads((distilled / "report.json").read_text())
    assert set(report["models"]) == {"teacher (ensemble of 2)", "student"}
    for row in report["models"].values():
        assert set(row) == {"parameters", "length_penalty", "valid", "test"}
        assert 0 <= row["test"]["bleu"] <= 100 and row["test"]["sentences_per_s"] > 0
        for set_name in ("valid", "test"):  # lowercasing only merges matches: never below the cased score
            assert row[set_name]["bleu"] <= row[set_name]["bleu_lc"] <= 100
    single = checkpoint.load(teacher / "final").model.num_parameters()
    assert report["models"]["teacher (ensemble of 2)"]["parameters"] == 2 * single
    assert report["models"]["student"]["parameters"] == checkpoint.load(distilled / "student" / "final").model.num_parameters()
    assert report["corpus"]["distilled"] + report["corpus"]["dropped_empty"] == 400 and report["corpus"]["original"] == 0
    assert report["measured"]["device"] == "cpu" and report["measured"]["workers"] == len(os.sched_getaffinity(0))  # auto
    markdown = (distilled / "report.md").read_text()
    assert f"| student | {report['models']['student']['parameters']:,} |" in markdown
    assert "| valid BLEU | valid BLEU (lc) | valid chrF | valid sentences/s | test BLEU | test BLEU (lc) |" in markdown
    student = report["models"]["student"]
    assert f"| {student['test']['bleu']:.2f} | {student['test']['bleu_lc']:.2f} | {student['test']['chrf']:.2f} |" in markdown
    assert not [p for p in distilled.rglob("*") if p.name.endswith(".tmp")]  # no temporary file left
    assert (distilled / "distilled" / "train.tgt").stat().st_mode & 0o777 == 0o666 & ~current_umask()  # a usual file, not mkstemp's 0600


def test_min_score_drops_low_scored_pairs_and_mix_original_appends_the_originals(dates, teacher, distilled, tmp_path):
    rows = [line.rsplit("\t", 1) for part in sorted((distilled / "distilled").glob("part-*.tsv"))
            for line in part.read_text(encoding="utf-8").splitlines()]
    texts, scores = [text for text, _ in rows], [float(value) for _, value in rows]
    threshold = sorted(scores)[len(scores) // 2]
    out = tmp_path / "mixed"
    assert main(distill_args(dates, [teacher / "step-000100", teacher / "final"], out, "--min-score", str(threshold), "--mix-original")) == 0
    corpus = json.loads((out / "report.json").read_text())["corpus"]
    assert corpus["dropped_score"] == sum(v < threshold for v in scores) > 0
    assert corpus["original"] == 400 and corpus["distilled"] == 400 - corpus["dropped_score"] - corpus["dropped_empty"]
    sources = dates["train_src"].read_text(encoding="utf-8").splitlines()
    kept = [(s, t) for s, t, v in zip(sources, texts, scores) if v >= threshold and t.strip()]
    originals = list(zip(sources, dates["train_tgt"].read_text(encoding="utf-8").splitlines()))
    pairs = list(zip((out / "distilled" / "train.src").read_text().splitlines(), (out / "distilled" / "train.tgt").read_text().splitlines()))
    assert pairs == kept + originals


def test_empty_translations_and_sources_are_dropped_and_counted(tmp_path):
    """A teacher's empty translation (or an empty source) trains nothing: it is left out and counted,
    while the low-scored and the kept are counted apart."""
    (tmp_path / distill.PARTS).mkdir()
    sources = ["le chat", "le chien", "", "la maison", "un oiseau"]
    translations = [("the cat", -0.1), ("  ", -0.2), ("a house", -0.1), ("the house", -5.0), ("a bird", -0.3)]
    corpus = distill.student_corpus(tmp_path, sources, translations, originals=None,
                                    filtering=distill.Filtering(min_score=-1.0))
    assert (corpus.distilled, corpus.dropped_empty, corpus.dropped_score, corpus.original) == (2, 2, 1, 0)
    assert corpus.src.read_text(encoding="utf-8") == "le chat\nun oiseau\n"
    assert corpus.tgt.read_text(encoding="utf-8") == "the cat\na bird\n"


def test_a_distillation_killed_after_training_writes_its_report_again_without_training(dates, teacher, distilled, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(distilled, out)
    (out / "report.json").unlink()  # killed between report.md and report.json
    final = {p: p.stat().st_mtime_ns for p in (out / "student").rglob("*") if p.is_file()}
    assert main(distill_args(dates, [teacher / "step-000100", teacher / "final"], out, *CALIBRATED)) == 0
    assert (out / "report.json").is_file()
    assert {p: p.stat().st_mtime_ns for p in (out / "student").rglob("*") if p.is_file()} == final  # not trained again


def test_the_same_command_again_reports_a_complete_distillation_without_work(dates, teacher, distilled, capsys):
    before = {p: p.stat().st_mtime_ns for p in distilled.rglob("*") if p.is_file()}
    assert main(distill_args(dates, [teacher / "step-000100", teacher / "final"], distilled, *CALIBRATED)) == 0
    assert "this distillation is complete" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in distilled.rglob("*") if p.is_file()} == before


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, process.stderr.read()


def test_a_distillation_killed_in_translation_and_in_training_ends_with_an_uninterrupted_ones_files(dates, teacher, distilled, tmp_path):
    out = tmp_path / "d"
    command = [sys.executable, "-m", "qkv", *distill_args(dates, [teacher / "step-000100", teacher / "final"], out)]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    wait_for(out / "distilled" / "part-000000.tsv", first)  # in the translation
    first.send_signal(signal.SIGKILL)
    first.wait()
    part = out / "distilled" / "part-000000.tsv"
    written = (part.stat().st_ino, part.stat().st_mtime_ns)
    second = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    wait_for(out / "student" / "last" / "config.json", second)  # the student's first checkpoint (step 3 of 6)
    second.send_signal(signal.SIGKILL)
    second.wait()
    assert not (out / "report.json").exists()
    # As a kill between a save's two renames leaves it: last/ moved aside, marked as qkv's.
    (out / "student" / "last").rename(out / "student" / "last.old")
    (out / "student" / "last.old" / ".qkv-save").write_text("written by qkv\n")
    third = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    assert (part.stat().st_ino, part.stat().st_mtime_ns) == written  # a finished part is read, not translated again
    starts = [json.loads(line) for line in (out / "student" / "log.jsonl").read_text().splitlines() if '"start"' in line]
    assert len(starts) == 2 and starts[1]["step"] >= 3  # the student resumed from its checkpoint, not from scratch
    for name in ("train.src", "train.tgt", *(p.name for p in (distilled / "distilled").glob("part-*.tsv"))):
        assert (out / "distilled" / name).read_bytes() == (distilled / "distilled" / name).read_bytes(), name
    ours, theirs = load_file(out / "student" / "final" / "model.safetensors"), load_file(distilled / "student" / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_bad_inputs_are_one_line_before_any_work(dates, teacher, distilled, random_checkpoint, tmp_path, capsys):
    def refused(args: list[str], message: str) -> None:
        assert main(args) == 2
        assert message in capsys.readouterr().err

    teacher_files = {p: p.read_bytes() for p in teacher.rglob("*") if p.is_file()}
    out = tmp_path / "new"
    refused(distill_args(dates, [teacher / "final", random_checkpoint], out), "different tokenizers")
    assert not out.exists()
    args = distill_args(dates, [teacher / "final"], out)
    refused([a for a in args if a not in ("--valid-src", str(dates["valid_src"]))], "give --valid-src and --valid-tgt")
    refused(distill_args(dates, [teacher / "final"], out, "--model", "no_such_key=1"), "no_such_key")
    assert not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    refused(distill_args(dates, [teacher / "final"], mine), "holds no qkv distillation")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    before = (distilled / "qkv-distill.json").read_text()
    refused(distill_args(dates, [teacher / "step-000100", teacher / "final"], distilled, *CALIBRATED, "--min-score", "-1"), "other settings (filtering)")
    refused(distill_args(dates, [teacher / "final"], teacher / "final" / "d"), "overlaps the teacher")
    refused(distill_args(dates, [teacher], teacher / "d"), "overlaps the teacher")  # the run named, final/ resolved
    assert (distilled / "qkv-distill.json").read_text() == before
    assert {p: p.read_bytes() for p in teacher.rglob("*") if p.is_file()} == teacher_files
    multi30k = [a for a in distill_args(dates, [teacher / "final"], out) if a not in ("--train-src", str(dates["train_src"]))]
    refused(multi30k, "go with --train-src")
