"""End to end through the real command line: train -> translate -> evaluate -> average, and the
errors a user meets on the way (one line, exit status 2, no traceback)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MULTI30K, needs_multi30k, require_multi30k

from qkv.io import checkpoint
from qkv.cli.common import LOOP_GUARD
from qkv.cli.main import main
from qkv.data.sentences import TextOptions
from qkv.data.corpus import load_multi30k
from qkv.infer.search import DecodeConfig
from qkv.infer.bleu import score
from qkv.infer.translator import Translator


def qkv(*args: str | Path, input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m qkv ARGS`` as a user would, capturing its output."""
    return subprocess.run(
        # a guard against a hang, not a timing: a shared machine can take minutes for the tiny training
        [sys.executable, "-m", "qkv", *map(str, args)], input=input, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    require_multi30k()
    run = tmp_path_factory.mktemp("cli") / "run"
    result = qkv(
        "train", "--preset", "tiny", "--max-steps", 60, "--data-dir", MULTI30K,
        "--data", "valid_limit=20", "--out", run, "--no-progress",
    )  # fmt: skip
    return run, result


@needs_multi30k
def test_train_writes_a_run_and_reports_it(cli_run):
    run, result = cli_run
    assert result.returncode == 0, result.stderr
    assert "stopped after 60 steps (max_steps)" in result.stdout
    assert re.search(r"validation: BLEU \d+\.\d\d, BLEU \(lc\) \d+\.\d\d, chrF \d+\.\d\d", result.stdout)
    for name in ("final", "last", "best", "step-000050", "step-000060", "log.jsonl", "curves.png"):
        assert (run / name).exists(), name
    config = checkpoint.read_config(run)
    assert config["train"]["max_steps"] == 60 and config["data"]["valid_limit"] == 20


@needs_multi30k
def test_translate_reads_stdin_and_writes_one_line_per_input_line(cli_run):
    run, _ = cli_run
    lines = ["A dog runs in the park.", "", "Two men are talking on a bench."]
    result = qkv("translate", "--checkpoint", run, input="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 3
    outputs = result.stdout.splitlines()
    assert outputs[1] == "" and outputs[0] and outputs[2]
    # the command writes what the library translates (beam 5, length penalty 0.6, the loop guard, sentences and capitals)
    config = DecodeConfig(loop_guard=LOOP_GUARD)
    assert outputs == Translator.from_checkpoint(run, config, text=TextOptions(split="en", recase=True)).translate(lines)


@needs_multi30k
def test_evaluate_prints_sacrebleu_scores_with_signatures(cli_run, tmp_path):
    run, _ = cli_run
    test = load_multi30k("test_2016_flickr", "en", "de", MULTI30K)
    (tmp_path / "src.en").write_text("\n".join(test.src[:20]) + "\n", encoding="utf-8")
    (tmp_path / "ref.de").write_text("\n".join(test.tgt[:20]) + "\n", encoding="utf-8")
    result = qkv(
        "evaluate", "--checkpoint", run, "--beam", 2, "--src-file", tmp_path / "src.en",
        "--ref-file", tmp_path / "ref.de", "--save", tmp_path / "hyp.de",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "20 sentences" in out and "beam 2" in out
    bleu = re.search(r"^BLEU +(\d+\.\d\d) +nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:\S+$", out, re.M)
    bleu_lc = re.search(r"^BLEU \(lc\) +(\d+\.\d\d) +nrefs:1\|case:lc\|eff:no\|tok:13a\|smooth:exp\|version:\S+$", out, re.M)
    chrf = re.search(r"^chrF +(\d+\.\d\d) +nrefs:1\|case:mixed\|eff:yes\|nc:6\|nw:0\|space:no\|version:\S+$", out, re.M)
    assert bleu and bleu_lc and chrf, out
    # the printed numbers are sacreBLEU's on the saved, detokenized translations
    hypotheses = (tmp_path / "hyp.de").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 20
    expected = score(hypotheses, test.tgt[:20])
    assert [float(m.group(1)) for m in (bleu, bleu_lc, chrf)] == [expected["bleu"], expected["bleu_lc"], expected["chrf"]]


@needs_multi30k
def test_average_writes_a_loadable_checkpoint(cli_run, tmp_path):
    run, _ = cli_run
    steps = [run / "step-000050", run / "step-000060"]
    result = qkv("average", *steps, "--out", tmp_path / "avg")
    assert result.returncode == 0, result.stderr
    averaged = checkpoint.load(tmp_path / "avg")
    assert averaged.tokenizer.vocab_size == checkpoint.load(steps[0]).tokenizer.vocab_size
    weights = averaged.model.state_dict()
    for name, value in checkpoint.average(steps).items():
        assert torch.equal(weights[name], value)
    # training averaged the same two checkpoints into final/
    final = checkpoint.load(run / "final").model.state_dict()
    assert all(torch.equal(final[name], weights[name]) for name in weights)
    assert Translator(averaged.model, averaged.tokenizer, DecodeConfig(beam_size=1)).translate(["A dog."])[0]


@needs_multi30k
def test_train_resume_continues_a_run(cli_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cli_run[0], run)
    result = qkv("train", "--resume", run, "--max-steps", 70, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "stopped after 70 steps (max_steps)" in result.stdout
    starts = [r["step"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r["event"] == "start"]
    assert starts == [0, 60]
    assert json.loads((run / "last" / "trainer.json").read_text())["step"] == 70


@needs_multi30k
def test_closing_stdout_early_is_quiet(cli_run):
    # `qkv translate < big.txt | head -1`: the reader leaves after one line while qkv still writes
    run, _ = cli_run
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkv", "translate", "--checkpoint", str(run), "--beam", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdin.write("A dog runs in the park.\n" * 3000)  # three windows of 1,024 lines (translate_stream)
    proc.stdin.close()
    first = proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert first.strip()
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr


# ---- errors a user can fix ---------------------------------------------------------------------


def test_a_missing_checkpoint_is_one_line_and_status_2(tmp_path):
    result = qkv("translate", "--checkpoint", tmp_path / "nowhere", input="A dog.\n")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("qkv translate: error: ") and str(tmp_path / "nowhere") in result.stderr


def test_training_files_of_different_lengths_name_both_files_and_counts(tmp_path, capsys):
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("A dog.\nA cat.\nA bird.\n", encoding="utf-8")
    tgt.write_text("Ein Hund.\nEine Katze.\n", encoding="utf-8")
    status = main(["train", "--preset", "tiny", "--train-src", str(src), "--train-tgt", str(tgt), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("qkv train: error: ") and err.count("\n") == 1
    assert f"{src} has 3 lines" in err and f"{tgt} has 2" in err
