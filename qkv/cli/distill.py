"""``qkv distill``: a teacher (one checkpoint or an ensemble) translates the training sources, a student
trains on its translations, and a report puts the two side by side (``qkv.train.distill``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from qkv.cli.common import command, decode_args, decode_config, decoding_model, device_arg, int8_arg, loop_guard_args, workers_arg
from qkv.errors import QkvError


def _distill_args(p: argparse.ArgumentParser) -> None:
    from qkv.train.recipes import parse_duration

    decode_args(p, ensemble=True, flag="--teacher")
    loop_guard_args(p)
    int8_arg(p)
    device_arg(p)
    workers_arg(p)
    p.add_argument("--out", required=True, help="the distillation's directory (new or empty; the same command again continues it)")
    p.add_argument("--src", help="Multi30k source language (default: the teacher's)")
    p.add_argument("--tgt", help="Multi30k target language (default: the teacher's)")
    p.add_argument("--data-dir", help="local Multi30k directory (default: $QKV_DATA, else the download cache)")
    p.add_argument("--train-src", help="your own sources for the teacher to translate (instead of Multi30k's training split)")
    p.add_argument("--train-tgt", help="their original targets (needed by --mix-original)")
    p.add_argument("--valid-src", help="validation sources (with --train-src): the student is validated on the real references")
    p.add_argument("--valid-tgt", help="validation references")
    p.add_argument("--test-src", help="test sources for the report (default with Multi30k: test_2016_flickr)")
    p.add_argument("--test-tgt", help="test references")
    p.add_argument("--part-size", type=int, default=2000, help="sources translated and saved together (default 2000): what a killed run redoes at most")
    p.add_argument("--min-score", type=float, help="drop distilled pairs the teacher scored below this (length-normalised log-probability)")
    p.add_argument("--mix-original", action="store_true", help="also train the student on the original pairs")
    p.add_argument("--preset", default="multi30k", help="the student's training recipe (default multi30k; qkv train --preset)")
    p.add_argument("--model", nargs="*", action="extend", metavar="KEY=VALUE", help="the student's model config, e.g. n_decoder_layers=1 (repeatable)")
    p.add_argument("--train", nargs="*", action="extend", metavar="KEY=VALUE", help="the student's training config overrides (repeatable)")
    p.add_argument("--data", nargs="*", action="extend", metavar="KEY=VALUE", help="the student's data config overrides, e.g. vocab_size=8000 (repeatable)")
    p.add_argument("--max-steps", type=int, help="the student's updates")
    p.add_argument("--time-budget", type=parse_duration, help="train the student for about this long (e.g. 60m)")
    p.add_argument("--seed", type=int, dest="student_seed", help="the student's seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


@command("distill", "train a student on a teacher's translations (sequence-level knowledge distillation)", _distill_args)
def distill(args: argparse.Namespace) -> int:
    import torch

    from qkv.data.corpus import load_multi30k, multi30k_dir, read_lines, read_parallel
    from qkv.infer.testset import trained_languages
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint
    from qkv.io.runs import check_new_run
    from qkv.model.quantize import int8_model
    from qkv.train import distill as lib
    from qkv.train.recipes import build_configs, parse_overrides
    from qkv.train.stopping import StopRequested
    from qkv.train.trainer import Trainer

    if args.part_size < 1:
        raise QkvError(f"--part-size must be at least 1, got {args.part_size}")
    if args.train_src:
        if args.mix_original and not args.train_tgt:
            raise QkvError("--mix-original needs the original targets: give --train-tgt")
        if not (args.valid_src and args.valid_tgt):
            raise QkvError("with --train-src, give --valid-src and --valid-tgt: the student is validated on real references")
    else:
        given = [flag for flag, value in (("--train-tgt", args.train_tgt), ("--valid-src", args.valid_src), ("--valid-tgt", args.valid_tgt)) if value]
        if given:
            raise QkvError(f"{', '.join(given)} go with --train-src (without it the data is Multi30k's)")
    if bool(args.test_src) != bool(args.test_tgt):
        raise QkvError("give both --test-src and --test-tgt")
    out = Path(args.out)
    teachers = [checkpoint.resolve(path) for path in args.checkpoint]
    for named, teacher in zip(args.checkpoint, teachers):  # the directory must not hold, or sit in, what the command reads
        for path in {Path(named).resolve(), teacher.resolve()}:
            if out.resolve() == path or out.resolve() in path.parents or path in out.resolve().parents:
                raise QkvError(f"--out {out} overlaps the teacher {named}: choose a directory apart from it")
    lib.refuse_foreign(out)  # before anything is loaded or read
    model, tokenizer = decoding_model(args)  # teachers with different tokenizers: one line, before any work
    known = trained_languages(checkpoint.read_config(teachers[0]))  # None where the teacher does not record one
    src_lang, tgt_lang = args.src or known[0], args.tgt or known[1]
    if not args.train_src and not (src_lang and tgt_lang):
        raise QkvError(f"{args.checkpoint[0]} does not record the languages it translates: give --src and --tgt "
                       "to distill on Multi30k (or --train-src and --train-tgt)")

    # The sets: what the teacher translates (and the original targets), validation, test.
    if args.train_src:
        sources = read_lines(Path(args.train_src))
        originals = read_lines(Path(args.train_tgt)) if args.train_tgt else None
        if originals is not None and len(originals) != len(sources):
            raise QkvError(f"{args.train_src} has {len(sources)} lines but {args.train_tgt} has {len(originals)}")
        valid_files = (args.valid_src, args.valid_tgt)
        test_files = (args.test_src, args.test_tgt) if args.test_src else None
    else:
        train = load_multi30k("train", src_lang, tgt_lang, args.data_dir)
        sources, originals = train.src, train.tgt
        where = multi30k_dir(args.data_dir)
        load_multi30k("val", src_lang, tgt_lang, args.data_dir)  # present (downloaded into the cache if need be)
        valid_files = (str(where / f"val.{src_lang}.gz"), str(where / f"val.{tgt_lang}.gz"))
        test_files = (args.test_src, args.test_tgt) if args.test_src else None
        if test_files is None:
            load_multi30k("test_2016_flickr", src_lang, tgt_lang, args.data_dir)
            test_files = (str(where / f"test_2016_flickr.{src_lang}.gz"), str(where / f"test_2016_flickr.{tgt_lang}.gz"))
    sets = {"valid": read_parallel(*valid_files, keep_empty=True)}
    if test_files:
        sets["test"] = read_parallel(*test_files, keep_empty=True)

    search = decode_config(args)
    filtering = lib.Filtering(min_score=args.min_score, mix_original=args.mix_original)
    student_train = parse_overrides(args.train, "--train")
    for key, value in (("max_steps", args.max_steps), ("time_budget", args.time_budget), ("seed", args.student_seed)):
        if value is not None:
            student_train[key] = value
    student_data = {**parse_overrides(args.data, "--data"), "src_lang": src_lang, "tgt_lang": tgt_lang}
    student_model = parse_overrides(args.model, "--model")
    build_configs(args.preset, model=student_model, train=student_train, data=student_data)  # a bad key: now
    settings = {
        "qkv_distill": 1, "decode": asdict(search), "int8": args.int8, "device": str(model.device), "part_size": args.part_size,
        **lib.fingerprint(teachers, sources, originals=originals if args.mix_original else None,
                          valid=[*sets["valid"].src, *sets["valid"].tgt], test=[*sets["test"].src, *sets["test"].tgt] if "test" in sets else None),
        "filtering": asdict(filtering),
        "student": {"preset": args.preset, "model": student_model, "data": student_data,
                    "train": {k: v for k, v in student_train.items() if k != "threads"}},  # threads change no result
    }
    if lib.open_directory(out, settings) and (out / lib.REPORT).is_file():
        print((out / "report.md").read_text(encoding="utf-8"), end="")
        print(f"(this distillation is complete: {out / lib.REPORT})")
        return 0
    measured = {"device": str(model.device), "int8": args.int8, "workers": args.workers, "threads": torch.get_num_threads()}
    teacher_parameters = sum(p.numel() for p in model.parameters()) if not args.int8 else \
        sum(checkpoint.load(t).model.num_parameters() for t in teachers)  # int8 packs the linear layers: count them as saved

    progress = not args.no_progress
    with Translator(model, tokenizer, search, max_tokens=args.batch_tokens, workers=args.workers) as teacher:
        print(f"translating {len(sources):,} sources with {' + '.join(args.checkpoint)} (beam {search.beam_size}) -> {out / lib.PARTS}",
              file=sys.stderr)
        translations = lib.translate_sources(out, sources, teacher, part_size=args.part_size, progress=progress)
    corpus = lib.student_corpus(out, sources, translations, originals=originals, filtering=filtering)
    del sources, originals, translations  # the student reads its two files

    run = out / lib.STUDENT
    if not (out / lib.TRAINED).is_file():
        try:
            if (run / "last" / checkpoint.CONFIG).is_file() or checkpoint.moved_aside(run / "last.old"):
                trainer = Trainer.resume(run, device=model.device)
            else:  # new, or killed before its first checkpoint: only what qkv wrote there is deleted
                if problem := check_new_run(run, overwrite=True):
                    raise QkvError(problem)
                configs = build_configs(args.preset, model=student_model, train=student_train, data={
                    **student_data, "corpus": "files", "train_src": str(corpus.src), "train_tgt": str(corpus.tgt),
                    "valid_src": valid_files[0], "valid_tgt": valid_files[1],
                })
                trainer = Trainer(run, *configs, start_over=run.is_dir(), device=model.device)
            print(f"training the student ({trainer.model.num_parameters():,} parameters) on {corpus.distilled:,} distilled and "
                  f"{corpus.original:,} original pairs -> {run}", file=sys.stderr)
            result = trainer.run(progress=progress)
        except StopRequested as stop:
            print(f"interrupted ({stop}): continue with the same qkv distill command", file=sys.stderr)
            return stop.exit_status
        from qkv.cli.trust import calibrate_after_training

        calibrate_after_training(trainer)  # the student's own confidence, as qkv train's
        lib._write_atomically(out / lib.TRAINED, json.dumps({"step": result.step, "stopped_because": result.stopped_because}) + "\n")
        del trainer

    rows = {}
    student = checkpoint.load(run / "final", device=model.device)
    alpha = search.length_penalty if args.length_penalty is not None else \
        checkpoint.decode_defaults(student.config).get("length_penalty", DecodeConfig.length_penalty)  # the student's own choice
    models = {
        "teacher" + (f" (ensemble of {len(teachers)})" if len(teachers) > 1 else ""): (model, tokenizer, search, teacher_parameters),
        "student": (int8_model(student.model) if args.int8 else student.model, student.tokenizer,
                    DecodeConfig(**{**asdict(search), "length_penalty": alpha}), student.model.num_parameters()),
    }
    for name, (m, tok, config, parameters) in models.items():
        rows[name] = {"parameters": parameters, "length_penalty": config.length_penalty}
        with Translator(m, tok, config, max_tokens=args.batch_tokens, workers=args.workers) as translator:
            for set_name, corpus_set in sets.items():
                rows[name][set_name] = lib.measure(translator, corpus_set.src, corpus_set.tgt)
    print(lib.write_report(out, rows, corpus, settings, measured), end="")
    return 0

