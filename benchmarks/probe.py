"""Measurements that need a process of their own (peak memory of one configuration), and the timing
helpers the sections share (repeated timings with their spread, the load-average check).

Peak memory on CPU is the growth of the resident set during one forward+backward pass, in a fresh
process per configuration: reset the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``),
run the step, then read ``VmHWM`` minus the ``VmRSS`` before it (Linux only). It counts everything
the step touched (activations, gradients, workspace), not only tensors torch's allocator tracked.

    python -m benchmarks.probe '{"kind": "attention", "impl": "qkv", "n": 256}'   # prints one JSON line
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _status_mb(key: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024


def peak_growth_mb(step: Callable[[], None]) -> float:
    """MB the resident set grew to, above its size before, while ``step`` ran."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_mb("VmRSS")
    step()
    return _status_mb("VmHWM") - before


def time_it(step: Callable[[], None], *, reps: int, max_seconds: float) -> dict[str, float]:
    """Median and min milliseconds of ``step`` after one warm-up call, within ``max_seconds``."""
    step()
    times: list[float] = []
    end = time.perf_counter() + max_seconds
    while len(times) < reps and (not times or time.perf_counter() < end):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"ms": statistics.median(times), "ms_min": min(times), "reps": len(times)}


def repeat_timed(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    """Seconds of each of ``repeats`` calls of ``fn`` (the caller warms up first), and the last result."""
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return seconds, result


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def load() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def busy(load_1min: float, threads: int) -> bool:
    """Whether a 1-minute load average shows another job beside a benchmark running ``threads`` threads.

    A benchmark alone keeps the load near its own threads (all busy; measured at most 1.71 with 2
    threads on a quiet machine), and near 0 between jobs; half a runnable thread beyond them means
    something else shares the cores, and the timings taken then are slower by an unknown amount."""
    return load_1min > threads + 0.5


def check_load(where: str, threads: int, log: Callable[[str], None]) -> float:
    """The 1-minute load average now, with a printed warning when it is ``busy``."""
    now = load()[0]
    if busy(now, threads):
        log(f"WARNING: load average {now} before {where} (over {threads} thread(s) + 0.5): another job is running, "
            "the timings that follow are not clean")
    return now


def attention_step(impl: str, n: int, d_model: int, n_heads: int) -> Callable[[], None]:
    """One forward+backward of self-attention over ``n`` positions (batch 1) with a padding mask
    in which every key is real, as for the longest sentence of a batch."""
    from torch import nn
    import torch.nn.functional as F

    from benchmarks.baselines import TutorialAttention
    from qkv.model.attention import MultiHeadAttention

    torch.manual_seed(0)
    x = torch.randn(1, n, d_model, requires_grad=True)
    keep = torch.ones(1, n, dtype=torch.bool)  # True = real key
    if impl == "qkv":
        module = MultiHeadAttention(d_model, n_heads)
        forward = lambda: module(x, key_mask=keep)[0]  # noqa: E731
    elif impl == "tutorial":
        module = TutorialAttention(d_model, n_heads)
        mask = keep[:, None, None, :]
        forward = lambda: module(x, x, x, mask)  # noqa: E731
    elif impl == "torch_mha":
        module = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        # need_weights=False: its default (True) materialises the averaged weights on a slower path.
        forward = lambda: module(x, x, x, key_padding_mask=~keep, need_weights=False)[0]  # noqa: E731
    elif impl == "sdpa":
        # The same projections, then PyTorch's fused kernel called directly: the floor for qkv.
        module = nn.ModuleDict({"in_proj": nn.Linear(d_model, 3 * d_model), "out_proj": nn.Linear(d_model, d_model)})
        mask = keep[:, None, None, :]

        def forward():
            q, k, v = module["in_proj"](x).view(1, n, 3, n_heads, d_model // n_heads).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (1, H, n, d)
            return module["out_proj"](out.transpose(1, 2).reshape(1, n, d_model))
    else:
        raise ValueError(f"unknown attention implementation {impl!r}")

    def step() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        forward().sum().backward()

    return step


def train_memory_step(batch_tokens: int, length: int, model: dict) -> Callable[[], None]:
    """One qkv training step (forward, label-smoothed loss, backward, Adam) on ``batch_tokens``
    source and target tokens per side, in sentences of ``length`` tokens."""
    from qkv.model.config import ModelConfig
    from qkv.model.transformer import Transformer
    from qkv.train.loss import label_smoothed_loss

    torch.manual_seed(0)
    config = ModelConfig.from_dict(model)
    net = Transformer(config).train()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    B = max(1, batch_tokens // length)
    src = torch.randint(4, config.src_vocab_size, (B, length))
    tgt = torch.randint(4, config.tgt_vocab_size, (B, length + 1))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, n = label_smoothed_loss(net(src, tgt[:, :-1]), tgt[:, 1:], pad_id=config.pad_id, smoothing=0.1)
        (loss / n).backward()
        optimizer.step()

    return step


def main(spec: dict) -> dict:
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    if spec["kind"] == "attention":
        step = attention_step(spec["impl"], spec["n"], spec.get("d_model", 512), spec.get("n_heads", 8))
    elif spec["kind"] == "train_memory":
        step = train_memory_step(spec["batch_tokens"], spec["length"], spec["model"])
    else:
        raise ValueError(f"unknown probe kind {spec['kind']!r}")
    result = {"peak_mb": round(peak_growth_mb(step), 1)}
    if spec.get("reps", 0) > 0:
        result |= time_it(step, reps=spec["reps"], max_seconds=spec.get("max_seconds", 10.0))
    return result


def run_probe(spec: dict, timeout: float = 600) -> dict:
    """Run ``main(spec)`` in a fresh Python process and return its result (or an ``error``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.probe", json.dumps(spec)], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def throwaway_trainer(model_cfg, train_cfg, data_cfg, *, tokenizer: Path | None = None):
    """A ``qkv.train.trainer.Trainer`` whose run directory is gone once it is built: a benchmark keeps its
    model, tokenizer and batches, never a run. ``tokenizer``: a tokenizer.model to use instead of
    training one."""
    from qkv.train.trainer import HeldPeakWarning, Trainer

    run_dir = Path(tempfile.mkdtemp(prefix="qkv-bench-"))
    try:
        if tokenizer is not None:
            shutil.copyfile(tokenizer, run_dir / "tokenizer.model")  # same vocabulary, no retraining
        with warnings.catch_warnings():  # it times steps and never runs a schedule to its end
            warnings.simplefilter("ignore", HeldPeakWarning)
            return Trainer(run_dir, model_cfg, train_cfg, data_cfg)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))


def write_results(out: str | Path, result: dict, markdown: Callable[[dict], str]) -> None:
    """``OUT.json`` (the numbers) and ``OUT.md`` (``markdown(result)``) beside each other."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(result) + "\n", encoding="utf-8")
