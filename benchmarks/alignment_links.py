"""What guided alignment's links cost before a run's first update (``qkv.train.alignment.run_links``):
eflomal over a prepared corpus's pairs, as ``qkv train --data-dir PREPARED --train alignment=W`` runs it.

For each shard size (``--shards``), one process of its own maps the prepared arrays, digests the pairs'
ids and aligns them (``align_pieces``: shards of at most that many pairs), measured from inside: wall
seconds of the digest and of the alignment, and peak resident memory of the process and of the eflomal
binary it ran (``getrusage``: the largest of the children, so the largest shard's).

    python -m benchmarks.alignment_links --prepared data/en-fr --out benchmarks/results/alignment_links

writes ``OUT/alignment_links.json`` and ``OUT/alignment_links.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def one(prepared: str, shard: int) -> dict:
    from qkv.io.prepared import load_prepared
    from qkv.train.alignment import align_pieces, pieces_digest, shards

    data = load_prepared(prepared)
    ids = data.train_ids(int(data.manifest["max_len"]))
    started = time.perf_counter()
    pieces_digest(ids.src_ids, ids.tgt_ids)
    digested = time.perf_counter()
    links = align_pieces(ids.src_ids, ids.tgt_ids, seed=1, shard=shard)
    aligned = time.perf_counter()
    n = len(ids.src_ids)
    return {
        "pairs": n, "shard": shard, "shards": len(shards(n, shard)), "links": int(len(links.flat)),
        "digest_s": round(digested - started, 2), "align_s": round(aligned - digested, 2),
        "align_s_per_1000_pairs": round(1000 * (aligned - digested) / n, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "eflomal_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepared", required=True, help="a directory qkv prepare wrote")
    parser.add_argument("--out", help="write alignment_links.json and .md here")
    parser.add_argument("--shards", default="100000,10000", help="shard sizes, comma-separated")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: this shard size only
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.prepared, args.one)))
        return
    rows = []
    for shard in (int(x) for x in args.shards.split(",")):
        child = subprocess.run([sys.executable, "-m", "benchmarks.alignment_links", "--prepared", args.prepared, "--one", str(shard)],
                               capture_output=True, text=True, check=True)
        rows.append(json.loads(child.stdout.splitlines()[-1]))
        print(rows[-1], flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "alignment_links.json").write_text(json.dumps({"prepared": args.prepared, "rows": rows}, indent=2) + "\n")
        lines = ["| pairs | shard | shards | links | digest s | eflomal s | s per 1,000 pairs | peak RSS MB | eflomal peak RSS MB |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['pairs']:,} | {r['shard']:,} | {r['shards']} | {r['links']:,} | {r['digest_s']} | {r['align_s']} | "
                  f"{r['align_s_per_1000_pairs']} | {r['peak_rss_mb']} | {r['eflomal_peak_rss_mb']} |" for r in rows]
        (out / "alignment_links.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
