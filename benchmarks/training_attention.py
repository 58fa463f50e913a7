"""Attention in a training step: PyTorch's fused kernel against the explicit steps, forward and backward.

``qkv.model.attention`` takes the explicit steps (matmul, scale, softmax, matmul) for inputs with
gradients when ``m * n`` per head is at most ``SHORT_TRAINING_ATTENTION``; this measures where that
pays. For each length L, a batch of about ``--tokens`` positions (B = tokens // L sentences, 4 heads
of 32, padding masks of random lengths between L/2 and L), self-attention with and without the causal
mask, output and gradients of q, k and v; both paths alternate in each repeat.

    python -m benchmarks.training_attention --lengths 16,28,64,128 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qkv.model.attention import SHORT_TRAINING_ATTENTION, scaled_dot_product_attention


def measure(length: int, *, tokens: int, repeats: int, heads: int = 4, d_head: int = 32) -> dict:
    g = torch.Generator().manual_seed(length)
    B = max(1, tokens // length)
    q, k, v = (torch.randn(B, heads, length, d_head, generator=g) for _ in range(3))
    lengths = torch.randint(length // 2, length + 1, (B,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L): real keys
    grad = torch.randn(B, heads, length, d_head, generator=g)

    def step(fused: bool) -> list[torch.Tensor]:
        results = []
        for causal in (False, True):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out, _ = scaled_dot_product_attention(*leaves, mask=mask, causal=causal, fused=fused)
            out.backward(grad)
            results += [out.detach(), *(x.grad for x in leaves)]
        return results

    difference = max(float((a - b).abs().max()) for a, b in zip(step(True), step(False)))
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for fused in (True, False):
            start = time.perf_counter()
            step(fused)
            ms[fused].append((time.perf_counter() - start) * 1e3)
    fused_ms, explicit_ms = statistics.median(ms[True]), statistics.median(ms[False])
    return {"length": length, "batch": B, "m_times_n": length * length, "explicit_in_training": length * length <= SHORT_TRAINING_ATTENTION,
            "fused_ms": round(fused_ms, 3), "explicit_ms": round(explicit_ms, 3), "explicit_speed": round(fused_ms / explicit_ms, 3),
            "fused_ms_range": [round(min(ms[True]), 3), round(max(ms[True]), 3)],
            "explicit_ms_range": [round(min(ms[False]), 3), round(max(ms[False]), 3)], "max_difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16,28,64,128", help="positions per sentence, comma-separated")
    parser.add_argument("--tokens", type=int, default=4000, help="positions per batch (the preset's batches hold about 4,000)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for length in map(int, args.lengths.split(",")):
        print(json.dumps({**measure(length, tokens=args.tokens, repeats=args.repeats), "threads": args.threads}), flush=True)


if __name__ == "__main__":
    main()
