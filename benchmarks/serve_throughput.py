"""`qkv serve` under concurrent clients against the same engine translating the same sentences in batches.

    python -m benchmarks.serve_throughput --checkpoint runs/en-de/final --data-dir ../shared/data/multi30k \\
        --engines qkv,ctranslate2 --clients 32 --seconds 40 --repeats 3 --out benchmarks/results/serve-throughput

For each repeat and engine, two cells, each in its own process, one after the other:

- ``batched``: the engine's library call on the sources of the split in one call (qkv's ``Translator``
  or ``CTranslate2Translator``, the server's own settings: the checkpoint's length penalty, the loop
  guard, beam ``--beam``), after a warm-up on the first 64; sentences/s of the timed call.
- ``server``: ``qkv serve --engine E`` in a child process, ``--clients`` clients each sending one
  sentence a request and the next once answered (a closed loop), the sentences of the split in turn,
  for ``--seconds`` after a warm-up of 5 s; sentences/s answered, latency p50/p99 and the server's mean
  batch (``GET /v1/stats``). The clients are wrk (Debian's ``wrk``, a C load generator: the clients
  take little of the two cores the server shares with them) or, with ``--client python`` or without
  wrk, ``benchmarks.load_test``'s asyncio clients.

The ratio of the two is the server's throughput as a share of its engine's batched. Each cell records
the load average before it; nothing else should run. An engine written ``qkv:batches`` is qkv's with
``qkv serve --batching batches`` (qkv's own default is the continuous search): its server cell beside
the default's, in the same repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.load_test import ServerProcess, run_load
from qkv.data.corpus import read_lines

ROOT = Path(__file__).resolve().parents[1]


def sources(data_dir: Path, split: str, src: str) -> list[str]:
    """The split's non-empty source lines (plain or .gz, read as every corpus is: ``qkv.data.corpus.read_lines``)."""
    path = data_dir / f"{split}.{src}"
    found = read_lines(path if path.exists() else path.with_name(path.name + ".gz"))
    return [line.strip() for line in found if line.strip()]


def batched_cell(checkpoint: str, engine: str, texts: list[str], beam: int) -> dict:
    """The engine's library call on all ``texts`` at once, as the server configures it (this process)."""
    from dataclasses import replace

    from qkv.cli.common import LOOP_GUARD
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint as ckpt

    loaded = ckpt.load(checkpoint)
    config = replace(DecodeConfig(beam_size=beam, loop_guard=LOOP_GUARD), **ckpt.decode_defaults(loaded.config))
    if engine == "ctranslate2":
        from qkv.interop.ct2_engine import CTranslate2Translator, ensure_export

        ct2_dir, _ = ensure_export(loaded.path, log=lambda m: None)
        translator = CTranslate2Translator(loaded.model, loaded.tokenizer, config, ct2_dir=ct2_dir)
    else:
        translator = Translator(loaded.model, loaded.tokenizer, config)
    ids = [translator.encode(t) for t in texts]
    translator.translate_ids(ids[:64])  # warm-up
    started = time.perf_counter()
    translator.translate_ids(ids)
    seconds = time.perf_counter() - started
    return {"sentences": len(texts), "seconds": seconds, "sentences_per_second": len(texts) / seconds}


def _wrk_script(texts: list[str], beam: int, path: Path) -> None:
    bodies = [json.dumps({"texts": [t], "beam_size": beam}) for t in texts]
    lua = ["local bodies = {"]
    lua += [f"  [==[{b}]==]," for b in bodies]
    lua += ["}", "local i = 0", 'local headers = {["Content-Type"] = "application/json"}',
            "request = function()", "  i = i % #bodies + 1",
            '  return wrk.format("POST", "/v1/translate", headers, bodies[i])', "end"]
    path.write_text("\n".join(lua) + "\n", encoding="utf-8")


def _ms(value: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value).groups()
    return float(number) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def wrk_load(url: str, script: Path, *, clients: int, seconds: float) -> dict:
    """wrk's closed loop: ``clients`` connections on one thread, each sending its next request once answered."""
    command = ["wrk", "-t1", f"-c{clients}", f"-d{seconds:g}s", "--timeout", "60s", "--latency", "-s", str(script), url]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    done = int(re.search(r"(\d+) requests in", out).group(1))
    took = _ms(re.search(r"requests in ([\d.]+\w+),", out).group(1)) / 1e3
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {"requests": done, "seconds": took, "sentences_per_second": done / took,
            "p50_ms": _ms(re.search(r"\s50%\s+(\S+)", out).group(1)), "p99_ms": _ms(re.search(r"\s99%\s+(\S+)", out).group(1)),
            "errors": (int(bad.group(1)) if bad else 0) + (sum(map(int, errors.groups())) if errors else 0)}


