"""(b, real batches) Training speed of the ``multi30k`` preset on the stream of batches a run really
draws, each sample in a fresh process.

Benchmark (b) (``benchmarks.preset_training``) times the same few batches again and again, so every
cache keyed by a shape (oneDNN's kernels, the allocator's free lists) is warm at every timed step.
A run meets a new batch shape at almost every step. Here each sample is one new process that builds
the preset's trainer (the same initial weights, a tokenizer trained once and shared), trains on the
epoch's first ``--warmup`` batches untimed, then on the next ``--stream`` batches once, in the order
the run draws them, timed. Rows (the paths of ``benchmarks.preset_training.ROWS``) are interleaved:
repeat 1 runs every row once, then repeat 2, ...; the table gives the median and the spread
(min-max) of target tokens/s, and the ms per step of the stream's first and second halves (a cost
that grows with the shapes already seen shows as a slower second half).

    python -m benchmarks.real_batches --data ../shared/data/multi30k --out DIR --rows today,all,all_mkl,bf16
    git worktree add /tmp/qkv-old 6dc7caf    # the main of 2026-11-22, as a row of its own:
    python -m benchmarks.real_batches --data ../shared/data/multi30k --out DIR --old-main /tmp/qkv-old

writes ``DIR/real_batches.md`` and ``DIR/real_batches.json``.

``--old-main TREE`` adds a row for another checkout of qkv (the main of 2026-11-22, whose package was
still flat: ``qkv/train.py``): its child runs this file as a script with ``TREE`` first on the path, so
that ``import qkv`` is that tree's, builds that tree's ``Trainer`` with the preset's model config of
today (the fields both know) and the same tokenizer, checks that it encodes the corpus to the same
ids, and times that tree's own ``train_step`` on the very batches today's code draws (passed in a file).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_stream(trainer, warm, stream) -> dict:
    """``trainer.train_step`` on each ``warm`` batch untimed, then on each ``stream`` batch once, timed."""
    import torch

    for batch in warm:
        trainer.train_step([batch])
    before = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for batch in stream:
        start = time.perf_counter()
        trainer.train_step([batch])
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    half = len(times) // 2
    return {
        "seconds": sum(times), "steps": len(times), "threads": torch.get_num_threads(),
        "ms_first_half": 1e3 * sum(times[:half]) / max(half, 1), "ms_second_half": 1e3 * sum(times[half:]) / max(len(times) - half, 1),
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / len(times),
    }


def child(args: argparse.Namespace) -> dict:
    """One sample: a fresh trainer, ``warmup`` batches untimed, ``stream`` batches timed once."""
    from benchmarks.preset_training import ROWS, _configure
    from benchmarks.probe import throwaway_trainer
    from qkv.train.recipes import build_configs

    flags = {key: f for key, _, f in ROWS}[args.child]
    model_cfg, train_cfg, data_cfg = build_configs("multi30k", model={}, train={"tune_allocator": False},
                                                   data={"data_dir": args.data, "valid_limit": 20})
    trainer = throwaway_trainer(model_cfg, train_cfg, data_cfg, tokenizer=Path(args.tokenizer))
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    _configure(trainer, train_cfg, flags, initial)
    batches = trainer.batches(0)
    warm, stream = batches[: args.warmup], batches[args.warmup : args.warmup + args.stream]
    ids = trainer.train_ids
    tokens = sum(len(ids.tgt_ids[i]) + 1 for b in stream for i in b)
    shapes = len({(len(b), max(len(ids.src_ids[i]) for i in b), max(len(ids.tgt_ids[i]) for i in b)) for b in stream})
    return {**timed_stream(trainer, warm, stream), "tokens": tokens, "distinct_shapes": shapes}


def old_child(args: argparse.Namespace) -> dict:
    """One sample of another qkv tree (``--old-main``), imported first: its Trainer and train_step on the given stream."""
    import dataclasses
    import hashlib
    import shutil

    import qkv
    from qkv.config import ModelConfig
    from qkv.train import Trainer, build_configs

    spec = json.loads(Path(args.spec).read_text())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in spec["model"].items() if k in known and k not in ("src_vocab_size", "tgt_vocab_size", "pad_id")}
    model_cfg, train_cfg, data_cfg = build_configs("multi30k", model=model, train={"max_tokens": spec["max_tokens"]},
                                                   data={"data_dir": args.data, "valid_limit": 20, "vocab_size": spec["vocab_size"]})
    with tempfile.TemporaryDirectory(prefix="qkv-old-main-") as run:
        shutil.copy(args.tokenizer, Path(run) / "tokenizer.model")  # loaded, not trained again
        trainer = Trainer(run, model_cfg, train_cfg, data_cfg)
    ids = trainer.train_ids
    digest = hashlib.sha256(json.dumps([ids.src_ids, ids.tgt_ids]).encode()).hexdigest()
    if digest != spec["ids_sha256"]:
        raise SystemExit("the old tree encodes the corpus to other ids than today's: its batches would not be the same")
    differs = {k: (getattr(trainer.model_config, k), v) for k, v in spec["model"].items() if k in known and getattr(trainer.model_config, k) != v}
    warm, stream = spec["warm"], spec["stream"]
    tokens = sum(len(ids.tgt_ids[i]) + 1 for b in stream for i in b)
    return {**timed_stream(trainer, warm, stream), "tokens": tokens, "qkv": qkv.__file__, "model_differs": differs}


def stream_spec(trainer, warmup: int, stream: int) -> dict:
    """What an ``--old-main`` child needs: today's batches (index lists), the ids' digest, the model config."""
    import dataclasses
    import hashlib

    batches = trainer.batches(0)
    ids = trainer.train_ids
    return {
        "warm": [list(map(int, b)) for b in batches[:warmup]], "stream": [list(map(int, b)) for b in batches[warmup : warmup + stream]],
        "ids_sha256": hashlib.sha256(json.dumps([[list(map(int, s)) for s in ids.src_ids], [list(map(int, t)) for t in ids.tgt_ids]]).encode()).hexdigest(),
        "model": dataclasses.asdict(trainer.model_config), "max_tokens": trainer.train_cfg.max_tokens,
        "vocab_size": trainer.data_cfg.vocab_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/multi30k", help="Multi30k directory")
    parser.add_argument("--out", help="where the table goes")
    parser.add_argument("--rows", default="today,all,all_mkl,bf16", help="keys of benchmarks.preset_training.ROWS")
    parser.add_argument("--stream", type=int, default=150, help="batches timed, in the run's order")
    parser.add_argument("--warmup", type=int, default=20, help="batches before them, untimed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old-main", metavar="TREE", help="also time another checkout of qkv (e.g. a worktree of 6dc7caf, the main of 2026-11-22)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--old-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.old_child:
        print(json.dumps(old_child(args)))
        return
    if args.child:
        print(json.dumps(child(args)))
        return
    from benchmarks.preset_training import ROWS
    from benchmarks.probe import load as load_average, throwaway_trainer
    from qkv.train.recipes import build_configs

    labels = {key: label for key, label, flags in ROWS if flags is not None}
    rows = args.rows.split(",")
    if args.old_main:
        commit = subprocess.run(["git", "-C", args.old_main, "log", "-1", "--format=%h %ad", "--date=short"], capture_output=True, text=True).stdout.strip()
        labels["old_main"] = f"the main of {commit.split()[-1] if commit else '?'} ({commit.split()[0] if commit else args.old_main}), its own train_step"
        rows = ["old_main", *rows]
    if unknown := [r for r in rows if r not in labels]:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(labels)}")
    out = Path(args.out or ".")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qkv-real-batches-") as work:
        tokenizer = Path(work) / "tokenizer.model"
        configs = build_configs("multi30k", model={}, train={}, data={"data_dir": args.data, "valid_limit": 20})
        probe = throwaway_trainer(*configs)
        probe.tokenizer.save(tokenizer)  # trained once: every sample the same vocabulary
        spec = Path(work) / "stream.json"
        if args.old_main:
            probe = throwaway_trainer(*configs, tokenizer=tokenizer)  # the ids and batches of that tokenizer
            spec.write_text(json.dumps(stream_spec(probe, args.warmup, args.stream)))
        del probe
        samples: dict[str, list[dict]] = {row: [] for row in rows}
        for repeat in range(args.repeats):
            for row in rows:
                load = load_average()[0]
                if row == "old_main":  # this file as a script: sys.path starts with benchmarks/, then the old tree
                    command = [sys.executable, str(Path(__file__).resolve()), "--old-child", "--spec", str(spec),
                               "--tokenizer", str(tokenizer), "--data", args.data]
                    env = {**os.environ, "PYTHONPATH": str(Path(args.old_main).resolve())}
                else:
                    command = [sys.executable, "-m", "benchmarks.real_batches", "--child", row, "--tokenizer", str(tokenizer),
                               "--data", args.data, "--stream", str(args.stream), "--warmup", str(args.warmup)]
                    env = None
                result = subprocess.run(command, capture_output=True, text=True, env=env)
                if result.returncode:
                    raise SystemExit(f"{row} failed:\n{result.stderr[-3000:]}")
                sample = json.loads(result.stdout.strip().splitlines()[-1]) | {"load": load}
                samples[row].append(sample)
                print(json.dumps({"repeat": repeat, "row": row, "tokens_per_s": round(sample["tokens"] / sample["seconds"]),
                                  **{k: round(v, 1) for k, v in sample.items() if isinstance(v, float)}}), flush=True)
    table = []
    for row in rows:
        s = samples[row]
        rates = [x["tokens"] / x["seconds"] for x in s]
        table.append({"key": row, "label": labels[row], "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                      "ms_first_half": statistics.median(x["ms_first_half"] for x in s),
                      "ms_second_half": statistics.median(x["ms_second_half"] for x in s),
                      "faults_per_step": statistics.median(x["faults_per_step"] for x in s), "max_load": max(x["load"] for x in s)})
    first = samples[next(r for r in rows if r != "old_main")][0]
    base = table[0]["tokens_per_s"]
    lines = [
        f"{args.stream} consecutive batches of epoch 0 after {args.warmup} untimed ones ({first['distinct_shapes']} distinct "
        f"batch shapes among the {args.stream}; {first['tokens']:,} target tokens), each sample a fresh process, "
        f"{args.repeats} interleaved repeats, {first['threads']} threads; median (min-max).",
        "",
        f"| path | target tokens/s | ms/step, first half / second half | page faults/step | x {'the 2026-11-22 main' if rows[0] == 'old_main' else rows[0]} |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) | "
                     f"{r['ms_first_half']:.0f} / {r['ms_second_half']:.0f} | {r['faults_per_step']:,.0f} | {r['tokens_per_s'] / base:.2f}x |")
    lines += ["", f"Highest 1-minute load average at a sample's start: {max(r['max_load'] for r in table):.2f}."]
    (out / "real_batches.json").write_text(json.dumps({"samples": samples, "table": table}, indent=2) + "\n")
    (out / "real_batches.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
