"""``--glossary`` for translate and evaluate: the flags, and what each prints."""

from __future__ import annotations

import argparse
import json

from qkv.cli.common import command
from qkv.errors import QkvError


def glossary_args(p: argparse.ArgumentParser, *, report: bool) -> None:
    p.add_argument("--glossary", metavar="FILE",
                   help="a TSV of terms (source term, target term, further accepted forms): every term a sentence "
                        "holds is put into its translation (docs/glossary.md)")
    p.add_argument("--glossary-always", action="store_true",
                   help="with --glossary: search every sentence that holds a term with the constrained search "
                        "(default: only those whose translation misses a term)")
    p.add_argument("--numbers", action="store_true",
                   help="every number a sentence writes in digits (42, 3.5, 1,000, 10:30, 3/4/2024, the 5 of $5) must "
                        "stand in its translation, checked and searched for as a glossary term (docs/glossary.md#numbers)")
    if report:
        p.add_argument("--glossary-report", action="store_true",
                       help="with --glossary or --numbers: write one JSON object a line: the translation, and each term "
                            "(or number) asked for, found or not, where, and the source words it aligns to")


def load_glossary(args: argparse.Namespace):
    """The --glossary file, checked before any model is loaded, and with --numbers the numbers of each
    sentence as terms (``qkv.infer.numbers.Numbers``); None with neither."""
    if not args.glossary and not args.numbers:
        if args.glossary_always or getattr(args, "glossary_report", False):
            raise QkvError("--glossary-always and --glossary-report go with --glossary FILE or --numbers")
        return None
    from qkv.infer.glossary import Glossary
    from qkv.infer.numbers import Numbers

    if getattr(args, "n_best", 1) > 1 or getattr(args, "sampling", False):
        flag = "--glossary" if args.glossary else "--numbers"
        raise QkvError(f"{flag} puts its terms into the one translation of each line: not with --n-best or --sampling")
    glossary = Glossary.read(args.glossary) if args.glossary else None
    return Numbers(glossary) if args.numbers else glossary


def aligner(args: argparse.Namespace, model, tokenizer):
    """``results`` -> where each found term aligns, filled in with the (first) checkpoint's own float32
    model (loaded once, if the one translating is not it)."""
    from qkv.cli.trust import trust_model
    from qkv.inspect.terms import place

    own = trust_model(args, model, tokenizer, notice=False)[0]
    return lambda results: place(own, tokenizer, results)


def glossary_writer(args: argparse.Namespace, translator, glossary, annotate=None):
    """For ``translate_stream``: input lines -> output lines, translated with the glossary (and with
    --glossary-report, as JSON; with --confidence, annotated as without a glossary)."""
    import contextlib

    from qkv.infer.encodings import kept_encodings
    from qkv.inspect.terms import translate_with_glossary  # mends by the model's alignment head

    place = aligner(args, translator.model, translator.tokenizer) if getattr(args, "glossary_report", False) else None

    def write(lines: list[str]) -> list[str]:
        encodings = None if annotate is None else kept_encodings(translator, getattr(annotate, "model", None))
        with encodings or contextlib.nullcontext():  # the trust pass reads the searches' encoder outputs
            results = translate_with_glossary(translator, lines, glossary, always=args.glossary_always)
        texts = [" ".join(r.text.splitlines()) for r in results]
        if place is not None:
            place(results)
            return [json.dumps(r.as_dict() | {"translation": t}, ensure_ascii=False) for r, t in zip(results, texts)]
        if annotate is None:
            return texts
        # judged as without a glossary: each sentence as the model read it, against its output before recasing
        return annotate([r.sources for r in results], [r.outputs for r in results], texts,
                        encodings.encode if encodings is not None else None)

    return write


