"""(e) Corpus size: what preparing and training cost as a corpus grows, prepared (`qkv prepare`) against text files.

Multi30k's training pairs repeated 1x, 10x, 100x, 1000x (``--sizes``), generated into ``--work`` (never
committed). Each command runs in its own process, measured from outside (``os.wait4``: wall seconds, and
peak resident memory: the largest of the process and the workers it waited for):

- training speed, first: the multi30k preset on Multi30k's text files and on Multi30k prepared without
  filters (the same tokenizer, ids and batches), target tokens/s of updates 51..``--speed-steps``,
  ``--speed-repeats`` runs of each, alternated;
- for each size, ``qkv prepare`` (duplicates kept: the repeats are the point): seconds, pairs/s, peak RSS;
- ``qkv train --data-dir PREPARED`` and, up to ``--text-up-to``, ``qkv train --train-src/--train-tgt`` on
  the text: the seconds from launch to the run's ``start`` event (reading or mapping the data, the
  tokenizer, the model), to its first checkpoint (``step-000001/``: the epoch's batches formed, one
  update, and a validation of 100 pairs: an upper bound on the time to the first update), and the peak
  RSS of a run of ``--steps`` updates.

    python -m benchmarks.prepared_scale --data ../shared/data/multi30k --work /tmp/qkv-scale --out DIR --sizes 1,10,100,1000

writes ``DIR/prepared_scale.md`` (the tables), ``DIR/prepared_scale.json`` and ``DIR/prepared_scale.png``
(each measure against the size). 1000x needs about 5 GB of disk for the text and 2 GB for the arrays.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def measured(args: list[str], *, log: Path, until_start: Path | None = None) -> dict[str, float]:
    """Run ``qkv ARGS``; its wall seconds, peak RSS (MB) and, with ``until_start``, the seconds to the run's start event."""
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "qkv", *args], stdout=out, stderr=subprocess.STDOUT)
    to_start = to_update = None
    first = None if until_start is None else until_start.parent / "step-000001" / "config.json"
    while until_start is not None and process.poll() is None and to_update is None:
        if to_start is None and until_start.is_file() and '"event": "start"' in until_start.read_text():
            to_start = time.monotonic() - started
        if first.is_file():  # written after the first update and its validation (eval_every=1)
            to_update = time.monotonic() - started
        time.sleep(0.02)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"qkv {' '.join(args)} failed; see {log}")
    result = {"seconds": time.monotonic() - started, "peak_mb": usage.ru_maxrss / 1024}
    if to_start is not None:
        result["to_start"], result["to_first_checkpoint"] = to_start, to_update
    return result


