"""Three more flags tried for the hallucinations the six miss (issue 83): would any pay?

    .venv/bin/python -m benchmarks.trust_candidates --checkpoint runs/en-de/final \\
        --data-dir ../shared/data/multi30k --out benchmarks/results/trust/candidates.json

The candidates, two read from the model itself (no second model), one from the text:

- ``contrast``: how much the source explains the translation, the mean log-probability per target token
  (EOS included) given the source minus that given an empty source (the decoder alone); a translation
  the source does not explain is suspect (low values). It costs a second teacher-forced decoder pass.
- ``alignment_entropy``: the alignment head's entropy over the source positions (EOS included), divided
  by the log of their number and averaged over the target tokens (EOS's row left out); an output the head
  cannot place is suspect (high values). It reads the head ``--confidence`` already runs.
- ``expansion``: the translation's words over the source's, each plus one; a translation much longer
  than its source says what the source does not (high values), the mirror of ``shortness``: the
  fragments the six flags miss ("with" -> "Ein mit einem Mann.") are such. It costs nothing.

Each cut is read at the flags' two bounds (``qkv.inspect.calibrate``'s MAX_FALSE_ALARMS and
MAX_FALSE_REFERENCES) on the model's own translations of Multi30k val (as ``qkv calibrate`` makes them)
and val's made-up pairs, as ``benchmarks.trust_reverse`` reads its cut: at most 1% of the acceptable own
translations and 0.5% of the references on the suspect side. Reported: what the cut catches of each
made-up kind (a flag must catch ``MIN_CAUGHT`` of one kind to exist), and, on the hand-labelled natural
set (benchmarks/gold/trust-natural), the lines of each label on the suspect side, the hallucinations
among them that the checkpoint's own six flags miss, and the correct lines. Nothing is chosen on the
natural set.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.trust import read_natural
from benchmarks.trust_reverse import HALLUCINATION, lowest_share, own_val_translations
from benchmarks.trust_signals import mean_logprobs
from qkv.data.corpus import collate
from qkv.inspect.calibrate import (
    KINDS, MAX_FALSE_ALARMS, MAX_FALSE_REFERENCES, MIN_CAUGHT, provoking_pairs, roc_auc, synthetic_pairs,
)
from qkv.inspect.trust import assess, calibration_of
from qkv.io import checkpoint

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = {"contrast": -1, "alignment_entropy": +1, "expansion": +1}  # the sign that makes high values suspect


@torch.inference_mode()
def candidates(model, tok, sources: list[str], translations: list[str], batch: int = 64) -> list[dict[str, float]]:
    """Each pair's ``contrast``, ``alignment_entropy`` and ``expansion`` (module docstring)."""
    model.eval()
    limit = model.config.max_len - 1  # as qkv.inspect.trust.assess reads the pairs
    src_ids = [tok.encode(s)[:limit] for s in sources]
    tgt_ids = [tok.encode_target(t)[:limit] for t in translations]
    given = mean_logprobs(model, tok, src_ids, tgt_ids, batch)
    alone = mean_logprobs(model, tok, [[] for _ in src_ids], tgt_ids, batch)  # the decoder without a source
    out = []
    for k in range(0, len(src_ids), batch):
        src, tgt_in, _ = collate(src_ids[k:k + batch], tgt_ids[k:k + batch], pad_id=tok.pad_id, bos_id=tok.bos_id,
                                 eos_id=tok.eos_id)  # (B, S), (B, T)
        memory, _, _ = model.encode(src)  # (B, S, D)
        weights = model.alignment_head(tgt_in, memory, src != tok.pad_id).float()  # (B, T, S)
        entropy = -(weights.clamp_min(1e-12).log() * weights).sum(-1)  # (B, T); padding columns hold 0
        for b, (s, t) in enumerate(zip(src_ids[k:k + batch], tgt_ids[k:k + batch])):
            rows = entropy[b, : len(t)] / math.log(max(2, len(s) + 1))  # the target tokens, EOS's row left out
            out.append({"alignment_entropy": float(rows.mean())})
    for values, g, a, source, translation in zip(out, given, alone, sources, translations, strict=True):
        values["contrast"] = g - a
        values["expansion"] = (len(translation.split()) + 1) / (len(source.split()) + 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a model with an alignment head")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--natural", default=str(ROOT / "benchmarks" / "gold" / "trust-natural"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = checkpoint.load(args.checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    if model.config.alignment_layer is None:
        parser.error(f"{args.checkpoint} has no alignment head")
    src, ref, own, good = own_val_translations(model, tok, Path(args.data_dir))
    joined_src, _ = provoking_pairs(src, ref)
    own_values = candidates(model, tok, src + joined_src, own)
    made = synthetic_pairs(src, ref)
    made_values = candidates(model, tok, [s for _, s, _ in made], [t for _, _, t in made])
    inputs, translations, labels = read_natural(Path(args.natural), Path(args.data_dir))
    natural = candidates(model, tok, inputs, translations)
    flagged = [bool(t.flags) for t in assess(model, tok, inputs, translations, calibration=calibration_of(checkpoint.resolve(args.checkpoint)))]
    report = {
        "command": "python -m benchmarks.trust_candidates " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "own_translations": len(own), "acceptable": sum(good),
        "natural_hallucinations_the_six_flags_miss": sum(not f and lab in HALLUCINATION for f, lab in zip(flagged, labels)),
        "candidates": {},
    }
    for name, sign in CANDIDATES.items():
        suspect = lambda values: [-sign * v[name] for v in values]  # noqa: E731 low: suspect
        by_kind = {k: [v for v, (kind, _, _) in zip(suspect(made_values), made) if kind == k] for k in KINDS}
        accepted = [v for v, g in zip(suspect(own_values), good) if g]
        cut = min(lowest_share(accepted, MAX_FALSE_ALARMS), lowest_share(by_kind["correct"], MAX_FALSE_REFERENCES))
        below = [v < cut for v in suspect(natural)]
        caught = {k: round(sum(v < cut for v in vs) / len(vs), 4) for k, vs in by_kind.items()}
        report["candidates"][name] = {
            "cut": round(-sign * cut, 4), "suspect": "below" if sign < 0 else "above",
            "own_acceptable_flagged": round(sum(v < cut for v in accepted) / len(accepted), 4),
            "made_up_flagged": caught,
            "a_kind_caught_at_min": [k for k, share in caught.items() if k != "correct" and share >= MIN_CAUGHT],
            "made_up_roc_auc": {k: round(roc_auc([-v for v in vs], [-v for v in by_kind["correct"]]), 4) for k, vs in by_kind.items() if k != "correct"},
            "natural_flagged": {lab: [sum(b for b, l in zip(below, labels) if l == lab), labels.count(lab)] for lab in sorted(set(labels))},
            "natural_missed_hallucinations_caught": [i + 1 for i, (b, f, lab) in enumerate(zip(below, flagged, labels))
                                                     if b and not f and lab in HALLUCINATION],
            "natural_correct_flagged": [i + 1 for i, (b, lab) in enumerate(zip(below, labels)) if b and lab == "correct"],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
