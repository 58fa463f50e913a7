"""What a unit of `qkv serve`'s work costs in time, by decoding setting: the measurements behind the
prices of sampled tokens in ``qkv.serve.batcher`` (1 per token, 2 with top_k, 12 with top_p).

    python benchmarks/sampling_cost.py            # random models, a few seconds each; no data needed

For each model size and vocabulary, times the search of the same units of work (output tokens x beam
size) with greedy search, sampling (plain, top_k 50, top_p 0.9) and beam 16, and prints each time per
unit relative to greedy search. The models are random, with EOS forbidden, so that every search runs to
its maximum length, as the work estimate assumes. One thread: set OMP_NUM_THREADS=1 for stable numbers.
"""

from __future__ import annotations

import argparse
import time

import torch

from qkv.model.config import model_preset
from qkv.infer.search import DecodeConfig, search
from qkv.model.transformer import Transformer
from qkv.infer.translator import sentence_seed

BOS, EOS = 1, 2
SETTINGS = {
    "sampling": dict(sampling=True),
    "top_k 50": dict(sampling=True, top_k=50),
    "top_p 0.9": dict(sampling=True, top_p=0.9),
    "beam 16": dict(beam_size=16),
}


def seconds(model: Transformer, src: torch.Tensor, config: DecodeConfig, repeats: int) -> float:
    """The fastest of ``repeats`` searches of ``src`` (B, S)."""
    seeds = [sentence_seed(config.seed, row.tolist()) for row in src] if config.sampling else None
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        search(model, src, bos_id=BOS, eos_id=EOS, config=config, seeds=seeds)
        best = min(best, time.perf_counter() - started)
    return best


def measure(preset: str, vocab: int, *, texts: int, tokens: int, repeats: int) -> dict[str, float]:
    """Time per unit of work relative to greedy search, for each of SETTINGS."""
    torch.manual_seed(0)
    model = Transformer(model_preset(preset, src_vocab_size=vocab, tgt_vocab_size=vocab, pad_id=0)).eval()
    model.generator.register_forward_hook(lambda module, inputs, logits: logits.index_fill(-1, torch.tensor([EOS]), float("-inf")))
    src = torch.randint(3, vocab, (texts, 20))  # (B, S)
    src[:, -1] = EOS
    length = dict(beam_size=1, max_len_a=0.0, max_len_b=tokens)
    greedy = seconds(model, src, DecodeConfig(**length), repeats)
    ratios = {}
    for name, options in SETTINGS.items():
        config = DecodeConfig(**{**length, **options})
        rows = src[: max(1, texts // config.beam_size)]  # the same units of work: texts x tokens
        ratios[name] = seconds(model, rows, config, repeats) / greedy * texts / (len(rows) * config.beam_size)
    return ratios


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=40, help="output tokens per text")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"time per unit of work relative to greedy search ({args.texts} texts x {args.tokens} tokens, "
          f"{torch.get_num_threads()} thread(s))")
    print(f"{'model':>16} {'vocab':>6} " + " ".join(f"{name:>10}" for name in SETTINGS))
    for preset, vocab in [("tiny", 60), ("tiny", 8000), ("transformer-tiny", 8000), ("transformer-tiny", 32000), ("base", 8000)]:
        ratios = measure(preset, vocab, texts=args.texts, tokens=args.tokens, repeats=args.repeats)
        print(f"{preset:>16} {vocab:>6} " + " ".join(f"{ratios[name]:>9.2f}x" for name in SETTINGS))


if __name__ == "__main__":
    main()
