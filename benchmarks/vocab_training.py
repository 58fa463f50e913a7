"""(b) Training speed by vocabulary size, the ``multi30k`` preset otherwise unchanged.

The vocabulary is a speed lever both ways: the output projection and the loss grow with it (about
44% of a step's FLOPs at 8,000 pieces), while a smaller vocabulary cuts each sentence into more
pieces, so a batch of 4,096 tokens holds fewer sentences. What decides the hour's quality is the
sentences trained on per second, so that is what this part compares, on like inputs: the same
sentence pairs (a fixed random sample of the training split) for every size, each size with its
own joint BPE tokenizer trained as ``qkv train`` trains it and the preset's own batching of those
pairs (length buckets within the token budget). Every size starts each repeat from its own initial
weights with a fresh Adam, with the preset's default speed-ups; repeats are interleaved (repeat 1
runs every size once, then repeat 2, ...), the table gives the median and the spread.

Validation BLEU at a fixed number of updates for each size needs a training run per size; those
runs are in ``docs/recipes.md``.
"""

from __future__ import annotations

import random
import statistics

import torch

from benchmarks.baselines import forward_flops
from benchmarks.preset_training import NEW, _configure, _measure
from benchmarks.probe import busy, load as load_average, throwaway_trainer
from qkv.data.corpus import token_batches
from qkv.train.recipes import build_configs

SIZES = (4000, 5000, 8000, 10000)
SMOKE_SIZES = (300, 600)
REFERENCE = 8000  # the preset's


def run(*, smoke: bool, data_dir: str, peak_flops: float, log, repeats: int = 0, sizes: tuple[int, ...] | None = None) -> dict:
    sizes = sizes or (SMOKE_SIZES if smoke else SIZES)
    repeats = repeats or (2 if smoke else 3)
    n_pairs = 100 if smoke else 1200
    setups = {}
    for size in sizes:
        data = {"data_dir": data_dir, "valid_limit": 20, "vocab_size": size} | ({"train_limit": 3000} if smoke else {})
        model_cfg, train_cfg, data_cfg = build_configs("multi30k", model={}, train={}, data=data)
        trainer = throwaway_trainer(model_cfg, train_cfg, data_cfg)  # trains this size's tokenizer
        ids = trainer.train_ids
        pairs = sorted(random.Random(0).sample(range(len(ids.src_ids)), n_pairs))  # the same pairs for every size
        local = token_batches([len(ids.src_ids[i]) for i in pairs], [len(ids.tgt_ids[i]) for i in pairs],
                              train_cfg.max_tokens, seed=train_cfg.seed, epoch=0)
        batches = [[pairs[j] for j in batch] for batch in local]
        config = trainer.model_config
        setups[size] = {
            "trainer": trainer, "base": train_cfg, "batches": batches,
            "initial": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "tokens": sum(len(ids.tgt_ids[i]) + 1 for i in pairs),
            "flops": 3 * sum(forward_flops(config, [len(ids.src_ids[i]) + 1 for i in b], [len(ids.tgt_ids[i]) + 1 for i in b])
                             for b in batches),
            "parameters": trainer.model.num_parameters(),
        }
        log(f"vocabulary {size}: tokenizer trained, {n_pairs} pairs in {len(batches)} batches, "
            f"{setups[size]['tokens']} target tokens")
    samples: dict[int, list[dict]] = {size: [] for size in sizes}
    for repeat in range(repeats):
        for size in sizes:
            s = setups[size]
            load = load_average()[0]
            _configure(s["trainer"], s["base"], NEW, s["initial"])
            sample = _measure(lambda b, t=s["trainer"]: t.train_step([b]), s["batches"])
            sample["load"] = load
            samples[size].append(sample)
            log(f"training by vocabulary, repeat {repeat + 1}/{repeats}, {size}: {n_pairs / sample['seconds']:.0f} sentences/s, "
                f"load {load:.2f}")
    rows = []
    for size in sizes:
        s, timed = setups[size], samples[size]
        rates = [n_pairs / x["seconds"] for x in timed]
        rows.append({
            "vocab_size": size, "parameters": s["parameters"], "steps": len(s["batches"]), "target_tokens": s["tokens"],
            "sentences_per_s": statistics.median(rates), "sentences_per_s_min": min(rates), "sentences_per_s_max": max(rates),
            "tokens_per_s": statistics.median(s["tokens"] / x["seconds"] for x in timed),
            "ms_per_step": statistics.median(1e3 * x["seconds"] / len(s["batches"]) for x in timed),
            "peak_share": statistics.median(s["flops"] / x["seconds"] / peak_flops for x in timed),
            "max_load": max(x["load"] for x in timed),
        })
    return {"pairs": n_pairs, "repeats": repeats, "threads": torch.get_num_threads(), "peak_gflops": peak_flops / 1e9, "rows": rows}


def markdown(section: dict) -> str:
    rows = section["rows"]
    reference = next((r for r in rows if r["vocab_size"] == REFERENCE), rows[0])
    lines = [
        "### (b) Training speed by vocabulary size (the `multi30k` preset otherwise unchanged)",
        "",
        f"The same {section['pairs']} training pairs for every size, each size with its own joint BPE tokenizer and the "
        f"preset's batching (4,096-token batches); timed after a warm-up pass; median of {section['repeats']} "
        f"interleaved repeats, spread min-max; fp32 matmul peak {section['peak_gflops']:.0f} GFLOP/s.",
        "",
        f"| vocabulary | parameters | updates for the pairs | target tokens | sentences/s (spread) | target tokens/s | ms/update | % of peak | x {reference['vocab_size']:,} |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab_size']:,} | {r['parameters']:,} | {r['steps']} | {r['target_tokens']:,} | "
            f"{r['sentences_per_s']:.0f} ({r['sentences_per_s_min']:.0f}-{r['sentences_per_s_max']:.0f}) | "
            f"{r['tokens_per_s']:.0f} | {r['ms_per_step']:.0f} | {100 * r['peak_share']:.0f}% | "
            f"{r['sentences_per_s'] / reference['sentences_per_s']:.2f}x |"
        )
    highest = max(r["max_load"] for r in rows)
    if busy(highest, section["threads"]):
        lines += ["", f"**Warning**: the 1-minute load average reached {highest:.2f} during the rows: another job was "
                      "running and the numbers are not clean."]
    return "\n".join(lines)
