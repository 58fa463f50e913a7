"""Run qkv's benchmarks and write ``results.json`` and ``results.md`` (plus plots) to ``--out``.

    .venv/bin/python -m benchmarks.run --out benchmarks/results --checkpoint runs/en-de/final
    .venv/bin/python -m benchmarks.run --smoke --out /tmp/bench      # seconds: small sizes, few steps

Sections: (a) attention, (b) training throughput (``--training preset`` for the multi30k preset's
rows alone: today's path, each speed-up, all, torch.nn.Transformer; ``--training vocab`` for its speed
by vocabulary size), (c) translation (needs ``--checkpoint``; skipped
with a printed reason otherwise), (d) scaling. ``--only a,c`` runs some of them. Speed targets are
printed as ratios; nothing here asserts a timing. The machine is described in both outputs, with the
load average before and after each section, so a busy machine shows in the results; the load is also
checked before each section and each measured cell, with a printed warning when another job runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks import attention, preset_training, scaling, training, translation, vocab_training
from benchmarks.baselines import matmul_peak
from benchmarks.probe import check_load, load

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "multi30k"
SECTIONS = {"a": "attention", "b": "training", "c": "translation", "d": "scaling"}
TRAINING_PARTS = ("preset", "base")  # (b): the multi30k preset's speed-ups; the paper's base size against the baselines
# (b) also has "vocab", on request (--training vocab): the preset's speed by vocabulary size


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("ctranslate2", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), **versions}


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"# qkv benchmarks ({'smoke' if results['smoke'] else 'full'} run, {results['started']})",
        "",
        f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"Python {m['python']}, CTranslate2 {m['ctranslate2']}, transformers {m['transformers']}. "
        f"fp32 matmul peak measured: {results['matmul_peak_gflops']:.0f} GFLOP/s.",
        f"Load average (1 min) before/after each section: "
        + ", ".join(f"{name} {v['load_before'][0]}/{v['load_after'][0]}" for name, v in results["sections"].items() if "load_before" in v)
        + f" (a quiet machine stays near {m['torch_threads']} while a benchmark runs, and near 0 between).",
        f"Command: `{results['command']}`",
        "",
    ]
    modules = {"attention": attention, "training": training, "translation": translation, "scaling": scaling}
    for name, section in results["sections"].items():
        if "skipped" in section:
            lines += [f"### {name}: skipped ({section['skipped']})", ""]
        elif "error" in section:
            lines += [f"### {name}: failed ({section['error']})", ""]
        else:
            if "preset" in section:
                lines += [preset_training.markdown(section["preset"]), ""]
            if "vocab" in section:
                lines += [vocab_training.markdown(section["vocab"]), ""]
            if name != "training" or "rows" in section:  # (b) may hold its preset part alone
                lines += [modules[name].markdown(section), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="directory for results.json, results.md and plots")
    parser.add_argument("--checkpoint", help="trained checkpoint for (c) translation (e.g. runs/en-de/final)")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA), help="Multi30k directory")
    parser.add_argument("--smoke", action="store_true", help="small sizes and few steps: a check that everything runs")
    parser.add_argument("--only", default="a,b,c,d", help="comma-separated sections to run (a,b,c,d)")
    parser.add_argument("--training", default=",".join(TRAINING_PARTS), help="parts of (b) to run: preset, base, vocab (default: preset,base)")
    parser.add_argument("--preset-rows", help="comma-separated rows of (b)'s preset part (default: all; today always runs)")
    parser.add_argument("--repeats", type=int, default=0,
                        help="timed repeats of each cell: (b) preset rows (default 3), (c) translation cells (default 5), "
                             "(d) decode-step sweeps (default 9); smoke: 2 (d: 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: PyTorch's default)")
    parser.add_argument("--engines", help="(c): comma-separated engine:compute cells to run, e.g. qkv:float32,qkv:bfloat16 "
                                          "(default: all but qkv:float32+compiled, which compiles for a minute or more in each cell)")
    parser.add_argument("--sentences", type=int, default=0, help="(c): the first N sentences of test_2016_flickr (default: all)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [SECTIONS[s.strip()] for s in args.only.split(",") if s.strip()]

    def log(message: str) -> None:
        print(message, flush=True)

    results = {"machine": machine(), "smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]), "sections": {}}
    log(f"machine: {results['machine']}; load {load()}")
    peak = matmul_peak(seconds=1.0 if args.smoke else 3.0)
    results["matmul_peak_gflops"] = round(peak / 1e9, 1)
    log(f"fp32 matmul peak: {peak / 1e9:.0f} GFLOP/s")
    tokenizer = Path(args.checkpoint) / "tokenizer.model" if args.checkpoint else None
    for name in wanted:
        started, before = time.perf_counter(), load()
        check_load(f"section {name}", threads, log)
        if name == "translation" and not args.checkpoint:
            reason = "no --checkpoint given; pass a trained checkpoint, e.g. --checkpoint runs/en-de/final"
            log(f"translation: skipped ({reason})")
            results["sections"][name] = {"skipped": reason}
            continue
        if name == "attention":
            section = attention.run(smoke=args.smoke, threads=threads, log=log)
        elif name == "training":
            parts, section = [p.strip() for p in args.training.split(",") if p.strip()], {}
            if "preset" in parts:
                section["preset"] = preset_training.run(smoke=args.smoke, data_dir=args.data_dir, peak_flops=peak, log=log,
                                                        repeats=args.repeats,
                                                        rows=args.preset_rows.split(",") if args.preset_rows else None)
            if "vocab" in parts:
                section["vocab"] = vocab_training.run(smoke=args.smoke, data_dir=args.data_dir, peak_flops=peak, log=log,
                                                      repeats=args.repeats)
            if "base" in parts:
                section |= training.run(smoke=args.smoke, data_dir=args.data_dir,
                                        tokenizer_from=tokenizer if tokenizer and tokenizer.exists() else None,
                                        peak_flops=peak, log=log)
        elif name == "translation":
            section = translation.run(checkpoint_dir=args.checkpoint, data_dir=args.data_dir, smoke=args.smoke,
                                      threads=threads, log=log, repeats=args.repeats, sentences=args.sentences,
                                      engines=[e.strip() for e in args.engines.split(",")] if args.engines else None)
        else:
            section = scaling.run(smoke=args.smoke, threads=threads, out=out, log=log, repeats=args.repeats)
        section |= {"seconds": round(time.perf_counter() - started, 1), "load_before": before, "load_after": load()}
        results["sections"][name] = section
        log(f"{name}: done in {section['seconds']}s")
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(results) + "\n", encoding="utf-8")
    log(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
