"""How well the confidence ranks a model's real translations, beside the mean token log-probability and
the confidence qkv had before (one fit of nine features on made-up pairs, docs/trust.md's old default).

    python -m benchmarks.confidence --checkpoint CKPT --out benchmarks/results/confidence [--test] \
        [--natural benchmarks/gold/trust-natural]

CKPT must hold its own confidence.json (``qkv calibrate`` or the end of ``qkv train``). On Multi30k val
(and its joined pairs, as ``qkv calibrate`` makes them) the new confidence is scored out of fold (the
cross-validation ``qkv.inspect.calibrate`` chose its features with), so that no number is of a fit on the
lines it scores; with ``--test``, test_2016_flickr is scored with the fit as it is (nothing chosen on it).
"Acceptable": sentence chrF >= ``ACCEPTABLE``. Writes confidence.json under --out.
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import replace
from pathlib import Path

from qkv.infer.bleu import sentence_chrf
from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.inspect.calibrate import ACCEPTABLE, cross_validated, provoking_pairs, ranks_acceptable, roc_auc
from qkv.inspect.trust import assess, calibration_of, confidence_of, sigmoid, spearman
from qkv.io import checkpoint

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
# The confidence of docs/trust.md before this change (fitted on made-up pairs of the En->De model).
OLD = {"features": ["logprob_mean", "logprob_min", "logprob_std", "source_mean", "source_min", "unused", "repeats", "copy", "length_ratio"],
       "mean": [-4.3502, -10.2342, 3.2907, 0.5791, 0.4932, 0.0609, 1.5922, 0.2595, 0.266],
       "std": [2.8844, 4.644, 1.5933, 0.0466, 0.0815, 0.1262, 1.4567, 0.3058, 0.2748],
       "weights": [2.7538, -1.1012, -0.2489, -0.0681, 0.0885, -0.8885, -0.0655, 0.2615, -0.8506], "bias": -1.8233}


def _read(name: str) -> list[str]:
    with gzip.open(name, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def measure(scores: dict[str, list[float]], chrf: list[float]) -> dict:
    good = [c >= ACCEPTABLE for c in chrf]
    return {name: {"roc_auc": round(ranks_acceptable(v, good), 4),
                   "spearman": round(spearman(v, chrf), 4)} for name, v in scores.items()} | {
        "n": len(chrf), "acceptable": sum(good)}


def flag_counts(trusts, chrf: list[float]) -> dict:
    """Per flag: the lines it fires on, and how many of them are acceptable."""
    from qkv.inspect.trust import FLAGS

    return {flag: {"flagged": sum(flag in t.flags for t in trusts),
                   "acceptable": sum(flag in t.flags and c >= ACCEPTABLE for t, c in zip(trusts, chrf))} for flag in FLAGS}


def natural(loaded, calibration: dict, directory: Path, data: Path) -> dict:
    """The labelled natural pairs (made from val lines 151 on; translated by the model their README names,
    scored here by this checkpoint): hallucinations (repetition, strongly or fully detached) and omissions
    against the rest, by logprob_mean and by the confidence; and what the flags catch."""
    from benchmarks.trust import read_natural
    from qkv.inspect.calibrate import precision_at_recall

    inputs, translations, labels = read_natural(directory, data)
    trusts = assess(loaded.model, loaded.tokenizer, inputs, translations, calibration=calibration)
    hallucination = {"repetition", "strongly-detached", "fully-detached"}
    out = {"lines": len(labels), "hallucinations": sum(lab in hallucination for lab in labels), "omissions": labels.count("omission")}
    for name, suspect in (("logprob_mean", [-t.features["logprob_mean"] for t in trusts]), ("confidence", [-t.confidence for t in trusts]),
                          ("shortness", [t.features["shortness"] for t in trusts])):  # the expected length's shortfall
        # The third: omissions against the lines that are not hallucinations. One score cannot rank
        # hallucinations below the omissions (the first) and the omissions below the hallucinations too.
        for kind, positive, excluded in (("hallucination", hallucination, set()), ("omission", {"omission"}, set()),
                                         ("omission among non-hallucinations", {"omission"}, hallucination)):
            pos = [s for s, lab in zip(suspect, labels) if lab in positive]
            neg = [s for s, lab in zip(suspect, labels) if lab not in positive and lab not in excluded]
            out[f"{name} {kind}"] = {"roc_auc": round(roc_auc(pos, neg), 4), "precision_at_90_recall": round(precision_at_recall(pos, neg), 4)}
    out["flags"] = {"hallucinations_flagged": round(sum(bool(t.flags) for t, lab in zip(trusts, labels) if lab in hallucination)
                                                    / max(1, out["hallucinations"]), 4),
                    "correct_flagged": sum(bool(t.flags) for t, lab in zip(trusts, labels) if lab == "correct"),
                    "correct": labels.count("correct")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--out", required=True)
    p.add_argument("--test", action="store_true", help="also score test_2016_flickr (the final report only)")
    p.add_argument("--natural", help="also score the hand-labelled natural pairs in this directory (translations.txt, "
                                      "labels.tsv: benchmarks/gold/trust-natural)")
    args = p.parse_args()
    loaded = checkpoint.load(args.checkpoint)
    calibration = calibration_of(loaded.path)
    if calibration.get("kind") != "fitted":
        raise SystemExit(f"{loaded.path} has no fitted confidence of its own")
    translator = Translator(loaded.model, loaded.tokenizer, replace(DecodeConfig(**loaded.model.decode_defaults), loop_guard=2))

    def judged(sources: list[str], references: list[str]):  # each line whole, as qkv calibrate judges it
        translations = translator.translate(sources)
        trusts = assess(loaded.model, loaded.tokenizer, sources, translations, calibration=calibration)
        return trusts, sentence_chrf(translations, references)

    src, ref = _read(f"{args.data}/val.en.gz"), _read(f"{args.data}/val.de.gz")
    joined_src, joined_ref = provoking_pairs(src, ref)
    trusts, chrf = judged(src + joined_src, ref + joined_ref)
    out_of_fold = cross_validated(trusts, [c >= ACCEPTABLE for c in chrf], calibration["features"])
    results = {"checkpoint": str(loaded.path), "features": calibration["features"], "val": measure({
        "logprob_mean": [t.features["logprob_mean"] for t in trusts],
        "old confidence": [confidence_of(t.features, OLD) for t in trusts],
        "confidence (out of fold)": [sigmoid(z) for z in out_of_fold],
        "confidence (as fitted, flags capping)": [t.confidence for t in trusts]}, chrf) | {"flags": flag_counts(trusts, chrf)}}
    if args.test:
        trusts, chrf = judged(_read(f"{args.data}/test_2016_flickr.en.gz"), _read(f"{args.data}/test_2016_flickr.de.gz"))
        results["test_2016_flickr"] = measure({
            "logprob_mean": [t.features["logprob_mean"] for t in trusts],
            "old confidence": [confidence_of(t.features, OLD) for t in trusts],
            "confidence": [t.confidence for t in trusts]}, chrf) | {"flags": flag_counts(trusts, chrf)}
    if args.natural:
        results["natural"] = natural(loaded, calibration, Path(args.natural), Path(args.data))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "confidence.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
