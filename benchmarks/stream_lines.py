"""How many lines ``qkv translate`` should read before it sorts and batches them (``STREAM_LINES``).

    python -m benchmarks.stream_lines --checkpoint runs/en-de --data-dir ../shared/data/multi30k [--beam 5] [--workers 2]

Translates a split's source side (val by default: the choice is made on validation) through
``translate_stream``, the loop of ``qkv translate``, once per setting of lines x batch tokens x batch
sentences, in one process, the settings interleaved (the order reversed every other repeat), after
one untimed pass. Prints the median sentences/s with the min-max and how many outputs equal the
first setting's (the chunking changes which sentences share a batch, never a translation).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import time
from pathlib import Path

import torch

from benchmarks.probe import check_load, spread
from qkv.infer import translator as T
from qkv.infer.search import DecodeConfig
from qkv.io import checkpoint
from qkv.model import cpu


def measure(loaded: checkpoint.Checkpoint, source: bytes, settings: list[tuple[int, int, int]], *, beam: int, alpha: float,
            workers: int, repeats: int) -> list[dict]:
    config = DecodeConfig(beam_size=beam, length_penalty=alpha)
    translators = {s: T.Translator(loaded.model, loaded.tokenizer, config, max_tokens=s[1], max_sentences=s[2], workers=workers)
                   for s in settings}
    n = source.count(b"\n")

    def run(setting: tuple[int, int, int]) -> tuple[str, float]:
        out = io.StringIO()
        started = time.perf_counter()
        T.translate_stream(translators[setting], io.BytesIO(source), out, name="source", lines=setting[0])
        return out.getvalue(), time.perf_counter() - started

    seconds: dict[tuple, list[float]] = {s: [] for s in settings}
    outputs: dict[tuple, str] = {}
    try:
        with torch.inference_mode():
            for s in settings:
                run(s)  # untimed: starts the workers, warms the allocator
            for r in range(repeats):
                for s in settings if r % 2 == 0 else settings[::-1]:
                    outputs[s], t = run(s)
                    seconds[s].append(t)
    finally:
        for translator in translators.values():
            translator.close()
    first = outputs[settings[0]].splitlines()
    rows = []
    for s in settings:
        sp = spread(seconds[s])
        rows.append({"lines": s[0], "max_tokens": s[1], "max_sentences": s[2], "sentences": n,
                     "sentences_per_s": n / sp["median"], "sentences_per_s_min": n / sp["max"], "sentences_per_s_max": n / sp["min"],
                     "same_as_first": sum(a == b for a, b in zip(outputs[s].splitlines(), first))})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data-dir", required=True, help="a Multi30k directory (SPLIT.SRC.gz)")
    p.add_argument("--split", default="val")
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--alpha", type=float, default=1.0, help="length penalty")
    p.add_argument("--workers", type=int, default=2, help="decoding workers (qkv translate's default: one per CPU)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the one process when --workers 1")
    p.add_argument("--settings", default="256x2048x128,1024x2048x128,4096x2048x128,4096x4096x256",
                   help="comma-separated LINESxMAX_TOKENSxMAX_SENTENCES")
    p.add_argument("--first", type=int, default=0, help="only the split's first N lines (0: all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="also write the rows as JSON to this file (refused if it exists)")
    args = p.parse_args(argv)
    if args.out and Path(args.out).exists():
        p.error(f"{args.out} exists: choose a new file")
    torch.set_num_threads(args.threads)
    cpu.tune_allocator()
    loaded = checkpoint.load(args.checkpoint)
    src_lang = loaded.config.get("data", {}).get("src_lang", "en")
    source = gzip.open(Path(args.data_dir) / f"{args.split}.{src_lang}.gz").read()
    if args.first:
        source = b"".join(source.splitlines(keepends=True)[: args.first])
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",")]
    load = check_load("stream_lines", args.threads, print)
    rows = measure(loaded, source, settings, beam=args.beam, alpha=args.alpha, workers=args.workers, repeats=args.repeats)
    print(f"{args.split}, beam {args.beam}, {args.workers} worker(s), {args.repeats} repeats, load {load:.2f} before")
    for r in rows:
        print(f"lines {r['lines']:>5} x tokens {r['max_tokens']:>5} x sentences {r['max_sentences']:>4}: "
              f"{r['sentences_per_s']:7.1f} sentences/s ({r['sentences_per_s_min']:.0f}-{r['sentences_per_s_max']:.0f}), "
              f"same as the first {r['same_as_first']}/{r['sentences']}")
    if args.out:
        with open(args.out, "x", encoding="utf-8") as f:  # "x": never over a file that appeared meanwhile
            f.write(json.dumps({"args": vars(args), "load_1min": load, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
