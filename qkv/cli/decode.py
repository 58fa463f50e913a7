"""The ``qkv`` commands that translate: translate, evaluate, and average (of the weights a translation uses)."""

from __future__ import annotations

import argparse
import sys

from qkv.errors import QkvError
from qkv.document.formats import FORMATS
from qkv.infer.shortlist import DEFAULT_FREQUENT, DEFAULT_K
from qkv.cli.trust import annotator, confidence_arg
from qkv.cli.glossary import aligner, glossary_args, glossary_writer, load_glossary, term_summary
from qkv.cli.common import (
    decode_args, decode_config, decoding_model, decoding_shortlist, device_arg, int8_arg, compile_arg, precision_label, loop_guard_args, shortlist_arg,
    engine_arg, text_args, text_options, translator_of, workers_arg, command, progress_arg, line_progress,
)


def _translate_args(p: argparse.ArgumentParser) -> None:
    decode_args(p, ensemble=True)
    engine_arg(p)
    int8_arg(p)
    compile_arg(p)
    shortlist_arg(p)
    device_arg(p)
    workers_arg(p)
    loop_guard_args(p)
    text_args(p)
    progress_arg(p)
    p.add_argument("--input", "-i", help="read sentences from this file (default: stdin)")
    p.add_argument("--output", "-o", help="write translations to this file (default: stdout)")
    p.add_argument("--n-best", type=int, default=1, help="write the N best, tab-separated with their scores")
    p.add_argument("--sampling", action="store_true", help="draw each token at random instead of searching (the beam defaults to 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="with --sampling: softmax temperature (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="with --sampling: only the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --sampling: only the nucleus holding this probability")
    p.add_argument("--seed", type=int, default=0, help="with --sampling: a sentence's sample repeats under the same seed")
    p.add_argument("--trace", metavar="TRACE", help="also write the beam search of the --input file's first line, step by step: TRACE.png, .html, .json")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output (and --trace) file that qkv wrote")
    confidence_arg(p, "after each translation, whether to trust it")
    glossary_args(p, report=True)
    p.add_argument("--format", choices=FORMATS,
                   help="translate a whole document, its markup, placeholders and structure kept (docs/documents.md): "
                        "html, markdown, srt, vtt, po, or text (lines, with placeholders kept); default: from the "
                        "--input file's extension (.html, .md, .srt, .vtt, .po), else lines of plain text")
    p.add_argument("--lang", help="with a document: the target language written into it (HTML's lang, a PO header's "
                                  "Language, a WebVTT Language header; default: the checkpoint's target language)")


@command("translate", "translate sentences, one per line, stdin to stdout (or --input/--output)", _translate_args)
def translate(args: argparse.Namespace) -> int:
    import contextlib
    import itertools

    from qkv.io.outputs import check_output, output_or_stdout, read_dirs
    from qkv.infer.translator import input_lines, translate_stream

    from qkv.cli.inspect import trace_paths, write_trace

    # Before loading anything: -o never truncates a file the command reads (the input, the glossary),
    # a file the user has, or the checkpoint.
    inputs, reads = (args.input, args.glossary), read_dirs(args.checkpoint)
    if args.output:
        check_output(args.output, force=args.force, inputs=inputs, reads=reads)
    if args.trace and not args.input:
        raise QkvError("--trace traces the first line of --input FILE: give one")
    for path in trace_paths(args.trace):
        check_output(path, force=args.force, inputs=inputs, reads=reads)
    if args.confidence and (args.n_best > 1 or args.sampling):
        raise QkvError("--confidence judges the one translation of each line: not with --n-best or --sampling")
    glossary = load_glossary(args)
    if glossary is not None and args.confidence and args.glossary_report:
        raise QkvError("--glossary-report and --confidence each write a line of their own: choose one")
    from qkv.cli.document import check_document_args, document_format, read_input_document

    format = args.format or document_format(args.input)
    document = None
    if format:  # the whole document read, and refused if broken, before any model loads
        check_document_args(args)
        document = read_input_document(args, format)
    elif args.lang:
        raise QkvError("--lang is the language written into a document: it goes with --format (or a document's --input)")
    model, tokenizer = decoding_model(args)
    if document is not None:
        from qkv.cli.document import translate_document_command

        return translate_document_command(args, document, model, tokenizer, glossary, inputs, reads)
    translator = translator_of(args, model, tokenizer, decode_config(args, args.n_best), max_tokens=args.batch_tokens,
                               workers=args.workers, shortlist=decoding_shortlist(args, model), text=text_options(args))
    annotate = annotator(args, model, tokenizer) if args.confidence else None
    with contextlib.ExitStack() as stack:
        if args.input:
            source, name = stack.enter_context(open(args.input, "rb")), args.input
        else:  # bytes, not text: Python would turn invalid UTF-8 on stdin into lone surrogates
            source, name = getattr(sys.stdin, "buffer", sys.stdin), "standard input"
        if args.trace:  # the first line is read once and translated with the rest (the input may be a pipe)
            first = source.readline()
            line = next(input_lines([first], name), "")
            written = write_trace(model, tokenizer, line, translator.config, args.trace, force=args.force)
            print(f"beam trace of line 1: {', '.join(map(str, written))}", file=sys.stderr)
            source = itertools.chain([first] if first else [], source)
        # The output file appears, whole, when the last line is translated.
        sink = stack.enter_context(output_or_stdout(args.output, force=args.force, inputs=inputs, reads=reads))
        stack.enter_context(translator)  # its workers end before the output file is put in place
        advance = stack.enter_context(line_progress(args))
        from qkv.cli.document import text_format_writer

        if glossary is not None:
            write = glossary_writer(args, translator, glossary, annotate)
            if not args.glossary_report:  # placeholders and tab-separated parts as --format text --glossary has them
                write = text_format_writer(translator, write, glossary, args.glossary_always, annotate=annotate)
        elif args.n_best == 1:  # placeholders and tab-separated parts as --format text has them
            from qkv.cli.trust import annotated_lines

            write = text_format_writer(translator, annotated_lines(translator, annotate) if annotate else None, annotate=annotate)
        else:
            write = None
        interactive = getattr(source, "isatty", lambda: False)()
        counted = sink if interactive else _EmptyCount(sink)
        translate_stream(translator, source if interactive else counted.inputs(source), counted, name=name, progress=advance,
                         n_best=args.n_best, annotate=annotate, write=write)
    if not interactive and (notice := counted.notice()):
        print(notice, file=sys.stderr)
    return 0


class _EmptyCount:
    """A translation sink that counts the empty translations of non-empty input lines, for one notice:
    a model that writes nothing for most lines has most likely not been trained enough."""

    def __init__(self, sink) -> None:
        self.sink, self.sources, self.empty = sink, [], 0
        self.written = 0

    def inputs(self, source):
        for raw in source:  # bytes lines (text in tests): whether each line has anything to translate
            self.sources.append(bool(raw.strip()))
            yield raw

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def write(self, line: str) -> None:
        for _ in range(line.count("\n")):
            if self.written < len(self.sources) and self.sources[self.written] and not line.split("\t")[0].strip():
                self.empty += 1
            self.written += 1
        self.sink.write(line)

    def flush(self) -> None:
        self.sink.flush()

    def notice(self) -> str | None:
        lines = sum(self.sources)
        if not lines or self.empty * 2 <= lines:
            return None
        return (f"note: {self.empty:,} of {lines:,} translations are empty: the model most likely has not been trained "
                "enough (a run of a few dozen updates writes nothing); train it longer, or check --checkpoint")


def text_label(text, loop_guard: int) -> str:
    """What the search did to the lines besides searching, for the summary line (each changes the score):
    split into sentences (by which language's rules), recased, the loop guard."""
    split = f", split ({text.split})" if text is not None and text.split else ", no split"
    case = ", recased" if text is not None and text.recase else ", case kept"
    return f"{split}{case}, {f'loop guard {loop_guard}' if loop_guard else 'no loop guard'}"


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    decode_args(p, ensemble=True)
    engine_arg(p)
    int8_arg(p)
    compile_arg(p)
    shortlist_arg(p)
    device_arg(p)
    workers_arg(p)
    loop_guard_args(p)
    text_args(p)
    p.add_argument("--split", help="Multi30k split (train, val, test_2016_flickr; default test_2016_flickr for a model trained "
                                   "on Multi30k; a model trained on other data is scored on Multi30k only when a split is named)")
    p.add_argument("--data-dir", help="local Multi30k directory (default: $QKV_DATA, else the download cache)")
    p.add_argument("--src-file", help="evaluate on your own source file instead of a Multi30k split")
    p.add_argument("--ref-file", help="reference translations for --src-file")
    p.add_argument("--save", help="also write the translations to this file, one line per source line")
    p.add_argument("--force", action="store_true", help="overwrite an existing --save file that qkv wrote")
    p.add_argument("--confidence", action="store_true",
                   help="also judge every translation (qkv translate --confidence): print how the confidence ranks "
                        "the sentences as their chrF does (Spearman) and list the flagged lines")
    glossary_args(p, report=False)


@command("evaluate", "translate a test set and score it with sacreBLEU (BLEU, lowercased BLEU, chrF)", _evaluate_args)
def evaluate(args: argparse.Namespace) -> int:
    import time

    from qkv.io import checkpoint
    from qkv.data.corpus import load_multi30k, multi30k_dir, read_parallel
    from qkv.infer.bleu import format_scores, score
    from qkv.io.outputs import check_output, output_file, read_dirs
    from qkv.infer.testset import MULTI30K_TEST, check_test_files, multi30k_pair

    # --save never replaces a file the command reads: source, references, glossary (below: the Multi30k split's files).
    inputs, reads = (args.src_file, args.ref_file, args.glossary), read_dirs(args.checkpoint)
    if args.save:  # a Multi30k split's files are inputs too, known below
        check_output(args.save, force=args.force, inputs=inputs, reads=reads, provenance=bool(args.src_file))
    # What the (first) checkpoint was trained on decides which test sets fit it, before any model is loaded.
    config = checkpoint.read_config(args.checkpoint[0])
    if args.src_file or args.ref_file:
        if not (args.src_file and args.ref_file):
            raise QkvError("give both --src-file and --ref-file")
        check_test_files(config, args.checkpoint[0], args.src_file, args.ref_file)
    else:
        src, tgt = multi30k_pair(config, args.checkpoint[0], split=args.split)
        data = config.get("data") or {}
        data_dir = args.data_dir or (data.get("data_dir") if data.get("corpus") == "multi30k" else None)
        directory = multi30k_dir(data_dir)
        inputs += tuple(directory / f"{args.split or MULTI30K_TEST}.{lang}.gz" for lang in (src, tgt))
        if args.save:
            check_output(args.save, force=args.force, inputs=inputs, reads=reads)
    glossary = load_glossary(args)
    model, tokenizer = decoding_model(args)
    if args.src_file:
        corpus = read_parallel(args.src_file, args.ref_file, keep_empty=True)  # line N in is line N out
    else:
        corpus = load_multi30k(args.split or MULTI30K_TEST, src, tgt, data_dir)
    started = time.perf_counter()
    shortlist = decoding_shortlist(args, model)
    with translator_of(args, model, tokenizer, decode_config(args), max_tokens=args.batch_tokens, workers=args.workers,
                       shortlist=shortlist, text=text_options(args)) as translator:
        # each line's sentences as the model read them (split, recased) and its outputs for them, for --confidence
        if glossary is None:
            lines = translator.translate_lines(corpus.src)
            hypotheses, read = [line.text for line in lines], ([line.sentences for line in lines], [line.outputs for line in lines])
        else:
            from qkv.inspect.terms import translate_with_glossary  # mends by the model's alignment head

            results = translate_with_glossary(translator, corpus.src, glossary, always=args.glossary_always)
            hypotheses = [r.text for r in results]
            read = ([r.sources for r in results], [r.outputs for r in results])
    seconds = time.perf_counter() - started
    if args.save:
        with output_file(args.save, force=args.force, inputs=inputs, reads=reads) as handle:
            handle.writelines(" ".join(h.splitlines()) + "\n" for h in hypotheses)
    names = " + ".join(str(checkpoint.resolve(path)) for path in args.checkpoint)
    workers = f", {args.workers} workers" if args.workers > 1 else ""
    print(f"{corpus.name}: {len(hypotheses)} sentences, checkpoint {names}, beam {args.beam}, length penalty {translator.config.length_penalty}"
          f"{text_label(translator.text, translator.config.loop_guard)}{precision_label(args, model)}{', shortlist' if shortlist else ''}"
          f"{workers}, {seconds:.1f}s")
    print(format_scores(score(hypotheses, corpus.tgt)))
    if glossary is not None:
        aligner(args, model, tokenizer)(results)
        print(term_summary(results, glossary=bool(args.glossary), numbers=args.numbers))
    if args.confidence:
        print_trust(args, model, tokenizer, corpus.tgt, hypotheses, read)
    return 0


def print_trust(args: argparse.Namespace, model, tokenizer, references: list[str], hypotheses: list[str],
                read: tuple[list[list[str]], list[list[str]]]) -> None:
    """``evaluate --confidence``: Spearman correlations of the confidence and of the mean token log-probability
    with sentence chrF, and the flagged lines (1-based), at most 20 of them shown. ``read``: each line's
    sentences as the model read them and its outputs for them, judged sentence by sentence as ``qkv
    translate --confidence`` judges them."""
    from qkv.cli.trust import trust_model
    from qkv.infer.bleu import sentence_chrf
    from qkv.inspect.trust import assess_lines, spearman

    model, tokenizer, calibration = trust_model(args, model, tokenizer)
    trusts = assess_lines(model, tokenizer, *read, calibration=calibration)
    chrf = sentence_chrf(hypotheses, references)
    rho = spearman([t.confidence for t in trusts], chrf)
    rho_lp = spearman([t.features["logprob_mean"] for t in trusts], chrf)
    flagged = [(i, t) for i, t in enumerate(trusts, 1) if t.flags]
    print(f"confidence: Spearman {rho:.3f} with sentence chrF (mean token log-probability alone: {rho_lp:.3f}); "
          f"{len(flagged)} of {len(trusts)} lines flagged")
    for i, t in flagged[:20]:
        print(f"  line {i}: {','.join(t.flags)} (confidence {t.confidence:.3f}): {hypotheses[i - 1][:80]}")


def _average_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories of one run")
    p.add_argument("--out", required=True, help="where to write the averaged checkpoint (a new directory)")
    p.add_argument("--force", action="store_true", help="replace --out if it is a qkv checkpoint (never another directory)")


@command("average", "average the weights of several checkpoints into one", _average_args)
def average(args: argparse.Namespace) -> int:
    from qkv.io import checkpoint
    from qkv.io.outputs import check_checkpoint_out, read_dirs

    out = check_checkpoint_out(args.out, force=args.force, reads=read_dirs(args.checkpoints))
    first = checkpoint.load(args.checkpoints[0])
    weights = checkpoint.average([checkpoint.resolve(p) for p in args.checkpoints])
    configs = {k: v for k, v in first.config.items() if k not in ("format", "model")}
    checkpoint.save(out, first.model, first.tokenizer, configs=configs, state_dict=weights)
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")
    return 0



def _shortlist_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/) to add the shortlist to")
    p.add_argument("--train-src", nargs="+", metavar="FILE",
                   help="source side of the parallel text to count (several files: one corpus; .gz/.xz/.bz2 read as such; "
                        "a TSV without --train-tgt). Default: the checkpoint's own training data")
    p.add_argument("--train-tgt", nargs="+", metavar="FILE", help="target side, one file per --train-src file")
    p.add_argument("--k", type=int, default=DEFAULT_K, help=f"target pieces kept per source piece (default {DEFAULT_K})")
    p.add_argument("--frequent", type=int, default=DEFAULT_FREQUENT,
                   help=f"most frequent target pieces every sentence may use (default {DEFAULT_FREQUENT})")
    p.add_argument("--max-pairs", type=int, default=1_000_000, help="count at most the first N pairs (default 1,000,000)")
    p.add_argument("--force", action="store_true", help="replace the checkpoint's shortlist if it has one")


