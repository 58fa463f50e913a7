"""(b) Training throughput on Multi30k: qkv's training loop against the tutorial's and torch.nn.Transformer.

All loops train the same architecture (post-LN, d_model 512, 8 heads, d_ff 2048, 6+6 layers;
``--smoke``: a small one) on the same tokenized Multi30k training set, timed over the same number
of optimizer steps after warm-up. Throughput counts real (non-padding) target tokens; model FLOP
utilisation (MFU) divides the model's matmul FLOPs on those tokens by the fp32 matmul peak measured
in the same run.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.baselines import TorchTransformer, TutorialTransformer, fixed_batches, forward_flops
from benchmarks.probe import throwaway_trainer
from qkv.data.corpus import collate
from qkv.train.trainer import Trainer
from qkv.train.recipes import build_configs

BASE = dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6, dropout=0.1, norm_first=False)
SMALL = dict(d_model=128, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2, dropout=0.1, norm_first=False)


def _baseline_step(model, optimizer, batch, pad_id: int) -> int:
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1), ignore_index=pad_id)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return int((tgt_out != pad_id).sum())


def _qkv_step(trainer: Trainer, batch: list[int]) -> int:
    """One ``Trainer.train_step``; it takes one batch, or (with gradient accumulation) a list of micro-batches."""
    takes_micro_batches = "batches" in inspect.signature(trainer.train_step).parameters
    return trainer.train_step([batch] if takes_micro_batches else batch)[1]


def _timed(steps: list, step_fn, warmup: int) -> tuple[float, int, int]:
    """Run ``step_fn`` on every batch; return seconds, target tokens and steps of the timed part."""
    for batch in steps[:warmup]:
        step_fn(batch)
    start, tokens = time.perf_counter(), 0
    for batch in steps[warmup:]:
        tokens += step_fn(batch)
    return time.perf_counter() - start, tokens, len(steps) - warmup


def run(*, smoke: bool, data_dir: str, tokenizer_from: Path | None, peak_flops: float, log) -> dict:
    sizes = SMALL if smoke else BASE
    warmup, timed = (1, 2) if smoke else (1, 3)
    data = {"data_dir": data_dir, "valid_limit": 20}
    if smoke:
        data |= {"train_limit": 3000, "vocab_size": 1000}
    model_cfg, train_cfg, data_cfg = build_configs("multi30k", model=sizes, train={"max_tokens": 4096}, data=data)
    trainer = throwaway_trainer(model_cfg, train_cfg, data_cfg, tokenizer=tokenizer_from if not smoke else None)
    config, tok, ids = trainer.model_config, trainer.tokenizer, trainer.train_ids
    parameters = trainer.model.num_parameters()
    n = warmup + timed

    def lengths(batch):
        return [len(ids.src_ids[i]) + 1 for i in batch], [len(ids.tgt_ids[i]) + 1 for i in batch]

    def collated(batch):
        return collate([ids.src_ids[i] for i in batch], [ids.tgt_ids[i] for i in batch],
                       pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)

    token_batches = trainer.batches(0)[:n]
    sentence_batches = fixed_batches(len(ids.src_ids), 128, seed=0)[:n]
    rows = []

    def record(name, label, batches, seconds, tokens, steps):
        flops = 3 * sum(forward_flops(config, *lengths(b)) for b in batches[warmup:])
        padded = sum(max(len(ids.tgt_ids[i]) + 1 for i in b) * len(b) for b in batches[warmup:])
        real = sum(len(ids.tgt_ids[i]) + 1 for b in batches[warmup:] for i in b)
        row = {"loop": name, "label": label, "steps": steps, "seconds": round(seconds, 3),
               "target_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
               "step_s": round(seconds / steps, 3), "model_tflops_per_s": round(flops / seconds / 1e12, 4),
               "mfu": round(flops / seconds / peak_flops, 4), "target_padding": round(1 - real / padded, 3)}
        rows.append(row)
        log(f"training {name}: {row}")

    # qkv: its own Trainer.train_step (label smoothing, lr schedule, clipping) on its token batches.
    seconds, tokens, steps = _timed(token_batches, lambda b: _qkv_step(trainer, b), warmup)
    record("qkv", "qkv.train.trainer (token batches <= 4096, length-sorted)", token_batches, seconds, tokens, steps)
    # The same qkv step on the tutorial's batches separates the model's speed from the batching's.
    seconds, tokens, steps = _timed(sentence_batches, lambda b: _qkv_step(trainer, b), warmup)
    record("qkv_fixed", "qkv.train.trainer on the tutorial's 128-sentence batches", sentence_batches, seconds, tokens, steps)
    del trainer

    for name, label, cls in [
        ("tutorial", "tutorial-literal model and loop (128 sentences, padded)", TutorialTransformer),
        ("torch_transformer", "torch.nn.Transformer loop (same 128-sentence batches)", TorchTransformer),
    ]:
        torch.manual_seed(0)
        model = cls(config).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
        cache = [collated(b) for b in sentence_batches]
        index = {id(b): c for b, c in zip(sentence_batches, cache)}
        seconds, tokens, steps = _timed(
            sentence_batches, lambda b: _baseline_step(model, optimizer, index[id(b)], tok.pad_id), warmup
        )
        record(name, label, sentence_batches, seconds, tokens, steps)
        del model, optimizer
    return {"model": {k: getattr(config, k) for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers", "tgt_vocab_size")},
            "parameters": parameters,
            "warmup_steps": warmup, "timed_steps": timed, "peak_tflops_per_s": round(peak_flops / 1e12, 4), "rows": rows}


def markdown(section: dict) -> str:
    m = section["model"]
    rows = section["rows"]
    lines = [
        f"### (b) Training throughput on Multi30k (d_model {m['d_model']}, {m['n_heads']} heads, d_ff {m['d_ff']}, "
        f"{m['n_encoder_layers']}+{m['n_decoder_layers']} layers, vocabulary {m['tgt_vocab_size']}, "
        f"{section['parameters'] / 1e6:.1f}M parameters in qkv)",
        "",
        f"{section['timed_steps']} timed optimizer steps after {section['warmup_steps']} warm-up step(s) per loop. "
        f"MFU = model FLOPs/s on real tokens (3x forward matmul FLOPs) / fp32 matmul peak measured in this run "
        f"({section['peak_tflops_per_s'] * 1e3:.0f} GFLOP/s).",
        "",
        "| loop | target tokens/s | s/step | model GFLOP/s | MFU | target padding |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['model_tflops_per_s'] * 1e3:.1f} | "
                     f"{100 * r['mfu']:.1f}% | {100 * r['target_padding']:.0f}% |")
    by = {r["loop"]: r for r in rows}
    if "qkv_fixed" in by and "tutorial" in by:  # like against like: the same 128-sentence batches
        lines += ["", f"On the same 128-sentence batches: qkv / tutorial throughput "
                      f"{by['qkv_fixed']['tokens_per_s'] / by['tutorial']['tokens_per_s']:.2f}x; "
                      f"qkv / torch.nn.Transformer {by['qkv_fixed']['tokens_per_s'] / by['torch_transformer']['tokens_per_s']:.2f}x"]
    return "\n".join(lines)
