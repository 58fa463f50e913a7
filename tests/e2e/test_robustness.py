"""Never lose a run, never trust input: resume after SIGKILL, NaN losses and gradients, Ctrl-C, SIGTERM
and SIGHUP, a full disk, --out over an existing run, hostile input, and property-based checks of the
tokenizer and of `qkv translate`'s one-line-in, one-line-out rule."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.io import checkpoint, manifest
from qkv.train import trainer as train_module
from qkv.inspect.doctor import check_resume_exactness
from qkv.cli.main import main
from qkv.train.log import RunLog
from qkv.train.stopping import StopRequested
from qkv.train.trainer import Trainer
from qkv.train.recipes import build_configs


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
    resumed_from = int(result.detail.split("resumed from step ")[1].split(",")[0])
    assert 0 < resumed_from < 40  # training really resumed: the kill came before the last checkpoint


def test_doctor_resume_runs_the_kill_and_resume_check(monkeypatch, capsys):
    from qkv.inspect import doctor as checks

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
    poison_loss(monkeypatch, lambda: trainer.step + 1 == step and trainer.model.training, float("nan"))


def poison_loss(monkeypatch, when, factor: float) -> None:
    """Multiply the training loss by ``factor`` whenever ``when()``, whichever loss the trainer uses
    (the plain one on logits, or the fused one with the output projection)."""
    for name in ("label_smoothed_loss", "projected_label_smoothed_loss"):
        real = getattr(train_module, name)

        def loss(*args, real=real, **kwargs):
            value, count = real(*args, **kwargs)
            return (value * factor if when() else value), count

        monkeypatch.setattr(train_module, name, loss)


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


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step(tmp_path, dates_tsv, clip_norm):
    trainer = dates_trainer(tmp_path / "run", dates_tsv, clip_norm=clip_norm)
    batches = trainer.batches(0)
    trainer.train_step([batches[0]])
    trainer.step = 1
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    adam = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    # an overflow in backward: one parameter's gradient is infinite (and NaN where it was 0)
    hook = next(trainer.model.parameters()).register_hook(lambda grad: grad * float("inf"))
    with pytest.warns(UserWarning, match="non-finite gradient norm at step 2: the update is skipped"):
        loss, _, applied = trainer.train_step([batches[1]])
    hook.remove()
    assert not applied and math.isfinite(loss)  # the loss itself was fine
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(adam[k], v) for k, v in trainer.optimizer.state_dict()["state"][0].items())
    trainer.step = 2
    loss, _, applied = trainer.train_step([batches[1]])  # the next step trains normally
    assert applied and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

    stopping = dates_trainer(tmp_path / "stop", dates_tsv, clip_norm=clip_norm, on_nan="stop")
    next(stopping.model.parameters()).register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(FloatingPointError, match=r"gradient norm is (nan|inf) at step 1; last good checkpoint"):
        stopping.train_step([batches[0]])


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
    poison_loss(monkeypatch, lambda: True, float("inf"))
    status = main(["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(tmp_path / "run"),
                   "--no-progress", "--train", "on_nan=stop"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("qkv train: error: loss is inf at step 1")


# ---- Ctrl-C, SIGTERM, SIGHUP during training ------------------------------------------------------


def start_training(run: Path, dates_tsv: Path, *extra: str) -> subprocess.Popen:
    """`qkv train` on dates for far more steps than the test waits for, once it has logged a step."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(run),
         "--max-steps", "100000", "--no-progress", "--train", "threads=1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # as from a terminal, even if pytest runs under nohup
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (run / "log.jsonl").exists() or '"train"' not in (run / "log.jsonl").read_text():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    return process


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_during_training_saves_a_clean_checkpoint_then_exits(tmp_path, dates_tsv, signum, status):
    """Ctrl-C, a scheduler's pre-emption (SIGTERM) and a closed terminal (SIGHUP) alike."""
    run = tmp_path / "run"
    process = start_training(run, dates_tsv, "eval_every=100000")
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == status, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    step = json.loads((run / "last" / "trainer.json").read_text())["step"]
    assert step >= 50
    assert f"interrupted: saved {run / 'last'} at step {step} ({signal.Signals(signum).name}); continue with qkv train --resume {run}" in err
    checkpoint.verify(run / "last")
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log[-1] == {**log[-1], "event": "interrupted", "step": step, "signal": signal.Signals(signum).name}
    resumed = Trainer.resume(run)
    assert resumed.step == step