def term_summary(results, *, glossary: bool = True, numbers: bool = False) -> str:
    """``evaluate --glossary``'s line: terms asked for, found, placed, and sentences mended and searched again
    (with ``numbers``, a line for the numbers too, or instead where there is no ``glossary``)."""
    from qkv.infer.numbers import NumberTerm

    all_uses = [u for r in results for s in r.sentences for u in s.uses]
    again = sum(s.constrained for r in results for s in r.sentences)
    mended = sum(s.substituted for r in results for s in r.sentences)
    lines = []
    for name, kind, wanted in (("glossary", "terms", glossary), ("numbers", "numbers", numbers)):
        if not wanted:
            continue
        uses = [u for u in all_uses if isinstance(u.term, NumberTerm) == (name == "numbers")]
        found = sum(u.found is not None for u in uses)
        exact = sum(u.found == u.term.forms[0] for u in uses)
        placed = sum(bool(u.placed) for u in uses)
        share = (lambda n: f"{100 * n / len(uses):.1f}%") if uses else (lambda n: "-")
        lines.append(f"{name}: {len(uses)} {kind} asked for; {found} found ({share(found)}), {exact} in the form asked for "
                     f"({share(exact)}), {placed} placed where their source term aligns ({share(placed)}); "
                     f"{mended} sentences mended by alignment, {again} searched again with constraints")
    return "\n".join(lines)


def _pseudo_terms_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="the aligner: a checkpoint (or run) in the training data's languages")
    p.add_argument("--out", required=True, help="the file to write: one JSON list a training pair, [pair key, [[source word index, "
                                                "target word], ...]] (a new file)")
    p.add_argument("--train-src", help="training sources (default: the checkpoint's own training data)")
    p.add_argument("--train-tgt", help="training targets, line-aligned with --train-src")
    p.add_argument("--data-dir", help="local Multi30k directory, for a checkpoint trained on Multi30k")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and qkv wrote it")


@command("pseudo-terms", "find pseudo-terms in training pairs with the aligner, for term-aware training (--data term_share)",
         _pseudo_terms_args)
def pseudo_terms_command(args: argparse.Namespace) -> int:
    import time

    from qkv.io import checkpoint
    from qkv.io.outputs import check_output, output_file, read_dirs
    from qkv.data.term_annotation import pair_key
    from qkv.inspect.terms import pseudo_terms

    inputs, reads = (args.train_src, args.train_tgt), read_dirs([args.checkpoint])
    check_output(args.out, force=args.force, inputs=inputs, reads=reads, provenance=bool(args.train_src))  # else the run's files: below
    if bool(args.train_src) != bool(args.train_tgt):
        raise QkvError("give both --train-src and --train-tgt (or neither: the checkpoint's own training data)")
    if not args.train_src:  # the checkpoint's own training data, from its config: the output checked before loading
        import dataclasses

        from qkv.model.config import ConfigError, config_from_dict
        from qkv.train.recipes import DataConfig, data_files

        try:
            data = config_from_dict(DataConfig, checkpoint.read_config(args.checkpoint).get("data") or {})
        except ConfigError as error:
            raise QkvError(f"{checkpoint.resolve(args.checkpoint)} does not say what it was trained on ({error}): give "
                           "--train-src and --train-tgt") from None
        if data.corpus == "prepared":
            raise QkvError("a prepared corpus holds token ids, not text: give --train-src and --train-tgt")
        if args.data_dir:
            data = dataclasses.replace(data, data_dir=args.data_dir)
        inputs = tuple(data_files(data).values())  # --out never replaces the training data it reads
        check_output(args.out, force=args.force, inputs=inputs, reads=reads)
    loaded = checkpoint.load(args.checkpoint)
    if args.train_src:
        from qkv.data.corpus import read_parallel

        corpus = read_parallel(args.train_src, args.train_tgt, keep_empty=True)
        sources, targets = corpus.src, corpus.tgt
    else:
        from qkv.train.recipes import load_corpora

        train, _ = load_corpora(data)
        sources, targets = train.src, train.tgt
    started = time.perf_counter()
    found = pseudo_terms(loaded.model, loaded.tokenizer, sources, targets)
    with output_file(args.out, force=args.force, inputs=inputs, reads=reads) as handle:
        handle.writelines(json.dumps([pair_key(s, t), [[i, w] for i, w in terms]], ensure_ascii=False) + "\n"
                          for s, t, terms in zip(sources, targets, found))
    with_terms = sum(bool(t) for t in found)
    print(f"wrote {args.out}: {len(found):,} pairs, {with_terms:,} with pseudo-terms ({sum(map(len, found)):,} in all), "
          f"{time.perf_counter() - started:.1f}s")
    return 0
