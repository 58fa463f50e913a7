"""``qkv align``'s default reading against eflomal, on a human gold set: the alignment head of a model
trained with guided alignment (qkv.train.alignment), any other model's default, and eflomal itself.

    .venv/bin/python -m benchmarks.alignment_head --checkpoint runs/en-de/final --checkpoint runs/en-de-align/final \
        --gold multi30k-val --out benchmarks/results/alignment_head

eflomal runs as qkv's training runs it (``qkv.train.alignment.align_pieces``: both directions,
grow-diag-final-and), here on whitespace words: the Multi30k training pairs of the gold set's
languages with the gold pairs after them (an aligner needs a corpus; the gold pairs' own links are
read). Each model reads the gold set's references (``qkv align -r``) at its default reading.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from benchmarks.alignment_gold import SHARED, gold_set
from qkv.inspect.align import LINKS, align, alignment_error_rate, default_link, default_reading
from qkv.io import checkpoint
from qkv.train.alignment import align_words_eflomal


def eflomal_words(sources: list[str], targets: list[str], corpus: tuple[list[str], list[str]]) -> list[list[tuple[int, int]]]:
    """eflomal's symmetrized word links of each (source, target), aligned after ``corpus``'s pairs."""
    return align_words_eflomal([*corpus[0], *sources], [*corpus[1], *targets])[len(corpus[0]):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", default=[], help="a checkpoint to read at its default (repeatable)")
    parser.add_argument("--gold", required=True, choices=["multi30k-val", "hansards"])
    parser.add_argument("--data-dir", default=str(SHARED / "multi30k"))
    parser.add_argument("--pair", default="en-de", help="the Multi30k training pair eflomal reads first (en-de, en-fr)")
    parser.add_argument("--out", required=True, help="directory for GOLD.json and GOLD.md")
    args = parser.parse_args()
    data_dir = Path(args.data_dir)
    sources, targets, gold = gold_set(args.gold, data_dir)
    src_lang, tgt_lang = args.pair.split("-")
    read = lambda lang: gzip.open(data_dir / f"train.{lang}.gz", "rt", encoding="utf-8").read().splitlines()  # noqa: E731
    rows = []
    started = time.time()
    found = eflomal_words(sources, targets, (read(src_lang), read(tgt_lang)))
    rows.append({"aligner": f"eflomal (Multi30k train {args.pair} + the gold pairs, words, grow-diag-final-and)",
                 "seconds": round(time.time() - started, 1), **alignment_error_rate(found, gold)})
    for path in args.checkpoint:
        loaded = checkpoint.load(path)
        method, layer, head = default_reading(loaded.model.config)
        link = default_link(loaded.model.config)
        reading = f"{method}, layer {layer + 1}" + (f", head {head + 1}" if head is not None else ", mean of heads")
        for side in (link, *(s for s in LINKS if s != link)):  # the default, then the other side of the same weights
            started = time.time()
            found = align(loaded.model, loaded.tokenizer, sources, targets, link=side)
            name = f"default: {reading}, {side} side" if side == link else f"--link {side}"
            rows.append({"aligner": f"qkv align --checkpoint {path} ({name})", "seconds": round(time.time() - started, 1),
                         **alignment_error_rate(found, gold)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.gold}.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    lines = [f"# Alignment error rate on {args.gold} ({len(gold)} pairs), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| aligner | AER | precision | recall | seconds |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['aligner']} | {100 * r['aer']:.1f} | {100 * r['precision']:.1f} | {100 * r['recall']:.1f} | {r['seconds']} |" for r in rows]
    (out / f"{args.gold}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