def test_under_nohup_a_closed_terminal_does_not_stop_the_run(tmp_path, dates_tsv):
    run = tmp_path / "run"
    process = subprocess.Popen(
        ["nohup", sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(run),
         "--max-steps", "100000", "--no-progress", "--train", "threads=1", "eval_every=100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (run / "log.jsonl").exists() or '"train"' not in (run / "log.jsonl").read_text():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGHUP)  # ignored ...
    steps = len((run / "log.jsonl").read_text().splitlines())
    while len((run / "log.jsonl").read_text().splitlines()) < steps + 2:  # ... the run goes on logging
        assert time.monotonic() < deadline + 60 and process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode == 130
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r.get("signal") for r in log if r["event"] == "interrupted"] == ["SIGINT"]


SECOND_SIGNAL = """
import os, signal, sys
from qkv.cli import main as cli
from qkv.train import trainer as train

class SignalledTwice(train.Trainer):
    def train_step(self, batches):
        if self.step + 1 == 13:  # Ctrl-C twice in the middle of step 13 (its forward pass)
            def twice(module, args):
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            self.model.register_forward_pre_hook(twice)
        return super().train_step(batches)

train.Trainer = SignalledTwice
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_stops_at_once_and_never_writes_over_last(tmp_path, dates_tsv):
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL, "train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(run),
         "--max-steps", "100", "--no-progress", "--train", "eval_every=5", "threads=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 130, result.stderr
    assert "second signal (SIGINT): stopped at once; nothing was saved after the first" in result.stderr
    assert "Traceback" not in result.stderr
    # last/ is the checkpoint of step 10, whole: nothing from the interrupted step 13 was written
    assert json.loads((run / "last" / "trainer.json").read_text())["step"] == 10
    checkpoint.verify(run / "last")
    assert Trainer.resume(run).step == 10


def test_a_signal_during_validation_abandons_it_and_saves_last(tmp_path, dates_tsv):
    """Validation can take minutes; torchrun sends SIGKILL 30 s after SIGTERM. A signal abandons it."""
    run = tmp_path / "run"
    trainer = dates_trainer(run, dates_tsv, max_steps=100, eval_every=5)
    validate, scored = trainer.validate, []

    def signalled_validate():
        if trainer.step == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        result = validate()
        scored.append(trainer.step)
        return result

    trainer.validate = signalled_validate
    with pytest.raises(StopRequested) as stopped:
        trainer.run(progress=False)
    assert stopped.value.exit_status == 143
    assert scored == [5]  # the validation of step 10 never finished
    assert json.loads((run / "last" / "trainer.json").read_text())["step"] == 10  # saved at once, no more steps
    assert not (run / "step-000010").exists()
    events = [(r["event"], r["step"]) for r in trainer.log.records if r["event"] != "train"]
    assert events[-3:] == [("valid", 5), ("valid_abandoned", 10), ("interrupted", 10)]
    checkpoint.verify(run / "last")


def test_a_signal_while_final_is_chosen_leaves_last_and_resume_writes_final_without_training(tmp_path, dates_tsv):
    run = tmp_path / "run"
    trainer = dates_trainer(run, dates_tsv, max_steps=4, eval_every=2, keep_last=2, average_last=2)
    finish, validate = trainer.finish, trainer.validate
    trainer.finish = lambda: (setattr(trainer, "finishing", True), finish())[1]

    def validate_or_signal():
        if getattr(trainer, "finishing", False):  # validating the average of step-2 and step-4
            os.kill(os.getpid(), signal.SIGTERM)
        return validate()

    trainer.validate = validate_or_signal
    with pytest.raises(StopRequested) as stopped:
        trainer.run(progress=False)
    assert stopped.value.exit_status == 143
    assert not (run / "final").exists()
    assert json.loads((run / "last" / "trainer.json").read_text())["step"] == 4

    resumed = Trainer.resume(run)
    stepped = []
    resumed.train_step = lambda batches: stepped.append(batches)
    result = resumed.run(progress=False)
    assert stepped == [] and (result.step, result.stopped_because) == (4, "max_steps")
    assert [r["event"] for r in resumed.log.records][-1] == "final"
    checkpoint.load(run / "final")


# ---- a full disk -----------------------------------------------------------------------------------


def fill_disk(monkeypatch, full: Callable[[str], bool]) -> Callable[[], None]:
    """Make ``os.fsync`` fail as a full disk does (ENOSPC) for every file whose path ``full`` accepts;
    returns what makes room again."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if full(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return lambda: monkeypatch.setattr(os, "fsync", real_fsync)


def test_a_full_disk_during_a_save_is_one_line_keeps_the_checkpoints_and_resume_works(monkeypatch, tmp_path, dates_tsv, capsys):
    run = tmp_path / "run"
    # the disk is full when last/ is written for the second time (step 10)
    make_room = fill_disk(monkeypatch, lambda path: "/last.tmp/" in path and (run / "last").exists())
    args = ["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--no-progress", "--max-steps", "20",
            "--train", "eval_every=5", "threads=1"]  # fmt: skip
    assert main([*args, "--out", str(run)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]  # tiny's data caps
    assert len(err) == 2 and err[-1].startswith(f"qkv train: error: cannot write checkpoint {run / 'last'} (No space left on device)")
    assert f"continue with qkv train --resume {run}" in err[-1]
    make_room()
    assert json.loads((run / "last" / "trainer.json").read_text())["step"] == 5  # the earlier last/, whole
    checkpoint.verify(run / "last")
    # the log's last line was torn by the full disk: resume drops it and goes on
    with open(run / "log.jsonl", "a", encoding="utf-8") as log:
        log.write('{"time": 1.0, "event": "tra')
    with pytest.warns(UserWarning, match="dropped a torn last line"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "final" and json.loads((run / "last" / "trainer.json").read_text())["step"] == 20


def test_a_full_disk_while_final_is_written_is_one_line_and_resume_writes_it_without_training(monkeypatch, tmp_path, dates_tsv, capsys):
    run = tmp_path / "run"
    make_room = fill_disk(monkeypatch, lambda path: "/final.tmp/" in path)  # full once last/ holds the final step
    args = ["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--no-progress", "--max-steps", "6",
            "--train", "eval_every=3", "threads=1", "tune_length_penalty=true", "--out", str(run)]  # fmt: skip
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]  # tiny's data caps
    assert len(err) == 2 and err[-1].startswith(f"qkv train: error: cannot write checkpoint {run / 'final'} (No space left on device)")
    assert f"continue with qkv train --resume {run}" in err[-1]
    assert not (run / "final").exists() and not (run / "final.tmp").exists()
    assert json.loads((run / "last" / "trainer.json").read_text())["step"] == 6
    make_room()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    resumed_at = max(i for i, r in enumerate(records) if r["event"] == "start")
    assert records[resumed_at]["step"] == 6  # nothing trained: final/ chosen and written again
    assert [r["event"] for r in records[resumed_at + 1:]] == ["length_penalty", "final"]
    checkpoint.verify(run / "final")


def test_the_run_log_drops_a_torn_last_line_but_not_a_corrupted_one(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "start", "step": 0}\n{"event": "train", "st', encoding="utf-8")
    with pytest.warns(UserWarning, match="dropped a torn last line"):
        log = RunLog(path)
    assert log.records == [{"event": "start", "step": 0}]
    log.write(event="train", step=1)
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["start", "train"]
    path.write_text('{"event": "start"}\n{"event": \n{"event": "train"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        RunLog(path)


def test_a_log_write_that_fails_keeps_no_record_of_it(monkeypatch, tmp_path):
    log = RunLog(tmp_path / "log.jsonl")
    log.write(event="start", step=0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(OSError, match=r"cannot append to .*log.jsonl \(No space left on device\); the run stops here") as error:
        log.write(event="train", step=1)
    assert error.value.errno == errno.ENOSPC
    assert [r["event"] for r in log.records] == ["start"]  # the plot and final/ never see a record the file lacks


# ---- --out over an existing run -------------------------------------------------------------------



def train_args(dates_tsv: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(out), "--no-progress",
            "--max-steps", "4", "--train", "eval_every=2", "threads=1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, dates_tsv) -> Path:
    """A finished four-step run, with a user's own files beside qkv's."""
    run = tmp_path_factory.mktemp("small") / "run"
    result = qkv(*train_args(dates_tsv, run))
    assert result.returncode == 0, result.stderr
    (run / "notes.txt").write_text("my notes\n")
    (run / "best.txt").write_text("not a checkpoint\n")
    (run / "data").mkdir()
    (run / "data" / "log.jsonl").write_text("the user's own log\n")
    return run


def test_out_over_an_existing_run_is_refused_and_changes_nothing(small_run, dates_tsv):
    before = snapshot(small_run)
    message = one_line_error(qkv(*train_args(dates_tsv, small_run, "--data", "vocab_size=100")), "train")
    assert f"--out {small_run} already holds a run: continue it with qkv train --resume {small_run}" in message
    assert "--overwrite" in message
    assert snapshot(small_run) == before
    # --overwrite deletes nothing before the new run's settings and data have loaded
    for mistake in (["--train", "lr_typo=1"], ["--train-src", str(dates_tsv.parent / "nowhere.tsv")]):
        one_line_error(qkv(*train_args(dates_tsv, small_run, "--overwrite"), *mistake), "train")
        assert snapshot(small_run) == before


def test_out_into_a_directory_that_is_not_a_run_is_refused_even_with_overwrite(tmp_path, dates_tsv):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work\n")
    (mine / "last").mkdir()  # named like a checkpoint, but not one
    (mine / "last" / "draft.txt").write_text("draft\n")
    before = snapshot(mine)
    for extra in ([], ["--overwrite"]):
        message = one_line_error(qkv(*train_args(dates_tsv, mine), *extra), "train")
        assert f"--out {mine} is not empty and holds no qkv run" in message
    assert snapshot(mine) == before


def test_overwrite_starts_over_and_deletes_only_what_qkv_wrote(small_run, tmp_path, dates_tsv):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    (run / "step-000090").mkdir()  # an older step checkpoint of the same run (a longer first attempt)
    shutil.copy(run / "step-000004" / "config.json", run / "step-000090" / "config.json")
    (run / "final.tmp").mkdir()  # and a save cut short (qkv marks it as its own first)
    (run / "final.tmp" / checkpoint.MARKER).write_text("")
    users = {name: data for name, data in snapshot(run).items() if name in ("notes.txt", "best.txt", "data/log.jsonl")}
    result = qkv(*train_args(dates_tsv, run, "--overwrite"), "--max-steps", "2", "--data", "vocab_size=100")
    assert result.returncode == 0, result.stderr
    after = snapshot(run)
    assert all(after[name] == data for name, data in users.items())  # the user's files, untouched
    assert not (run / "step-000090").exists() and not (run / "step-000004").exists() and not (run / "final.tmp").exists()
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "start"] == [0]  # a new log, not appended to
    assert log[0]["vocab_size"] == 100  # a new tokenizer, trained with the new setting
    assert checkpoint.load(run / "final").tokenizer.vocab_size == 100


def test_a_run_stopped_before_its_first_checkpoint_is_started_over_with_overwrite(small_run, tmp_path, dates_tsv):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("tokenizer.model", "qkv-run.json"):  # what a run stopped while loading its data leaves
        shutil.copy(small_run / name, run)
    message = one_line_error(qkv(*train_args(dates_tsv, run)), "train")
    assert f"--out {run} holds a run that saved no checkpoint to resume from: start it over with --overwrite" in message
    result = qkv(*train_args(dates_tsv, run, "--overwrite"))
    assert result.returncode == 0, result.stderr
    assert f"--overwrite: deleted qkv-run.json, tokenizer.model from {run}" in result.stderr


def test_a_directory_holding_a_users_own_tokenizer_is_not_a_run(small_run, tmp_path, dates_tsv):
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(small_run / "tokenizer.model", mine)  # their own SentencePiece model, named as qkv names one
    before = snapshot(mine)
    for extra in ([], ["--overwrite"]):
        message = one_line_error(qkv(*train_args(dates_tsv, mine), *extra), "train")
        assert f"--out {mine} is not empty and holds no qkv run" in message
    assert snapshot(mine) == before


@pytest.mark.parametrize("mistake", [
    ["--data", "vocab_size=16"],  # the tokenizer cannot be trained
    ["--tensorboard", "FILE"],  # the writer cannot be made
    ["--model", "d_ff=1099511627776"],  # the model cannot be allocated (128 TiB)
    ["--model", "max_len=1"],  # the pairs cannot be encoded (no room for a token)
    ["--data", "term_share=0.3", "term_file=TERMS"],  # pseudo-terms of other pairs (read at the first batch, after the clearing)
    ["--data", "term_share=0.3", "term_file=FILE"],  # not a pseudo-terms file at all
])
def test_overwrite_deletes_nothing_when_a_later_step_fails(small_run, tmp_path, dates_tsv, mistake):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    terms = tmp_path / "terms.jsonl"
    terms.write_text('["0123456789abcdef", [[0, "Mann"]]]\n')  # a well-formed line for a pair this run does not have
    before = snapshot(run)
    given = {"FILE": a_file, "TERMS": terms}  # a flag's value, or a key's after its "="
    filled = [str(given[m]) if m in given else m.replace("=FILE", f"={a_file}").replace("=TERMS", f"={terms}") for m in mistake]
    result = qkv(*train_args(dates_tsv, run, "--overwrite"), *filled)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert snapshot(run) == before  # the old run is whole: the user has it still


def test_overwrite_refuses_to_delete_the_checkpoint_it_fine_tunes_from(small_run, tmp_path, dates_tsv):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    before = snapshot(run)
    message = one_line_error(qkv(*train_args(dates_tsv, run, "--overwrite"), "--init-from", run / "final"), "train")
    assert f"--out {run} overlaps {(run / 'final').resolve()}, which this command reads" in message
    assert snapshot(run) == before


def test_overwrite_refuses_a_checkpoint_directory_holding_a_users_file(small_run, tmp_path, dates_tsv):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    (run / "best" / "my-notes.txt").write_text("mine\n")
    before = snapshot(run)
    message = one_line_error(qkv(*train_args(dates_tsv, run, "--overwrite")), "train")
    assert f"{run / 'best'} holds files qkv did not write (my-notes.txt)" in message
    assert snapshot(run) == before  # refused before anything was deleted


def test_resume_with_a_setting_it_cannot_change_is_one_line(small_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    message = one_line_error(qkv("train", "--resume", run, "--seed", "7", "--train", "beta2=0.99"), "train")
    assert "--resume cannot change beta2 (0.98 -> 0.99), seed (1 -> 7)" in message
    # model and data flags that differ from the run's are refused too, never silently dropped
    message = one_line_error(qkv("train", "--resume", run, "--preset", "tiny", "--model", "dropout=0.3"), "train")
    assert "--resume cannot change dropout (0.0 -> 0.3)" in message and message.endswith("and the data flags")


def test_resume_without_a_preset_checks_only_the_keys_the_flags_set(small_run, tmp_path, dates_tsv):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)  # a tiny-preset run: without --preset, the multi30k preset says nothing about it
    message = one_line_error(qkv("train", "--resume", run, "--model", "dropout=0.3"), "train")
    assert message.endswith("--resume cannot change dropout (0.0 -> 0.3): the run keeps the model and data it started "
                            "with; leave out --preset, --model and the data flags")  # fmt: skip
    result = qkv("train", "--resume", run, "--model", "dropout=0.0", "--train-src", dates_tsv, "--max-steps", "5", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "stopped after 5 steps" in result.stdout


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
    manifest.write(newer)  # as a newer qkv would write it: whole, with its own checksums
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
    # the one warning is the cut line's ("note: " lines are notices, e.g. that an untrained model writes empty lines)
    warnings = [line for line in result.stderr.splitlines() if line and not line.startswith("note: ")]
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
    source, target = tmp_path / "in.txt", tmp_path / f"out-{os.urandom(6).hex()}.txt"  # a new output each example
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    status = main(["translate", "--checkpoint", str(model_dir), "--beam", "1", "--input", str(source), "--output", str(target)])
    assert status == 0
    out = target.read_text(encoding="utf-8")
    assert out.count("\n") == len(lines) and (out == "" or out.endswith("\n"))


def test_doctor_runs_its_decoding_checks_on_a_trained_checkpoint(model_dir, capsys):
    assert main(["doctor", "--checkpoint", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "9/9 checks passed" in out and "FAIL" not in out
    assert out.count("batch invariance (batch 1 vs 32") == 3  # the random model, then this one at beam 1 and 5
