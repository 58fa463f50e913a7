"""Decoding speed of several checkpoints side by side: sentences/s at each beam on one test set, in one
process, the cells interleaved (repeat 1 runs every checkpoint at every beam, then repeat 2, ...),
median and spread (min-max), each cell after a warm-up, with the load average checked.

    python -m benchmarks.model_speed --checkpoint runs/teacher --checkpoint runs/fast/student \\
        --data ../shared/data/multi30k --beams 5,1 --repeats 3 --workers 2

prints one table (Markdown) and, with ``--out FILE``, writes it there with the raw numbers as JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="a checkpoint or run directory (repeat for more)")
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k directory (its test_2016_flickr is decoded)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--beams", default="5,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", help="a .md file for the table (and .json beside it)")
    args = parser.parse_args()

    from benchmarks.probe import load as load_average
    from qkv.data.corpus import load_multi30k
    from qkv.infer.bleu import score
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint
    from qkv.model.cpu import tune_allocator

    tune_allocator()  # as qkv translate does
    test = load_multi30k("test_2016_flickr", args.src, args.tgt, args.data)
    beams = [int(b) for b in args.beams.split(",")]
    loaded = {path: checkpoint.load(path) for path in args.checkpoint}
    cells: dict[tuple[str, int], list[float]] = {(p, b): [] for p in args.checkpoint for b in beams}
    bleu: dict[tuple[str, int], float] = {}
    loads = []
    for _ in range(args.repeats):
        for path, ckpt in loaded.items():
            alpha = checkpoint.decode_defaults(ckpt.config).get("length_penalty", DecodeConfig.length_penalty)
            for beam in beams:
                loads.append(load_average()[0])
                with Translator(ckpt.model, ckpt.tokenizer, DecodeConfig(beam_size=beam, length_penalty=alpha), workers=args.workers) as t:
                    t.translate(test.src[:64])  # warm-up: the workers start, the allocator grows
                    started = time.perf_counter()
                    hypotheses = t.translate(test.src)
                    cells[path, beam].append(len(test.src) / (time.perf_counter() - started))
                bleu[path, beam] = score(hypotheses, test.tgt)["bleu"]
    lines = [f"test_2016_flickr ({len(test.src)} sentences), {args.workers} worker(s), median (min-max) of {args.repeats} "
             f"interleaved repeats; highest 1-minute load average before a cell {max(loads):.2f}.", "",
             "| checkpoint | parameters | " + " | ".join(f"beam {b} sentences/s | beam {b} BLEU" for b in beams) + " |",
             "|---|---:|" + "---:|---:|" * len(beams)]
    for path, ckpt in loaded.items():
        row = [f"{statistics.median(cells[path, b]):,.1f} ({min(cells[path, b]):,.1f}-{max(cells[path, b]):,.1f}) | {bleu[path, b]:.2f}"
               for b in beams]
        lines.append(f"| {path} | {ckpt.model.num_parameters():,} | " + " | ".join(row) + " |")
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"cells": {f"{p} beam {b}": v for (p, b), v in cells.items()}, "bleu": {f"{p} beam {b}": v for (p, b), v in bleu.items()}},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
