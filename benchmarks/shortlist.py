"""Vocabulary shortlists on Multi30k: what each size of table costs in BLEU and buys in speed, chosen
on validation, the choice reported once on test2016.

    python -m benchmarks.shortlist --checkpoint runs/en-de/final --out benchmarks/results/shortlist

For every (k, frequent) in the grid a table is built from the checkpoint's Multi30k training pairs
(``qkv.infer.shortlist.build``, as ``qkv shortlist`` builds it); val is translated with beam 5 and
greedy, exactly and with each table, in one process on the same threads, the variants interleaved
and repeated (median and min-max of the seconds). Each row gives BLEU (sacreBLEU, cased), the
sentences whose translation differs from the exact search's, the mean number of pieces a sentence
may use, and the speed-up over the exact search in the same run. The table the defaults should be
is the fastest whose beam-5 BLEU on val is within 0.2 of the exact search's; test2016 is then
translated exactly and with the defaults (``DEFAULT_K``, ``DEFAULT_FREQUENT``) only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.probe import check_load, write_results
from qkv.data.corpus import load_multi30k
from qkv.infer import shortlist
from qkv.infer.bleu import score
from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.io import checkpoint
from qkv.model.cpu import tune_allocator

GRID = ((10, 100), (20, 200), (50, 200), (10, 500), (20, 500), (50, 500))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shortlist", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", default="../shared/data/multi30k")
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_allocator()
    loaded = checkpoint.load(args.checkpoint)
    model, tok, config = loaded.model, loaded.tokenizer, loaded.model.config
    data = loaded.config.get("data", {})
    src, tgt = data.get("src_lang", "en"), data.get("tgt_lang", "de")
    alpha = checkpoint.decode_defaults(loaded.config).get("length_penalty", DecodeConfig.length_penalty)
    train = load_multi30k("train", src, tgt, args.data_dir)
    pairs = [(tok.encode(s), tok.encode_target(t)) for s, t in zip(train.src, train.tgt)]
    tables = {(k, f): shortlist.build(pairs, src_vocab=config.src_vocab_size, tgt_vocab=config.tgt_vocab_size, k=k,
                                      frequent=f, always=(tok.eos_id,))
              for k, f in {*GRID, (shortlist.DEFAULT_K, shortlist.DEFAULT_FREQUENT)}}
    log = lambda message: print(message, flush=True)  # noqa: E731
    rows = []
    for split in ("val", "test_2016_flickr"):
        corpus = load_multi30k(split, src, tgt, args.data_dir)
        grid = GRID if split == "val" else ((shortlist.DEFAULT_K, shortlist.DEFAULT_FREQUENT),)
        for beam in (5, 1):
            variants = [("exact", None)] + [(f"k {k}, frequent {f}", tables[k, f]) for k, f in grid]
            translators = {name: Translator(model, tok, DecodeConfig(beam_size=beam, length_penalty=alpha), shortlist=table)
                           for name, table in variants}
            seconds: dict[str, list[float]] = {name: [] for name, _ in variants}
            outputs: dict[str, list[str]] = {}
            load = check_load(f"shortlist {split} beam {beam}", args.threads, log)
            for name, translator in translators.items():  # warm-up
                translator.translate(corpus.src[::8])
            for _ in range(args.repeats):  # interleaved
                for name, translator in translators.items():
                    started = time.perf_counter()
                    outputs[name] = translator.translate(corpus.src)
                    seconds[name].append(time.perf_counter() - started)
            exact_s = statistics.median(seconds["exact"])
            ids = [tok.encode(s) for s in corpus.src]
            for name, table in variants:
                median = statistics.median(seconds[name])
                row = {"split": split, "beam": beam, "variant": name, "bleu": score(outputs[name], corpus.tgt)["bleu"],
                       "changed": sum(a != b for a, b in zip(outputs[name], outputs["exact"])), "sentences": len(corpus.src),
                       "mean_pieces": None if table is None else round(statistics.mean(len(v) for v in table.vocab(ids)), 1),
                       "seconds": [round(s, 3) for s in seconds[name]], "sentences_per_s": round(len(corpus.src) / median, 1),
                       "speedup": round(exact_s / median, 3), "speedup_range": [round(min(seconds["exact"]) / max(seconds[name]), 3),
                                                                               round(max(seconds["exact"]) / min(seconds[name]), 3)],
                       "load": load}
                rows.append(row)
                log(f"{split} beam {beam} {name}: BLEU {row['bleu']:.2f}, changed {row['changed']}, "
                    f"{row['sentences_per_s']} sentences/s, {row['speedup']:.2f}x")
    result = {"checkpoint": str(loaded.path), "threads": args.threads, "repeats": args.repeats,
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "defaults": {"k": shortlist.DEFAULT_K, "frequent": shortlist.DEFAULT_FREQUENT}, "rows": rows}
    write_results(args.out, result, markdown)
    return 0


def markdown(result: dict) -> str:
    lines = [f"Checkpoint `{result['checkpoint']}`, {result['threads']} threads, {result['started']}, torch {result['torch']}; "
             f"each variant translated {result['repeats']} times, interleaved, after a warm-up; speed-up: median seconds of the "
             "exact search over the variant's (range: slowest against fastest). \"changed\": sentences whose translation "
             "differs from the exact search's.", "",
             "| split | beam | variant | BLEU | changed | pieces a sentence may use | sentences/s | speed-up | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        low, high = r["speedup_range"]
        pieces = "all" if r["mean_pieces"] is None else f"{r['mean_pieces']:,}"
        lines.append(f"| {r['split']} | {r['beam']} | {r['variant']} | {r['bleu']:.2f} | {r['changed']} / {r['sentences']} | "
                     f"{pieces} | {r['sentences_per_s']:,} | {r['speedup']:.2f}x ({low:.2f}-{high:.2f}) | {r['load']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
