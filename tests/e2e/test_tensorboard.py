"""qkv train --tensorboard DIR: the log's training and validation numbers as TensorBoard scalars,
the same values at the same steps as log.jsonl (which stays the source of truth)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import MULTI30K, needs_multi30k

pytest.importorskip("tensorboard")


@needs_multi30k
def test_train_writes_the_logs_numbers_as_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, board = tmp_path / "run", tmp_path / "board"
    out = subprocess.run(
        [sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--data-dir", str(MULTI30K), "--out", str(run),
         "--tensorboard", str(board), "--no-progress", "--max-steps", "100",
         "--train", "eval_every=50", "--data", "train_limit=400", "valid_limit=10"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "valid/bleu", "valid/valid_loss", "valid/chrf"} <= tags
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    for event, key in (("train", "loss"), ("train", "lr"), ("valid", "bleu"), ("valid", "valid_loss")):
        logged = [(r["step"], r[key]) for r in records if r["event"] == event]
        board_values = [(s.step, s.value) for s in events.Scalars(f"{event}/{key}")]
        assert [s for s, _ in board_values] == [s for s, _ in logged] and logged
        assert all(v == pytest.approx(w, rel=1e-6) for (_, v), (_, w) in zip(board_values, logged))


def test_tensorboard_is_refused_clearly_without_the_package(tmp_path, monkeypatch):
    import builtins

    from qkv.train.log import open_tensorboard

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ValueError, match=r"pip install tensorboard \(in qkv's clone: pip install -e '\.\[tensorboard\]'\)"):
        open_tensorboard(tmp_path / "board")


@needs_multi30k
def test_overwrite_with_tensorboard_but_no_package_keeps_the_old_run(tmp_path, monkeypatch):
    import builtins

    from qkv.cli.main import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"event": "start", "step": 0}\n')  # an earlier run, stopped before a checkpoint
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    status = main(["train", "--preset", "tiny", "--data-dir", str(MULTI30K), "--out", str(run), "--overwrite",
                   "--tensorboard", str(tmp_path / "board"), "--no-progress", "--max-steps", "1",
                   "--data", "train_limit=50", "valid_limit=5"])  # fmt: skip
    assert status == 2
    assert (run / "log.jsonl").read_text() == '{"event": "start", "step": 0}\n'
    assert [p.name for p in run.iterdir()] == ["log.jsonl"]
