"""``qkv train``: the command line of a training run, new (``--out``), resumed (``--resume``) or
fine-tuned (``--init-from``); the loop itself is ``qkv.train.trainer.Trainer``.

"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from qkv.errors import QkvError
from qkv.cli.common import device_of, command


def _train_args(p: argparse.ArgumentParser) -> None:
    from qkv.train.recipes import parse_duration

    p.add_argument("--out", help="run directory (checkpoints, log.jsonl, curves.png): new or empty")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a killed or interrupted run from RUN_DIR/last")
    p.add_argument(
        "--overwrite", action="store_true",
        help="start over in the run --out: delete what qkv wrote there (log, curves, tokenizer, checkpoints), nothing else",
    )
    p.add_argument("--preset", help="training recipe (default multi30k): " + ", ".join(sorted(_train_presets())))
    p.add_argument("--init-from", metavar="CKPT", help="fine-tune: start from this checkpoint's weights and tokenizer (fresh optimizer and schedule)")
    p.add_argument("--config", metavar="FILE.toml", help="preset and [model]/[train]/[data] keys from a TOML file; flags override it")
    p.add_argument("--dump-config", action="store_true", help="print the full resolved config (a --config file) and exit")
    p.add_argument("--src", help="source language (Multi30k: en, de, fr, cs)")
    p.add_argument("--tgt", help="target language")
    p.add_argument("--data-dir", help="a directory qkv prepare wrote, or a local Multi30k directory (default: $QKV_DATA, else download to a cache)")
    p.add_argument("--train-src", help="your own training data: source file (or a TSV with both sides)")
    p.add_argument("--train-tgt", help="your own training data: target file")
    p.add_argument("--valid-src", help="validation source file (default: hold out part of the training data)")
    p.add_argument("--valid-tgt", help="validation target file")
    p.add_argument(
        "--time-budget", type=parse_duration,
        help="train for about this long (e.g. 60m): the first updates are timed and the budget becomes a step count",
    )
    p.add_argument("--max-steps", type=int, help="stop after this many updates")
    p.add_argument("--seed", type=int)
    p.add_argument("--model", nargs="*", action="extend", metavar="KEY=VALUE", help="model config overrides, e.g. norm_first=true (repeatable)")
    p.add_argument("--train", nargs="*", action="extend", metavar="KEY=VALUE", help="training config overrides, e.g. lr=1e-3 (repeatable)")
    p.add_argument("--data", nargs="*", action="extend", metavar="KEY=VALUE", help="data config overrides, e.g. vocab_size=8000 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to log.jsonl)")
    p.add_argument("--tensorboard", metavar="DIR", help="also write losses, learning rate, throughput and validation scores as TensorBoard scalars to DIR (needs the tensorboard package)")
    p.add_argument("--device", default="auto", help="auto (the first GPU if PyTorch sees one, else the CPU), cpu, cuda or cuda:N; under torchrun each process uses its rank's device")
    p.add_argument("--accumulate", type=int, metavar="K", help="sum K batches per optimizer step, per process")
    p.add_argument("--bf16", action="store_true", help="bfloat16: autocast on a GPU; on a CPU with AVX-512 BF16 or AMX, the output layer and loss (else float32, with a warning)")


def _train_presets() -> list[str]:
    from qkv.train.recipes import TRAIN_PRESETS

    return list(TRAIN_PRESETS)


@command("train", "train a translation model (Multi30k or your own parallel text; under torchrun: distributed)", _train_args)
def train(args: argparse.Namespace) -> int:
    from qkv.train import distributed

    # Under torchrun, join the process group (gloo on CPU, NCCL on GPU); otherwise a single process.
    ctx = distributed.init_from_env()
    try:
        code = _train(args, ctx)
    except BaseException:
        distributed.shutdown(clean=False)
        raise
    distributed.shutdown()
    return code


def _train(args: argparse.Namespace, ctx) -> int:
    from qkv.train import distributed
    from qkv.io.outputs import check_apart, read_dirs
    from qkv.io.runs import check_new_run, run_entries
    from qkv.train.stopping import StopRequested
    from qkv.io.prepared import is_prepared
    from qkv.io import checkpoint
    from qkv.model.devices import describe
    from qkv.train.recipes import LanguageWarning, dump_config, fine_tuning_model, parse_overrides, read_config_file
    from qkv.train.trainer import Trainer
    from qkv.train.recipes import build_configs, resolved_paths
    from qkv.train.alignment import check_alignment_head

    device = None if ctx.enabled else device_of(args)  # torchrun gives each process its device
    if args.tensorboard:  # its event files may not land in a checkpoint the run reads or writes
        run = args.resume or args.out
        check_apart(args.tensorboard, [*read_dirs([args.init_from]), *(run_entries(Path(run)) if run else [])],
                    flag="--tensorboard", replaced=False)
    train_overrides = parse_overrides(args.train, "--train")
    for key, value in [
        ("time_budget", args.time_budget), ("max_steps", args.max_steps), ("seed", args.seed),
        ("accumulate", args.accumulate), ("bf16", args.bf16 or None),
    ]:
        if value is not None:
            train_overrides[key] = value
    data = parse_overrides(args.data, "--data")
    for key, value in [
        ("src_lang", args.src), ("tgt_lang", args.tgt), ("data_dir", args.data_dir),
        ("train_src", args.train_src), ("train_tgt", args.train_tgt),
        ("valid_src", args.valid_src), ("valid_tgt", args.valid_tgt),
    ]:
        if value is not None:
            data[key] = value
    if args.train_src:
        data["corpus"] = "files"
    elif is_prepared(args.data_dir):  # what qkv prepare wrote: its arrays are mapped, not loaded
        data["corpus"] = "prepared"
    if args.resume:
        ignored = [
            flag for flag, value in [
                ("--out", args.out), ("--overwrite", args.overwrite), ("--config", args.config),
                ("--dump-config", args.dump_config), ("--init-from", args.init_from),
            ] if value
        ]  # fmt: skip
        if ignored:
            raise QkvError(f"--resume continues the run as it was configured: leave out {', '.join(ignored)}")
        if args.preset or args.model or data:  # the command that started the run, say: it must agree with it
            model = parse_overrides(args.model, "--model")
            configs = build_configs(args.preset or "multi30k", model=model, train={}, data=data)
            given = None if args.preset else {"model": set(model), "data": set(data)}  # a preset sets every key
            _check_resume_agrees(args.resume, configs[0], resolved_paths(configs[2]), given=given)  # paths as the run records them
        trainer = Trainer.resume(args.resume, device=device, tensorboard=args.tensorboard, **train_overrides)
    else:
        if args.init_from and args.out:  # --overwrite must never delete the checkpoint it fine-tunes from
            check_apart(args.out, read_dirs([args.init_from]))
        file = read_config_file(args.config) if args.config else {}
        preset = args.preset or file.get("preset", "multi30k")
        model = {**file.get("model", {}), **parse_overrides(args.model, "--model")}
        with warnings.catch_warnings(record=True) as said:  # what is known of the data's languages, said once the run starts
            warnings.simplefilter("always", LanguageWarning)
            model_cfg, train_cfg, data_cfg = build_configs(  # the file first, then the flags over it
                preset, model={} if args.init_from else model,
                train={**file.get("train", {}), **train_overrides}, data={**file.get("data", {}), **data},
            )
        if not args.init_from:  # before anything is loaded: a head named and none trained
            check_alignment_head(model, train_cfg.alignment)
        parent = checkpoint.load(args.init_from) if args.init_from else None
        if parent:  # the parent's model, not the preset's
            model_cfg = fine_tuning_model(parent.model.config, model)
        if args.dump_config:
            print(dump_config(preset, model_cfg, train_cfg, data_cfg), end="")
            return 0
        if not args.out:
            raise QkvError("give --out RUN_DIR for a new run (or --resume RUN_DIR)")
        # Every process checks before any writes (rank 0 alone clears the directory, in Trainer).
        problem = check_new_run(Path(args.out), overwrite=args.overwrite)
        if distributed.any_rank([problem is not None], ctx)[0]:
            raise QkvError(problem or f"--out {args.out} was refused by another process")
        trainer = Trainer(args.out, model_cfg, train_cfg, data_cfg, start_over=args.overwrite, init_from=parent, device=device,
                          tensorboard=args.tensorboard)
        if trainer.deleted:
            print(f"--overwrite: deleted {', '.join(trainer.deleted)} from {args.out}", file=sys.stderr)
        for warning in said:
            if ctx.is_main:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if ctx.is_main:
        where = f"in {ctx.world_size} processes on {trainer.device.type}" if ctx.world_size > 1 else f"on {describe(trainer.device)}"
        where += {"autocast": ", bf16 autocast", "output layer": ", output layer and loss in bf16",
                  "linear and output layers": ", linear layers, output layer and loss in bf16", None: ""}[trainer.bf16_mode]
        print(f"training {trainer.model.num_parameters():,} parameters on {len(trainer.train_ids.src_ids):,} pairs {where} -> {trainer.run_dir}", file=sys.stderr)
        if notice := data_caps_notice(trainer.data_cfg, trainer.train_cfg):
            print(notice, file=sys.stderr)
    try:
        result = trainer.run(progress=not args.no_progress)
    except StopRequested as stop:
        if ctx.is_main:
            print(
                f"interrupted: saved {trainer.run_dir / 'last'} at step {trainer.saved_step} ({stop}); "
                f"continue with qkv train --resume {trainer.run_dir}", file=sys.stderr,
            )  # fmt: skip
        return stop.exit_status
    if not ctx.is_main:
        return 0
    final = result.final
    print(f"stopped after {result.step} steps ({result.stopped_because})")
    print(f"final checkpoint (the best average of the newest step checkpoints on validation): {result.run_dir / 'final'}")
    print(f"validation: BLEU {final['bleu']:.2f}, BLEU (lc) {final['bleu_lc']:.2f}, chrF {final['chrf']:.2f}")
    # The model's own confidence, fitted on its validation data (qkv calibrate; docs/trust.md)
    from qkv.cli.trust import calibrate_after_training

    calibrate_after_training(trainer)
    return 0


def data_caps_notice(data, train) -> str | None:
    """One line saying that the run reads only part of its data (``train_limit``/``valid_limit``, which
    the test preset ``tiny`` sets, with its small vocabulary and step count); None when nothing is capped."""
    if not (data.train_limit or data.valid_limit):
        return None
    capped = " and ".join(f"the first {n:,} {kind} pairs" for n, kind in ((data.train_limit, "training"), (data.valid_limit, "validation")) if n)
    steps = f" and stops after {train.max_steps:,} steps" if train.max_steps else ""
    skipped = [what for what, on in (("tune_length_penalty", train.tune_length_penalty), ("calibrate", train.calibrate)) if not on]
    skipped = f", without {' or '.join(skipped)}" if skipped else ""
    vocabulary = "" if data.corpus == "prepared" else f", with a {data.vocab_size:,}-piece vocabulary"  # prepared: its own
    return (f"note: this run reads only {capped} (train_limit={data.train_limit}, valid_limit={data.valid_limit})"
            f"{vocabulary}{steps}{skipped}; --data train_limit=0 valid_limit=0 reads all")


def _check_resume_agrees(run: str, model, data, *, given: dict[str, set[str]] | None = None) -> None:
    """Model and data flags given with --resume must describe the run as it was started: they cannot
    change it (its weights and its position in the data depend on them), and are never ignored silently.
    ``given``: the keys the flags set, per section; None when a preset was named, which sets them all."""
    from dataclasses import asdict

    from qkv.io import checkpoint
    from qkv.train.recipes import FROM_TOKENIZER, LANGUAGE_KEYS

    saved = checkpoint.read_config(Path(run) / "last")
    # A run on your own data from before qkv recorded how its languages were set holds en -> de, given or not.
    unrecorded = set(LANGUAGE_KEYS) if saved["data"].get("corpus") != "multi30k" and not saved["data"].get("languages") else set()
    changes = [
        f"{key} ({saved[section].get(key)!r} -> {value!r})"
        for section, config in (("model", model), ("data", data))
        for key, value in asdict(config).items()
        if key not in FROM_TOKENIZER and key != "languages" and saved[section].get(key) != value
        and (given is None or key in given[section]) and not (key in unrecorded and (given is None or key not in given[section]))
    ]
    if changes:
        raise QkvError(
            f"--resume cannot change {', '.join(changes[:3])}{' and more' if len(changes) > 3 else ''}: "
            "the run keeps the model and data it started with; leave out --preset, --model and the data flags"
        )


def _prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train-src", required=True, nargs="+", metavar="FILE",
                   help="source side (plain, .gz, .xz or .bz2), or a TSV with both sides; several files: several corpora, read as one")
    p.add_argument("--train-tgt", nargs="+", metavar="FILE", help="target side, aligned line by line with --train-src (one per source file)")
    p.add_argument("--valid-src", help="validation source (default: hold out the last 5%% of the pairs, at most 1,000)")
    p.add_argument("--valid-tgt", help="validation target")
    p.add_argument("--out", required=True, help="the prepared directory to write (new); train with qkv train --data-dir OUT")
    p.add_argument("--vocab-size", type=int, default=8000, help="joint subword vocabulary (default 8000)")
    p.add_argument("--max-len", type=int, default=128, help="subword tokens per side (default 128); longer pairs are dropped")
    p.add_argument("--sample", type=int, default=1_000_000, help="pairs sampled (seeded) to train the tokenizer (default 1,000,000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, help="encoding processes (default: one per CPU)")
    p.add_argument("--max-ratio", type=float, default=3.0, help="drop pairs whose one side has more than this many times the other's tokens (0: keep all; default 3)")
    p.add_argument("--keep-long", action="store_true", help="truncate pairs longer than --max-len instead of dropping them")
    p.add_argument("--keep-empty", action="store_true", help="keep pairs with an empty side")
    p.add_argument("--keep-duplicates", action="store_true", help="keep repeated (source, target) pairs")
    p.add_argument("--keep-copies", action="store_true", help="keep pairs whose source equals their target")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("prepare", "encode a large parallel corpus once into memory-mapped arrays that qkv train --data-dir streams", _prepare_args)
def prepare_command(args: argparse.Namespace) -> int:
    from qkv.io.prepared import Filters, prepare

    for name in ("vocab_size", "max_len", "sample"):
        if getattr(args, name) < 1:
            raise QkvError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers is not None and args.workers < 1:
        raise QkvError(f"--workers must be at least 1, got {args.workers}")
    if args.max_ratio < 0:
        raise QkvError(f"--max-ratio must be >= 0 (0: keep all), got {args.max_ratio}")
    filters = Filters(empty=not args.keep_empty, too_long=not args.keep_long, ratio=args.max_ratio,
                      duplicates=not args.keep_duplicates, copies=not args.keep_copies)
    summary = prepare(args.train_src, args.train_tgt, args.out, valid_src=args.valid_src, valid_tgt=args.valid_tgt,
                      vocab_size=args.vocab_size, max_len=args.max_len, sample=args.sample, seed=args.seed,
                      workers=args.workers, filters=filters, progress=not args.no_progress)
    c = summary.counts
    dropped = ", ".join(f"{reason} {n:,}" for reason, n in c.dropped.items() if n) or "none"
    print(f"prepared {c.kept:,} of {c.read:,} pairs ({c.read / max(summary.seconds, 1e-9):,.0f} pairs/s; dropped: {dropped}; "
          f"truncated {c.truncated:,}), {summary.valid_pairs:,} validation pairs -> {summary.out}")
    return 0


def _split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, metavar="FILE", help="source side of your corpus (plain, .gz, .xz or .bz2), or a TSV with both sides")
    p.add_argument("--tgt", metavar="FILE", help="target side, aligned line by line with --src")
    p.add_argument("--out", required=True, help="a new (or empty) directory for train, dev and test files, named by the input's language suffix (train.en), else .src and .tgt (a TSV)")
    p.add_argument("--dev", type=float, metavar="N", help="validation pairs: a share below 1 (0.05) or a whole count (default 5%%, at most 1,000)")
    p.add_argument("--test", type=float, metavar="N", help="test pairs: a share below 1 or a whole count (default 5%%, at most 1,000)")
    p.add_argument("--seed", type=int, default=1, help="the draw of the held-out pairs (default 1)")


@command("split", "hold out validation (dev) and test pairs from one corpus, sharing no sentence with training", _split_args)
def split_command(args: argparse.Namespace) -> int:
    from qkv.data.split import split_corpus

    c = split_corpus(args.src, args.tgt, args.out, dev=args.dev, test=args.test, seed=args.seed)
    print(f"split {c.read:,} pairs: train {c.train:,}, dev {c.dev:,}, test {c.test:,} -> {args.out} "
          f"({c.overlapping:,} {'pair' if c.overlapping == 1 else 'pairs'} left out as {'it shares' if c.overlapping == 1 else 'they share'} "
          f"a sentence with dev or test; {c.empty:,} with an empty side)")
    print("wrote " + " ".join(str(path) for path in c.files.values()))
    return 0