@command("shortlist", "add a vocabulary shortlist to a checkpoint, for faster beam search with --shortlist", _shortlist_args)
def shortlist_command(args: argparse.Namespace) -> int:
    import itertools
    import time
    from pathlib import Path

    from qkv.infer import shortlist
    from qkv.io import checkpoint

    if args.train_tgt and not args.train_src:
        raise QkvError("--train-tgt needs --train-src")
    if args.train_src and args.train_tgt and len(args.train_src) != len(args.train_tgt):
        raise QkvError(f"{len(args.train_src)} --train-src files but {len(args.train_tgt)} --train-tgt files: give one target file per source file")
    if args.max_pairs < 1:
        raise QkvError("--max-pairs must be at least 1")
    directory = checkpoint.resolve(args.checkpoint)
    if (directory / checkpoint.SHORTLIST).exists() and not args.force:
        raise QkvError(f"{directory} already has a shortlist: give --force to replace it")
    loaded = checkpoint.load(directory)
    tok, config = loaded.tokenizer, loaded.model.config
    started = time.perf_counter()
    pairs = itertools.islice(_training_pairs(args, loaded), args.max_pairs)
    table = shortlist.build(pairs, src_vocab=config.src_vocab_size, tgt_vocab=config.tgt_vocab_size, k=args.k,
                            frequent=args.frequent, always=(tok.eos_id,), max_len=config.max_len - 1)  # as training cut them
    checkpoint.add_file(directory, checkpoint.SHORTLIST, lambda path: shortlist.save(table, Path(path)), replace=args.force)
    print(f"added a shortlist to {directory}: {table.info['pairs']:,} pairs counted, {args.k} target pieces per source "
          f"piece and the {args.frequent} most frequent, {time.perf_counter() - started:.1f}s")
    return 0


