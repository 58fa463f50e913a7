"""Are a translation's numbers carried through? Lines with a number added, and a count of the
translations that hold every number of their source (``qkv translate --numbers``, docs/glossary.md#numbers).

    python -m benchmarks.number_lines make --data-dir /work/shared/data/multi30k > numbers.en
    qkv translate --checkpoint runs/en-de/final -i numbers.en -o plain.de
    qkv translate --checkpoint runs/en-de/final -i numbers.en -o numbers.de --numbers
    python -m benchmarks.number_lines count numbers.en plain.de numbers.de
    python -m benchmarks.number_lines time --checkpoint runs/en-de/final --data-dir /work/shared/data/multi30k \
        --lines 200 --repeats 3 --out benchmarks/results/numbers/cost.json

``make`` takes the first 40 lines of Multi30k's val.en and adds a number to each: a leading number
word becomes digits ("Two dogs" -> "2 dogs"); else the line gets a phrase with a number, one of
integers, decimals, thousands, times, prices and dates in turn. ``count`` checks each translation with
the rule ``--numbers`` checks (``qkv.infer.numbers``: the decimal convention swapped is accepted too).
``time`` translates ``make``'s lines in one process, as ``qkv translate`` does (the checkpoint's search
settings and the loop guard), three ways in turn for each repeat: plain, ``--numbers`` (a missing number
mended where the alignment head puts its source, else searched for), and ``--numbers`` searching every
miss with constraints (as before mending, and for a model without the head); the median seconds of each,
and the count of translations that hold their numbers.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

from qkv.infer.numbers import Numbers

WORDS = {"Two": "2", "Three": "3", "Four": "4", "Five": "5", "Six": "6", "Seven": "7", "Eight": "8", "Nine": "9", "Ten": "10"}
PHRASES = ["at 10:30", "in 1998", "for $25", "on 3/4/2024", "with 1,000 others", "at 7:45 pm", "for 3.50 euros",
           "in 2015", "on 12/25/2019", "with 15 friends", "at 6:15", "for 5€", "near 42 trees", "with 2.5 liters"]


def make(data_dir: Path, n: int) -> list[str]:
    with gzip.open(data_dir / "val.en.gz", "rt", encoding="utf-8") as handle:
        lines = [next(handle).strip() for _ in range(n)]
    out, phrase = [], 0
    for line in lines:
        first, _, rest = line.partition(" ")
        if first in WORDS:
            out.append(f"{WORDS[first]} {rest}")
            continue
        end = "." if line.endswith(".") else ""
        out.append(f"{line.removesuffix('.')} {PHRASES[phrase % len(PHRASES)]}{end}")
        phrase += 1
    return out


def carried(source: str, translation: str) -> bool:
    """Whether every number of ``source`` stands in ``translation`` (each as often as the source has it)."""
    numbers = Numbers()
    matches = numbers.matches(source)
    from qkv.infer.glossary import missing

    return not missing(numbers, matches, translation)


def time_rows(args: argparse.Namespace) -> int:
    import json
    import os
    import statistics
    import time
    from dataclasses import replace

    import torch

    from qkv.cli.common import LOOP_GUARD
    from qkv.infer.search import DecodeConfig
    from qkv.infer.terms import translate_with_glossary
    from benchmarks.engine import engine_label, engine_translator
    from qkv.inspect.terms import alignment_substitution
    from qkv.io import checkpoint

    sources = make(args.data_dir, args.lines)
    loaded = checkpoint.load(args.checkpoint)
    config = replace(DecodeConfig(**loaded.model.decode_defaults), loop_guard=LOOP_GUARD)
    translator = engine_translator(args, args.checkpoint, loaded.model, loaded.tokenizer, config)
    mend = alignment_substitution(loaded.model, loaded.tokenizer)
    rows = {"plain": None, "numbers": mend, "numbers, search alone": None}
    seconds: dict[str, list[float]] = {row: [] for row in rows}
    held, loads = {}, []
    for _ in range(args.repeats):
        for row, align in rows.items():
            loads.append(round(os.getloadavg()[0], 2))
            started = time.perf_counter()
            if row == "plain":
                texts = [line.text for line in translator.translate_lines(sources)]
            else:
                texts = [r.text for r in translate_with_glossary(translator, sources, None, numbers=True, align=align)]
            seconds[row].append(round(time.perf_counter() - started, 3))
            held[row] = sum(carried(s, t) for s, t in zip(sources, texts))
    base = statistics.median(seconds["plain"])
    result = {"checkpoint": args.checkpoint, "engine": engine_label(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "lines": len(sources),
              "threads": torch.get_num_threads(), "seconds": seconds, "load_average_before_rows": loads,
              "rows": {row: {"median_seconds": statistics.median(s), "ratio": round(statistics.median(s) / base, 3),
                             "hold_every_number": held[row]} for row, s in seconds.items()},
              "command": "python -m benchmarks.number_lines " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["rows"], indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.engine import engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("make", help="print the lines with a number added")
    m.add_argument("--data-dir", type=Path, required=True)
    m.add_argument("--lines", type=int, default=40)
    c = sub.add_parser("count", help="how many translations of each file hold their numbers")
    c.add_argument("source", type=Path)
    c.add_argument("translations", type=Path, nargs="+")
    t = sub.add_parser("time", help="plain, --numbers and --numbers by search alone, side by side in one process")
    t.add_argument("--checkpoint", required=True)
    t.add_argument("--data-dir", type=Path, required=True)
    t.add_argument("--lines", type=int, default=200)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--out", type=Path, required=True)
    engine_args(t)
    args = p.parse_args(argv)
    if args.what == "make":
        sys.stdout.writelines(line + "\n" for line in make(args.data_dir, args.lines))
        return 0
    if args.what == "time":
        return time_rows(args)
    sources = args.source.read_text(encoding="utf-8").splitlines()
    for path in args.translations:
        translations = path.read_text(encoding="utf-8").splitlines()
        ok = sum(carried(s, t) for s, t in zip(sources, translations, strict=True))
        print(f"{path}: {ok} of {len(sources)} translations hold every number of their source")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
