"""``--glossary`` for translate and evaluate: the flags, and what each prints."""

from __future__ import annotations

import argparse
import json

from qkv.errors import QkvError


def glossary_args(p: argparse.ArgumentParser, *, report: bool) -> None:
    p.add_argument("--glossary", metavar="FILE",
                   help="a TSV of terms (source term, target term, further accepted forms): every term a sentence "
                        "holds is put into its translation (docs/glossary.md)")
    p.add_argument("--glossary-always", action="store_true",
                   help="with --glossary: search every sentence that holds a term with the constrained search "
                        "(default: only those whose translation misses a term)")
    if report:
        p.add_argument("--glossary-report", action="store_true",
                       help="with --glossary: write one JSON object a line: the translation, and each term asked for, "
                            "found or not, where, and the source words it aligns to")


def load_glossary(args: argparse.Namespace):
    """The --glossary file, checked before any model is loaded; None without one."""
    if not args.glossary:
        if args.glossary_always or getattr(args, "glossary_report", False):
            raise QkvError("--glossary-always and --glossary-report go with --glossary FILE")
        return None
    from qkv.infer.glossary import Glossary

    if getattr(args, "n_best", 1) > 1 or getattr(args, "sampling", False):
        raise QkvError("--glossary puts its terms into the one translation of each line: not with --n-best or --sampling")
    return Glossary.read(args.glossary)


def placed(args: argparse.Namespace, model, tokenizer, results) -> None:
    """Fill in where each found term aligns, with the (first) checkpoint's own float32 model."""
    from qkv.cli.trust import trust_model
    from qkv.inspect.terms import place

    place(trust_model(args, model, tokenizer)[0], tokenizer, results)


def glossary_writer(args: argparse.Namespace, translator, glossary, annotate=None):
    """For ``translate_stream``: input lines -> output lines, translated with the glossary (and with
    --glossary-report, as JSON; with --confidence, annotated as without a glossary)."""
    from qkv.infer.terms import translate_with_glossary

    def write(lines: list[str]) -> list[str]:
        results = translate_with_glossary(translator, lines, glossary, always=args.glossary_always)
        texts = [" ".join(r.text.splitlines()) for r in results]
        if getattr(args, "glossary_report", False):
            placed(args, translator.model, translator.tokenizer, results)
            return [json.dumps(r.as_dict() | {"translation": t}, ensure_ascii=False) for r, t in zip(results, texts)]
        return annotate(lines, texts) if annotate is not None else texts

    return write


def term_summary(results) -> str:
    """``evaluate --glossary``'s line: terms asked for, found, placed, and sentences searched again."""
    uses = [u for r in results for s in r.sentences for u in s.uses]
    found = sum(u.found is not None for u in uses)
    exact = sum(u.found == u.term.forms[0] for u in uses)
    placed = sum(bool(u.placed) for u in uses)
    again = sum(s.constrained for r in results for s in r.sentences)
    share = (lambda n: f"{100 * n / len(uses):.1f}%") if uses else (lambda n: "-")
    return (f"glossary: {len(uses)} terms asked for; {found} found ({share(found)}), {exact} in the form asked for "
            f"({share(exact)}), {placed} placed where their source term aligns ({share(placed)}); "
            f"{again} sentences searched again with constraints")
