"""A reverse-direction model as a trust signal: would a flag on it pay? (issue 83, its optional item)

    .venv/bin/python -m benchmarks.trust_reverse --checkpoint runs/en-de/final --reverse runs/study/rev-de-en/final \\
        --data-dir ../shared/data/multi30k --out benchmarks/results/trust/reverse.json

The signal: the reverse model's mean log-probability per token of the source given the translation
(``qkv score`` with the models swapped). Its cut is read at the flags' two bounds
(``qkv.inspect.calibrate``'s MAX_FALSE_ALARMS and MAX_FALSE_REFERENCES) on the model's own translations
of Multi30k val (as ``qkv calibrate`` makes them) and val's made-up pairs: the highest cut that at most
1% of the acceptable own translations and 0.5% of the references fall below (a low score is suspect).
It is those bounds' quantile, not ``flag_threshold`` itself (which also asks the cut to catch more of
its made-up kind than of either, and half of it, and here would name one kind). Reported: what that cut catches of each made-up kind (val, the
pairs it was fitted beside), and how many lines of each label of the hand-labelled natural set
(benchmarks/gold/trust-natural) fall below it. Nothing here is chosen on the natural set.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.trust import read_natural
from qkv.cli.common import LOOP_GUARD
from qkv.infer.bleu import sentence_chrf
from qkv.infer.score import score_pairs
from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.inspect.calibrate import ACCEPTABLE, KINDS, MAX_FALSE_ALARMS, MAX_FALSE_REFERENCES, provoking_pairs, roc_auc, synthetic_pairs
from qkv.io import checkpoint

ROOT = Path(__file__).resolve().parents[1]
HALLUCINATION = {"repetition", "strongly-detached", "fully-detached"}


def reverse_scores(reverse, sources: list[str], translations: list[str]) -> list[float]:
    """The reverse model's mean log-probability per token (EOS included) of each source given its translation."""
    return [s.log_prob / s.n_tokens for s in score_pairs(reverse.model, reverse.tokenizer, translations, sources)]


def lowest_share(values: list[float], share: float) -> float:
    """The cut c such that at most ``share`` of ``values`` lie strictly below it (the lowest value kept)."""
    ordered = sorted(values)
    return ordered[int(share * len(ordered))]


def own_val_translations(model, tok, data_dir: Path) -> tuple[list[str], list[str], list[str], list[bool]]:
    """Multi30k val's non-empty pairs, the model's own translations of them and of their joined pairs as
    ``qkv calibrate`` makes them (the checkpoint's settings and the loop guard; the joined pairs without it),
    and which translations are acceptable: (sources, references, translations, acceptable)."""
    read = lambda split, lang: gzip.open(data_dir / f"{split}.{lang}.gz", "rt", encoding="utf-8").read().splitlines()  # noqa: E731
    src, ref = read("val", "en"), read("val", "de")
    keep = [i for i, (s, r) in enumerate(zip(src, ref)) if s.strip() and r.strip()]
    src, ref = [src[i] for i in keep], [ref[i] for i in keep]
    joined_src, joined_ref = provoking_pairs(src, ref)
    config = replace(DecodeConfig(**model.decode_defaults), loop_guard=LOOP_GUARD)
    own = (Translator(model, tok, config).translate(src)
           + Translator(model, tok, replace(config, loop_guard=0)).translate(joined_src))
    good = [c >= ACCEPTABLE for c in sentence_chrf(own, ref + joined_ref)]
    return src, ref, own, good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the forward (En->De) model")
    parser.add_argument("--reverse", required=True, help="a De->En model of the same data")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--natural", default=str(ROOT / "benchmarks" / "gold" / "trust-natural"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    forward, reverse = checkpoint.load(args.checkpoint), checkpoint.load(args.reverse)
    src, ref, own, good = own_val_translations(forward.model, forward.tokenizer, Path(args.data_dir))
    joined_src, _ = provoking_pairs(src, ref)
    own_scores = reverse_scores(reverse, src + joined_src, own)
    made = synthetic_pairs(src, ref)
    made_scores = reverse_scores(reverse, [s for _, s, _ in made], [t for _, _, t in made])
    by_kind = {k: [v for v, (kind, _, _) in zip(made_scores, made) if kind == k] for k in KINDS}
    accepted = [v for v, g in zip(own_scores, good) if g]
    cut = min(lowest_share(accepted, MAX_FALSE_ALARMS), lowest_share(by_kind["correct"], MAX_FALSE_REFERENCES))
    inputs, translations, labels = read_natural(Path(args.natural), Path(args.data_dir))
    natural = reverse_scores(reverse, inputs, translations)
    report = {
        "command": "python -m benchmarks.trust_reverse " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "own_translations": len(own), "acceptable": sum(good), "cut": round(cut, 4),
        "own_acceptable_below": round(sum(v < cut for v in accepted) / len(accepted), 4),
        "made_up_below": {k: round(sum(v < cut for v in vs) / len(vs), 4) for k, vs in by_kind.items()},
        "made_up_roc_auc": {k: round(roc_auc([-v for v in vs], [-v for v in by_kind["correct"]]), 4)
                            for k, vs in by_kind.items() if k != "correct"},
        "natural_below": {lab: [sum(v < cut for v, l in zip(natural, labels) if l == lab), labels.count(lab)]
                          for lab in sorted(set(labels))},
        "natural_hallucination_roc_auc": round(roc_auc([-v for v, l in zip(natural, labels) if l in HALLUCINATION],
                                                       [-v for v, l in zip(natural, labels) if l not in HALLUCINATION]), 4),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