def _training_pairs(args: argparse.Namespace, loaded):
    """(source ids, target ids) of the --train-src/--train-tgt files, else of the checkpoint's training data."""
    tok = loaded.tokenizer
    if args.train_src:
        from pathlib import Path

        from qkv.io.prepared import read_corpora

        for src, tgt in read_corpora([Path(f) for f in args.train_src], [Path(f) for f in args.train_tgt] if args.train_tgt else None):
            yield tok.encode(src), tok.encode_target(tgt)
        return
    from qkv.io.prepared import load_prepared
    from qkv.model.config import ConfigError, config_from_dict
    from qkv.train.recipes import DataConfig, load_corpora

    try:
        data = config_from_dict(DataConfig, loaded.config.get("data") or {})
    except ConfigError as error:
        raise QkvError(f"{loaded.path} does not say where its training data is ({error}): give --train-src and --train-tgt") from None
    if data.corpus == "prepared":
        prepared = load_prepared(data.data_dir)
        if prepared.tokenizer.model_proto != getattr(tok, "model_proto", None):
            raise QkvError(f"{data.data_dir} holds another tokenizer than {loaded.path}: give --train-src and --train-tgt")
        ids = prepared.train_ids(min(data.max_len, loaded.model.config.max_len - 1), data.train_limit)  # as the run read them
        yield from zip(ids.src_ids, ids.tgt_ids)
        return
    train, _ = load_corpora(data)
    for src, tgt in zip(train.src, train.tgt):
        yield tok.encode(src)[: data.max_len], tok.encode_target(tgt)[: data.max_len]  # as the run read them
