"""The speed/quality front: BLEU on Multi30k test_2016_flickr against sentences/s, for every model
(a teacher and its students) and engine, greedy and beam 5, all cells in one run.

Each cell is a cell of (c)'s own-settings table (``benchmarks.translation``): one process of its own,
the engine's batch budget and thread layout chosen on every 4th sentence in this run, a warm-up, then
``--repeats`` timed passes over all 1,000 sentences (median and min-max). The engines:

- ``qkv:float32`` and ``qkv:float32+shortlist`` (qkv's own search; ``--shortlist``),
- ``ctranslate2:float32``, ``ctranslate2:int8`` and ``ctranslate2:int8+vmap`` (CTranslate2 used directly;
  ``+vmap`` the same shortlist as its vocabulary map, ``use_vmap=True``),
- ``qkv+ct2:float32`` (``qkv translate --engine ctranslate2``).

The shortlists are built for this run from the Multi30k training pairs with ``qkv shortlist``'s
defaults (``--shortlist K FREQUENT``: another size). The speed ratios are against CTranslate2 fp32 at beam 5 on the first checkpoint (the teacher).

    python -m benchmarks.front --checkpoint runs/en-de/final --checkpoint runs/student/student/final \\
        --data-dir ../shared/data/multi30k --out benchmarks/results/front
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks import translation
from qkv.io import checkpoint

ENGINES = ["qkv:float32", "qkv:float32+shortlist", "ctranslate2:float32", "ctranslate2:int8", "ctranslate2:int8+vmap",
           "qkv+ct2:float32"]


def label(result: dict) -> str:
    m = result["model"]
    return f"{Path(result['checkpoint']).parent.name} ({m['n_encoder_layers']}-{m['n_decoder_layers']})"


def front_rows(results: list[dict]) -> list[dict]:
    """Every cell of every model, with its speed as a ratio of the first model's CTranslate2 fp32 beam 5."""
    base = next((r for r in results[0]["rows"] if (r["engine"], r["compute"], r["beam"]) == ("ctranslate2", "float32", 5)), None)
    rows = []
    for result in results:
        for r in result["rows"]:
            rows.append({"model": label(result), "parameters": result["parameters"], "engine": r["engine"],
                         "compute": r["compute"], "beam": r["beam"], "settings": r["settings"],
                         "sentences_per_s": r["sentences_per_s"], "min": r["sentences_per_s_min"], "max": r["sentences_per_s_max"],
                         "bleu": r["bleu"], "load": r["load"],
                         "vs_teacher_ct2_fp32_beam5": None if base is None else r["sentences_per_s"] / base["sentences_per_s"]})
    return rows


def write_markdown(path: Path, rows: list[dict], header: str) -> None:
    lines = [header, "", "| model | parameters | engine | compute | beam | sentences/s | min-max | BLEU | x teacher's CTranslate2 fp32 beam 5 | load |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "" if r["vs_teacher_ct2_fp32_beam5"] is None else f"{r['vs_teacher_ct2_fp32_beam5']:.2f}x"
        lines.append(f"| {r['model']} | {r['parameters']:,} | {r['engine']} | {r['compute']} | {r['beam']} | {r['sentences_per_s']:,.1f} | "
                     f"{r['min']:,.1f}-{r['max']:,.1f} | {r['bleu']:.2f} | {ratio} | {r['load']:.2f} |")
    lines.append("")
    lines.append("Settings of each cell (own settings, chosen in this run):")
    lines.append("")
    lines += [f"- {r['model']}, {r['engine']} {r['compute']}, beam {r['beam']}: {r['settings']}" for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    markers = {1: "o", 5: "s"}
    for n, model in enumerate(models):
        color = f"C{n}"
        for r in rows:
            if r["model"] != model:
                continue
            ax.scatter(r["sentences_per_s"], r["bleu"], color=color, marker=markers.get(r["beam"], "x"))
            ax.annotate(f"{r['engine']} {r['compute']}".replace("ctranslate2", "ct2"), (r["sentences_per_s"], r["bleu"]),
                        fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.scatter([], [], color=color, label=model)
    ax.scatter([], [], color="gray", marker="o", label="greedy")
    ax.scatter([], [], color="gray", marker="s", label="beam 5")
    ax.set_xscale("log")
    ax.set_xlabel("sentences/s (2 threads, log scale)")
    ax.set_ylabel("BLEU, test_2016_flickr")
    ax.set_title("Speed and quality: models x engines")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.front", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", required=True, help="a checkpoint (the first: the teacher); repeatable")
    parser.add_argument("--data-dir", required=True, help="local Multi30k directory")
    parser.add_argument("--out", required=True, help="directory for results.json, results.md and front.png")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shortlist", nargs=2, type=int, metavar=("K", "FREQUENT"),
                        help="the shortlist's size (qkv shortlist --k K --frequent FREQUENT; default: its defaults)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engine:compute cells")
    parser.add_argument("--teacher-engines", help="the first checkpoint's cells, when not --engines (the ratios need "
                                                  "its ctranslate2:float32)")
    parser.add_argument("--smoke", action="store_true", help="a few sentences, to check the script runs (times mean nothing)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    results = []
    for n, path in enumerate(args.checkpoint):
        engines = (args.teacher_engines if n == 0 and args.teacher_engines else args.engines).split(",")
        result = translation.run(checkpoint_dir=path, data_dir=args.data_dir, smoke=args.smoke, threads=args.threads, log=log,
                                 repeats=args.repeats, engines=engines, tables=("own",), shortlist_size=args.shortlist)
        result["parameters"] = checkpoint.load(path).model.num_parameters()
        results.append(result)
    rows = front_rows(results)
    header = (f"# Speed/quality front ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))})\n\n"
              f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads available, torch "
              f"{torch.__version__}, Python {platform.python_version()}. test_2016_flickr, {results[0]['sentences']} sentences, "
              f"{args.repeats} timed passes a cell (median, min-max), {args.threads} threads for every engine.\n\n"
              f"Command: `python -m benchmarks.front {' '.join(argv if argv is not None else sys.argv[1:])}`")
    (out / "results.json").write_text(json.dumps({"results": results, "front": rows}, indent=1), encoding="utf-8")
    write_markdown(out / "results.md", rows, header)
    plot(out / "front.png", rows)
    log(f"wrote {out / 'results.md'} and {out / 'front.png'} in {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
