"""Which decoder layer's cross-attention aligns words best on Multi30k, measured against eflomal.

    .venv/bin/pip install eflomal      # a statistical word aligner (Bayesian IBM models), from PyPI
    .venv/bin/python -m benchmarks.alignment --checkpoint runs/en-de/final --out benchmarks/results/alignment

eflomal aligns the whole training corpus plus the evaluated split (unsupervised, both directions, on
lowercased whitespace words: the words ``qkv align`` uses). Its two directions give the reference
in the usual way: their intersection is "sure", their union "possible". Each qkv choice (every
decoder layer, the mean of its heads and each head alone) is scored with the alignment error rate
(AER, Och and Ney 2003; lower is better), precision against "possible" and recall against "sure".
The layer is chosen on val; test_2016_flickr is reported beside it. This is agreement with another
aligner, not accuracy against human alignments (Multi30k has none).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from qkv.io import checkpoint
from qkv.inspect.align import align, alignment_error_rate
from qkv.data.corpus import load_multi30k

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "multi30k"
Links = set[tuple[int, int]]


def eflomal_links(src: list[str], tgt: list[str]) -> tuple[list[Links], list[Links]]:
    """Forward and reverse eflomal alignments of every line pair (source index, target index)."""
    try:
        import eflomal
    except ImportError:
        raise SystemExit("this measurement needs eflomal: .venv/bin/pip install eflomal") from None
    with tempfile.TemporaryDirectory() as tmp:
        fwd, rev = Path(tmp, "fwd"), Path(tmp, "rev")
        lower = lambda lines: [" ".join(line.lower().split()) + "\n" for line in lines]  # noqa: E731
        eflomal.Aligner().align(lower(src), lower(tgt), links_filename_fwd=str(fwd), links_filename_rev=str(rev))
        read = lambda path: [parse(line) for line in path.read_text().splitlines()]  # noqa: E731
        return read(fwd), read(rev)


def parse(line: str) -> Links:
    return {(int(i), int(j)) for i, j in (pair.split("-") for pair in line.split())}


def scores(predicted: list[Links], sure: list[Links], possible: list[Links]) -> dict[str, float]:
    """AER, precision and recall over the corpus (``qkv align --gold``'s measure)."""
    return alignment_error_rate([sorted(x) for x in predicted], list(zip(sure, possible)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = checkpoint.load(args.checkpoint)
    cfg = loaded.model.config
    data = loaded.config.get("data") or {}
    langs = (data.get("src_lang", "en"), data.get("tgt_lang", "de"))
    train = load_multi30k("train", *langs, args.data_dir)
    rows, chosen = [], None
    for split in ("val", "test_2016_flickr"):
        corpus = load_multi30k(split, *langs, args.data_dir)
        n = len(corpus.src)
        fwd, rev = eflomal_links(train.src + corpus.src, train.tgt + corpus.tgt)
        fwd, rev = fwd[-n:], rev[-n:]
        sure = [f & r for f, r in zip(fwd, rev)]
        possible = [f | r for f, r in zip(fwd, rev)]
        print(f"{split}: eflomal sure {sum(map(len, sure)):,} links, possible {sum(map(len, possible)):,}", flush=True)
        for layer in range(cfg.n_decoder_layers):
            for head in [None, *range(cfg.n_heads)]:
                links = [set(a) for a in align(loaded.model, loaded.tokenizer, corpus.src, corpus.tgt, layer=layer, head=head)]
                row = {"split": split, "layer": layer + 1, "head": "mean" if head is None else head + 1, **scores(links, sure, possible)}
                rows.append(row)
                print(f"  layer {row['layer']} head {row['head']}: AER {row['aer']:.3f} P {row['precision']:.3f} R {row['recall']:.3f}", flush=True)
    val_means = [r for r in rows if r["split"] == "val" and r["head"] == "mean"]
    chosen = min(val_means, key=lambda r: r["aer"])["layer"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"checkpoint": args.checkpoint, "chosen_layer": chosen, "rows": rows}, indent=1))
    lines = [
        "# Which decoder layer aligns words best (agreement with eflomal; lower AER is better)",
        "",
        f"Checkpoint `{args.checkpoint}` ({cfg.n_decoder_layers} decoder layers, {cfg.n_heads} heads), references given (`qkv align -r`).",
        f"Chosen on val (mean of heads): layer {chosen}. Command: `python -m benchmarks.alignment --checkpoint {args.checkpoint} --out {args.out}`.",
        "",
        "| layer | head | val AER | val P | val R | test2016 AER | test2016 P | test2016 R |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["split"] == "val"):
        t = next(x for x in rows if x["split"] != "val" and x["layer"] == r["layer"] and x["head"] == r["head"])
        lines.append(
            f"| {r['layer']} | {r['head']} | {r['aer']:.3f} | {r['precision']:.3f} | {r['recall']:.3f} "
            f"| {t['aer']:.3f} | {t['precision']:.3f} | {t['recall']:.3f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"chosen on val: layer {chosen}; wrote {out}/results.md")


if __name__ == "__main__":
    main()
