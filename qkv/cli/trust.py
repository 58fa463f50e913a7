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


def trust_model(args: argparse.Namespace, model, tokenizer, *, notice: bool = True):
    """The model whose internals the trust signals read, and its calibration: the (first) checkpoint's own
    float32 model (an --int8 or --bf16 copy or an ensemble is not it), and its confidence.json; without
    one, the log-probability-only confidence, said in one line on stderr (``notice``)."""
    import torch

    from qkv.io import checkpoint
    from qkv.model.transformer import Transformer
    from qkv.inspect.trust import calibration_of

    paths = args.checkpoint if isinstance(args.checkpoint, list) else [args.checkpoint]
    if not isinstance(model, Transformer) or getattr(args, "int8", False) or model.src_embed.weight.dtype != torch.float32:
        model = checkpoint.load(paths[0], device=model.device).model
    directory = checkpoint.resolve(paths[0])
    calibration = calibration_of(directory)
    if notice:
        say_uncalibrated(directory, calibration)
    return model, tokenizer, calibration


def say_uncalibrated(directory, calibration: dict) -> None:
    """One line on stderr where the confidence is the log-probability only: the checkpoint has no
    calibration of its own, or its own had too little to fit one."""
    from qkv.inspect.trust import LOGPROB_NOTICE, LOGPROB_ONLY, UNCALIBRATED_NOTICE, is_calibrated

    if not is_calibrated(calibration):
        print((UNCALIBRATED_NOTICE if calibration is LOGPROB_ONLY else LOGPROB_NOTICE).format(path=directory), file=sys.stderr)


def annotator(args: argparse.Namespace, model, tokenizer):
    """For ``translate_stream``: per input line, the sentences the model read and its translations of
    them, and the line written -> output lines with the confidence of what was translated."""
    from qkv.inspect.trust import assess_lines

    model, tokenizer, calibration = trust_model(args, model, tokenizer)

    def annotate(sources: list[list[str]], translations: list[list[str]], texts: list[str], encode=None) -> list[str]:
        # the tab-separated columns print no word: the light pass where the calibration allows (assess),
        # reading the search's encoder outputs (encode) where the search ran this model in this process
        trusts = assess_lines(model, tokenizer, sources, translations, calibration=calibration, words=args.confidence == "json",
                              encode=encode)
        return [format_line(text, trust, args.confidence) for text, trust in zip(texts, trusts)]

    annotate.model = model  # type: ignore[attr-defined]  # the model it judges with (encoder outputs of its searches fit)
    annotate.calibration = calibration  # type: ignore[attr-defined]  # for the text format's lines (qkv.cli.document)
    annotate.words = args.confidence == "json"  # type: ignore[attr-defined]
    annotate.format = lambda text, trust: format_line(text, trust, args.confidence)  # type: ignore[attr-defined]
    return annotate


def annotated_lines(translator, annotate):
    """Lines -> output lines, each translation with its confidence (``annotator``'s), as ``translate_stream``
    writes them with ``annotate``: for ``qkv.cli.document.text_format_writer``'s plain lines."""
    import contextlib

    from qkv.infer.encodings import kept_encodings

    def write(lines: list[str]) -> list[str]:
        encodings = kept_encodings(translator, annotate.model)
        with encodings or contextlib.nullcontext():  # the trust pass reads the searches' encoder outputs
            done = translator.translate_lines(lines)
        texts = [" ".join(line.text.splitlines()) for line in done]
        return annotate([d.sentences for d in done], [d.outputs for d in done], texts,
                        encodings.encode if encodings is not None else None)

    return write


def format_line(text: str, trust, form: str) -> str:
    if form == "json":
        return json.dumps({"translation": text, **trust.to_json()}, ensure_ascii=False)
    # a tab the line had between its sentences would make a column of its own
    return f"{text.replace(chr(9), ' ')}\t{trust.confidence:.3f}\t{','.join(trust.flags) or '-'}"


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/) to calibrate")
    p.add_argument("--valid-src", help="validation sources (default: the validation data its run recorded: Multi30k val, "
                                       "its --valid-src, or the pairs it held out)")
    p.add_argument("--valid-tgt", help="their references")
    p.add_argument("--data-dir", help="local Multi30k directory (default: the run's, else $QKV_DATA, else the download cache)")
    p.add_argument("--force", action="store_true", help="replace the checkpoint's calibration if it has one")


