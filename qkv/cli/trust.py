"""The ``qkv`` commands and options of trust: ``qkv calibrate``, and what ``translate --confidence``,
``score --confidence`` and ``evaluate --confidence`` share (qkv.inspect.trust)."""

from __future__ import annotations

import argparse
import json
import sys

from qkv.errors import QkvError
from qkv.cli.common import command


def confidence_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--confidence", nargs="?", const="tsv", choices=["tsv", "json"],
                   help=f"{what}: tsv (default) adds a tab, the confidence (0 to 1, higher is more trustworthy) "
                        "and the flags (comma-separated, or -); json writes one JSON object a line with the "
                        "translation, confidence, flags, features and per-word marks (docs/trust.md)")


def trust_model(args: argparse.Namespace, model, tokenizer):
    """The model whose internals the trust signals read, and its calibration: the (first) checkpoint's own
    float32 model (an --int8 or --bf16 copy or an ensemble is not it), and its confidence.json if it has one."""
    import torch

    from qkv.io import checkpoint
    from qkv.model.transformer import Transformer
    from qkv.inspect.trust import calibration_of

    paths = args.checkpoint if isinstance(args.checkpoint, list) else [args.checkpoint]
    if not isinstance(model, Transformer) or getattr(args, "int8", False) or model.src_embed.weight.dtype != torch.float32:
        model = checkpoint.load(paths[0], device=model.device).model
    return model, tokenizer, calibration_of(checkpoint.resolve(paths[0]))


def annotator(args: argparse.Namespace, model, tokenizer):
    """For ``translate_stream``: sources and translations -> output lines with the confidence."""
    from qkv.inspect.trust import assess

    model, tokenizer, calibration = trust_model(args, model, tokenizer)

    def annotate(sources: list[str], translations: list[str]) -> list[str]:
        trusts = assess(model, tokenizer, sources, translations, calibration=calibration)
        return [format_line(text, trust, args.confidence) for text, trust in zip(translations, trusts)]

    return annotate


def format_line(text: str, trust, form: str) -> str:
    if form == "json":
        return json.dumps({"translation": text, **trust.to_json()}, ensure_ascii=False)
    return f"{text}\t{trust.confidence:.3f}\t{','.join(trust.flags) or '-'}"


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/) to calibrate")
    p.add_argument("--valid-src", help="validation sources (default: Multi30k val in the checkpoint's languages)")
    p.add_argument("--valid-tgt", help="their references")
    p.add_argument("--data-dir", help="local Multi30k directory (default: $QKV_DATA, else the download cache)")
    p.add_argument("--force", action="store_true", help="replace the checkpoint's calibration if it has one")


def calibrate(model, tokenizer, sources: list[str], references: list[str], *, name: str) -> dict:
    """Fit a calibration on validation pairs: the made-up labelled pairs, and the model's own beam-5
    translations of the sources (its length penalty) scored by sentence chrF against the references."""
    from qkv.infer.bleu import sentence_chrf
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.inspect.calibrate import fit, synthetic_pairs
    from qkv.inspect.trust import assess

    made = synthetic_pairs(sources, references)
    print(f"translating {len(sources)} validation sources, then scoring them and {len(made)} labelled pairs made "
          f"from {name} ...", file=sys.stderr)
    alpha = getattr(model, "decode_defaults", {}).get("length_penalty", 0.6)
    own = Translator(model, tokenizer, DecodeConfig(beam_size=5, length_penalty=alpha)).translate(sources)
    chrf = sentence_chrf(own, references)
    trusts = assess(model, tokenizer, [s for _, s, _ in made], [t for _, _, t in made])
    own_trusts = assess(model, tokenizer, sources, own)
    return fit(trusts, [k for k, _, _ in made], name=f"{len(made)} pairs and {len(own)} translations from {name}",
               own=own_trusts, own_chrf=chrf)


@command("calibrate", "fit the confidence and the flags of --confidence on validation pairs, into the checkpoint", _calibrate_args)
def calibrate_command(args: argparse.Namespace) -> int:
    from qkv.io import checkpoint
    from qkv.data.corpus import load_multi30k, read_parallel
    from qkv.inspect.trust import CONFIDENCE

    # Everything add_file would refuse (a file of yours in the checkpoint, an existing calibration), refused
    # before the minutes of scoring
    directory = checkpoint.check_add_file(args.checkpoint, CONFIDENCE, replace=args.force)
    loaded = checkpoint.load(directory)
    if bool(args.valid_src) != bool(args.valid_tgt):
        raise QkvError("--valid-src and --valid-tgt go together")
    if args.valid_src:
        pairs, name = read_parallel(args.valid_src, args.valid_tgt), f"{args.valid_src} / {args.valid_tgt}"
    else:
        data = loaded.config.get("data", {})
        if data.get("corpus", "multi30k") != "multi30k":
            raise QkvError("this model was not trained on Multi30k: give --valid-src and --valid-tgt (its validation pairs)")
        src, tgt = data.get("src_lang") or "en", data.get("tgt_lang") or "de"
        pairs, name = load_multi30k("val", src, tgt, args.data_dir), f"Multi30k val {src}-{tgt}"
    calibration = calibrate(loaded.model, loaded.tokenizer, pairs.src, pairs.tgt, name=name)
    checkpoint.add_file(directory, CONFIDENCE, lambda path: path.write_text(json.dumps(calibration, indent=1) + "\n"),
                        replace=args.force)
    thresholds = ", ".join(f"{k} {'never' if v is None else f'{v:.3g}'}" for k, v in calibration["thresholds"].items())
    print(f"calibrated {directory}: {CONFIDENCE} (flags at {thresholds})", file=sys.stderr)
    return 0
