"""Documents against lines: markup kept, text quality, where the markup lands, and what it costs.

    .venv/bin/python -m benchmarks.documents --checkpoint runs/en-de/final --out benchmarks/results/documents
    .venv/bin/python -m benchmarks.documents --checkpoint runs/en-de/final --choose   # ROW_SHARE, on pairs 1-75

The set is built from the hand-aligned Multi30k validation pairs (benchmarks/gold/multi30k-val.en-de,
pairs 1-150; no test data): in each pair, up to two source phrases of 1-4 words whose gold links are
*consistent* (every link of the phrase's words lands in one run of reference words, and no word of
that run links outside the phrase: the phrase-extraction rule of statistical MT) become inline
elements (``<b>``, ``<i>``, ``<a href>``, ``<em>``, ``<span class>``); the reference's element is that run.
15 pairs make one HTML page (a ``<p>`` each) and one Markdown file: 10 of each.

Measured, with the checkpoint's own settings and ``qkv translate``'s text options:
- markup whole: each output page holds every inline element with its attributes, the same block
  skeleton, and parses back to itself (html5lib); each Markdown file the same inline tokens and URLs;
- BLEU of the pages' text without markup against the same sentences translated as plain lines, and
  of the fragments way (the text between two tags translated piece by piece);
- placement on the model's translation: mean chrF of each element's text against the reference
  element's text (and of the fragments way's element pieces; and of a min..max rule over the model's
  own source-side links, ``qkv align``'s reading);
- ``qkv markup`` onto the references: the share of elements that wrap exactly the reference's run
  (and of the min..max rule over the same links);
- subtitles: each pair cut into two cues, cue numbers and timings compared byte for byte; a PO
  catalogue of the pairs with placeholders put into them, checked by ``msgfmt --check``;
- time: the pages translated as documents against their sentences as lines, side by side, 3 times.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.alignment_gold import SHARED, gold_set
from qkv.data.sentences import TextOptions
from qkv.document import placement
from qkv.document.translate import place_markup, translate_document
from qkv.infer.bleu import score, sentence_chrf
from qkv.infer.translator import Translator
from qkv.inspect.align import align
from qkv.io import checkpoint

TAGS = [("b", ""), ("i", ""), ("a", ' href="https://example.org/x?a=1&amp;b=2"'), ("em", ""), ("span", ' class="term"')]
PER_PAGE = 15


def consistent_phrases(n_src: int, links: set[tuple[int, int]], words: list[str]) -> list[tuple[int, int, int, int]]:
    """(i, j, a, b): source words i..j (inclusive) whose links all land in reference words a..b, none
    of which links outside i..j; phrases of 1-4 words with at least one letter, not the whole sentence."""
    out = []
    for i in range(n_src):
        for j in range(i, min(n_src, i + 4)):
            if j - i + 1 == n_src or not any(c.isalpha() for w in words[i : j + 1] for c in w):
                continue
            targets = {t for s, t in links if i <= s <= j}
            if not targets:
                continue
            a, b = min(targets), max(targets)
            if all(i <= s <= j for s, t in links if a <= t <= b):
                out.append((i, j, a, b))
    return out


def build_set(sources: list[str], references: list[str], gold: list, seed: int = 1) -> list[list[tuple]]:
    """Per pair, its elements: (i, j, a, b, tag, attrs), at most two, not overlapping on either side."""
    rng = random.Random(seed)
    elements = []
    for k, (src, (sure, possible)) in enumerate(zip(sources, gold)):
        phrases = consistent_phrases(len(src.split()), possible, src.split())
        rng.shuffle(phrases)
        chosen = []
        for i, j, a, b in phrases:
            if all(j < ci or i > cj for ci, cj, *_ in chosen) and all(b < ca or a > cb for _, _, ca, cb, *_ in chosen):
                chosen.append((i, j, a, b, *TAGS[(k + len(chosen)) % len(TAGS)]))
            if len(chosen) == 2:
                break
        elements.append(sorted(chosen))
    return elements


def html_sentence(words: list[str], elements: list[tuple]) -> str:
    out, at = [], 0
    for i, j, _, _, tag, attrs in elements:
        out += words[at:i] + [f"<{tag}{attrs}>" + " ".join(words[i : j + 1]) + f"</{tag}>"]
        at = j + 1
    return " ".join(out + words[at:])


def markdown_sentence(words: list[str], elements: list[tuple]) -> str:
    marks = {"b": ("**", "**"), "i": ("*", "*"), "em": ("*", "*"), "span": ("`", "`")}
    out, at = [], 0
    for i, j, _, _, tag, _ in elements:
        inner = " ".join(words[i : j + 1])
        if tag == "a":
            piece = f"[{inner}](https://example.org/x)"
        elif tag == "span":
            piece = "**" + inner + "**"
        else:
            piece = marks[tag][0] + inner + marks[tag][1]
        out += words[at:i] + [piece]
        at = j + 1
    return " ".join(out + words[at:])


def escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def pages(sources: list[str], elements: list[list[tuple]]) -> list[str]:
    out = []
    for start in range(0, len(sources), PER_PAGE):
        body = "\n".join(f"<p>{html_sentence(escape(sources[k]).split(), elements[k])}</p>" for k in range(start, min(len(sources), start + PER_PAGE)))
        out.append(f"<!DOCTYPE html>\n<html lang=\"en\"><head><title>Page {start // PER_PAGE + 1}</title></head>\n<body>\n{body}\n</body></html>\n")
    return out


def element_runs(page: str) -> list[tuple[str, list[tuple[str, str, int, int]]]]:
    """Per <p>: its text and its inline elements as (name, attributes, first word, last word + 1)."""
    from bs4 import BeautifulSoup, NavigableString, Tag

    out = []
    for p in BeautifulSoup(page, "html5lib").find_all("p"):
        text, found = "", []

        def walk(node):
            nonlocal text
            for child in node.children:
                if isinstance(child, NavigableString):
                    text += str(child)
                elif isinstance(child, Tag):
                    start = len(text)
                    walk(child)
                    first = len(text[:start].split()) if text[:start].strip() else 0
                    if start > 0 and not text[start - 1].isspace() and text[:start].strip():
                        first -= 1  # the element starts inside a word: that word
                    inner = text[start:].split()
                    found.append((child.name, json.dumps(child.attrs, sort_keys=True), first, first + len(inner)))

        walk(p)
        out.append((text, found))
    return out


def markup_whole(source: str, output: str) -> bool:
    from bs4 import BeautifulSoup

    def shape(page):
        soup = BeautifulSoup(page, "html5lib")
        blocks = [t.name for t in soup.find_all(True) if t.name in ("html", "head", "title", "body", "p")]
        inline = sorted((t.name, json.dumps(t.attrs, sort_keys=True)) for t in soup.find_all(True) if t.name not in blocks)
        return blocks, inline

    reparsed = BeautifulSoup(output, "html5lib").decode()
    return shape(source) == shape(output) and BeautifulSoup(reparsed, "html5lib").decode() == reparsed


def markdown_whole(source: str, output: str) -> bool:
    from markdown_it import MarkdownIt

    def shape(text):
        tokens = MarkdownIt("commonmark").parse(text)
        inline = [c.type + c.attrGet("href").__str__() for t in tokens if t.type == "inline" for c in t.children if c.type != "text" and c.type != "softbreak"]
        return [t.type for t in tokens if t.type != "inline"], sorted(inline)

    return shape(source) == shape(output)


def min_max(links: list[tuple[int, int]], i: int, j: int) -> tuple[int, int] | None:
    targets = [t for s, t in links if i <= s <= j]
    return (min(targets), max(targets) + 1) if targets else None


def evaluate(translator: Translator, model, tokenizer, sources, references, elements, *, timing: bool) -> dict:
    out: dict = {}
    html_pages = pages(sources, elements)
    translated = [translate_document(translator, page, "html", target_lang="de", model=model).text for page in html_pages]
    out["html_pages_whole"] = sum(markup_whole(s, t) for s, t in zip(html_pages, translated)) / len(html_pages)
    runs = [r for page in translated for r in element_runs(page)]
    doc_text = [" ".join(text.split()) for text, _ in runs]
    plain = [line.text for line in translator.translate_lines(sources)]
    out["bleu_document"] = round(score(doc_text, references)["bleu"], 2)
    out["bleu_plain"] = round(score(plain, references)["bleu"], 2)
    # the fragments way: every text piece between two tags on its own line
    pieces, owners = [], []
    for k, src in enumerate(sources):
        words, at = src.split(), 0
        for i, j, *_ in elements[k]:
            if words[at:i]:
                pieces.append(" ".join(words[at:i])), owners.append((k, None))
            pieces.append(" ".join(words[i : j + 1])), owners.append((k, (i, j)))
            at = j + 1
        if words[at:]:
            pieces.append(" ".join(words[at:])), owners.append((k, None))
    frag = [line.text for line in translator.translate_lines(pieces)]
    joined = [" ".join(f for f, (k, _) in zip(frag, owners) if k == n) for n in range(len(sources))]
    out["bleu_fragments"] = round(score(joined, references)["bleu"], 2)
    # placement on the model's own translation, against the reference element's words
    ref_words = [r.split() for r in references]
    hyp_inside, ref_inside, frag_inside, minmax_inside = [], [], [], []
    own_links = align(model, tokenizer, sources, [" ".join(t.split()) for t in doc_text])
    for n, (text, found) in enumerate(runs):
        words, by_name = text.split(), {name: (first, last) for name, _, first, last in found}
        for i, j, a, b, tag, _ in elements[n]:  # the two elements of a sentence have different names
            first, last = by_name.get(tag, (0, 0))
            hyp_inside.append(" ".join(words[first:last]))
            ref_inside.append(" ".join(ref_words[n][a : b + 1]))
            run = min_max(own_links[n], i, j)
            minmax_inside.append(" ".join(words[run[0] : run[1]]) if run else "")
        for piece, (k, span) in zip(frag, owners):
            if k == n and span is not None:
                frag_inside.append(piece)
    out["chrf_inside_document"] = round(statistics.fmean(sentence_chrf(hyp_inside, ref_inside)), 1)
    out["chrf_inside_fragments"] = round(statistics.fmean(sentence_chrf(frag_inside, ref_inside)), 1)
    out["chrf_inside_minmax_links"] = round(statistics.fmean(sentence_chrf(minmax_inside, ref_inside)), 1)
    out["elements"] = len(ref_inside)
    # qkv markup onto the references
    exact = exact_minmax = total = 0
    ref_links = align(model, tokenizer, sources, references)
    for start, page in zip(range(0, len(sources), PER_PAGE), html_pages):
        refs = references[start : start + PER_PAGE]
        plain_page = "<!DOCTYPE html>\n<html lang=\"de\"><head><title>Page</title></head>\n<body>\n" + \
            "\n".join(f"<p>{escape(r)}</p>" for r in refs) + "\n</body></html>\n"
        placed_page = place_markup(model, tokenizer, page, plain_page, "html")
        for n, (_, found) in enumerate(element_runs(placed_page)):
            k = start + n
            by_name = {name: (first, last) for name, _, first, last in found}
            for i, j, a, b, tag, _ in elements[k]:
                total += 1
                exact += by_name.get(tag) == (a, b + 1)
                exact_minmax += min_max(ref_links[k], i, j) == (a, b + 1)
    out["markup_on_reference_exact"] = round(100 * exact / max(total, 1), 1)
    out["minmax_links_on_reference_exact"] = round(100 * exact_minmax / max(total, 1), 1)
    # Markdown
    md_files = ["\n\n".join(markdown_sentence(sources[k].split(), elements[k]) for k in range(s, min(len(sources), s + PER_PAGE))) + "\n"
                for s in range(0, len(sources), PER_PAGE)]
    md_out = [translate_document(translator, md, "markdown", model=model).text for md in md_files]
    out["markdown_files_whole"] = sum(markdown_whole(s, t) for s, t in zip(md_files, md_out)) / len(md_files)
    if timing:
        out["time"] = time_documents(translator, model, html_pages, sources)
    return out


def time_documents(translator, model, html_pages: list[str], sources: list[str], repeats: int = 5) -> dict:
    """Each page as a document against its own sentences as lines (like for like: the same batch), one
    after the other, the order swapped every repeat, ``repeats`` times; the sums over the pages, and the
    load average before and after."""
    import os

    doc_s, plain_s, load = [], [], [os.getloadavg()[0]]
    for r in range(repeats):
        doc, plain = 0.0, 0.0
        for k, page in enumerate(html_pages):
            for kind in (("plain", "doc") if r % 2 == 0 else ("doc", "plain")):
                started = time.perf_counter()
                if kind == "plain":
                    translator.translate_lines(sources[k * PER_PAGE : (k + 1) * PER_PAGE])
                    plain += time.perf_counter() - started
                else:
                    translate_document(translator, page, "html", target_lang="de", model=model)
                    doc += time.perf_counter() - started
        doc_s.append(round(doc, 3))
        plain_s.append(round(plain, 3))
    ratios = [d / p for d, p in zip(doc_s, plain_s)]
    load.append(os.getloadavg()[0])
    return {"document_s": doc_s, "plain_s": plain_s, "load_average_1min": load, "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}


def subtitles_and_po(translator, model, sources: list[str]) -> dict:
    """Cue lines byte for byte, and msgfmt --check on a catalogue with placeholders."""
    from qkv.document.segments import PLACEHOLDER

    cues, n = [], 1
    for k, src in enumerate(sources):
        words = src.split()
        half = max(1, len(words) // 2)
        for part in (words[:half], words[half:]):
            if part:
                start = 2 * (n - 1)
                cues.append(f"{n}\n00:{start // 60:02d}:{start % 60:02d},000 --> 00:{(start + 1) // 60:02d}:{(start + 1) % 60:02d},900\n{' '.join(part)}\n")
                n += 1
    srt = "\n".join(cues)
    out = translate_document(translator, srt, "srt", model=model).text
    timing = lambda text: [b.splitlines()[:2] for b in text.strip().split("\n\n")]  # noqa: E731
    holders = ["%s", "{name}", "%(count)d", "{0}", "https://example.org/a", "%d"]
    entries = []
    for k, src in enumerate(sources):
        words = src.split()
        words.insert(len(words) // 2, holders[k % len(holders)])
        text = " ".join(words).replace("\\", "\\\\").replace('"', '\\"')
        flag = "#, python-format\n" if "%(" in text or "{" in text else ("#, c-format\n" if "%" in text else "")
        entries.append(f'{flag}msgid "{text}"\nmsgstr ""\n')
    po = ('msgid ""\nmsgstr ""\n"Project-Id-Version: bench\\n"\n"PO-Revision-Date: 2026-12-06 00:00+0000\\n"\n'
          '"Last-Translator: qkv\\n"\n"Language-Team: none\\n"\n"Language: de\\n"\n"MIME-Version: 1.0\\n"\n'
          '"Content-Type: text/plain; charset=UTF-8\\n"\n"Content-Transfer-Encoding: 8bit\\n"\n'
          '"Plural-Forms: nplurals=2; plural=(n != 1);\\n"\n\n' + "\n".join(entries))
    po_out = translate_document(translator, po, "po", model=model).text
    import polib

    kept = total = 0
    for entry in polib.pofile(po_out):
        if entry.msgid:
            wanted = PLACEHOLDER.findall(entry.msgid)
            total += len(wanted)
            kept += sum(min(entry.msgstr.count(w), entry.msgid.count(w)) for w in set(wanted)) if wanted else 0
    result = {"srt_cues": len(cues), "srt_lines_identical": timing(srt) == timing(out), "po_placeholders_kept": round(100 * kept / total, 1)}
    if shutil.which("msgfmt"):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "de.po"
            path.write_text(po_out, encoding="utf-8")
            done = subprocess.run(["msgfmt", "--check", "-o", str(Path(tmp) / "de.mo"), str(path)], capture_output=True, text=True)
            result["msgfmt_check"] = done.returncode == 0
            result["msgfmt_stderr"] = done.stderr.strip()[-500:]
    return result


class Memo:
    """A translator whose translate_lines answers a list it has seen from memory (``--choose``)."""

    def __init__(self, translator: Translator) -> None:
        self.translator, self.seen = translator, {}
        self.model, self.tokenizer = translator.model, translator.tokenizer

    def translate_lines(self, texts: list[str]):
        key = tuple(texts)
        if key not in self.seen:
            self.seen[key] = self.translator.translate_lines(texts)
        return self.seen[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--data-dir", default=str(SHARED / "multi30k"))
    parser.add_argument("--out", help="directory for documents.json and documents.md")
    parser.add_argument("--choose", action="store_true", help="choose ROW_SHARE on pairs 1-75 and report both halves")
    parser.add_argument("--limit", type=int, default=150, help="only the first N pairs (a quick look; the report uses 150)")
    args = parser.parse_args()
    sources, references, gold = (x[: args.limit] for x in gold_set("multi30k-val", Path(args.data_dir)))
    elements = build_set(sources, references, gold)
    loaded = checkpoint.load(args.checkpoint)
    lang = (loaded.config.get("data") or {}).get("src_lang") or "en"
    translator = Translator(loaded.model, loaded.tokenizer, text=TextOptions(split=lang, recase=True))
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.choose:  # the translations do not depend on the placement: searched once, kept
        results = {}
        memo = Memo(translator)
        for share in (0.25, 0.5, 0.75, 1.0):
            for outside in (1.0, 2.0, 4.0):
                placement.ROW_SHARE, placement.OUTSIDE_WEIGHT = share, outside
                key = f"row_share={share} outside_weight={outside}"
                results[key] = {half: evaluate(memo, model, tokenizer, sources[a:b], references[a:b], elements[a:b], timing=False)
                                for half, (a, b) in (("1-75", (0, 75)), ("76-150", (75, 150)))}
                print(key, json.dumps(results[key]), flush=True)
        report = {"choose": results}
    else:
        report = {"checkpoint": args.checkpoint, "row_share": placement.ROW_SHARE,
                  "all": evaluate(translator, model, tokenizer, sources, references, elements, timing=True),
                  "subtitles_po": subtitles_and_po(translator, model, sources)}
        print(json.dumps(report, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "choose" if args.choose else "documents"
        (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
