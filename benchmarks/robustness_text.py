"""Text as people write it (issue 66): paragraphs, capitals, numbers, lists, fragments and typos, made
from Multi30k val sources, translated with and without the sentence splitter, the recasing of
capitals and the loop guard; and clean val (every variant) and test2016 (today's and the defaults, once).

    .venv/bin/python -m benchmarks.robustness_text --checkpoint runs/en-de/final --out benchmarks/results/robustness_text

Inputs: ``benchmarks.trust_inputs.make`` (ten kinds, 40 lines each, val lines 151 on; ``--seed 1`` is
the set of the issue and of the hand-labelled gold set benchmarks/gold/trust-natural), and an
eleventh kind, ``title``: the control captions in Title Case (``string.capwords``). References
where they survive: a caption's own German line (control, typos, mixed, title), in capitals for caps, and
the captions' lines joined by spaces for joined2, joined3 and long; numbers, list and fragment have
none (their text is not the caption's any more).

Loop detector (``looping``): a translation loops when one n-gram of whitespace words (n <= 4, case
ignored) occurs 3 times back to back, or a run of one to six characters 5 times back to back
("ISIGGGGG", "satzsatzsatz..."): ``qkv.inspect.trust``'s repeats feature (``max_repeats`` of the
words, ``char_repeats`` with ``max_n=6``) at 3 or more. With ``--seed 1`` the detector is also scored
against the gold set's hand labels of today's translations (which it reproduces).

Sentence by sentence: the captions of joined2, joined3 and long translated each alone with the same
settings and joined by spaces, scored against the same joined references.
"""

from __future__ import annotations

import argparse
import string
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.probe import write_results
from benchmarks.trust_inputs import KINDS, make
from qkv.data.corpus import load_multi30k
from qkv.data.sentences import TextOptions
from qkv.infer.bleu import score
from qkv.infer.search import DecodeConfig
from qkv.infer.translator import Translator
from qkv.inspect.trust import char_repeats, max_repeats
from qkv.io import checkpoint
from qkv.model.cpu import tune_allocator

ROOT = Path(__file__).resolve().parents[1]
GOLD = ROOT / "benchmarks" / "gold" / "trust-natural" / "labels.tsv"
JOINED = ("joined2", "joined3", "long")
# name: (split into sentences, recase capitals, loop guard n-gram)
VARIANTS = {
    "today": (False, False, 0),
    "guard 2": (False, False, 2),
    "split": (True, False, 0),
    "split + recase": (True, True, 0),
    "split + guard 2": (True, False, 2),
    "split + recase + guard 3": (True, True, 3),
    "split + recase + guard 2": (True, True, 2),
}
DEFAULT = "split + recase + guard 2"  # what qkv translate, evaluate and serve do without flags


def looping(translation: str) -> bool:
    """The benchmark's loop detector (module docstring)."""
    return max(max_repeats(translation.split()), char_repeats(translation, max_n=6)) >= 3


def _numbered(translation: str) -> bool:
    """Whether a list's translation keeps its items' numbers "1.", "2.", "3." in that order."""
    at = 0
    for n in ("1.", "2.", "3."):
        at = translation.find(n, at)
        if at < 0:
            return False
    return True


