"""Distributed training: how ranks share an epoch's batches, the exactness of the loss normalisation
(N ranks x K micro-batches make the update of one big batch), and torchrun end to end: train,
interrupt, resume, translate the checkpoint in a single process.

Processes run with one thread each (OMP_NUM_THREADS=1), so two ranks fit on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qkv.io import checkpoint
from qkv.train.distributed import step_share
from qkv.data.tasks import date_pairs
from qkv.train.trainer import Trainer
from qkv.train.recipes import build_configs

TESTS = Path(__file__).resolve().parent


def tiny_configs(data_tsv: Path, **train):
    # Dropout 0 makes a step a deterministic function of the weights and the batch; no clipping, so
    # the gradients compared below are the raw ones (clipping would hide a wrong overall scale).
    # Adam's first step is about lr * sign(grad) wherever |grad| >> eps: with the default eps (1e-9),
    # rounding noise (~1e-11) in gradients that are exactly zero in exact arithmetic (the key bias:
    # softmax ignores a shift shared by all keys) would become full-size steps of either sign.
    return build_configs(
        "tiny",
        model={"dropout": 0.0},
        train={"clip_norm": 0.0, "eps": 1e-6, **train},
        data={"corpus": "files", "train_src": str(data_tsv), "valid_limit": 10},
    )


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model steps fastest on one thread (and two threads crawl when the cores are busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dates(tmp_path_factory) -> tuple[Path, Path]:
    """A TSV of 300 generated date pairs, and a run directory whose tokenizer is already trained."""
    root = tmp_path_factory.mktemp("dist")
    data = root / "dates.tsv"
    data.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(300, seed=0)), encoding="utf-8")
    Trainer(root / "ref", *tiny_configs(data))  # trains and writes the tokenizer
    return data, root / "ref"


def fresh(dates: tuple[Path, Path], run_dir: Path | None = None, *, cls: type[Trainer] = Trainer, **train) -> Trainer:
    """A new trainer with the same initial weights every time (the seed is fixed); in ``run_dir``
    (given the shared tokenizer) when it will write a run, else in the shared directory."""
    data, ref_dir = dates
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / checkpoint.TOKENIZER).write_bytes((ref_dir / checkpoint.TOKENIZER).read_bytes())
    return cls(run_dir or ref_dir, *tiny_configs(data, **train), _checked=True)  # a directory holding the shared tokenizer


def grads_and_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {f"grad.{name}": p.grad.detach().clone() for name, p in model.named_parameters()}
    return out | {f"weight.{name}": p.detach().clone() for name, p in model.named_parameters()}


def step(trainer: Trainer, micro_batches: list[list[int]]) -> tuple[float, int, dict[str, torch.Tensor]]:
    """Take one optimizer step; return its loss per token, its target tokens, the gradients and new weights."""
    loss, n_tokens, applied = trainer.train_step(micro_batches)
    assert applied
    return loss, n_tokens, grads_and_weights(trainer.model)


def assert_same_step(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def target_tokens(trainer: Trainer, batch: list[int]) -> int:
    return sum(len(trainer.train_ids.tgt_ids[i]) + 1 for i in batch)  # + EOS


# ---- sharing an epoch between ranks ---------------------------------------------------------


@pytest.mark.parametrize("world_size, accumulate", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_ranks_get_disjoint_shares_that_cover_each_step(world_size, accumulate):
    batches = [[i] for i in range(11)]
    position, seen = 0, []
    while position < len(batches):
        shares = [step_share(batches, position, rank=r, world_size=world_size, accumulate=accumulate) for r in range(world_size)]
        used = shares[0][1]
        if not used:
            break
        assert all(n == used for _, n in shares) and used <= world_size * accumulate
        assert all(1 <= len(mine) <= accumulate for mine, _ in shares)  # every rank has work, at most K micro-batches
        in_step = sorted(b[0] for mine, _ in shares for b in mine)
        assert in_step == list(range(position, position + used))  # the step's next batches, each on one rank
        seen += in_step
        position += used
    assert sorted(seen) == seen == list(range(len(seen)))  # nothing twice, in order
    # Only a tail too short to give every rank a batch is left out (11 = 5 x 2 + 1 for two ranks).
    assert len(batches) - len(seen) == (1 if (world_size, accumulate) == (2, 1) else 0)


# ---- exactness: accumulation, and two ranks -------------------------------------------------


class RecordingTrainer(Trainer):
    """Remembers the micro-batches of every step."""

    def train_step(self, batches):
        self.__dict__.setdefault("steps", []).append(batches)
        return super().train_step(batches)


def test_accumulating_micro_batches_makes_the_update_of_one_big_batch(dates, tmp_path):
    reference = fresh(dates)
    micro = reference.batches(0)[:3]
    tokens = [target_tokens(reference, b) for b in micro]
    assert len(set(tokens)) > 1  # unequal batches: averaging per batch would weight them wrongly
    big_loss, big_tokens, big = step(reference, [sum(micro, [])])

    loss, n_tokens, accumulated = step(fresh(dates), micro)
    assert n_tokens == big_tokens == sum(tokens)
    assert loss == pytest.approx(big_loss, rel=1e-6)
    assert_same_step(accumulated, big)

    # The test can tell: the mean of per-batch mean gradients is a different gradient.
    per_batch = [step(fresh(dates), [b])[2] for b in micro]
    name = "grad.src_embed.weight"
    naive = sum(g[name] for g in per_batch) / len(micro)
    assert not torch.allclose(naive, big[name], rtol=1e-3, atol=1e-6)

    # A run with accumulate=3 feeds each optimizer step the epoch's next three batches.
    run = fresh(dates, tmp_path / "run", cls=RecordingTrainer, accumulate=3, max_steps=2, eval_every=10)
    run.run(progress=False)
    batches = run.batches(0)
    assert run.steps == [batches[0:3], batches[3:6]] and (run.step, run.position) == (2, 6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_worker(data_tsv: str, run_dir: str, out_dir: str) -> None:
    """One rank of the two-rank test: two optimizer steps through DDP, results saved for the parent.

    Step 1: the first two batches, one per rank. Step 2: the next three, with accumulation, so rank 0
    accumulates two micro-batches (no_sync on the first) while rank 1 has one. Step 3: rank 1's
    gradient overflows (infinite) while the loss stays finite: both ranks must skip it.
    """
    from qkv.train import distributed

    ctx = distributed.init_from_env()
    assert ctx.enabled and ctx.world_size == 2
    trainer = Trainer(run_dir, *tiny_configs(Path(data_tsv), threads=1), _checked=True)  # the tokenizer is in run_dir
    batches = trainer.batches(0)
    first, used_first = step_share(batches, 0, rank=ctx.rank, world_size=2, accumulate=1)
    second, used_second = step_share(batches[:5], 2, rank=ctx.rank, world_size=2, accumulate=2)
    assert (used_first, used_second) == (2, 3)
    results = {}
    for name, mine in (("first", first), ("second", second)):
        loss, n_tokens, tensors = step(trainer, mine)
        results[name] = {"loss": loss, "n_tokens": n_tokens, "batches": mine}
        save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out_dir}/{name}.rank{ctx.rank}.safetensors")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    if ctx.rank == 1:
        next(trainer.model.parameters()).register_hook(lambda grad: grad * float("inf"))
    loss, _, applied = trainer.train_step(first)
    unchanged = all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    results["overflow"] = {"loss": loss, "applied": applied, "unchanged": unchanged}
    Path(f"{out_dir}/rank{ctx.rank}.json").write_text(json.dumps(results))
    del trainer
    distributed.shutdown()


def test_two_ranks_make_the_update_of_one_process_on_both_their_batches(dates, tmp_path):
    data, ref_dir = dates
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / checkpoint.TOKENIZER).write_bytes((ref_dir / checkpoint.TOKENIZER).read_bytes())  # as rank 0 would
    port = free_port()
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_distributed as t; t.ddp_worker(*sys.argv[1:])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(data), str(run_dir), str(tmp_path)],
            env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # An infinite gradient on one rank only, with a finite loss: every rank skipped that step.
    assert [(r["overflow"]["applied"], r["overflow"]["unchanged"]) for r in ranks] == [(False, True), (False, True)]
    assert all(r["overflow"]["loss"] == r["overflow"]["loss"] < float("inf") for r in ranks)

    reference = fresh(dates)
    batches = reference.batches(0)
    # Each rank computed the same epoch order on its own and took its disjoint share of it.
    assert [ranks[r]["first"]["batches"] for r in range(2)] == [[batches[0]], [batches[1]]]
    assert [ranks[r]["second"]["batches"] for r in range(2)] == [[batches[2], batches[4]], [batches[3]]]
    for name, union in (("first", batches[0] + batches[1]), ("second", batches[2] + batches[3] + batches[4])):
        loss, n_tokens, expected = step(reference, [union])  # one process, one batch holding the step's examples
        for r in range(2):
            assert ranks[r][name]["n_tokens"] == n_tokens  # all-reduced: the whole step's tokens
            assert ranks[r][name]["loss"] == pytest.approx(loss, rel=1e-5)
            assert_same_step(load_file(str(tmp_path / f"{name}.rank{r}.safetensors")), expected)


# ---- torchrun end to end ----------------------------------------------------------------------


def torchrun_train(*args: str | Path) -> list[str]:
    """``torchrun --standalone --nproc_per_node=2 -m qkv train ARGS`` (torchrun is torch.distributed.run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "qkv", "train", *map(str, args)]  # fmt: skip


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_torchrun_trains_is_interrupted_resumes_and_its_checkpoint_translates(dates, tmp_path):
    data, _ = dates
    run = tmp_path / "run"
    common = ["--preset", "tiny", "--train-src", data, "--model", "dropout=0.1", "--no-progress"]
    # A run that would go on for a while: Ctrl-C it once it has saved a checkpoint (the time budget
    # is only a safety net). torchrun passes SIGINT on to both ranks, which stop together after a step.
    proc = subprocess.Popen(
        torchrun_train(*common, "--out", run, "--max-steps", 100000, "--time-budget", "120s",
                       "--train", "eval_every=4", "threads=1"),
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run / "last" / checkpoint.TRAINER_JSON).exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert output.count("interrupted: saved") == 1, output  # rank 0 saved last/ and said so
    saved = json.loads((run / "last" / checkpoint.TRAINER_JSON).read_text())
    S = saved["step"]
    assert S >= 4
    assert len(saved["rank_rng"]) == 2  # both ranks' dropout generators, gathered by rank 0
    log = read_log(run)
    starts = [r for r in log if r["event"] == "start"]
    assert len(starts) == 1 and starts[0]["world_size"] == 2  # rank 0 alone writes the log
    # once per evaluation, not once per rank (the interrupt may come just before the evaluation at S)
    valid = [r["step"] for r in log if r["event"] == "valid"]
    assert valid == list(range(4, 4 * len(valid) + 1, 4)) and valid[-1] <= S <= valid[-1] + 4
    assert log[-1]["event"] == "interrupted" and log[-1]["step"] == S

    result = subprocess.run(
        torchrun_train(*common, "--resume", run, "--max-steps", S + 4), env=ENV, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(f"stopped after {S + 4} steps (max_steps)") == 1  # printed by rank 0 only
    log = read_log(run)
    assert [r["step"] for r in log if r["event"] == "start"] == [0, S]  # continued from the saved step
    assert [r["step"] for r in log if r["event"] == "final"] == [S + 4]
    # ... and from the saved data position: four more steps of two batches each (the tail of an
    # epoch shorter than two batches is dropped), as a single process computes the epochs' batches.
    last = json.loads((run / "last" / checkpoint.TRAINER_JSON).read_text())
    single = Trainer.resume(run)
    epoch, position = saved["epoch"], saved["position"]
    for _ in range(4):
        while (used := step_share(single.batches(epoch), position, rank=0, world_size=2, accumulate=1)[1]) == 0:
            epoch, position = epoch + 1, 0
        position += used
    assert (last["step"], last["epoch"], last["position"]) == (S + 4, epoch, position)

    # The checkpoints hold the plain model (no "module." prefixes) and translate in one process.
    with safe_open(str(run / "final" / checkpoint.WEIGHTS), "pt") as weights:
        assert weights.keys() and not any(k.startswith("module.") for k in weights.keys())
    sources = ["9 mai 2017", "3. Oktober 1990", "Tuesday, 9th of May 2017"]
    translated = subprocess.run(
        [sys.executable, "-m", "qkv", "translate", "--checkpoint", run, "--beam", "1"],
        input="\n".join(sources) + "\n", env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert translated.returncode == 0, translated.stderr
    assert len(translated.stdout.splitlines()) == len(sources)


SLOW_VALIDATION = """
import sys, time
from qkv.cli import main as cli
from qkv.train import trainer as train

class SlowValidation(train.Trainer):
    def validate(self):
        if self.step >= 4 and self.dist.is_main:
            (self.run_dir / "validating").write_text(str(self.step))
            while True:  # a validation that would outlast torchrun's grace period (SIGKILL after 30 s)
                time.sleep(0.05)
        return super().validate()

train.Trainer = SlowValidation
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_while_rank_0_validates_saves_last_before_torchrun_kills(dates, tmp_path):
    """A scheduler pre-empts a torchrun job with SIGTERM, and torchrun sends SIGKILL 30 s later. Rank 0
    abandons a validation that would never end, and every rank stops at the same step: last/ is saved."""
    data, _ = dates
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
         sys.executable, "-c", SLOW_VALIDATION, "train", "--preset", "tiny", "--train-src", str(data), "--out", str(run),
         "--model", "dropout=0.1", "--no-progress", "--max-steps", "100000", "--train", "eval_every=4", "threads=1"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run / "validating").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no validation within 120 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    S = int((run / "validating").read_text())
    assert output.count(f"interrupted: saved {run / 'last'} at step {S} (SIGTERM)") == 1, output
    saved = json.loads((run / "last" / checkpoint.TRAINER_JSON).read_text())
    assert saved["step"] == S and len(saved["rank_rng"]) == 2
    checkpoint.verify(run / "last")
    log = read_log(run)
    assert [(r["event"], r["step"]) for r in log if r["event"] != "train"][-2:] == [("valid_abandoned", S), ("interrupted", S)]