def fresh(run: Path) -> Path:
    """``run``, with an earlier run of this benchmark there removed (a qkv run only: anything else stops it)."""
    from qkv.io.runs import is_run

    if run.exists():
        if not is_run(run):
            raise SystemExit(f"{run} exists and is not a qkv run: choose another --work")
        shutil.rmtree(run)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k directory")
    parser.add_argument("--work", default="/tmp/qkv-scale", help="where the generated corpora and runs go")
    parser.add_argument("--out", required=True, help="where the table and the plot go")
    parser.add_argument("--sizes", default="1,10,100,1000", help="repeats of Multi30k's 29,000 pairs")
    parser.add_argument("--steps", type=int, default=5, help="updates of each training run (each validated on 100 pairs)")
    parser.add_argument("--text-up-to", type=int, default=100, help="also train on the text files up to this size")
    parser.add_argument("--speed-steps", type=int, default=150, help="updates of each training-speed run")
    parser.add_argument("--speed-repeats", type=int, default=3, help="training-speed runs of each kind, alternated (0: none)")
    args = parser.parse_args()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    lines = {side: gzip.open(Path(args.data) / f"train.{side}.gz", "rt", encoding="utf-8").read() for side in ("en", "de")}
    rows = []
    speed = training_speed(Path(args.data), work, args.speed_steps, args.speed_repeats) if args.speed_repeats else None
    for size in map(int, args.sizes.split(",")):
        corpus = {side: work / f"x{size}.{side}" for side in lines}
        for side, path in corpus.items():
            if not path.exists() or path.stat().st_size != len(lines[side].encode()) * size:
                with open(path, "w", encoding="utf-8") as handle:
                    for _ in range(size):
                        handle.write(lines[side])
        pairs = lines["en"].count("\n") * size
        prepared = work / f"x{size}.prepared"
        if prepared.exists():
            if not (prepared / "prepared.json").is_file():
                raise SystemExit(f"{prepared} exists and is not a prepared directory: choose another --work")
            shutil.rmtree(prepared)
        prep = measured(["prepare", "--train-src", str(corpus["en"]), "--train-tgt", str(corpus["de"]), "--out", str(prepared),
                         "--keep-duplicates", "--no-progress"], log=work / f"x{size}.prepare.log")
        common = ["--preset", "multi30k", "--max-steps", str(args.steps), "--train", "eval_every=1", "tune_length_penalty=false",
                  "--data", "valid_limit=100", "--no-progress"]
        row = {"size": size, "pairs": pairs, "prepare": prep, "pairs_per_s": pairs / prep["seconds"]}
        run = fresh(work / f"x{size}.run-prepared")
        row["train_prepared"] = measured(["train", "--data-dir", str(prepared), "--out", str(run), *common],
                                         log=work / f"x{size}.train-prepared.log", until_start=run / "log.jsonl")
        if size <= args.text_up_to:
            run = fresh(work / f"x{size}.run-text")
            row["train_text"] = measured(["train", "--train-src", str(corpus["en"]), "--train-tgt", str(corpus["de"]),
                                          "--out", str(run), *common], log=work / f"x{size}.train-text.log", until_start=run / "log.jsonl")
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "prepared_scale.json").write_text(json.dumps({"sizes": rows, "speed": speed}, indent=2) + "\n")
    table = ["| pairs | prepare s | pairs/s | prepare peak MB | to start, prepared / text, s | to first checkpoint, prepared / text, s | training peak MB, prepared / text |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, t = r["train_prepared"], r.get("train_text")
        both = lambda key, f: f"{f(p[key])} / {f(t[key]) if t else '-'}"  # noqa: E731
        table.append(
            f"| {r['pairs']:,} | {r['prepare']['seconds']:.1f} | {r['pairs_per_s']:,.0f} | {r['prepare']['peak_mb']:,.0f} | "
            f"{both('to_start', lambda v: f'{v:.1f}')} | {both('to_first_checkpoint', lambda v: f'{v:.1f}')} | "
            f"{both('peak_mb', lambda v: f'{v:,.0f}')} |"
        )
    if speed:
        table += ["", f"Training speed on Multi30k, the multi30k preset, updates 51-{args.speed_steps} of each run (target tokens/s; "
                  "the same batches both ways), runs alternated:", "",
                  "| data | tokens/s of each run | median |", "|---|---|---:|"]
        for kind in ("text", "prepared"):
            rates = speed[kind]
            table.append(f"| {kind} | {', '.join(f'{r:,.0f}' for r in rates)} | {sorted(rates)[len(rates) // 2]:,.0f} |")
    (out / "prepared_scale.md").write_text("\n".join(table) + "\n")
    _plot(rows, out / "prepared_scale.png")
    print("\n".join(table))


def training_speed(data: Path, work: Path, steps: int, repeats: int) -> dict[str, list[float]]:
    """Target tokens/s of the multi30k preset on Multi30k's text and on Multi30k prepared without filters
    (the same tokenizer, ids and batches: tests/e2e/test_prepared.py), ``repeats`` runs of each, alternated."""
    prepared = work / "m30k.prepared"
    if not (prepared / "prepared.json").is_file():
        if prepared.exists():
            raise SystemExit(f"{prepared} exists and is not a prepared directory: choose another --work")
        measured(["prepare", "--train-src", str(data / "train.en.gz"), "--train-tgt", str(data / "train.de.gz"),
                  "--valid-src", str(data / "val.en.gz"), "--valid-tgt", str(data / "val.de.gz"), "--out", str(prepared),
                  "--keep-long", "--max-ratio", "0", "--keep-duplicates", "--keep-copies", "--no-progress"], log=work / "m30k.prepare.log")
    rates: dict[str, list[float]] = {"text": [], "prepared": []}
    for repeat in range(repeats):
        for kind, source in (("text", data), ("prepared", prepared)):
            run = fresh(work / f"speed-{kind}")
            measured(["train", "--preset", "multi30k", "--data-dir", str(source), "--out", str(run), "--max-steps", str(steps),
                      "--train", "tune_length_penalty=false", "--data", "valid_limit=100", "--no-progress"], log=work / f"speed-{kind}.log")
            events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
            windows = [e["tokens_per_s"] for e in events if e.get("event") == "train" and e["step"] > 50]  # the first window warms up
            rates[kind].append(sum(windows) / len(windows))
            print(json.dumps({"speed": kind, "repeat": repeat, "tokens_per_s": rates[kind][-1]}), flush=True)
    return rates


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [r["pairs"] for r in rows]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train_prepared", "training, prepared"), ("train_text", "training, text files")):
        have = [r for r in rows if key in r]
        ax_mem.plot([r["pairs"] for r in have], [r[key]["peak_mb"] for r in have], "o-", label=label)
        ax_time.plot([r["pairs"] for r in have], [r[key]["to_first_checkpoint"] for r in have], "o-", label=label)
    ax_mem.plot(pairs, [r["prepare"]["peak_mb"] for r in rows], "s--", label="qkv prepare")
    ax_time.plot(pairs, [r["prepare"]["seconds"] for r in rows], "s--", label="qkv prepare (all of it)")
    for ax, ylabel in ((ax_mem, "peak resident memory (MB)"), (ax_time, "seconds (training: to the first checkpoint)")):
        ax.set(xscale="log", xlabel="training pairs", ylabel=ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
