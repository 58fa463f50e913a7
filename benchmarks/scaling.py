"""(d) Scaling: decode step time against output position with and without the KV cache, training step
time against sequence length at a fixed token budget, and training peak memory against batch tokens.

All on qkv's model at the benchmark's size (post-LN, d_model 512, 8 heads, d_ff 2048, 6+6 layers,
vocabulary 8000; ``--smoke``: a small one) with random weights: speed does not depend on training.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks.probe import run_probe, time_it, train_memory_step
from qkv.config import ModelConfig
from qkv.model import Transformer

BASE = dict(src_vocab_size=8000, tgt_vocab_size=8000, d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6,
            n_decoder_layers=6, dropout=0.1)
SMALL = dict(BASE, d_model=128, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2)


@torch.inference_mode()
def decode_steps(model: Transformer, *, positions: int, src_len: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of the decoder step that produces position t (t = 1..positions), one sentence,
    with the cache (one new token per step) and without it (the whole prefix again every step)."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, model.config.src_vocab_size, (1, src_len), generator=g)
    tgt = torch.randint(4, model.config.tgt_vocab_size, (1, positions), generator=g)
    memory, src_mask, _ = model.encode(src)
    cached, full = [[] for _ in range(positions)], [[] for _ in range(positions)]
    for _ in range(repeats):
        state = model.new_state()
        for t in range(positions):
            start = time.perf_counter()
            model.decode(tgt[:, t : t + 1], memory, src_mask, state=state)
            cached[t].append((time.perf_counter() - start) * 1e3)
        for t in range(positions):
            start = time.perf_counter()
            model.decode(tgt[:, : t + 1], memory, src_mask)
            full[t].append((time.perf_counter() - start) * 1e3)
    return {"with_cache_ms": [statistics.median(x) for x in cached], "without_cache_ms": [statistics.median(x) for x in full]}


def run(*, smoke: bool, threads: int, out: Path, log) -> dict:
    sizes = SMALL if smoke else BASE
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**sizes)).eval()
    positions = 24 if smoke else 128
    steps = decode_steps(model, positions=positions, src_len=20, repeats=2)
    log(f"decode steps: last position {steps['with_cache_ms'][-1]:.2f} ms cached, {steps['without_cache_ms'][-1]:.2f} ms uncached")
    plot = _plot_decode(steps, out / "decode_steps.png", sizes)

    budget = 256 if smoke else 1024
    lengths = [16, 64] if smoke else [16, 64, 256]
    train_rows = []
    for length in lengths:
        timing = time_it(train_memory_step(budget, length, sizes), reps=2, max_seconds=30)
        train_rows.append({"length": length, "batch_sentences": max(1, budget // length), **timing})
        log(f"train step at length {length}: {timing}")

    memory_rows = []
    for batch_tokens in ([256, 1024] if smoke else [512, 1024, 2048, 4096]):
        result = run_probe({"kind": "train_memory", "batch_tokens": batch_tokens, "length": 32, "model": sizes,
                            "reps": 0, "threads": threads})
        memory_rows.append({"batch_tokens": batch_tokens, **result})
        log(f"train memory at {batch_tokens} tokens: {result}")
    return {"model": sizes, "decode": {"positions": positions, "src_len": 20, **steps, "plot": plot.name},
            "train_step_vs_length": {"tokens_per_batch": budget, "rows": train_rows},
            "train_memory_vs_batch_tokens": {"length": 32, "rows": memory_rows}}


def _plot_decode(steps: dict, path: Path, sizes: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(1, len(steps["with_cache_ms"]) + 1))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, steps["without_cache_ms"], label="without cache (whole prefix each step)")
    ax.plot(x, steps["with_cache_ms"], label="with KV cache (one token each step)")
    ax.set(xlabel="output position", ylabel="decoder step (ms)",
           title=f"Decode step time, d_model {sizes['d_model']}, {sizes['n_decoder_layers']} decoder layers, batch 1")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(section: dict) -> str:
    d, m = section["decode"], section["model"]
    pick = sorted(p for p in {1, 8, 32, d["positions"] // 2, d["positions"]} if p <= d["positions"])
    lines = [
        f"### (d) Scaling (d_model {m['d_model']}, {m['n_heads']} heads, {m['n_encoder_layers']}+{m['n_decoder_layers']} layers, random weights)",
        "",
        f"Decoder step time by output position, batch 1, source of {d['src_len']} tokens (plot: `{d['plot']}`):",
        "",
        "| position | " + " | ".join(str(p) for p in pick) + " |",
        "|---|" + "---:|" * len(pick),
        "| with KV cache (ms) | " + " | ".join(f"{d['with_cache_ms'][p - 1]:.2f}" for p in pick) + " |",
        "| without cache (ms) | " + " | ".join(f"{d['without_cache_ms'][p - 1]:.2f}" for p in pick) + " |",
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
