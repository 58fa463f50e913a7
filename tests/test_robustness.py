"""Never lose a run, never trust input: resume after SIGKILL, NaN losses, Ctrl-C, hostile input,
and property-based checks of the tokenizer and of `qkv translate`'s one-line-in, one-line-out rule."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MULTI30K
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv import checkpoint, train as train_module
from qkv.checks import check_resume_exactness
from qkv.cli import main
from qkv.tasks import date_pairs
from qkv.train import Trainer, build_configs


def qkv(*args: str | Path, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv", *map(str, args)], input=input, capture_output=True, text=True, timeout=timeout,
        encoding="utf-8",
    )


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    """Assert the failure looks as a user should see it, and return the message."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qkv {command}: error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def dates_tsv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dates") / "dates.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(300, seed=3)), encoding="utf-8")
    return path


def dates_trainer(run_dir: Path, data: Path, **train) -> Trainer:
    model, train_cfg, data_cfg = build_configs(
        "tiny", model={}, train={"threads": 1, **train}, data={"corpus": "files", "train_src": str(data), "vocab_size": 120}
    )
    return Trainer(run_dir, model, train_cfg, data_cfg)


# ---- exact resume after SIGKILL ------------------------------------------------------------------


def test_a_run_killed_with_sigkill_resumes_to_bitwise_identical_weights(tmp_path):
    result = check_resume_exactness(str(tmp_path), steps=40)
    assert result.passed, result.detail
    assert "max |diff| = 0.0e+00" in result.detail


def test_doctor_resume_runs_the_kill_and_resume_check(monkeypatch, capsys):
    from qkv import checks

    calls = []

    def fake() -> checks.CheckResult:
        calls.append(1)
        return checks.CheckResult("resume after SIGKILL is bitwise exact", False, "max |diff| = 1.0e-03")

    monkeypatch.setattr(checks, "check_resume_exactness", fake)
    assert main(["doctor", "--resume"]) == 1  # a failed check fails the command
    out = capsys.readouterr().out
    assert calls == [1] and "FAIL  resume after SIGKILL is bitwise exact: max |diff| = 1.0e-03" in out


# ---- numerical faults ----------------------------------------------------------------------------


def inject_nan_at(monkeypatch, trainer: Trainer, step: int) -> None:
    """Make the loss of optimizer step ``step`` (1-based) NaN, as an overflow would."""
    real = train_module.label_smoothed_loss

    def loss(*args, **kwargs):
        value, count = real(*args, **kwargs)
        if trainer.step + 1 == step and trainer.model.training:
            value = value * float("nan")
        return value, count

    monkeypatch.setattr(train_module, "label_smoothed_loss", loss)


def test_a_nan_loss_skips_the_step_and_leaves_weights_and_adam_alone(monkeypatch, tmp_path, dates_tsv):
    trainer = dates_trainer(tmp_path / "run", dates_tsv)
    batches = trainer.batches(0)
    trainer.train_step([batches[0]])
    trainer.step = 1
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    adam = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    inject_nan_at(monkeypatch, trainer, 2)
    with pytest.warns(UserWarning, match="non-finite loss at step 2: the update is skipped"):
        loss, _, applied = trainer.train_step([batches[1]])
    assert not applied and loss != loss  # NaN
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(adam[k], v) for k, v in trainer.optimizer.state_dict()["state"][0].items())
    trainer.step = 2
    loss, _, applied = trainer.train_step([batches[1]])  # the next step trains normally
    assert applied and loss == loss
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_on_nan_stop_ends_the_run_with_a_clear_message_and_keeps_the_last_checkpoint(monkeypatch, tmp_path, dates_tsv, capsys):
    run = tmp_path / "run"
    trainer = dates_trainer(run, dates_tsv, on_nan="stop", eval_every=5, max_steps=20)
    inject_nan_at(monkeypatch, trainer, 8)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 8; last good checkpoint: .*last"):
        trainer.run(progress=False)
    saved = json.loads((run / "last" / "trainer.json").read_text())
    assert saved["step"] == 5
    checkpoint.verify(run / "last")
    assert all(torch.isfinite(p).all() for p in checkpoint.load(run / "last").model.parameters())


