"""(b) Training speed of the ``multi30k`` preset itself: today's path, each speed-up alone, all of
them, and a ``torch.nn.Transformer`` loop, on the same fixed batches.

Every row starts from the same initial weights and trains on the same batches (the preset's first
token batches of epoch 0). Rows are interleaved: repeat 1 runs every row once, then repeat 2, ..., so
that a change in the machine's load touches every row alike; the table gives the median and the
spread (min-max) over the repeats. Per row: target tokens/s and sentences/s, ms per step, model
GFLOP/s and its share of the fp32 matmul peak measured in the same run, minor page faults per step
and the share of the process's CPU time spent in the kernel (``getrusage``), and the peak resident
memory of the row (``VmHWM`` after resetting it through ``/proc/self/clear_refs``).

The speed-ups are ``TrainConfig`` flags, so "today's path" is the same Trainer with them off:
``tune_allocator`` (``qkv.model.cpu``; off means glibc's own steady state, restored by
``qkv.model.cpu.untune_allocator``), ``fused_loss`` (``qkv.train.loss.projected_label_smoothed_loss``) and
``adam`` ("for": PyTorch's per-tensor loop) and ``onednn`` (``qkv.model.kernels``; off: MKL through
``F.linear``) and ``fast_dropout`` (``qkv.model.dropout.FastDropout``, on by default since 2026-11-26:
other random masks than ``nn.Dropout`` draws, so the default without it has a row of its own,
``all_nn_dropout``); ``bf16`` has rows of its own (the fused loss's products in bfloat16: not the
same numbers; on a CPU without native bfloat16 its rows run in float32, and the table says so).
Two speed-ups have no flag and run in every row: attention over short sentences with gradients in
explicit steps (``qkv.model.attention.SHORT_TRAINING_ATTENTION``) and the fused loss's chunk size.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.baselines import TorchTransformer, forward_flops
from benchmarks.probe import busy, load as load_average, throwaway_trainer
from qkv.model import cpu
from qkv.model import kernels
from qkv.model.dropout import FastDropout
from qkv.train.recipes import adam_kernel
from qkv.data.corpus import collate
from qkv.train.recipes import build_configs
from qkv.train.precision import cpu_bf16_layers, cpu_bf16_loss, uses_fused_loss
from qkv.train.trainer import Trainer

OLD = {"tune_allocator": False, "fused_loss": False, "adam": "for", "fast_dropout": False, "bf16": False, "onednn": False,
       "bf16_layers": False}
NEW = {"tune_allocator": True, "fused_loss": True, "adam": "fused", "fast_dropout": True, "bf16": False, "onednn": True,
       "bf16_layers": False}
ROWS = [  # (key, label, flags)
    ("today", "today's path (every speed-up flag off)", OLD),
    ("allocator", "+ glibc kept from returning memory (tune_allocator)", {**OLD, "tune_allocator": True}),
    ("fused_loss", "+ fused chunked projection and loss (fused_loss)", {**OLD, "fused_loss": True}),
    ("adam", "+ fused Adam (adam=fused)", {**OLD, "adam": "fused"}),
    ("onednn", "+ linear layers on oneDNN (onednn)", {**OLD, "onednn": True}),
    ("fast_dropout", "+ dropout masks from 64-bit draws (fast_dropout: other random draws than nn.Dropout's)", {**OLD, "fast_dropout": True}),
    ("all", "the speed-ups together (the default)", NEW),
    ("all_mkl", "the default with MKL's linear layers (onednn=false)", {**NEW, "onednn": False}),
    ("all_nn_dropout", "the default with nn.Dropout's masks (fast_dropout=false; the exact speed-ups together)", {**NEW, "fast_dropout": False}),
    ("bf16", "the default + the output layer and loss in bf16 (--bf16, opt-in: rounds the logits)", {**NEW, "bf16": True}),
    ("bf16_layers", "the default + --bf16 + the linear layers' products in bf16 (bf16_layers, opt-in: rounds them)",
     {**NEW, "bf16": True, "bf16_layers": True}),
    ("bf16_mkl", "the default + --bf16, with MKL's linear layers (onednn=false)", {**NEW, "bf16": True, "onednn": False}),
    ("all_opt_in", "the default + bf16 + bf16_layers (every opt-in speed-up)", {**NEW, "bf16": True, "bf16_layers": True}),
    ("autocast", "the default under whole-step bf16 autocast (not offered on the CPU: plain loss)", {**NEW, "fused_loss": False, "autocast": True}),
    ("rdrop", "the default + R-Drop (rdrop=5: each batch twice, the logits whole; a recipe, not a speed-up)", {**NEW, "rdrop": 5.0}),
    ("rdrop_bf16_layers", "R-Drop with --bf16 and bf16_layers (the linear and output layers' products in bf16)",
     {**NEW, "rdrop": 5.0, "bf16": True, "bf16_layers": True}),
    ("torch_transformer", "torch.nn.Transformer loop (pre-LN, same batches, tuned allocator, fused Adam)", None),
]

RECIPE_ROWS = {"rdrop", "rdrop_bf16_layers"}  # what a recipe costs, not a speed-up: run only when named


def _peak_rss_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _measure(step, batches: list) -> dict:
    """Run ``step`` on every batch twice: once to warm up (the allocator's heap grows to what these
    batches need), then timed, with rusage around the timed pass."""
    for batch in batches:
        step(batch)
    _peak_rss_reset()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for batch in batches:
        step(batch)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"seconds": seconds, "faults": after.ru_minflt - before.ru_minflt, "system_share": system / max(user + system, 1e-9),
            "peak_rss_mb": _peak_rss_mb()}


def _allocator(tuned: bool) -> None:
    """glibc's steady state, its free memory given back (so that each row's peak RSS is its own), then tuned or not."""
    cpu.untune_allocator()
    if tuned:
        cpu.tune_allocator()


def _configure(trainer: Trainer, base, flags: dict, initial: dict) -> None:
    """Put ``trainer`` back at its initial weights with a fresh Adam and the speed-ups in ``flags``."""
    flags = dict(flags)
    trainer.autocast = flags.pop("autocast", False)  # whole-step torch.autocast, as on a GPU
    trainer.train_cfg = cfg = replace(base, **flags)
    trainer.fused_loss = uses_fused_loss(cfg, trainer.autocast)
    trainer.loss_bf16 = cpu_bf16_loss(cfg, trainer.device)
    trainer.linear_bf16 = cpu_bf16_layers(cfg, trainer.device)
    kernels.prefer_onednn(cfg.onednn)
    for module in list(trainer.model.modules()):  # nn.Dropout or FastDropout, as the flag says
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Dropout):
                setattr(module, name, FastDropout(child.p, cfg.dropout_bits) if cfg.fast_dropout else torch.nn.Dropout(child.p))
    trainer.model.load_state_dict(initial)
    trainer.optimizer = torch.optim.Adam(trainer.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                         **adam_kernel(cfg.adam))
    trainer.step = 0
    _allocator(cfg.tune_allocator)
    torch.manual_seed(0)


def run(*, smoke: bool, data_dir: str, peak_flops: float, log, repeats: int = 0, rows: list[str] | None = None) -> dict:
    """``rows``: the keys of ``ROWS`` to run (default: all but ``RECIPE_ROWS``), in ``ROWS``' order;
    "today" is always run."""
    repeats = repeats or (2 if smoke else 3)
    unknown = set(rows or ()) - {key for key, _, _ in ROWS}
    if unknown:
        raise ValueError(f"unknown rows {sorted(unknown)}; choose from {', '.join(key for key, _, _ in ROWS)}")
    chosen = [row for row in ROWS if (row[0] not in RECIPE_ROWS if rows is None else row[0] in rows) or row[0] == "today"]
    timed = 2 if smoke else 3
    data = {"data_dir": data_dir, "valid_limit": 20} | ({"train_limit": 3000, "vocab_size": 1000} if smoke else {})
    model_cfg, train_cfg, data_cfg = build_configs("multi30k", model={}, train={"tune_allocator": False}, data=data)
    trainer = throwaway_trainer(model_cfg, train_cfg, data_cfg)
    config, tok, ids = trainer.model_config, trainer.tokenizer, trainer.train_ids
    batches = timed_batches = trainer.batches(0)[:timed]
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    tokens = sum(len(ids.tgt_ids[i]) + 1 for b in timed_batches for i in b)
    sentences = sum(len(b) for b in timed_batches)
    flops = 3 * sum(forward_flops(config, [len(ids.src_ids[i]) + 1 for i in b], [len(ids.tgt_ids[i]) + 1 for i in b])
                    for b in timed_batches)
    collated = {id(b): collate([ids.src_ids[i] for i in b], [ids.tgt_ids[i] for i in b], pad_id=tok.pad_id,
                               bos_id=tok.bos_id, eos_id=tok.eos_id) for b in batches}

    def torch_row():
        _allocator(True)
        torch.manual_seed(0)
        model = TorchTransformer(config).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, **adam_kernel("fused"))

        def step(batch):
            src, tgt_in, tgt_out = collated[id(batch)]
            logits = model(src, tgt_in)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1), ignore_index=tok.pad_id,
                                   label_smoothing=train_cfg.label_smoothing, reduction="sum")
            opt.zero_grad(set_to_none=True)
            (loss / int((tgt_out != tok.pad_id).sum())).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return _measure(step, batches)

    onednn = kernels.prefer_onednn(True)  # each row sets its own; put back afterwards
    samples: dict[str, list[dict]] = {key: [] for key, _, _ in chosen}
    for repeat in range(repeats):
        for key, _, flags in chosen:
            load = load_average()[0]
            if flags is None:
                sample = torch_row()
            else:
                _configure(trainer, train_cfg, flags, initial)
                sample = _measure(lambda b: trainer.train_step([b]), batches)
            sample["load"] = load
            samples[key].append(sample)
            log(f"training preset, repeat {repeat + 1}/{repeats}, {key}: {timed / sample['seconds']:.2f} steps/s, "
                f"{sample['faults'] / timed:.0f} faults/step, system {100 * sample['system_share']:.1f}%, load {load:.2f}")
    cpu.tune_allocator()
    kernels.prefer_onednn(onednn)
    table = []
    for key, label, _ in chosen:
        s = samples[key]
        rates = [tokens / x["seconds"] for x in s]
        table.append({
            "key": key, "label": label,
            "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
            "sentences_per_s": statistics.median(sentences / x["seconds"] for x in s),
            "ms_per_step": statistics.median(1e3 * x["seconds"] / timed for x in s),
            "gflops": statistics.median(flops / x["seconds"] / 1e9 for x in s),
            "peak_share": statistics.median(flops / x["seconds"] / peak_flops for x in s),
            "faults_per_step": statistics.median(x["faults"] / timed for x in s),
            "system_share": statistics.median(x["system_share"] for x in s),
            "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in s),
            "max_load": max(x["load"] for x in s),
        })
    return {"model": {k: getattr(config, k) for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers", "tgt_vocab_size")},
            "parameters": trainer.model.num_parameters(), "batches": len(timed_batches),
            "sentences": sentences, "target_tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads(),
            "bf16_native": cpu.cpu_has_bf16(),
            "peak_gflops": peak_flops / 1e9, "rows": table}


def markdown(section: dict) -> str:
    m, rows = section["model"], section["rows"]
    by = {r["key"]: r for r in rows}
    lines = [
        f"### (b) Training speed of the `multi30k` preset (d_model {m['d_model']}, {m['n_encoder_layers']}+{m['n_decoder_layers']} "
        f"layers, vocabulary {m['tgt_vocab_size']}, {section['parameters'] / 1e6:.1f}M parameters)",
        "",
        f"The same {section['batches']} token batches ({section['sentences']} sentences, {section['target_tokens']} target tokens) "
        f"for every row, timed after a warm-up pass over them; median of {section['repeats']} interleaved repeats, "
        f"spread min-max; {section['threads']} threads; fp32 matmul peak {section['peak_gflops']:.0f} GFLOP/s.",
        "",
        "| path | target tokens/s (spread) | sentences/s | ms/step | GFLOP/s | % of peak | page faults/step | system time | peak RSS MB | x today |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:.0f} ({r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}) | "
            f"{r['sentences_per_s']:.1f} | {r['ms_per_step']:.0f} | {r['gflops']:.1f} | {100 * r['peak_share']:.0f}% | "
            f"{r['faults_per_step']:.0f} | {100 * r['system_share']:.1f}% | {r['peak_rss_mb']:.0f} | "
            f"{r['sentences_per_s'] / by['today']['sentences_per_s']:.2f}x |"
        )
    if not section.get("bf16_native", True):
        lines += ["", "This CPU has no native bfloat16 matmuls (AVX-512 BF16 or AMX): the bf16 rows ran in float32."]
    highest = max(r["max_load"] for r in rows)
    if busy(highest, section["threads"]):
        lines += ["", f"**Warning**: the 1-minute load average reached {highest:.2f} during the rows (more than the "
                      f"{section['threads']} threads used): another job was running and the numbers are not clean."]
    return "\n".join(lines)