def references(kind: str, lines: list[int], de: list[str]) -> str | None:
    """The reference of one input, or None where the input is no longer the caption (numbers, list, fragment)."""
    if kind in JOINED:
        return " ".join(de[i].strip() for i in lines)
    if kind == "caps":
        return de[lines[0]].strip().upper()
    if kind in ("control", "typos", "mixed", "title"):
        return de[lines[0]].strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.robustness_text", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    parser.add_argument("--seed", type=int, default=1, help="of the inputs (1: the issue's set)")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-test", dest="test", action="store_false", help="skip test2016")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_allocator()
    loaded = checkpoint.load(args.checkpoint)
    data = loaded.config.get("data", {})
    src, tgt = data.get("src_lang") or "en", data.get("tgt_lang") or "de"
    base = replace(DecodeConfig(**loaded.model.decode_defaults), beam_size=args.beam)
    data_dir = Path(args.data_dir)
    val = load_multi30k("val", src, tgt, data_dir)
    rows = [(kind, [int(i) - 1 for i in lines.split(",")], text) for kind, lines, text in make(data_dir, args.seed)]
    rows += [("title", lines, string.capwords(text)) for kind, lines, text in rows if kind == "control"]
    refs = [references(kind, lines, val.tgt) for kind, lines, _ in rows]
    log = lambda message: print(message, flush=True)  # noqa: E731
    result: dict = {"checkpoint": str(loaded.path), "seed": args.seed, "beam": args.beam, "threads": args.threads,
                    "length_penalty": base.length_penalty, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "torch": torch.__version__, "default": DEFAULT, "variants": {}}
    outputs = {}
    for name, (split, recase, guard) in VARIANTS.items():
        translator = Translator(loaded.model, loaded.tokenizer, replace(base, loop_guard=guard),
                                text=TextOptions(split=src if split else None, recase=recase))
        started = time.perf_counter()
        hyps = outputs[name] = translator.translate([text for _, _, text in rows])
        alone = translator.translate([val.src[i] for kind, lines, _ in rows if kind in JOINED for i in lines])
        clean = translator.translate(val.src)
        per_kind = {}
        for kind in (*KINDS, "title"):
            mine = [i for i, row in enumerate(rows) if row[0] == kind]
            entry = {"lines": len(mine), "loops": sum(looping(hyps[i]) for i in mine)}
            if kind == "list":  # the items' numbers, in order, in the translation
                entry["numbers_kept"] = sum(_numbered(hyps[i]) for i in mine)
            if refs[mine[0]] is not None:
                entry["bleu"] = round(score([hyps[i] for i in mine], [refs[i] for i in mine])["bleu"], 2)
            per_kind[kind] = entry
        by_sentence, at = [], iter(alone)
        for kind, lines, _ in rows:
            if kind in JOINED:
                by_sentence.append((kind, " ".join(next(at) for _ in lines)))
        for kind in JOINED:
            mine = [i for i, row in enumerate(rows) if row[0] == kind]
            one_by_one = [text for k, text in by_sentence if k == kind]
            per_kind[kind]["bleu_sentence_by_sentence"] = round(score(one_by_one, [refs[i] for i in mine])["bleu"], 2)
        joined_idx = [i for i, row in enumerate(rows) if row[0] in JOINED]
        entry = {
            "loops": sum(map(looping, hyps)), "lines": len(hyps), "kinds": per_kind,
            "joined_bleu": round(score([hyps[i] for i in joined_idx], [refs[i] for i in joined_idx])["bleu"], 2),
            "joined_bleu_sentence_by_sentence": round(score([t for _, t in by_sentence], [refs[i] for i in joined_idx])["bleu"], 2),
            "val_bleu": round(score(clean, val.tgt)["bleu"], 2), "val_loops": sum(map(looping, clean)),
            "seconds": round(time.perf_counter() - started, 1),
        }
        result["variants"][name] = entry
        log(f"{name}: loops {entry['loops']}/{entry['lines']}, joined BLEU {entry['joined_bleu']} "
            f"(one by one {entry['joined_bleu_sentence_by_sentence']}), val BLEU {entry['val_bleu']} "
            f"({entry['val_loops']} loops), {entry['seconds']}s")
    if args.seed == 1 and GOLD.is_file():  # how the detector agrees with the hand labels of today's translations
        labels = [line.split("\t")[1].strip() for line in GOLD.read_text(encoding="utf-8").splitlines()]
        found = [looping(h) for h in outputs["today"][: len(labels)]]  # the gold set's 400 (title comes after)
        gold = [label == "repetition" for label in labels]
        both = sum(f and g for f, g in zip(found, gold))
        result["detector_vs_gold"] = {"hand_labelled_repetition": sum(gold), "detected": sum(found), "both": both}
    if args.test:
        test = load_multi30k("test_2016_flickr", src, tgt, data_dir)
        result["test2016"] = {}
        for name in ("today", DEFAULT):
            split, recase, guard = VARIANTS[name]
            translator = Translator(loaded.model, loaded.tokenizer, replace(base, loop_guard=guard),
                                    text=TextOptions(split=src if split else None, recase=recase))
            result["test2016"][name] = round(score(translator.translate(test.src), test.tgt)["bleu"], 2)
            log(f"test2016 {name}: BLEU {result['test2016'][name]}")
    write_results(args.out, result, markdown)
    return 0


def markdown(result: dict) -> str:
    names = list(result["variants"])
    lines = [f"Checkpoint `{result['checkpoint']}`, beam {result['beam']}, length penalty {result['length_penalty']}, "
             f"inputs of `benchmarks.trust_inputs` seed {result['seed']} (40 a kind, Multi30k val lines 151 on; title: "
             "the control captions in Title Case), "
             f"{result['threads']} thread(s), {result['started']}, torch {result['torch']}. Loops: translations the "
             "benchmark's detector flags (`looping`); BLEU: sacreBLEU, cased, against the references that survive "
             "(caps: the German caption in capitals); \"one by one\": the same captions translated each alone and joined.",
             "", "Outputs that loop, per kind:", "",
             "| kind | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    kinds = list(result["variants"][names[0]]["kinds"])
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(str(result["variants"][n]["kinds"][kind]["loops"]) for n in names) + " |")
    lines.append(f"| **all {result['variants'][names[0]]['lines']}** | " + " | ".join(
        f"**{v['loops']}** ({100 * v['loops'] / v['lines']:.1f}%)" for v in result["variants"].values()) + " |")
    lines.append("| list: numbers 1. 2. 3. kept | " + " | ".join(
        str(v["kinds"]["list"]["numbers_kept"]) for v in result["variants"].values()) + " |")
    lines += ["", "BLEU per kind (where a reference survives):", "",
              "| kind | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for kind in kinds:
        if "bleu" in result["variants"][names[0]]["kinds"][kind]:
            lines.append(f"| {kind} | " + " | ".join(f"{result['variants'][n]['kinds'][kind]['bleu']:.2f}" for n in names) + " |")
    lines.append("| joined2 + joined3 + long | " + " | ".join(f"{result['variants'][n]['joined_bleu']:.2f}" for n in names) + " |")
    lines.append("| the same, one by one | " + " | ".join(
        f"{result['variants'][n]['joined_bleu_sentence_by_sentence']:.2f}" for n in names) + " |")
    lines.append("| clean val (1,014) | " + " | ".join(f"{result['variants'][n]['val_bleu']:.2f}" for n in names) + " |")
    lines.append("| clean val: loops | " + " | ".join(str(result["variants"][n]["val_loops"]) for n in names) + " |")
    if "detector_vs_gold" in result:
        d = result["detector_vs_gold"]
        lines += ["", f"Detector against the hand labels of today's translations (benchmarks/gold/trust-natural): "
                      f"{d['detected']} flagged, {d['hand_labelled_repetition']} labelled repetition, {d['both']} both."]
    if "test2016" in result:
        lines += ["", "test2016 BLEU: " + ", ".join(f"{name} {bleu:.2f}" for name, bleu in result["test2016"].items()) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
