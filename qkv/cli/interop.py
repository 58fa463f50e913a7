"""The ``qkv`` commands that exchange models with other toolkits: export (CTranslate2, Hugging Face
Marian) and import (OPUS-MT)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qkv.cli.common import command


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/)")
    p.add_argument("--format", default="ctranslate2", choices=["ctranslate2", "marian"], help="target format (default ctranslate2; marian: a Hugging Face MarianMTModel directory)")
    p.add_argument("--out", required=True, help="directory to write the exported model into")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export (never a checkpoint or another directory)")
    p.add_argument("--check", type=int, default=100, metavar="N", help="compare N sentences: ctranslate2 translations at beam 1 and 5, marian token ids and logits (0: skip; default 100)")
    p.add_argument("--check-file", help="sentences for the check, one per line (default: Multi30k test_2016_flickr)")


def _check_sentences(args: argparse.Namespace) -> list[str] | None:
    from qkv.io import checkpoint
    from qkv.data.corpus import DataError, load_multi30k

    if args.check_file:
        return Path(args.check_file).read_text(encoding="utf-8").splitlines()[: args.check]
    data = checkpoint.read_config(args.checkpoint).get("data", {})
    try:
        return load_multi30k("test_2016_flickr", data.get("src_lang", "en"), data.get("tgt_lang", "de"), data.get("data_dir")).src[: args.check]
    except DataError as error:
        print(f"parity check skipped: no check sentences ({error}); pass --check-file FILE", file=sys.stderr)
        return None


@command("export", "export a checkpoint to CTranslate2 or Hugging Face Marian, with a parity check against qkv", _export_args)
def export_command(args: argparse.Namespace) -> int:
    from qkv.interop.ctranslate2 import export_ctranslate2, parity_check
    from qkv.interop.marian import check_export, export_marian
    from qkv.io.outputs import check_apart, read_dirs

    check_apart(args.out, read_dirs([args.checkpoint]))
    out = (export_marian if args.format == "marian" else export_ctranslate2)(args.checkpoint, args.out, force=args.force)
    print(f"wrote {args.format} model to {out}")
    sources = _check_sentences(args) if args.check > 0 else None
    if not sources:
        return 0
    if args.format == "marian":
        n, same, worst = check_export(args.checkpoint, out, sources)
        print(f"parity: MarianTokenizer gives qkv's ids on {same}/{n} sentences; largest logit difference {worst:.2e}")
        if same < n or worst > 1e-3:
            print("the export does not reproduce this model (ids differ or logits differ by more than 1e-3)", file=sys.stderr)
            return 1
        return 0
    worst = 1.0
    for beam in (1, 5):
        report = parity_check(args.checkpoint, out, sources, beam_size=beam)
        worst = min(worst, report.rate)
        print(f"parity, beam {beam}: {report.identical}/{report.n} identical ({100 * report.rate:.1f}%); "
              f"qkv {report.qkv_seconds:.2f}s, ctranslate2 {report.ct2_seconds:.2f}s")
        for source, ours, theirs in report.examples:
            print(f"  differs: {source!r}\n    qkv:         {ours!r}\n    ctranslate2: {theirs!r}")
    if worst < 0.99:
        print("parity below 99%: the export does not reproduce this model's translations", file=sys.stderr)
        return 1
    return 0


def _import_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("format", choices=["marian"], help="the model's format: marian (Hugging Face MarianMTModel, e.g. OPUS-MT)")
    p.add_argument("directory", help="a local model directory (save_pretrained: config.json, weights, source.spm, target.spm, vocab.json)")
    p.add_argument("--out", required=True, help="the qkv checkpoint to write (a new directory)")
    p.add_argument("--force", action="store_true", help="replace --out if it is a qkv checkpoint (never another directory)")


@command("import", "turn a local Hugging Face Marian (OPUS-MT) model directory into a qkv checkpoint", _import_args)
def import_command(args: argparse.Namespace) -> int:
    from qkv.interop.marian import import_marian
    from qkv.io.outputs import check_apart

    check_apart(args.out, [Path(args.directory)])
    loaded = import_marian(args.directory, args.out, force=args.force)
    cfg = loaded.model.config
    print(f"imported {args.directory}: {loaded.model.num_parameters():,} parameters, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
          f"vocabulary {loaded.tokenizer.vocab_size:,} -> {loaded.path}")
    return 0