def server_cell(checkpoint: str, engine: str, texts: list[str], beam: int, *, clients: int, seconds: float, client: str,
                server_args: list[str]) -> dict:
    log = Path(tempfile.gettempdir()) / f"qkv-serve-throughput-{os.getpid()}.log"
    args = ["--engine", engine, "--log-level", "warning", *server_args]
    with ServerProcess(checkpoint, *args, log_path=log) as server, tempfile.TemporaryDirectory() as tmp:
        stats = lambda: httpx.get(f"{server.url}/v1/stats", timeout=30).json()  # noqa: E731
        if client == "wrk":
            script = Path(tmp) / "load.lua"
            _wrk_script(texts, beam, script)
            wrk_load(server.url, script, clients=clients, seconds=5)  # warm-up (and the CTranslate2 export's check)
            before = stats()
            result = wrk_load(server.url, script, clients=clients, seconds=seconds)
        else:
            asyncio.run(run_load(server.url, clients=clients, requests=4, sentences=texts, beam=beam))  # warm-up
            before = stats()
            per_client = max(1, round(seconds * 100 / clients))  # about --seconds at 100 sentences/s
            found = asyncio.run(run_load(server.url, clients=clients, requests=per_client, sentences=texts, beam=beam,
                                         max_seconds=10 * seconds))
            result = {k: found[k] for k in ("requests", "seconds", "sentences_per_second", "p50_ms", "p99_ms", "errors")}
        after = stats()
    batches = after["batches"] - before["batches"]
    result["mean_batch"] = (after["sentences"] - before["sentences"]) / batches if batches else 0.0
    steps = after.get("steps", 0) - before.get("steps", 0)  # the continuous search's
    decoded = after.get("mean_step_sentences", 0) * after.get("steps", 0) - before.get("mean_step_sentences", 0) * before.get("steps", 0)
    result["mean_step_sentences"] = decoded / steps if steps else 0.0
    return result


def _child(kind: str, args: argparse.Namespace, engine: str) -> dict:
    """One cell in its own process: this module again, with --cell."""
    engine, _, batching = engine.partition(":")
    server_args = args.server_args + (f" --batching {batching}" if batching else "")
    command = [sys.executable, "-m", "benchmarks.serve_throughput", "--cell", kind, "--engines", engine,
               "--checkpoint", args.checkpoint, "--data-dir", str(args.data_dir), "--split", args.split, "--src", args.src,
               "--beam", str(args.beam), "--clients", str(args.clients), "--seconds", str(args.seconds),
               "--client", args.client, "--server-args", server_args]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"the {kind} cell ({engine}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "multi30k")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--src", default="en")
    p.add_argument("--engines", default="qkv,ctranslate2")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--client", choices=["wrk", "python"], default="wrk" if shutil.which("wrk") else "python")
    p.add_argument("--server-args", default="", help="more `qkv serve` flags, e.g. '--max-wait-ms 5'")
    p.add_argument("--out", type=Path, help="a directory for serve-throughput.json")
    p.add_argument("--cell", choices=["batched", "server"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    texts = sources(args.data_dir, args.split, args.src)
    if args.cell == "batched":
        print(json.dumps(batched_cell(args.checkpoint, args.engines, texts, args.beam)))
        return
    if args.cell == "server":
        print(json.dumps(server_cell(args.checkpoint, args.engines, texts, args.beam, clients=args.clients,
                                     seconds=args.seconds, client=args.client, server_args=args.server_args.split())))
        return
    engines = args.engines.split(",")
    runs: dict[str, dict[str, list]] = {e: {"batched": [], "server": []} for e in engines}
    for repeat in range(args.repeats):
        for engine in engines:
            for kind in ("batched", "server"):
                load = os.getloadavg()[0]
                cell = _child(kind, args, engine) | {"load_before": round(load, 2)}
                runs[engine][kind].append(cell)
                print(f"repeat {repeat + 1} {engine:>11} {kind:>7}: {cell['sentences_per_second']:.1f} sentences/s"
                      + (f", p50 {cell['p50_ms']:.0f} ms, p99 {cell['p99_ms']:.0f} ms, mean batch {cell['mean_batch']:.1f}, "
                         f"mean step {cell['mean_step_sentences']:.1f}, "
                         f"errors {cell['errors']}" if kind == "server" else "") + f" (load {load:.2f})", flush=True)
    summary = {}
    for engine, cells in runs.items():
        batched = statistics.median(c["sentences_per_second"] for c in cells["batched"])
        served = statistics.median(c["sentences_per_second"] for c in cells["server"])
        ratios = [s["sentences_per_second"] / b["sentences_per_second"] for b, s in zip(cells["batched"], cells["server"])]
        summary[engine] = {"batched": batched, "server": served, "ratio": served / batched, "ratios": ratios,
                           "p50_ms": statistics.median(c["p50_ms"] for c in cells["server"]),
                           "p99_ms": statistics.median(c["p99_ms"] for c in cells["server"])}
        print(f"{engine}: server {served:.1f} / batched {batched:.1f} sentences/s = {served / batched:.2f}x "
              f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"command": "python -m benchmarks.serve_throughput " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": os.cpu_count(),
                  "client": args.client, "clients": args.clients, "beam": args.beam, "split": args.split,
                  "summary": summary, "cells": runs}
        (args.out / "serve-throughput.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
