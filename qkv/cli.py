"""The ``qkv`` command line: parses arguments into configs and calls library functions.

Errors a user can fix are printed as one line and exit with status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, args: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``fn(namespace) -> exit code`` as a subcommand; ``args`` declares its options."""

    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, args, fn)
        return fn

    return register


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="also check decoding on this model: greedy == beam 1, batch invariance")
    _device_arg(p)
    p.add_argument(
        "--resume", action="store_true",
        help="also prove resume is exact here: kill a tiny training run with SIGKILL, resume it, compare bitwise (~1 min)",
    )


@command("doctor", "self-checks of the attention mechanism and the model on this install", _doctor_args)
def doctor(args: argparse.Namespace) -> int:
    from qkv.checks import check_resume_exactness, checkpoint_checks, run_checks

    from qkv.devices import describe

    device = _device(args)
    print(f"device: {describe(device)}")
    results = run_checks()
    if args.checkpoint:
        results += checkpoint_checks(args.checkpoint, device)
    if args.resume:
        results.append(check_resume_exactness())
    for r in results:
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.detail}")
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed}/{len(results)} checks passed")
    return 1 if failed else 0


from qkv import cli_train  # noqa: E402,F401  registers train here, so that `qkv --help` lists it second


# Upper bounds of the decoding flags, checked as they are parsed (one line, exit 2). A step of beam
# search holds beam x vocabulary scores for every sentence of a batch: at beam 64, 32,000 tokens and
# 128 sentences, 1 GB. (`qkv serve` allows clients at most beam 16: qkv.server_api.MAX_BEAM.)
MAX_BEAM = 64


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _int_at_most(high: Callable[[], int], why: str) -> type[argparse.Action]:
    """An int option of at most ``high()``; above, one line that ends with ``why`` (formatted with it).
    (Too low is the library's to say: DecodeConfig and Translator name the lower bounds.)"""

    class AtMost(argparse.Action):
        def __call__(self, parser, namespace, value, option_string=None) -> None:
            if value > (top := high()):
                parser.exit(2, f"{parser.prog}: error: {option_string} must be at most {top}, got {value}: {why.format(top)}\n")
            setattr(namespace, self.dest, value)

    return AtMost


def _decode_args(
    p: argparse.ArgumentParser, *, ensemble: bool = False,
    batch_tokens: str | None = "padded source tokens per batch, whatever the beam (default 2048)",
) -> None:
    """The search's flags; ``batch_tokens``: the help of --batch-tokens, or None for a command without batches."""
    if ensemble:
        p.add_argument("--checkpoint", required=True, action="append",
                       help="checkpoint directory (or a run directory: uses its final/); give it again to translate with an ensemble")
    else:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/)")
    p.add_argument("--beam", type=int, action=_int_at_most(lambda: MAX_BEAM, "each step holds beam x vocabulary scores per sentence"),
                   help=f"beam size (1 = greedy; default 5; at most {MAX_BEAM}: each step holds beam x vocabulary scores for "
                        "every sentence of a batch, 1 GB at beam 64 with 32,000 tokens and 128 sentences)")
    p.add_argument("--length-penalty", type=float,
                   help="GNMT length penalty alpha (0 = none; default: the one chosen on validation at the end of "
                        "the checkpoint's training, else 0.6)")
    p.add_argument("--max-len-a", type=float, default=1.5, help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--stop-early", action="store_true",
                   help="end a sentence's beam search at beam-size finished hypotheses, as CTranslate2 and fairseq do "
                        "(default: search on while a live beam can still beat the best finished one)")
    if batch_tokens:
        p.add_argument("--batch-tokens", type=int, default=2048, help=batch_tokens)


def _workers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1,
                   action=_int_at_most(_usable_cpus, "this process may use {} CPUs, and a worker runs one thread: more only take turns"),
                   help="search batches side by side in N processes of one thread each (CPU only; faster for small "
                        "models, the translations of one process with one thread; default 1; at most the CPUs this "
                        "process may use: more workers of one thread would only take turns)")


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (the first GPU if PyTorch sees one, else the CPU), cpu, cuda or cuda:N")


