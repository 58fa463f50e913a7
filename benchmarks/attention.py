"""(a) Attention alone: forward+backward time and peak memory, qkv against three alternatives.

Self-attention over n positions, batch 1, d_model 512, 8 heads, with a padding mask in which every
key is real. Each configuration runs in a fresh process (see ``benchmarks.probe``), so one's memory
does not hide another's.
"""

from __future__ import annotations

from benchmarks.probe import run_probe

IMPLEMENTATIONS = {
    "qkv": "qkv MultiHeadAttention",
    "tutorial": "tutorial-literal (matmul, scale, masked_fill, softmax, matmul)",
    "torch_mha": "torch.nn.MultiheadAttention (need_weights=False)",
    "sdpa": "F.scaled_dot_product_attention called directly (same projections)",
}


def run(*, smoke: bool, threads: int, log) -> dict:
    sizes = [64, 256] if smoke else [64, 256, 1024, 4096]
    reps, max_seconds = (2, 1.0) if smoke else (3, 6.0)
    rows = []
    for n in sizes:
        for impl in IMPLEMENTATIONS:
            spec = {"kind": "attention", "impl": impl, "n": n, "d_model": 512, "n_heads": 8, "reps": reps,
                    "max_seconds": max_seconds, "threads": threads}
            result = run_probe(spec)
            rows.append({"impl": impl, "n": n, **result})
            log(f"attention n={n} {impl}: {result}")
    return {"d_model": 512, "n_heads": 8, "batch": 1, "rows": rows, "implementations": IMPLEMENTATIONS}


def markdown(section: dict) -> str:
    rows = section["rows"]
    sizes = sorted({r["n"] for r in rows})
    by = {(r["impl"], r["n"]): r for r in rows}
    lines = [
        "### (a) Attention: forward+backward, batch 1, d_model 512, 8 heads",
        "",
        "Time: median of repeated forward+backward passes after a warm-up. Peak memory: growth of the",
        "resident set during one forward+backward pass, in a fresh process per cell (VmHWM after the",
        "pass minus VmRSS before it, with the high-water mark reset through /proc/self/clear_refs).",
        "",
        "| implementation | " + " | ".join(f"n={n} ms" for n in sizes) + " | " + " | ".join(f"n={n} MB" for n in sizes) + " |",
        "|---|" + "---:|" * (2 * len(sizes)),
    ]
    for impl, label in section["implementations"].items():
        cells = [_fmt(by.get((impl, n), {}), "ms") for n in sizes] + [_fmt(by.get((impl, n), {}), "peak_mb") for n in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Speed ratios (tutorial time / qkv time; >1 means qkv is faster): " + ", ".join(
        f"n={n}: {by[('tutorial', n)]['ms'] / by[('qkv', n)]['ms']:.2f}x"
        for n in sizes if "ms" in by.get(("tutorial", n), {}) and "ms" in by.get(("qkv", n), {})
    ))
    return "\n".join(lines)


def _fmt(row: dict, key: str) -> str:
    if "error" in row:
        return "error"
    value = row.get(key)
    return "-" if value is None else (f"{value:.1f}" if value < 100 else f"{value:.0f}")
