"""(d) Scaling: decode step time against output position with and without the KV cache (median and
min-max of repeated sweeps, per position), training step time against sequence length at a fixed
token budget, and training peak memory against batch tokens.

All on qkv's model at the benchmark's size (post-LN, d_model 512, 8 heads, d_ff 2048, 6+6 layers,
vocabulary 8000; ``--smoke``: a small one) with random weights: speed does not depend on training.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from benchmarks.probe import busy, check_load, run_probe, spread, time_it, train_memory_step
from qkv.model.config import ModelConfig
from qkv.model.transformer import Transformer

BASE = dict(src_vocab_size=8000, tgt_vocab_size=8000, d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6,
            n_decoder_layers=6, dropout=0.1)
SMALL = dict(BASE, d_model=128, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2)


@torch.inference_mode()
def decode_steps(model: Transformer, *, positions: int, src_len: int, repeats: int, uncached_every: int = 8) -> dict:
    """Milliseconds of the decoder step that produces position t, one sentence: with the cache (one new
    token per step; every t = 1..positions) and without it (the whole prefix again; t = 1, every
    ``uncached_every``-th and the last, as each such step costs the prefix).

    One warm-up sweep of each, then ``repeats`` sweeps alternating cached and uncached with the
    garbage collector paused; per position the median, min and max over the sweeps. (Two sweeps
    without a warm-up on a busy machine made the cached step look slower than the uncached one.)"""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, model.config.src_vocab_size, (1, src_len), generator=g)
    tgt = torch.randint(4, model.config.tgt_vocab_size, (1, positions), generator=g)
    memory, src_mask, _ = model.encode(src)
    uncached_at = sorted({1, *range(uncached_every, positions + 1, uncached_every), positions})

    def cached_sweep() -> list[float]:
        state, times = model.new_state(), []
        for t in range(positions):
            start = time.perf_counter()
            model.decode(tgt[:, t : t + 1], memory, src_mask, state=state)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def uncached_sweep() -> list[float]:
        times = []
        for p in uncached_at:
            start = time.perf_counter()
            model.decode(tgt[:, :p], memory, src_mask)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    cached_sweep(), uncached_sweep()  # warm-up
    cached, uncached = [], []
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            cached.append(cached_sweep())
            uncached.append(uncached_sweep())
    finally:
        if collecting:
            gc.enable()

    def per_position(at: list[int], sweeps: list[list[float]]) -> dict:
        stats = [spread(list(times)) for times in zip(*sweeps)]
        return {"positions": at, **{f"{k}_ms": [round(x[k], 4) for x in stats] for k in ("median", "min", "max")}}

    return {"repeats": repeats, "with_cache": per_position(list(range(1, positions + 1)), cached),
            "without_cache": per_position(uncached_at, uncached)}


def run(*, smoke: bool, threads: int, out: Path, log, repeats: int = 0) -> dict:
    sizes = SMALL if smoke else BASE
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**sizes)).eval()
    positions = 24 if smoke else 128
    loads = {"decode": check_load("scaling: decode steps", threads, log)}
    steps = decode_steps(model, positions=positions, src_len=20, repeats=repeats or (3 if smoke else 9))
    cached, full = steps["with_cache"], steps["without_cache"]
    log(f"decode steps ({steps['repeats']} sweeps, medians): position {positions} {cached['median_ms'][-1]:.2f} ms cached, "
        f"{full['median_ms'][-1]:.2f} ms uncached; position 8 {cached['median_ms'][7]:.2f} ms cached")
    plot = _plot_decode(steps, out / "decode_steps.png", sizes)

    budget = 256 if smoke else 1024
    lengths = [16, 64] if smoke else [16, 64, 256]
    loads["train_step"] = check_load("scaling: training step by length", threads, log)
    train_rows = []
    for length in lengths:
        timing = time_it(train_memory_step(budget, length, sizes), reps=2, max_seconds=30)
        train_rows.append({"length": length, "batch_sentences": max(1, budget // length), **timing})
        log(f"train step at length {length}: {timing}")

    loads["train_memory"] = check_load("scaling: training memory", threads, log)
    memory_rows = []
    for batch_tokens in ([256, 1024] if smoke else [512, 1024, 2048, 4096]):
        result = run_probe({"kind": "train_memory", "batch_tokens": batch_tokens, "length": 32, "model": sizes,
                            "reps": 0, "threads": threads})
        memory_rows.append({"batch_tokens": batch_tokens, **result})
        log(f"train memory at {batch_tokens} tokens: {result}")
    return {"model": sizes, "threads": threads, "loads": loads,
            "decode": {"positions": positions, "src_len": 20, **steps, "plot": plot.name},
            "train_step_vs_length": {"tokens_per_batch": budget, "rows": train_rows},
            "train_memory_vs_batch_tokens": {"length": 32, "rows": memory_rows}}


def _plot_decode(steps: dict, path: Path, sizes: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, marker in (("without_cache", "without cache (whole prefix each step)", "o"),
                               ("with_cache", "with KV cache (one token each step)", None)):
        d = steps[key]
        line, = ax.plot(d["positions"], d["median_ms"], marker=marker, markersize=3, label=f"{label}, median")
        ax.fill_between(d["positions"], d["min_ms"], d["max_ms"], color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set(xlabel="output position", ylabel="decoder step (ms)",
           title=f"Decode step time, d_model {sizes['d_model']}, {sizes['n_decoder_layers']} decoder layers, batch 1\n"
                 f"median of {steps['repeats']} sweeps, band: min-max")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(section: dict) -> str:
    d, m = section["decode"], section["model"]
    cached, full = d["with_cache"], d["without_cache"]
    at = {p: i for i, p in enumerate(full["positions"])}
    last = d["positions"]
    pick = sorted(p for p in {1, 8, 32, 64, 96, last} if p in at)
    growth_cached = cached["median_ms"][last - 1] / cached["median_ms"][8 - 1]  # the step at `last` over the one at 8
    growth_full = full["median_ms"][at[last]] / full["median_ms"][at[8]]
    load = section["loads"]["decode"]
    lines = [
        f"### (d) Scaling (d_model {m['d_model']}, {m['n_heads']} heads, {m['n_encoder_layers']}+{m['n_decoder_layers']} layers, random weights)",
        "",
        f"Decoder step time by output position, batch 1, source of {d['src_len']} tokens (plot: `{d['plot']}`): median "
        f"of {d['repeats']} sweeps after a warm-up sweep, min-max in brackets; load average {load:.2f} before"
        + (" (**busy**: another job was running, the times are not clean)." if busy(load, section["threads"]) else "."),
        "",
        "| position | with KV cache (ms) | without cache (ms) |",
        "|---:|---:|---:|",
        *(f"| {p} | {cached['median_ms'][p - 1]:.2f} ({cached['min_ms'][p - 1]:.2f}-{cached['max_ms'][p - 1]:.2f}) | "
          f"{full['median_ms'][at[p]]:.2f} ({full['min_ms'][at[p]]:.2f}-{full['max_ms'][at[p]]:.2f}) |" for p in pick),
        "",
        f"Step at position {last} over the step at position 8 (medians; 1.00x = flat): with the cache "
        f"{growth_cached:.2f}x, without it {growth_full:.2f}x.",
        "",
        f"Training step (forward, loss, backward, Adam) at {section['train_step_vs_length']['tokens_per_batch']} "
        "tokens per side, by sentence length:",
        "",
        "| length | sentences | ms/step |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {r['length']} | {r['batch_sentences']} | {r['ms']:.0f} |" for r in section["train_step_vs_length"]["rows"]]
    lines += ["", f"Training peak memory (resident-set growth during one step, fresh process, sentences of "
                  f"{section['train_memory_vs_batch_tokens']['length']} tokens) by batch tokens:", "",
              "| batch tokens | peak MB |", "|---:|---:|"]
    lines += [f"| {r['batch_tokens']} | {r.get('peak_mb', 'error')} |" for r in section["train_memory_vs_batch_tokens"]["rows"]]
    return "\n".join(lines)
