"""Glossaries: how many of the terms asked for a translation uses, where, at what cost in quality and time.

    apt-get install dict-freedict-eng-deu   # the English-German FreeDict (Ding) dictionary
    .venv/bin/python -m benchmarks.glossary --checkpoint runs/en-de/final --split val --out benchmarks/results/glossary

Term sets are built as Dinu et al. (2019) built theirs from Wiktionary and IATE: for each sentence pair of
the split, the dictionary's entries whose English side stands in the source (whole words, in lower case)
and whose German side stands in the reference (whole words, as written); English terms made only of the
500 most frequent words of the training source are left out. Two sets:

- ``exact``: the German form is the dictionary's own (the glossary asks for the form the reference has);
- ``inflected``: the reference has the dictionary's word only inflected (its form plus a German ending:
  "Hund" as "Hunde"); the glossary lists the dictionary's form first, then as accepted forms those of
  its forms with an ending that occur in the training target, and the translation must choose one.

Rows: no glossary; ``--glossary`` (a sentence whose translation misses a term mended where the
alignment head puts its source term, ``qkv.infer.terms.substitute``, and searched again with constraints
where that fails); ``search`` (the constrained search for every sentence that misses a term, as
``--glossary`` did before it mended by alignment, and as it does for a model without an alignment
head); ``--glossary-always`` (the constrained search for every sentence with a term). Columns:
term use (the form asked for; any accepted form), terms placed where their source term aligns (the
alignment check), BLEU and chrF of the set's sentences, and seconds for the set on the machine's threads
(median of ``--repeats``; each row translates the same sentences in the same process, one after another).
Choices (the constrained beam, ``--beam``; the slack of its length cap, ``--first-slack``) are made on val;
test_2016_flickr is for the report. ``--rows`` runs some rows only (a choice needs only ``glossary``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import torch

from qkv.cli.common import LOOP_GUARD
from qkv.infer.bleu import score
from qkv.infer.search import DecodeConfig
from qkv.infer.glossary import Glossary, Term
from qkv.inspect.terms import translate_with_glossary  # as qkv translate --glossary runs it
from qkv.infer.translator import Translator
from qkv.inspect.terms import alignment_substitution, place
from qkv.io import checkpoint
from benchmarks.engine import engine_args, engine_label, engine_translator

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
DICT = Path("/usr/share/dictd/freedict-eng-deu")
ENDINGS = ("e", "en", "n", "s", "es", "er", "em", "ern", "nen")
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64(text: str) -> int:
    n = 0
    for ch in text:
        n = n * 64 + _B64.index(ch)
    return n


def read_freedict(base: Path = DICT) -> dict[str, set[str]]:
    """English headword (lower case) -> German translations: the first line after each entry's
    headword, its comma-separated words without grammar <...>, domain [...] and {...} marks."""
    data = gzip.open(f"{base}.dict.dz").read()
    out: dict[str, set[str]] = {}
    for line in open(f"{base}.index", encoding="utf-8"):
        word, offset, length = line.rstrip("\n").split("\t")
        if word.startswith("00-") or not re.fullmatch(r"[a-z][a-z -]*[a-z]", word):
            continue
        body = data[_b64(offset) : _b64(offset) + _b64(length)].decode("utf-8", "replace").split("\n")
        if len(body) < 2:
            continue
        german = re.sub(r"<[^>]*>|\[[^\]]*\]|\{[^}]*\}|\([^)]*\)", "", body[1])
        for term in german.split(","):
            term = " ".join(term.split())
            if re.fullmatch(r"[A-Za-zÄÖÜäöüß]+(?: [A-Za-zÄÖÜäöüß]+)?", term) and len(term) > 1:
                out.setdefault(word, set()).add(term)
    return out


def _read(split: str, lang: str) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+(?:-\w+)*", text)


def term_sets(split: str, dictionary: dict[str, set[str]]) -> dict[str, list[dict]]:
    """The ``exact`` and ``inflected`` sets of ``split``: one record per sentence with at least one term."""
    frequent = {w for w, _ in Counter(w.lower() for s in _read("train", "en") for w in _words(s)).most_common(500)}
    german_words = {w for s in _read("train", "de") for w in _words(s)}  # the forms the inflected set may accept
    sets: dict[str, list[dict]] = {"exact": [], "inflected": []}
    for i, (src, ref) in enumerate(zip(_read(split, "en"), _read(split, "de"))):
        words = [w.lower() for w in _words(src)]
        ref_words = set(_words(ref))
        exact, inflected, covered, listed = [], [], set(), set()
        for n in (3, 2, 1):
            for start in range(len(words) - n + 1):
                span = set(range(start, start + n))
                phrase = " ".join(words[start : start + n])
                if span & covered or phrase in listed or phrase not in dictionary or all(w in frequent for w in phrase.split()):
                    continue
                for german in sorted(dictionary[phrase]):
                    if re.search(rf"(?<!\w){re.escape(german)}(?!\w)", ref):
                        exact.append([phrase, german])
                    elif " " not in german and any(german + e in ref_words for e in ENDINGS):
                        inflected.append([phrase, german, *[german + e for e in ENDINGS if german + e in german_words]])
                    else:
                        continue
                    covered |= span
                    listed.add(phrase)
                    break
        for name, terms in (("exact", exact), ("inflected", inflected)):
            if terms:
                sets[name].append({"line": i + 1, "source": src, "reference": ref, "terms": terms})
    return sets


def run_rows(translator: Translator, model, records: list[dict], repeats: int,
             which: list[str] = ("none", "glossary", "search", "always")) -> dict[str, dict]:
    sources = [r["source"] for r in records]
    references = [r["reference"] for r in records]
    glossaries = [Glossary.from_pairs(r["terms"]) for r in records]
    empty = [Glossary([]) for _ in records]
    rows = {}
    # "head": as qkv translate --glossary mends, by the translator's model's alignment head, reading the
    # first search's encoder outputs (None where the model has no head: the row is then the search's)
    mend = "head" if alignment_substitution(model, translator.tokenizer) is not None else None
    for row, glossary, always, align in (("none", empty, False, None), ("glossary", glossaries, False, mend),
                                         ("search", glossaries, False, None), ("always", glossaries, True, None)):
        if row not in which:
            continue
        times, results = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            results = translate_with_glossary(translator, sources, glossary, always=always, align=align)
            times.append(time.perf_counter() - started)
        texts = [r.text for r in results]
        # Term use judged with the glossaries also for the row without one.
        judged = [(g, r) for g, r in zip(glossaries, results)]
        asked = exact = anyform = placed = 0
        checked = translate_uses(judged, texts)
        place(model, translator.tokenizer, checked)
        for result in checked:
            for s in result.sentences:
                for u in s.uses:
                    asked += 1
                    exact += u.found == u.term.forms[0]
                    anyform += u.found is not None
                    placed += bool(u.placed)
        scores = score(texts, references)
        rows[row] = {
            "terms": asked, "exact_form": exact / asked, "any_form": anyform / asked, "placed": placed / asked,
            "bleu": scores["bleu"], "chrf": scores["chrf"], "seconds": statistics.median(times),
            "seconds_all": times, "searched_again": sum(s.constrained for r in results for s in r.sentences),
            "substituted": sum(s.substituted for r in results for s in r.sentences),
            "translations": texts,
        }
    return rows


def translate_uses(judged, texts):
    """The term uses of given translations (``qkv.infer.terms`` records, without searching)."""
    from qkv.infer.terms import GlossaryTranslation, SentenceTerms, term_uses

    out = []
    for (glossary, result), text in zip(judged, texts):
        source = result.sentences[0].source
        matches = glossary.matches(source)
        out.append(GlossaryTranslation(text, [SentenceTerms(source, text, term_uses(glossary, matches, source, text))]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--split", default="val", choices=["val", "test_2016_flickr"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--beam", type=int, nargs="+", default=[5], help="constrained beams to compare (qkv.infer.terms.CONSTRAINED_BEAM)")
    parser.add_argument("--mended-beam", type=int, default=None,
                        help="beams for the sentences mending left (qkv.infer.terms.MENDED_BEAM; default: the module's)")
    parser.add_argument("--first-slack", nargs="+", default=None,
                        help="slacks of the constrained search's length cap to compare, 'none' for no cap "
                             "(qkv.infer.terms.FIRST_SLACK; default: the module's)")
    parser.add_argument("--rows", default="none,glossary,search,always", help="which rows to run (comma-separated)")
    parser.add_argument("--min-terms", type=int, default=1,
                        help="keep the sentences with at least this many terms (2: a denser set, about two terms a sentence)")
    engine_args(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import qkv.infer.terms as terms

    slacks = [None if s == "none" else int(s) for s in args.first_slack] if args.first_slack else [terms.FIRST_SLACK]
    if len(slacks) > 1 and len(args.beam) > 1:  # the report keys several slacks by slack alone
        parser.error("compare several --first-slack values at one --beam")

    dictionary = read_freedict()
    sets = {name: [r for r in records if len(r["terms"]) >= args.min_terms] for name, records in term_sets(args.split, dictionary).items()}
    loaded = checkpoint.load(args.checkpoint)
    # What `qkv translate` searches with: the checkpoint's settings and the loop guard's default.
    config = replace(DecodeConfig(**loaded.model.decode_defaults), loop_guard=LOOP_GUARD)
    translator = engine_translator(args, args.checkpoint, loaded.model, loaded.tokenizer, config)
    report = {"engine": engine_label(args), "checkpoint": str(checkpoint.resolve(args.checkpoint)), "split": args.split, "threads": torch.get_num_threads(),
              "decode": asdict(config), "command": "python -m benchmarks.glossary " + " ".join(sys.argv[1:]),
              "dictionary_entries": len(dictionary), "min_terms": args.min_terms, "mended_beam": args.mended_beam or terms.MENDED_BEAM,
              "first_slack": slacks[0] if len(slacks) == 1 else slacks, "sets": {}}
    for name, records in sets.items():
        report["sets"][name] = {"sentences": len(records), "by_beam": {str(b): {} for b in args.beam} if len(slacks) == 1 else {}}
        for beam, slack in ((b, s) for b in args.beam for s in slacks):
            terms.CONSTRAINED_BEAM, terms.FIRST_SLACK = beam, slack
            if args.mended_beam is not None:
                terms.MENDED_BEAM = args.mended_beam
            rows = run_rows(translator, loaded.model, records, args.repeats, args.rows.split(","))
            cell = report["sets"][name]["by_beam"][str(beam)] if len(slacks) == 1 else report["sets"][name].setdefault(
                "by_slack", {}).setdefault(str(slack), {})
            cell.update({row: {k: v for k, v in r.items() if k != "translations"} for row, r in rows.items()})
            if "none" in rows and "glossary" in rows:
                # A few sentences the glossary changed, for a reader; the rest are not kept (the file stays small).
                changed = [i for i, (a, b) in enumerate(zip(rows["none"]["translations"], rows["glossary"]["translations"])) if a != b]
                cell["examples"] = [
                    {"source": records[i]["source"], "reference": records[i]["reference"], "terms": records[i]["terms"],
                     "none": rows["none"]["translations"][i], "glossary": rows["glossary"]["translations"][i]} for i in changed[:12]]
            for row, r in rows.items():
                print(f"{args.split} {name} ({len(records)} sentences, {r['terms']} terms) beam {beam} slack {slack} {row:9s} exact "
                      f"{r['exact_form']:.3f} any {r['any_form']:.3f} placed {r['placed']:.3f} BLEU {r['bleu']:.2f} chrF "
                      f"{r['chrf']:.2f} {r['seconds']:.2f}s again {r['searched_again']} substituted {r['substituted']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.split}.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
