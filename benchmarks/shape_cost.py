"""What an update of the ``multi30k`` preset costs at other model shapes, side by side.

Recipes of other shapes are compared at equal compute (docs/recipes.md): a shape whose update costs
c times the preset's gets N / c updates where the preset gets N. This measures c on this machine:
every shape trains on the same first batches of the preset's epoch 0 (its tokenizer, its batches),
the shapes interleaved in each repeat so that a change in the machine's load touches them alike;
the median ms per update over the repeats, with the min-max, and the load average before and after.

    python -m benchmarks.shape_cost --shape d_ff=512 --shape d_ff=512,n_encoder_layers=6,n_decoder_layers=3 --bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.probe import throwaway_trainer
from benchmarks.run import DEFAULT_DATA
from qkv.train.recipes import parse_overrides
from qkv.train.recipes import build_configs


def measure(shapes: dict[str, dict], *, data_dir: str, bf16: bool, batches: int, repeats: int,
            smoke: bool = False) -> dict[str, list[float]]:
    """Seconds per update of each shape (the preset's model with the given overrides), per repeat.
    ``smoke``: 3,000 training pairs and a 1,000-piece vocabulary, a check that it runs."""
    trainers = {}
    data = {"data_dir": data_dir, "valid_limit": 20} | ({"train_limit": 3000, "vocab_size": 1000} if smoke else {})
    for name, overrides in shapes.items():
        model, train, data_cfg = build_configs("multi30k", model=overrides, train={"bf16": bf16}, data=data)
        trainers[name] = throwaway_trainer(model, train, data_cfg)
    first = next(iter(trainers.values())).batches(0)[:batches]
    for trainer in trainers.values():  # a warm-up: the allocator's heap grows to what these batches need
        for batch in first[:2]:
            trainer.train_step([batch])
    seconds: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(repeats):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for batch in first:
                trainer.train_step([batch])
            seconds[name].append((time.perf_counter() - start) / len(first))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", default=[], help="model overrides KEY=VALUE[,KEY=VALUE...]; repeatable")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--bf16", action="store_true", help="the output layer and loss in bf16, as qkv train --bf16")
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shapes = {"preset": {}} | {spec: parse_overrides(spec.split(",")) for spec in args.shape}
    before = os.getloadavg()[0]
    seconds = measure(shapes, data_dir=args.data_dir, bf16=args.bf16, batches=args.batches, repeats=args.repeats)
    after = os.getloadavg()[0]
    base = statistics.median(seconds["preset"])
    print(f"{args.batches} batches of the preset's epoch 0, {args.repeats} interleaved repeats, bf16 {args.bf16}, "
          f"load average {before:.2f} before, {after:.2f} after")
    print("| shape | ms/update (min-max) | cost x preset |")
    print("|---|---:|---:|")
    for name, s in seconds.items():
        median = statistics.median(s)
        print(f"| {name} | {1e3 * median:.0f} ({1e3 * min(s):.0f}-{1e3 * max(s):.0f}) | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
