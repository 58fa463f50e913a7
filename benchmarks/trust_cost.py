"""What --confidence costs: `qkv translate --beam 5` of test_2016_flickr with and without it, side by side.

    .venv/bin/python -m benchmarks.trust_cost --checkpoint runs/en-de --repeats 3 --out benchmarks/results/trust/cost.json

Each run is the whole command in its own process (start-up and model loading included, as a user
meets it), 2 threads (--workers 1: one process), the two settings alternating so that a change in
the machine's speed falls on both; the load average is recorded before each run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.engine import engine_args, engine_label

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", default=str(DATA))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", help="keep the translations of the first plain run here")
    parser.add_argument("--out", required=True)
    engine_args(parser)
    args = parser.parse_args()
    engine = ["--engine", args.engine, *(["--int8"] if args.int8 else [])]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "test.en")
        src.write_text(gzip.open(Path(args.data_dir) / "test_2016_flickr.en.gz", "rt", encoding="utf-8").read(), encoding="utf-8")
        runs = {"plain": [], "confidence": []}
        loads = []
        for _ in range(args.repeats):
            for name, extra in (("plain", []), ("confidence", ["--confidence"])):
                loads.append(os.getloadavg()[0])
                start = time.perf_counter()
                subprocess.run([sys.executable, "-m", "qkv", "translate", "--checkpoint", args.checkpoint, "--beam", "5",
                                "--workers", "1", "-i", str(src), "-o", str(Path(tmp, name)), "--force", *engine, *extra],
                               check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
                runs[name].append(round(time.perf_counter() - start, 2))
                if args.save and name == "plain" and len(runs[name]) == 1:
                    Path(args.save).write_text(Path(tmp, name).read_text(encoding="utf-8"), encoding="utf-8")
                print(name, runs[name][-1], flush=True)
    ratio = [c / p for p, c in zip(runs["plain"], runs["confidence"])]
    result = {"checkpoint": args.checkpoint, "engine": engine_label(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": runs,
              "ratio_per_repeat": [round(r, 3) for r in ratio], "ratio_median": round(statistics.median(ratio), 3),
              "load_average_before_runs": [round(x, 2) for x in loads], "lines": 1000, "beam": 5, "threads": 2}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