def _device(args: argparse.Namespace):
    from qkv.devices import resolve_device

    return resolve_device(args.device)


def _int8_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--int8", action="store_true", help="int8 linear layers on the CPU: faster, an approximation (README: Benchmarks)")


def _int8_device(args: argparse.Namespace):
    """The device of a decoding command; ``--int8`` runs on the CPU, so with it ``auto`` means the CPU."""
    from qkv.devices import resolve_device

    if args.int8 and args.device == "auto":
        return resolve_device("cpu")
    device = resolve_device(args.device)
    if args.int8 and device.type != "cpu":
        raise ValueError(f"--int8 runs on the CPU: leave out --device {args.device} (or give --device cpu)")
    return device


def _decoding_model(args: argparse.Namespace):
    """The model of translate/evaluate (several ``--checkpoint``s: an ensemble), on its device, int8 if asked."""
    from qkv.ensemble import load_ensemble
    from qkv.quantize import int8_model

    model, tokenizer = load_ensemble(args.checkpoint, device=_int8_device(args))
    return (int8_model(model) if args.int8 else model), tokenizer


def _decode_config(args: argparse.Namespace, n_best: int = 1):
    from qkv.decode import DecodeConfig

    sampling = {k: getattr(args, k) for k in ("sampling", "temperature", "top_k", "top_p", "seed") if hasattr(args, k)}
    alpha = args.length_penalty
    if alpha is None:  # the checkpoint's (an ensemble: the first's), else DecodeConfig's
        from qkv import checkpoint

        first = args.checkpoint[0] if isinstance(args.checkpoint, list) else args.checkpoint
        alpha = checkpoint.decode_defaults(checkpoint.read_config(first)).get("length_penalty", DecodeConfig.length_penalty)
    return DecodeConfig(
        beam_size=args.beam, length_penalty=alpha, max_len_a=args.max_len_a,
        max_len_b=args.max_len_b, n_best=n_best, stop_early=args.stop_early, **sampling,
    )