def test_on_nan_stop_through_the_cli_is_one_line(monkeypatch, tmp_path, dates_tsv, capsys):
    real = train_module.label_smoothed_loss
    monkeypatch.setattr(train_module, "label_smoothed_loss", lambda *a, **k: (real(*a, **k)[0] * float("inf"), real(*a, **k)[1]))
    status = main(["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(tmp_path / "run"),
                   "--no-progress", "--train", "on_nan=stop"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("qkv train: error: loss is inf at step 1")


# ---- Ctrl-C during training ----------------------------------------------------------------------


def test_ctrl_c_during_training_saves_a_clean_checkpoint_then_exits(tmp_path, dates_tsv):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(run),
         "--max-steps", "100000", "--no-progress", "--train", "eval_every=100000", "threads=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (run / "log.jsonl").exists() or '"train"' not in (run / "log.jsonl").read_text():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"continue with qkv train --resume {run}" in err
    step = json.loads((run / "last" / "trainer.json").read_text())["step"]
    assert step >= 50
    checkpoint.verify(run / "last")
    resumed = Trainer.resume(run)
    assert resumed.step == step


# ---- hostile and broken input --------------------------------------------------------------------


def test_an_empty_corpus_is_one_line(tmp_path):
    (tmp_path / "empty.tsv").write_text("", encoding="utf-8")
    message = one_line_error(qkv("train", "--preset", "tiny", "--train-src", tmp_path / "empty.tsv", "--out", tmp_path / "run"), "train")
    assert "empty.tsv" in message and "no usable sentence pairs" in message


def test_a_missing_training_file_is_named(tmp_path):
    message = one_line_error(qkv("train", "--preset", "tiny", "--train-src", tmp_path / "nowhere.tsv", "--out", tmp_path / "run"), "train")
    assert "nowhere.tsv" in message


@pytest.mark.parametrize(
    "args, hint",
    [
        (["--preset", "multi30"], "did you mean 'multi30k'"),
        (["--train", "warmup_step=100"], "did you mean 'warmup_steps'"),
        (["--model", "d_modle=64"], "did you mean 'd_model'"),
    ],
)
def test_unknown_presets_and_config_keys_suggest_the_right_name(tmp_path, dates_tsv, args, hint):
    message = one_line_error(qkv("train", "--train-src", dates_tsv, "--out", tmp_path / "run", *args), "train")
    assert hint in message


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, dates_tsv) -> Path:
    """A tiny model trained for 20 steps on dates: enough to translate (badly), fast to make."""
    run = tmp_path_factory.mktemp("model") / "run"
    dates_trainer(run, dates_tsv, max_steps=20, eval_every=20, average_last=1, keep_last=1).run(progress=False)
    return run / "final"


def test_a_checkpoint_from_a_newer_qkv_and_a_missing_tokenizer_are_one_line(model_dir, tmp_path):
    import shutil

    newer = tmp_path / "newer"
    shutil.copytree(model_dir, newer)
    config = json.loads((newer / "config.json").read_text())
    (newer / "config.json").write_text(json.dumps({**config, "format": checkpoint.FORMAT_VERSION + 1}))
    checkpoint._write_manifest(newer)  # as a newer qkv would write it: whole, with its own checksums
    message = one_line_error(qkv("translate", "--checkpoint", newer, input="9 mai 2017\n"), "translate")
    assert "newer qkv" in message

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.model").unlink()
    message = one_line_error(qkv("translate", "--checkpoint", broken, input="9 mai 2017\n"), "translate")
    assert "tokenizer.model is missing" in message


def test_translate_survives_hostile_lines_and_keeps_one_line_per_line(model_dir):
    lines = [
        "9 mai 2017",
        "",
        ("9 mai 2017 " * 10_000)[:100_000],  # 100,000 characters, far beyond the model's positions: truncated, with a warning
        "\x00\x07 control \x1b[31m characters\x7f",
        "zero\u200bwidth\u200djoiners\ufeff",
        "🐶🚲 emoji 👩‍👩‍👧 and ﷽",
        "   ",
        "carriage\rreturn and line\u2028separator inside one line",
        "last line",
    ]
    result = qkv("translate", "--checkpoint", model_dir, "--beam", "2", input="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[1] == "" and out[6] == ""  # empty (and blank) input lines give empty output lines
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: an input of ") and "truncated" in warnings[0]


def test_invalid_utf8_on_stdin_is_one_line(model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "translate", "--checkpoint", str(model_dir)], input=b"ok\n\xff\xfe bad\n",
        capture_output=True, timeout=120,
    )
    assert result.returncode == 2
    err = result.stderr.decode()
    assert "Traceback" not in err and err.startswith("qkv translate: error: standard input line 2 is not valid UTF-8 (byte 1: ")


# ---- properties ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return checkpoint.load(model_dir).tokenizer


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_any_unicode_text_encodes_to_valid_ids_and_decodes(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert isinstance(tokenizer.decode(ids), str)


def alphabet_of(tokenizer) -> str:
    pieces = (tokenizer.pieces([i])[0] for i in range(4, tokenizer.vocab_size))
    return "".join(sorted({c for piece in pieces for c in piece if c != "\u2581"})) + " "


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_over_the_vocabulary_alphabet_round_trips(tokenizer, data):
    text = data.draw(st.text(alphabet=alphabet_of(tokenizer), max_size=60))
    assert tokenizer.decode(tokenizer.encode(text)) == tokenizer.normalize(text)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.text(alphabet=st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=40), max_size=6))
def test_translate_keeps_n_lines_in_n_lines_out(model_dir, tmp_path, lines):
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    status = main(["translate", "--checkpoint", str(model_dir), "--beam", "1", "--input", str(source), "--output", str(target), "--force"])
    assert status == 0
    out = target.read_text(encoding="utf-8")
    assert out.count("\n") == len(lines) and (out == "" or out.endswith("\n"))


def test_doctor_runs_its_decoding_checks_on_a_trained_checkpoint(model_dir, capsys):
    assert main(["doctor", "--checkpoint", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "9/9 checks passed" in out and "FAIL" not in out
    assert out.count("batch invariance (batch 1 vs 32") == 3  # the random model, then this one at beam 1 and 5
