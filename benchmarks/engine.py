"""The engine a benchmark's translator searches with: ``--engine qkv|ctranslate2`` and ``--int8``, as
``qkv translate`` takes them (``qkv.cli.common.translator_of``: CTranslate2 on the checkpoint's export,
its own batches and threads; qkv's float32 model for everything else: the alignment pass, the
constrained search, the trust pass)."""

from __future__ import annotations

import argparse


def engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["qkv", "ctranslate2"], default="qkv", help="what runs the search (default qkv)")
    parser.add_argument("--int8", action="store_true", help="with --engine ctranslate2: CTranslate2's int8")


def engine_translator(args: argparse.Namespace, checkpoint: str, model, tokenizer, config):
    """A Translator of ``model`` searching with ``args.engine`` (``qkv translate``'s own construction)."""
    from qkv.cli.common import translator_of
    from qkv.infer.translator import Translator

    if args.engine == "qkv":
        if args.int8:
            raise SystemExit("--int8 here is CTranslate2's: give it with --engine ctranslate2")
        return Translator(model, tokenizer, config)
    from qkv.interop.ct2_engine import CT2_BATCH_TOKENS
    from qkv.io.checkpoint import resolve

    where = argparse.Namespace(engine="ctranslate2", checkpoint=[str(resolve(checkpoint))], int8=args.int8)
    return translator_of(where, model, tokenizer, config, max_tokens=CT2_BATCH_TOKENS)


def engine_label(args: argparse.Namespace) -> str:
    return "qkv" if args.engine == "qkv" else f"ctranslate2 {'int8' if args.int8 else 'float32'}"
