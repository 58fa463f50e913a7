"""Cheap extra signals for ``--confidence``, tried on val as ``qkv calibrate`` chooses its features: does an
empty-source contrast or a few dropout passes add to the out-of-fold ranking of acceptable translations?

The model translates Multi30k val and its joined pairs (what ``qkv calibrate`` fits on), every translation is
scored by ``qkv.inspect.trust.assess`` (the features ``--confidence`` reads), and four candidates are added:

- ``empty_lp``: the translation's mean token log-probability given an empty source (the decoder alone, a
  language model of sorts), and ``contrast``: logprob_mean minus it (how much the source explains);
- ``dropout_mean`` and ``dropout_std``: the mean and spread of the mean token log-probability over
  ``--dropout-passes`` passes with the model's dropout on (Monte Carlo dropout).

Each row: the 5-fold cross-validated ROC AUC of the acceptable translations (sentence chrF >= 50, as
``qkv calibrate``) and Spearman with chrF, for ``logprob_mean`` and the checkpoint's own calibrated features,
each alone and with one candidate added. ``qkv calibrate`` admits a feature that adds at least
``MIN_GAIN`` ROC AUC without lowering the Spearman.

    python -m benchmarks.trust_signals --checkpoint runs/en-de/final --data-dir ../shared/data/multi30k \\
        --out benchmarks/results/trust/signals.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from qkv.cli.common import LOOP_GUARD
from qkv.data.corpus import collate, read_lines
from qkv.infer.bleu import sentence_chrf
from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.inspect.calibrate import ACCEPTABLE, cross_validated, fit_length, provoking_pairs, ranks_acceptable, spearman
from qkv.inspect.trust import LOGPROB_ONLY, assess
from qkv.io import checkpoint

MIN_GAIN = 0.005  # the cross-validated ROC AUC a signal had to add (the calibration of 2026-12-04 and before)
CANDIDATES = ("empty_lp", "contrast", "dropout_mean", "dropout_std")


def mean_logprobs(model, tok, src_ids: list[list[int]], tgt_ids: list[list[int]], batch: int = 64) -> list[float]:
    """Each target's mean token log-probability (EOS included) given its source, teacher-forced, in the
    model's current mode (``qkv.infer.score.target_log_probs`` switches to eval, which the dropout passes
    must not)."""
    out = []
    for k in range(0, len(src_ids), batch):
        src, tgt_in, tgt_out = collate(src_ids[k:k + batch], tgt_ids[k:k + batch], pad_id=tok.pad_id,
                                       bos_id=tok.bos_id, eos_id=tok.eos_id)  # (B, S), (B, T), (B, T)
        logp = model(src, tgt_in).float().log_softmax(-1).gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)  # (B, T)
        mask = (tgt_out != tok.pad_id).float()
        out += ((logp * mask).sum(1) / mask.sum(1)).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--dropout-passes", type=int, default=4)
    parser.add_argument("--out", required=True, help="a JSON file")
    args = parser.parse_args()
    loaded = checkpoint.load(args.checkpoint)
    model, tok = loaded.model.eval(), loaded.tokenizer
    sources, references = (read_lines(Path(args.data_dir) / f"val.{lang}.gz") for lang in ("en", "de"))
    joined_src, joined_ref = provoking_pairs(sources, references)
    inputs, refs = sources + joined_src, references + joined_ref
    started = time.time()
    config = replace(DecodeConfig(**getattr(model, "decode_defaults", {})), loop_guard=LOOP_GUARD)  # as qkv calibrate searches
    translations = Translator(model, tok, config).translate(inputs)
    chrf = sentence_chrf(translations, refs)
    good = [c >= ACCEPTABLE for c in chrf]
    trusts = assess(model, tok, inputs, translations, calibration={**LOGPROB_ONLY, "length": fit_length(sources, references)})
    limit = model.config.max_len - 1  # as assess reads them
    src_ids = [tok.encode(s)[:limit] for s in inputs]
    tgt_ids = [tok.encode_target(t)[:limit] for t in translations]
    with torch.inference_mode():
        empty = mean_logprobs(model, tok, [[] for _ in src_ids], tgt_ids)
        model.train()  # dropout on; no gradients
        torch.manual_seed(1)
        passes = [mean_logprobs(model, tok, src_ids, tgt_ids) for _ in range(args.dropout_passes)]
        model.eval()
    for i, trust in enumerate(trusts):
        drawn = [p[i] for p in passes]
        trust.features.update(empty_lp=empty[i], contrast=trust.features["logprob_mean"] - empty[i],
                              dropout_mean=statistics.mean(drawn), dropout_std=statistics.pstdev(drawn))

    def measure(features: list[str]) -> dict:
        z = cross_validated(trusts, good, features)
        return {"features": features, "roc_auc": round(ranks_acceptable(z, good), 4), "spearman": round(spearman(z, chrf), 4)}

    calibrated = json.loads((Path(args.checkpoint) / "confidence.json").read_text(encoding="utf-8"))["features"]
    rows = []
    for base in (["logprob_mean"], list(calibrated)):
        rows.append(measure(base))
        rows += [measure([*base, extra]) for extra in CANDIDATES]
    rows += [measure([extra]) for extra in CANDIDATES]
    result = {"checkpoint": args.checkpoint, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "translations": len(inputs), "acceptable_share": round(sum(good) / len(good), 4), "min_gain": MIN_GAIN,
              "dropout_passes": args.dropout_passes, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    for row in rows:
        print(f"{' + '.join(row['features']):55s} ROC AUC {row['roc_auc']:.3f}  Spearman {row['spearman']:.3f}")


if __name__ == "__main__":
    main()
