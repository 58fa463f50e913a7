"""Alignment error rate of every reading qkv align offers, against human gold alignments.

    .venv/bin/python -m benchmarks.alignment_gold --checkpoint runs/en-de/final --gold multi30k-val \
        --out benchmarks/results/alignment_gold
    .venv/bin/python -m benchmarks.alignment_gold --checkpoint runs/en-fr/final --gold hansards \
        --out benchmarks/results/alignment_gold

Gold sets: ``multi30k-val``, Multi30k val lines 1-150 En-De annotated for qkv
(benchmarks/gold/multi30k-val.en-de, guidelines beside it; sentences read from the Multi30k
directory), and ``hansards``, the English-French Hansards test set (447 pairs, ../shared/data/alignment).
For each method (attention weights, value norms, ALTI+), reading (where the target word is
predicted, or where it is the decoder's input) and decoder layer, the AER (sure and possible links,
Och and Ney 2003; lower is better), precision and recall. The default of ``qkv align`` was chosen
on the Multi30k val set; Hansards is reported beside it and chose nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from qkv.inspect.align import METHODS, ROWS, align, alignment_error_rate, read_gold
from qkv.io import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
GOLD_M30K = ROOT / "benchmarks" / "gold" / "multi30k-val.en-de"


def gold_set(name: str, data_dir: Path) -> tuple[list[str], list[str], list]:
    """Sources, targets and gold links of a gold set (see the module docstring)."""
    if name == "multi30k-val":
        gold = read_gold(GOLD_M30K / "gold")
        read = lambda lang: gzip.open(data_dir / f"val.{lang}.gz", "rt", encoding="utf-8").read().splitlines()  # noqa: E731
        return read("en")[: len(gold)], read("de")[: len(gold)], gold
    if name == "hansards":
        pairs = (SHARED / "alignment" / "hansards.en-fr.src-tgt").read_text(encoding="utf-8").splitlines()
        src, tgt = zip(*(line.split(" ||| ") for line in pairs))
        return list(src), list(tgt), read_gold(SHARED / "alignment" / "hansards.en-fr.gold")
    raise SystemExit(f"unknown gold set {name}: multi30k-val or hansards")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--gold", required=True, choices=["multi30k-val", "hansards"])
    parser.add_argument("--data-dir", default=str(SHARED / "multi30k"))
    parser.add_argument("--out", required=True, help="directory for GOLD.json and GOLD.md")
    args = parser.parse_args()
    loaded = checkpoint.load(args.checkpoint)
    sources, targets, gold = gold_set(args.gold, Path(args.data_dir))
    rows = []
    start = time.perf_counter()
    for method in METHODS:
        for row in ROWS:
            for layer in range(len(loaded.model.decoder_layers)):
                predicted = align(loaded.model, loaded.tokenizer, sources, targets, method=method, row=row, layer=layer)
                rate = alignment_error_rate(predicted, gold)
                rows.append({"method": method, "read": row, "layer": layer + 1, **{k: round(100 * v, 1) for k, v in rate.items()}})
                print(f"{method:9s} {row:7s} layer {layer + 1}: AER {rows[-1]['aer']:5.1f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"checkpoint": str(args.checkpoint), "gold": args.gold, "pairs": len(gold), "seconds": round(time.perf_counter() - start, 1),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    (out / f"{args.gold}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    lines = [f"# AER on {args.gold} ({len(gold)} pairs), {args.checkpoint}, {result['date']}", "",
             "| method | read at | layer | AER | precision | recall |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['read']} | {r['layer']} | {r['aer']} | {r['precision']} | {r['recall']} |" for r in rows]
    (out / f"{args.gold}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