def recorded_validation(config: dict, directory, data_dir: str | None = None):
    """The validation pairs the run of a checkpoint recorded (its config's data section), as its training
    read them, and their name; a one-line error where it records none (an imported model) or they are gone."""
    from qkv.errors import DataError
    from qkv.model.config import config_from_dict
    from qkv.train.recipes import DataConfig, load_corpora

    data = config.get("data") or {}
    corpus = data.get("corpus")
    if not corpus:
        raise QkvError(f"{directory}: its config names no corpus it was trained on (an imported model?): give "
                       "--valid-src and --valid-tgt, validation pairs in its languages")
    try:
        if corpus == "prepared":
            from qkv.io.prepared import load_prepared

            return load_prepared(data["data_dir"]).validation(data.get("valid_limit") or 0), f"the validation pairs of {data['data_dir']}"
        known = {k: v for k, v in data.items() if k in DataConfig.__dataclass_fields__}
        if data_dir and corpus == "multi30k":
            known["data_dir"] = data_dir
        cfg = config_from_dict(DataConfig, known)
        valid = load_corpora(cfg)[1]
    except (OSError, KeyError, ValueError, DataError) as error:
        raise QkvError(f"{directory}: the validation data its run recorded cannot be read ({str(error).splitlines()[0]}): "
                       "give --valid-src and --valid-tgt") from None
    if corpus == "multi30k":
        return valid, f"Multi30k val {cfg.src_lang}-{cfg.tgt_lang}"
    return valid, f"{cfg.valid_src} / {cfg.valid_tgt}" if cfg.valid_src else f"{valid.name}"


def summary(calibration: dict) -> str:
    """One line: what the confidence reads, how it ranked val (cross-validated) and where the flags are."""
    thresholds = ", ".join(f"{k} {'never' if v is None else f'{v:.3g}'}" for k, v in calibration["thresholds"].items())
    if calibration.get("kind") == "logprob":
        what = f"log-probability only ({calibration.get('why', '')})"
    elif "combination" in calibration:  # version 3
        given, lp = calibration["given"], calibration["logprob"]
        reads = " + ".join(calibration["features"]) if len(calibration["features"]) > 1 else \
            "the calibrated log-probability (nothing else ranked validation better)"
        what = (f"{reads}: acceptable (chrF >= {calibration['acceptable']:g}) ranked at ROC AUC {given['roc_auc']:.3f} "
                f"(logprob_mean alone {lp['roc_auc']:.3f})")
    else:  # a version 2 calibration
        best, lp = calibration["selection"][-1], calibration["logprob"]
        what = (f"{' + '.join(calibration['features'])}: acceptable (chrF >= {calibration['acceptable']:g}) ranked at ROC AUC "
                f"{best['roc_auc']:.3f} (logprob_mean alone {lp['roc_auc']:.3f}), cross-validated")
    caps = ""
    if calibration.get("kind") != "logprob" and "capping" in calibration:
        caps = f"; {', '.join(calibration['capping']) or 'no flag'} {'caps' if len(calibration['capping']) <= 1 else 'cap'} the confidence"
    return f"{what}; flags at {thresholds}{caps}"


@command("calibrate", "fit the confidence and the flags of --confidence on validation pairs, into the checkpoint", _calibrate_args)
def calibrate_command(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from qkv.cli.common import LOOP_GUARD
    from qkv.io import checkpoint
    from qkv.data.corpus import read_parallel
    from qkv.inspect.calibrate import calibrate_checkpoint
    from qkv.inspect.trust import CONFIDENCE

    if bool(args.valid_src) != bool(args.valid_tgt):
        raise QkvError("--valid-src and --valid-tgt go together")
    # A symlinked checkpoint (or run) is calibrated where it really is: the link stays a link to it.
    target = Path(os.path.realpath(checkpoint.resolve(args.checkpoint)))
    # Everything add_file would refuse (a file of yours in the checkpoint, an existing calibration), and
    # the validation data, refused before the minutes of scoring
    directory = checkpoint.check_add_file(target, CONFIDENCE, replace=args.force)
    if args.valid_src:
        pairs, name = read_parallel(args.valid_src, args.valid_tgt), f"{args.valid_src} / {args.valid_tgt}"
    else:
        pairs, name = recorded_validation(checkpoint.read_config(directory), directory, args.data_dir)
    calibration = calibrate_checkpoint(directory, pairs.src, pairs.tgt, name=name, loop_guard=LOOP_GUARD, replace=args.force)
    print(f"calibrated {directory}: {CONFIDENCE}: {summary(calibration)}", file=sys.stderr)
    return 0


def calibrate_after_training(trainer) -> None:
    """``qkv train``'s and ``qkv distill``'s last step: the run's ``final/`` calibrated on its validation
    pairs, unless its ``TrainConfig.calibrate`` is off. Any failure leaves the checkpoint as it was,
    uncalibrated, and says so in one line: the run's work and its exit status are kept."""
    from qkv.cli.common import LOOP_GUARD
    from qkv.inspect.calibrate import calibrate_checkpoint
    from qkv.inspect.trust import CONFIDENCE

    if not trainer.train_cfg.calibrate:
        return
    final, valid = trainer.run_dir / "final", trainer.valid_data
    try:
        calibration = calibrate_checkpoint(final, valid.src, valid.tgt, name=f"the run's validation pairs ({valid.name})",
                                           loop_guard=LOOP_GUARD)
    except Exception as error:  # noqa: BLE001 (the trained model is kept whatever went wrong here)
        what = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"note: {final} was not calibrated ({what}); its confidence is log-probability "
              f"only until qkv calibrate --checkpoint {final} fits one", file=sys.stderr)
        return
    print(f"calibrated {final}: {CONFIDENCE}: {summary(calibration)}", file=sys.stderr)