def _translate_args(p: argparse.ArgumentParser) -> None:
    _decode_args(p, ensemble=True)
    _int8_arg(p)
    _device_arg(p)
    _workers_arg(p)
    p.add_argument("--input", "-i", help="read sentences from this file (default: stdin)")
    p.add_argument("--output", "-o", help="write translations to this file (default: stdout)")
    p.add_argument("--n-best", type=int, default=1, help="write the N best, tab-separated with their scores")
    p.add_argument("--sampling", action="store_true", help="draw each token at random instead of searching (the beam defaults to 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="with --sampling: softmax temperature (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="with --sampling: only the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --sampling: only the nucleus holding this probability")
    p.add_argument("--seed", type=int, default=0, help="with --sampling: a sentence's sample repeats under the same seed")
    p.add_argument("--trace", metavar="TRACE", help="also write the beam search of the --input file's first line, step by step: TRACE.png, .html, .json")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output (and --trace) file")


@command("translate", "translate sentences, one per line, stdin to stdout (or --input/--output)", _translate_args)
def translate(args: argparse.Namespace) -> int:
    import contextlib
    import itertools

    from qkv.outputs import check_output, output_or_stdout, read_dirs
    from qkv.translate import Translator, input_lines, translate_stream

    from qkv.cli_inspect import trace_paths, write_trace

    # Before loading anything: -o never truncates the input, a file the user has, or the checkpoint.
    reads = read_dirs(args.checkpoint)
    if args.output:
        check_output(args.output, force=args.force, inputs=(args.input,), reads=reads)
    if args.trace and not args.input:
        raise ValueError("--trace traces the first line of --input FILE: give one")
    for path in trace_paths(args.trace):
        check_output(path, force=args.force, inputs=(args.input,), reads=reads)
    model, tokenizer = _decoding_model(args)
    translator = Translator(model, tokenizer, _decode_config(args, args.n_best), max_tokens=args.batch_tokens,
                            workers=args.workers)
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
        sink = stack.enter_context(output_or_stdout(args.output, force=args.force, inputs=(args.input,), reads=reads))
        stack.enter_context(translator)  # its workers end before the output file is put in place
        translate_stream(translator, source, sink, name=name, n_best=args.n_best)
    return 0


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    _decode_args(p, ensemble=True)
    _int8_arg(p)
    _device_arg(p)
    _workers_arg(p)
    p.add_argument("--split", default="test_2016_flickr", help="Multi30k split (train, val, test_2016_flickr)")
    p.add_argument("--data-dir", help="local Multi30k directory (default: $QKV_DATA, else the download cache)")
    p.add_argument("--src-file", help="evaluate on your own source file instead of a Multi30k split")
    p.add_argument("--ref-file", help="reference translations for --src-file")
    p.add_argument("--save", help="also write the translations to this file, one line per source line")
    p.add_argument("--force", action="store_true", help="overwrite an existing --save file")


@command("evaluate", "translate a test set and score it with sacreBLEU (BLEU, lowercased BLEU, chrF)", _evaluate_args)
def evaluate(args: argparse.Namespace) -> int:
    import time

    from qkv import checkpoint
    from qkv.data import load_multi30k, read_parallel
    from qkv.evaluate import format_scores, score
    from qkv.outputs import check_output, output_file, read_dirs
    from qkv.translate import Translator

    reads = read_dirs(args.checkpoint)
    if args.save:
        check_output(args.save, force=args.force, inputs=(args.src_file, args.ref_file), reads=reads)
    model, tokenizer = _decoding_model(args)
    if args.src_file or args.ref_file:
        if not (args.src_file and args.ref_file):
            raise ValueError("give both --src-file and --ref-file")
        corpus = read_parallel(args.src_file, args.ref_file, keep_empty=True)  # line N in is line N out
    else:
        data = checkpoint.read_config(args.checkpoint[0]).get("data", {})
        src, tgt = data.get("src_lang", "en"), data.get("tgt_lang", "de")
        corpus = load_multi30k(args.split, src, tgt, args.data_dir or data.get("data_dir"))
    started = time.perf_counter()
    with Translator(model, tokenizer, _decode_config(args), max_tokens=args.batch_tokens, workers=args.workers) as translator:
        hypotheses = translator.translate(corpus.src)
    seconds = time.perf_counter() - started
    if args.save:
        with output_file(args.save, force=args.force, inputs=(args.src_file, args.ref_file), reads=reads) as handle:
            handle.writelines(" ".join(h.splitlines()) + "\n" for h in hypotheses)
    names = " + ".join(str(checkpoint.resolve(path)) for path in args.checkpoint)
    workers = f", {args.workers} workers" if args.workers > 1 else ""
    print(f"{corpus.name}: {len(hypotheses)} sentences, checkpoint {names}, beam {args.beam}, length penalty {translator.config.length_penalty}{', int8' if args.int8 else ''}{workers}, {seconds:.1f}s")
    print(format_scores(score(hypotheses, corpus.tgt)))
    return 0


def _average_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories of one run")
    p.add_argument("--out", required=True, help="where to write the averaged checkpoint (a new directory)")
    p.add_argument("--force", action="store_true", help="replace --out if it is a qkv checkpoint (never another directory)")


@command("average", "average the weights of several checkpoints into one", _average_args)
def average(args: argparse.Namespace) -> int:
    from qkv import checkpoint
    from qkv.outputs import check_checkpoint_out, read_dirs

    out = check_checkpoint_out(args.out, force=args.force, reads=read_dirs(args.checkpoints))
    first = checkpoint.load(args.checkpoints[0])
    weights = checkpoint.average([checkpoint.resolve(p) for p in args.checkpoints])
    configs = {k: v for k, v in first.config.items() if k not in ("format", "model")}
    checkpoint.save(out, first.model, first.tokenizer, configs=configs, state_dict=weights)
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")
    return 0

def _serve_args(p: argparse.ArgumentParser) -> None:
    _device_arg(p)
    # The defaults are qkv.server.DEFAULT_LIMITS, written out so that parsing does not import the server
    # (a test checks that the two agree).
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-sentences", type=int, default=32, help="sentences per batch (default 32)")
    p.add_argument("--max-batch-tokens", type=int, default=4096, help="source tokens per batch (default 4096)")
    p.add_argument("--max-wait-ms", type=float, default=10.0, help="how long a batch waits for more requests (default 10)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting or being translated before 503 (default 256)")
    p.add_argument("--max-queue-work", type=int, default=200_000, help="units of work waiting or being translated before 503 (default 200000)")
    p.add_argument("--max-texts", type=int, default=64, help="texts per request (default 64)")
    p.add_argument("--max-chars", type=int, default=1000, help="characters per text (default 1000)")
    p.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="request body size; larger gets 413 before it is read (default 1048576)"
    )
    p.add_argument(
        "--max-request-work", type=int, default=20_000,
        help="decoding work per request and per batch: beam size x maximum output tokens, summed over texts (default 20000)",
    )
    p.add_argument(
        "--max-attention-weights", type=int, default=1_000_000,
        help="attention weights one request may return: layers x heads x output x source tokens (default 1000000)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=60.0, help="seconds a request may wait for its translation, then 504 (default 60)"
    )
    p.add_argument(
        "--graceful-timeout", type=float, default=30.0,
        help="seconds requests in flight get on SIGTERM; then they are dropped and the server exits (default 30)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


@command("serve", "serve translations over HTTP: JSON API with dynamic batching, docs and an attention page", _serve_args)
def serve_command(args: argparse.Namespace) -> int:
    from qkv.server import DEFAULT_LIMITS, serve

    serve(
        args.checkpoint, host=args.host, port=args.port, log_level=args.log_level, device=_device(args),
        graceful_timeout=args.graceful_timeout, **{name: getattr(args, name) for name in DEFAULT_LIMITS},
    )
    return 0


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/)")
    p.add_argument("--format", default="ctranslate2", choices=["ctranslate2", "marian"], help="target format (default ctranslate2; marian: a Hugging Face MarianMTModel directory)")
    p.add_argument("--out", required=True, help="directory to write the exported model into")
    p.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export (never a checkpoint or another directory)")
    p.add_argument("--check", type=int, default=100, metavar="N", help="compare N sentences: ctranslate2 translations at beam 1 and 5, marian token ids and logits (0: skip; default 100)")
    p.add_argument("--check-file", help="sentences for the check, one per line (default: Multi30k test_2016_flickr)")


