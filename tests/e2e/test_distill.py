"""`qkv distill` on the dates task with tiny models: the teacher's translations are `qkv translate`'s,
an ensemble teacher is an ensemble, a killed distillation ends with the files of an uninterrupted one,
and bad inputs are one line before any work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli.main import main
from qkv.data.tasks import date_pairs
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
    assert main(distill_args(dates, [teacher / "step-000100", teacher / "final"], out)) == 0
    return out


def test_the_students_corpus_is_the_ensembles_qkv_translate_output(dates, teacher, distilled, tmp_path):
    expected = translate([teacher / "step-000100", teacher / "final"], dates["train_src"], tmp_path / "ensemble.txt")
    assert (distilled / "distilled" / "train.tgt").read_text(encoding="utf-8").splitlines() == expected
    assert (distilled / "distilled" / "train.src").read_text() == dates["train_src"].read_text()
    alone = translate([teacher / "final"], dates["train_src"], tmp_path / "alone.txt")
    assert alone != expected  # the ensemble was used as an ensemble, not its first member alone
    parts = sorted((distilled / "distilled").glob("part-*.tsv"))
    assert len(parts) == 7  # 400 sources in parts of 64


def test_the_report_puts_teacher_and_student_side_by_side(distilled):
    report = json.loads((distilled / "report.json").read_text())
    assert set(report["models"]) == {"teacher (ensemble of 2)", "student"}
    for row in report["models"].values():
        assert set(row) == {"parameters", "valid", "test"} and 0 <= row["test"]["bleu"] <= 100 and row["test"]["sentences_per_s"] > 0
    assert report["corpus"]["distilled"] + report["corpus"]["dropped_empty"] == 400 and report["corpus"]["original"] == 0
    assert (distilled / "student" / "final" / "model.safetensors").is_file()
    assert "| student |" in (distilled / "report.md").read_text()


def test_the_same_command_again_reports_a_complete_distillation_without_work(dates, teacher, distilled, capsys):
    before = {p: p.stat().st_mtime_ns for p in distilled.rglob("*") if p.is_file()}
    assert main(distill_args(dates, [teacher / "step-000100", teacher / "final"], distilled)) == 0
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
    wait_for(out / "distilled" / "part-000001.tsv", first)  # in the middle of the translation
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not (out / "distilled" / "part-000006.tsv").exists()
    second = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    wait_for(out / "student" / "last" / "config.json", second)  # the student's first checkpoint (step 3 of 6)
    second.send_signal(signal.SIGKILL)
    second.wait()
    assert not (out / "report.json").exists()
    third = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    for name in ("train.src", "train.tgt", *(p.name for p in (distilled / "distilled").glob("part-*.tsv"))):
        assert (out / "distilled" / name).read_bytes() == (distilled / "distilled" / name).read_bytes(), name
    ours, theirs = load_file(out / "student" / "final" / "model.safetensors"), load_file(distilled / "student" / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_bad_inputs_are_one_line_before_any_work(dates, teacher, distilled, random_checkpoint, tmp_path, capsys):
    def refused(args: list[str], message: str) -> None:
        assert main(args) == 2
        assert message in capsys.readouterr().err

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
    refused(distill_args(dates, [teacher / "step-000100", teacher / "final"], distilled, "--min-score", "-1"), "other settings (filtering)")
    refused(distill_args(dates, [teacher / "final"], teacher / "final" / "d"), "overlaps the teacher")
    assert (distilled / "qkv-distill.json").read_text() == before
