"""How well each detector tells a bad translation from a good one, and what --confidence costs.

    .venv/bin/python -m benchmarks.trust --checkpoint runs/en-de/final --out benchmarks/results/trust

Detectors (higher = more suspect): ``logprob`` (minus the mean token log-probability, the usual
baseline), ``attention`` (the entropy of the last layer's cross-attention, a raw-attention detector),
``alti`` (minus ALTI+'s mean source share) and ``confidence`` (one minus qkv's combined confidence).

1. Synthetic pairs with exact labels (qkv.inspect.calibrate.synthetic_pairs) from Multi30k val: the
   confidence and flags are fitted on val lines 1-507 and every number is reported on lines 508-1014.
   Each kind against the correct pairs: ROC AUC and precision at 90% recall. The calibration is what
   ``qkv calibrate`` fits (with the model's own translations of those lines).
2. Natural pairs: the model's own beam-5 translations of provoking inputs (benchmarks/trust_inputs.py;
   benchmarks/gold/trust-natural/translations.txt), labelled by hand (labels.tsv, guidelines beside
   it): any hallucination (repetition, strongly or fully detached) and fully detached, each against
   the rest, scored with the calibration of part 1.
3. Test: Spearman correlation of each detector's trust (minus its score) with sentence chrF of the
   model's beam-5 translations of test_2016_flickr (nothing is chosen on it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.inspect.calibrate import calibrate
from qkv.inspect.calibrate import FLAG_OF, KINDS, precision_at_recall, roc_auc, synthetic_pairs
from qkv.infer.bleu import sentence_chrf
from qkv.inspect.trust import assess, spearman
from qkv.io import checkpoint

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
HALF = 507


def detectors(trust) -> dict[str, float]:
    f = trust.features
    return {"logprob": -f["logprob_mean"], "attention": f["attention_entropy"], "alti": -f["source_mean"],
            "confidence": 1 - trust.confidence}


def table(scores: dict[str, list[dict]], negative: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    for kind, positive in scores.items():
        out[kind] = {name: {"roc_auc": round(roc_auc([p[name] for p in positive], [n[name] for n in negative]), 4),
                            "precision_at_90_recall": round(precision_at_recall([p[name] for p in positive], [n[name] for n in negative]), 4)}
                     for name in ("logprob", "attention", "alti", "confidence")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", default=str(DATA))
    parser.add_argument("--natural", default=str(ROOT / "benchmarks" / "gold" / "trust-natural"),
                        help="the labelled natural pairs: translations.txt and labels.tsv")
    parser.add_argument("--parts", default="synthetic,natural,test", help="which parts to run (their results are merged into OUT/trust.json)")
    parser.add_argument("--test-translations", help="the model's beam-5 translations of test_2016_flickr (default: translate)")
    parser.add_argument("--calibration", choices=("half", "checkpoint"), default="half",
                        help="half: fit on val lines 1-507 and report on the rest (default); checkpoint: the checkpoint's own "
                             "confidence.json, as qkv calibrate fitted it on all of val (the made-up pairs of val 508-1,014 then "
                             "are pairs its flags were fitted on)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    loaded = checkpoint.load(args.checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    read = lambda split, lang: gzip.open(Path(args.data_dir) / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().splitlines()  # noqa: E731
    src, ref = read("val", "en"), read("val", "de")
    out = Path(args.out)
    previous = out / "trust.json"
    result: dict = json.loads(previous.read_text(encoding="utf-8")) if previous.is_file() else {}
    result.update({"checkpoint": args.checkpoint, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "calibration_from": args.calibration})
    parts = set(args.parts.split(","))

    from dataclasses import replace

    from qkv.cli.common import LOOP_GUARD

    config = replace(DecodeConfig(**getattr(model, "decode_defaults", {})), loop_guard=LOOP_GUARD)  # what qkv calibrate searches with
    if args.calibration == "checkpoint":
        from qkv.inspect.trust import calibration_of

        calibration = calibration_of(checkpoint.resolve(args.checkpoint))
    else:
        calibration = calibrate(model, tok, src[:HALF], ref[:HALF], name=f"val lines 1-{HALF}", config=config)  # what qkv calibrate does
    result["calibration"] = calibration
    if "synthetic" in parts:
        synthetic(result, model, tok, src, ref, calibration)
    if "natural" in parts:
        natural_part(result, model, tok, Path(args.natural), Path(args.data_dir), calibration)
    if "test" in parts:
        test_part(result, model, tok, read, calibration, args.test_translations)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trust.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "calibration"}, indent=1))


def synthetic(result: dict, model, tok, src: list[str], ref: list[str], calibration: dict) -> None:
    report = synthetic_pairs(src[HALF:], ref[HALF:])
    trusts = assess(model, tok, [s for _, s, _ in report], [t for _, _, t in report], calibration=calibration)
    by_kind = {k: [detectors(t) for t, (kind, _, _) in zip(trusts, report) if kind == k] for k in KINDS}
    result["synthetic"] = {"pairs_per_kind": len(by_kind["correct"]),
                           "detectors": table({k: v for k, v in by_kind.items() if k != "correct"}, by_kind["correct"])}
    result["synthetic"]["flags"] = {  # each flag on the made-up kind it names, and on the references
        flag: {"kind": kind,
               "flagged": round(sum(flag in t.flags for t, (k, _, _) in zip(trusts, report) if k == kind) / len(by_kind[kind]), 4),
               "correct_flagged": round(sum(flag in t.flags for t, (k, _, _) in zip(trusts, report) if k == "correct") / len(by_kind["correct"]), 4)}
        for flag, (kind, _, _) in FLAG_OF.items()}
    correct = [t for t, (k, _, _) in zip(trusts, report) if k == "correct"]
    result["synthetic"]["references_flagged"] = [sum(bool(t.flags) for t in correct), len(correct)]  # by any flag


def read_natural(directory: Path, data_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """The labelled natural pairs: inputs (rebuilt from Multi30k val), translations and labels, one each."""
    from benchmarks.trust_inputs import make

    inputs = [text for _, _, text in make(data_dir)]
    translations = (directory / "translations.txt").read_text(encoding="utf-8").splitlines()
    labels = [line.split("\t")[1].strip() for line in (directory / "labels.tsv").read_text(encoding="utf-8").splitlines() if line]
    assert len(inputs) == len(translations) == len(labels), (len(inputs), len(translations), len(labels))
    return inputs, translations, labels


def natural_part(result: dict, model, tok, directory: Path, data_dir: Path, calibration: dict) -> None:
    inputs, translations, labels = read_natural(directory, data_dir)
    trusts = assess(model, tok, inputs, translations, calibration=calibration)
    scored = [detectors(t) for t in trusts]
    result["natural"] = {"lines": len(inputs), "labels": {lab: labels.count(lab) for lab in sorted(set(labels))}, "detectors": {}}
    for name, positive in (("any hallucination", {"repetition", "strongly-detached", "fully-detached"}),
                           ("fully detached", {"fully-detached"})):
        pos = [s for s, lab in zip(scored, labels) if lab in positive]
        neg = [s for s, lab in zip(scored, labels) if lab not in positive]
        if pos:
            result["natural"]["detectors"][name] = table({name: pos}, neg)[name]
    hallucination = {"repetition", "strongly-detached", "fully-detached"}
    omissions = [t for t, lab in zip(trusts, labels) if lab == "omission"]
    rest = [t for t, lab in zip(trusts, labels) if lab not in hallucination | {"omission"}]  # neither
    correct = [t for t, lab in zip(trusts, labels) if lab == "correct"]
    halluc = [t for t, lab in zip(trusts, labels) if lab in hallucination]
    result["natural"]["flags"] = {
        "hallucinations_flagged": [sum(bool(t.flags) for t in halluc), len(halluc)],
        "correct_flagged": [sum(bool(t.flags) for t in correct), len(correct)],
        "omissions_flagged_omission": [sum("omission" in t.flags for t in omissions), len(omissions)],
        "correct_flagged_omission": [sum("omission" in t.flags for t in correct), len(correct)]}
    result["natural"]["by_flag"] = {  # each flag: the hallucinations it flags, those only it flags, the correct lines
        flag: {"hallucinations": sum(flag in t.flags for t in halluc), "only_it": sum(t.flags == [flag] for t in halluc),
               "correct": sum(flag in t.flags for t in correct), "omissions": sum(flag in t.flags for t in omissions)}
        for flag in FLAG_OF}
    result["natural"]["omission_vs_not_hallucinated"] = {  # ROC AUC, omissions against the lines neither omitted nor hallucinated
        name: round(roc_auc([t.features[name] for t in omissions], [t.features[name] for t in rest]), 4)
        for name in ("omission", "shortness", "unused", "uncovered")}


def test_part(result: dict, model, tok, read, calibration: dict, translations: str | None) -> None:
    test_src, test_ref = read("test_2016_flickr", "en"), read("test_2016_flickr", "de")
    if translations is not None:  # the beam-5 translations benchmarks/trust_cost.py saved
        hyps = Path(translations).read_text(encoding="utf-8").splitlines()
    else:
        hyps = Translator(model, tok, DecodeConfig(beam_size=5, length_penalty=model.decode_defaults["length_penalty"])).translate(test_src)
    test_trusts = assess(model, tok, test_src, hyps, calibration=calibration)
    # The cost of --confidence, side by side in this process: beam-5 search of the first 200 test sentences,
    # then the trust pass over its output (what translate --confidence adds).
    start = time.perf_counter()
    first = Translator(model, tok, DecodeConfig(beam_size=5, length_penalty=model.decode_defaults["length_penalty"])).translate(test_src[:200])
    search_s = time.perf_counter() - start
    start = time.perf_counter()
    assess(model, tok, test_src[:200], first, calibration=calibration)
    trust_s = time.perf_counter() - start
    result["cost_200_test_sentences"] = {"search_seconds": round(search_s, 2), "trust_seconds": round(trust_s, 2),
                                         "added": round(trust_s / search_s, 4), "threads": torch.get_num_threads()}
    chrf = sentence_chrf(hyps, test_ref)
    result["test_spearman_with_chrf"] = {
        name: round(spearman([-detectors(t)[name] for t in test_trusts], chrf), 4) for name in ("logprob", "attention", "alti", "confidence")}
    result["test_flagged"] = sum(bool(t.flags) for t in test_trusts)
    acceptable = [t for t, c in zip(test_trusts, chrf) if c >= 50]
    result["test_acceptable_flagged"] = [sum(bool(t.flags) for t in acceptable), len(acceptable)]
    result["test_acceptable_flagged_by_flag"] = {flag: sum(flag in t.flags for t in acceptable) for flag in FLAG_OF}
    # Made-up pathologies of the test references (report only): the references ranked over each, and flagged
    made = synthetic_pairs(test_src, test_ref)
    kinds = [k for k, _, _ in made]
    judged = assess(model, tok, [s for _, s, _ in made], [t for _, _, t in made], calibration=calibration, words=False)
    correct = [t for t, k in zip(judged, kinds) if k == "correct"]
    result["test_made_up"] = {kind: {name: round(roc_auc([value(t) for t in correct], [value(t) for t, k in zip(judged, kinds) if k == kind]), 4)
                                     for name, value in (("confidence", lambda t: t.confidence), ("logprob", lambda t: t.features["logprob_mean"]))}
                              for kind in ("detached", "oscillation", "copy")}
    result["test_made_up"]["references_flagged"] = [sum(bool(t.flags) for t in correct), len(correct)]


if __name__ == "__main__":
    main()