def _check_sentences(args: argparse.Namespace) -> list[str] | None:
    from qkv import checkpoint
    from qkv.data import DataError, load_multi30k

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
    from qkv.export import export_ctranslate2, parity_check
    from qkv.marian import check_export, export_marian
    from qkv.outputs import check_apart, read_dirs

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
    from qkv.marian import import_marian
    from qkv.outputs import check_apart

    check_apart(args.out, [Path(args.directory)])
    loaded = import_marian(args.directory, args.out, force=args.force)
    cfg = loaded.model.config
    print(f"imported {args.directory}: {loaded.model.num_parameters():,} parameters, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
          f"vocabulary {loaded.tokenizer.vocab_size:,} -> {loaded.path}")
    return 0


from qkv import cli_inspect  # noqa: E402,F401  registers explain, score, align, attend and demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:  # warnings as one plain line, without the source line that raised them
        warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "beam", 0) is None:  # decoding commands: beam 5, or 1 when sampling
        args.beam = 1 if getattr(args, "sampling", False) else 5
    try:
        return COMMANDS[args.command][2](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (for example `| head -1`): stop quietly, as Unix tools do. Point stdout
        # at /dev/null so that Python's own flush at exit does not fail on the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, RuntimeError, FloatingPointError) as error:
        if args.debug:
            raise
        print(f"qkv {args.command}: error: {error}", file=sys.stderr)
        return 2
