"""`qkv train --init-from CKPT`: a new run that starts from a checkpoint's weights and tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.io import checkpoint
from qkv.data.corpus import collate
from qkv.train.loss import label_smoothed_loss
from qkv.train.recipes import build_configs, fine_tuning_model
from qkv.data.tasks import date_pairs
from qkv.train.trainer import Trainer


def qkv(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], capture_output=True, text=True, timeout=300)


def train_args(data: Path, out: Path, steps: int) -> list[str | Path]:
    return ["train", "--preset", "tiny", "--train-src", data, "--out", out, "--max-steps", str(steps), "--no-progress",
            "--train", f"eval_every={steps}", "threads=1", "average_last=1", "keep_last=1", "--data", "vocab_size=120"]  # fmt: skip


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model trained for 60 steps on dates, and a second task: the same dates, the target reversed."""
    where = tmp_path_factory.mktemp("finetune")
    pairs = date_pairs(400, seed=5)
    (where / "dates.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    (where / "reversed.tsv").write_text("".join(f"{s}\t{t[::-1]}\n" for s, t in pairs), encoding="utf-8")
    result = qkv(*train_args(where / "dates.tsv", where / "parent", 60))
    assert result.returncode == 0, result.stderr
    return where, where / "parent" / "final"


def first_batch_loss(model, tokenizer, tsv: Path) -> float:
    """The model's per-token loss (label-smoothed as in training) on the first lines of a TSV."""
    lines = [line.split("\t") for line in tsv.read_text(encoding="utf-8").splitlines()[:64]]
    src, tgt_in, tgt_out = collate([tokenizer.encode(s) for s, _ in lines], [tokenizer.encode(t) for _, t in lines],
                                   pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)  # fmt: skip
    with torch.no_grad():
        total, n = label_smoothed_loss(model.eval()(src, tgt_in), tgt_out, pad_id=tokenizer.pad_id, smoothing=0.1)
    return float(total / n)


def test_fine_tuning_starts_from_the_parent_and_learns_the_new_task(parent):
    where, parent_ckpt = parent
    result = qkv(*train_args(where / "reversed.tsv", where / "child", 40), "--init-from", parent_ckpt)
    assert result.returncode == 0, result.stderr
    loaded_parent, child_run = checkpoint.load(parent_ckpt), where / "child"
    # the run uses the parent's tokenizer (not a new one trained on the new text) and says where it started
    assert (child_run / "tokenizer.model").read_bytes() == loaded_parent.tokenizer.model_proto
    start = json.loads((child_run / "log.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["init_from"] == str(parent_ckpt)
    # it learned the new task: the child's loss on it is well below the parent's
    parent_loss = first_batch_loss(loaded_parent.model, loaded_parent.tokenizer, where / "reversed.tsv")
    child = checkpoint.load(child_run / "final")
    assert first_batch_loss(child.model, child.tokenizer, where / "reversed.tsv") < parent_loss - 0.2


def test_the_first_step_starts_from_the_parents_weights_with_a_fresh_optimizer(parent, tmp_path):
    where, parent_ckpt = parent
    loaded = checkpoint.load(parent_ckpt)
    model, train, data = build_configs("tiny", model={}, train={"threads": 1}, data={"corpus": "files", "train_src": str(where / "reversed.tsv")})
    child = Trainer(tmp_path / "child", fine_tuning_model(loaded.model.config, {}), train, data, init_from=loaded)
    fresh = Trainer(tmp_path / "fresh", child.model_config, train, data)  # same seed, same config, random start
    parent_state = loaded.model.state_dict()
    assert all(torch.equal(value, parent_state[name]) for name, value in child.model.state_dict().items())
    assert not torch.equal(fresh.model.src_embed.weight, parent_state["src_embed.weight"])
    assert child.optimizer.state_dict()["state"] == {} and child.step == 0
    # the loss of its first step is the parent's on that batch, far below a random model's
    batch = child.batches(0)[:1]
    child_loss, _, _ = child.train_step(batch)
    fresh_loss, _, _ = fresh.train_step(batch)
    with torch.no_grad():
        src, tgt_in, tgt_out = child._collate(batch[0])
        total, n = label_smoothed_loss(loaded.model.eval()(src, tgt_in), tgt_out, pad_id=loaded.tokenizer.pad_id, smoothing=0.1)
    assert child_loss == pytest.approx(float(total / n), rel=1e-5)  # tiny has no dropout: train == eval
    assert fresh_loss > child_loss + 1.0


def test_a_model_override_that_does_not_fit_the_checkpoint_is_one_line(parent, tmp_path):
    where, parent_ckpt = parent
    result = qkv(*train_args(where / "reversed.tsv", tmp_path / "run", 5), "--init-from", parent_ckpt, "--model", "d_model=64")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--init-from keeps the checkpoint's model: --model d_model cannot change" in result.stderr
    assert not (tmp_path / "run").exists()
    ok = qkv(*train_args(where / "reversed.tsv", tmp_path / "run2", 2), "--init-from", parent_ckpt, "--model", "dropout=0.1")
    assert ok.returncode == 0, ok.stderr
