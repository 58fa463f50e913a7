"""What the ``qkv`` commands share: the registry that ``command`` fills, and the flags and settings
of the decoding commands (search, device, int8, workers, shortlist).

Each command module registers its commands with ``command``; ``qkv.cli.main`` imports them all and
builds the parser.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from qkv.errors import QkvError

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, args: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``fn(namespace) -> exit code`` as a subcommand; ``args`` declares its options."""

    def register(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, args, fn)
        return fn

    return register


# Upper bounds of the decoding flags, checked as they are parsed (one line, exit 2). A step of beam
# search holds beam x vocabulary scores for every sentence of a batch: at beam 64, 32,000 tokens and
# 128 sentences, 1 GB. (`qkv serve` allows clients at most beam 16: qkv.serve.api.MAX_BEAM.)
MAX_BEAM = 64


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def int_at_most(high: Callable[[], int], why: str) -> type[argparse.Action]:
    """An int option of at most ``high()``; above, one line that ends with ``why`` (formatted with it).
    (Too low is the library's to say: DecodeConfig and Translator name the lower bounds.)"""

    class AtMost(argparse.Action):
        def __call__(self, parser, namespace, value, option_string=None) -> None:
            if value > (top := high()):
                parser.exit(2, f"{parser.prog}: error: {option_string} must be at most {top}, got {value}: {why.format(top)}\n")
            setattr(namespace, self.dest, value)

    return AtMost


def decode_args(
    p: argparse.ArgumentParser, *, ensemble: bool = False,
    batch_tokens: str | None = "padded source tokens per batch, whatever the beam (default 2048; with --engine ctranslate2, 512)", flag: str = "--checkpoint",
) -> None:
    """The search's flags; ``batch_tokens``: the help of --batch-tokens, or None for a command without batches;
    ``flag``: the name of the checkpoint flag (its value is ``args.checkpoint`` whatever the name)."""
    if ensemble:
        p.add_argument(flag, dest="checkpoint", required=True, action="append",
                       help="checkpoint directory (or a run directory: uses its final/); give it again to translate with an ensemble")
    else:
        p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/)")
    p.add_argument("--beam", type=int, action=int_at_most(lambda: MAX_BEAM, "each step holds beam x vocabulary scores per sentence"),
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
        p.add_argument("--batch-tokens", type=int, default=DefaultTokens(2048), help=batch_tokens)


class DefaultTokens(int):
    """--batch-tokens when the user did not give it: an engine with another best budget takes its own
    (``--engine ctranslate2``: ``qkv.interop.ct2_engine.CT2_BATCH_TOKENS``)."""


# --loop-guard's default: on Multi30k val (En->De, beam 5) it left no output looping and raised BLEU by
# 0.06; 3 left 5 loops (docs/robustness.md, benchmarks/robustness_text.py).
LOOP_GUARD = 2


def loop_guard_args(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that write translations (translate, evaluate, distill) against loops."""
    p.add_argument("--loop-guard", type=int, default=LOOP_GUARD, metavar="N",
                   help=f"search a sentence whose output loops (a run of 1-4 tokens 3 times back to back that is not a "
                        f"number and that the source does not repeat too, or no end "
                        f"before the length limit) again with no repeated N-gram of tokens; 0: off, the exact search "
                        f"(default {LOOP_GUARD}, chosen on val: docs/robustness.md)")
    p.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="no N-gram of tokens twice in any output, as fairseq's no_repeat_ngram_size (default 0: off)")


def text_args(p: argparse.ArgumentParser) -> None:
    """The flags of how a line is read: cut into sentences, and sentences in capitals."""
    p.add_argument("--no-split", action="store_true",
                   help="translate each line as one sentence (default: cut a line into sentences by the source "
                        "language's rules, translate them in one batch and join their translations into one line)")
    p.add_argument("--keep-case", action="store_true",
                   help="translate a sentence in capitals or in Title Case as it is (default: in sentence case, "
                        "and the translation of one in capitals written back in capitals)")


def progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress line on stderr: lines translated, their rate and, with --input, the share done "
                        "(default: when stderr is a terminal and the input is not; in a log, a line a minute)")


@contextlib.contextmanager
def line_progress(args: argparse.Namespace) -> Iterator[Callable[[int], None] | None]:
    """The ``progress`` of ``translate_stream`` for ``progress_arg``: a bar's ``update`` (``qkv.train.progress``:
    redrawn on a terminal, a plain line a minute in a log), over the lines of ``--input`` when it is given;
    None (nothing shown) when not asked for, and by default for lines typed at a terminal."""
    wanted = getattr(args, "progress", None)
    if wanted is None:
        wanted = sys.stderr.isatty() and (bool(args.input) or not sys.stdin.isatty())
    if not wanted:
        yield None
        return
    from qkv.train.progress import progress

    bar = progress(total=_count_lines(args.input) if args.input else None, unit="line")
    try:
        yield bar.update
    finally:
        bar.close()


def _count_lines(path: str) -> int:
    """Lines of a file as ``input_lines`` reads them: each "\n" ends one, and a last line may lack it."""
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            count, last = count + block.count(b"\n"), block[-1:]
    return count + (last != b"\n")


def text_options(args: argparse.Namespace):
    """``text_args``' ``TextOptions``, the source language read from the (first) checkpoint (unknown: English rules)."""
    from qkv.data.sentences import TextOptions
    from qkv.io import checkpoint

    first = args.checkpoint[0] if isinstance(args.checkpoint, list) else args.checkpoint
    lang = (checkpoint.read_config(first).get("data") or {}).get("src_lang") or "en"
    return TextOptions(split=None if args.no_split else lang, recase=not args.keep_case)


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def workers_arg(p: argparse.ArgumentParser) -> None:
    at_most = int_at_most(usable_cpus, "this process may use {} CPUs, and a worker runs one thread: more only take turns")

    class Workers(at_most):
        def __call__(self, parser, namespace, value, option_string=None) -> None:
            if value == "auto":
                setattr(namespace, self.dest, value)
            else:
                super().__call__(parser, namespace, value, option_string)

    p.add_argument("--workers", type=_workers, default="auto", action=Workers,
                   help="search batches side by side in N processes of one thread each (CPU only; the translations "
                        "of one process with one thread; at most the CPUs this process may use: more workers of one "
                        "thread would only take turns). Default auto: one per CPU this process may use on the CPU, "
                        "1 on a GPU or with --compile; an input of one batch is searched in the command's own process")


def resolve_workers(args: argparse.Namespace, device) -> int:
    """``--workers``' count for a model on ``device``: auto is one per usable CPU on the CPU, 1 elsewhere
    and with --compile (a compiled step runs in one process)."""
    if args.workers == "auto":
        return usable_cpus() if device.type == "cpu" and not getattr(args, "compile", False) else 1
    return args.workers


def device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (the first GPU if PyTorch sees one, else the CPU), cpu, cuda or cuda:N")


def device_of(args: argparse.Namespace):
    from qkv.model.devices import resolve_device

    return resolve_device(args.device)


def int8_arg(p: argparse.ArgumentParser) -> None:
    """The precision flags of the decoding commands: --int8 and --bf16."""
    p.add_argument("--int8", action="store_true",
                   help="int8 linear weights on the CPU (torchao): 0.45x fp32's parameter memory on the multi30k preset's model, an approximation; "
                        "its speed against fp32 is in docs/translation.md")
    bf16_arg(p)


def compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="compile the decoder's step (torch.compile): the first batches wait about a minute while it "
                        "compiles (three the first time on a machine), later steps run faster; for long inputs "
                        "(docs/translation.md)")


def bf16_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bf16", action="store_true",
                   help="decode in bfloat16 where the CPU (AVX-512 BF16 or AMX) or GPU multiplies it natively, "
                        "scores still in float32; elsewhere a one-line note and float32 (docs/translation.md)")


def precision_label(args: argparse.Namespace, model) -> str:
    """', int8' or ', bfloat16' for a summary line (nothing for float32), after the engine if not qkv."""
    if getattr(args, "engine", "qkv") != "qkv":
        return f", {args.engine}" + (" int8" if args.int8 else "")
    if getattr(args, "int8", False):
        return ", int8"
    import torch

    return ", bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else ""


def decoding_dtype(args: argparse.Namespace, device):
    """``--bf16``'s dtype on this device (a note on stderr where it falls back to float32)."""
    from qkv.model.bf16 import decoding_dtype as choose

    dtype, note = choose(device, args.bf16)
    if note:
        print(note, file=sys.stderr)
    return dtype


def int8_device(args: argparse.Namespace):
    """The device of a decoding command; ``--int8`` runs on the CPU, so with it ``auto`` means the CPU."""
    from qkv.model.devices import resolve_device

    if args.int8 and args.device == "auto":
        return resolve_device("cpu")
    device = resolve_device(args.device)
    if args.int8 and device.type != "cpu":
        raise QkvError(f"--int8 runs on the CPU: leave out --device {args.device} (or give --device cpu)")
    return device


def decoding_model(args: argparse.Namespace):
    """The model of translate/evaluate (several ``--checkpoint``s: an ensemble), on its device, int8 or bfloat16 if asked.
    Also settles ``args.workers`` (auto: ``resolve_workers``)."""
    from qkv.model.cpu import tune_allocator
    from qkv.infer.ensemble import load_ensemble
    from qkv.model.quantize import int8_model

    if args.int8 and args.bf16:
        raise QkvError("--int8 and --bf16 are two precisions: choose one")
    ct2 = getattr(args, "engine", "qkv") == "ctranslate2"
    if ct2 and (args.bf16 or device_of(args).type != "cpu"):
        raise QkvError("--engine ctranslate2 runs on the CPU in float32 or int8: not with --bf16 or --device cuda")
    if ct2 and (getattr(args, "n_best", 1) > 1 or getattr(args, "sampling", False)):  # before the export, not after it
        raise QkvError("--engine ctranslate2 searches for the best translation: not with --sampling or --n-best")
    if ct2 and getattr(args, "workers", "auto") not in ("auto", 1):
        raise QkvError("--engine ctranslate2 runs in one process with its own threads: not with --workers above 1")
    if ct2:  # its package before the checkpoint loads and anything is exported or read
        from qkv.interop.ctranslate2 import import_ctranslate2

        import_ctranslate2()
    compiled = getattr(args, "compile", False)
    if compiled and (args.int8 or ct2):
        raise QkvError("--compile compiles qkv's own float step: not with --int8 or --engine ctranslate2")
    if compiled and getattr(args, "workers", "auto") not in ("auto", 1):
        raise QkvError("--compile runs the search in one process: not with --workers above 1")
    model, tokenizer = load_ensemble(args.checkpoint, device=int8_device(args))
    if compiled:
        from qkv.model import incremental

        incremental.compile_steps(True)
    if model.device.type == "cpu":  # decoding frees and allocates vocabulary-sized scores every step (qkv.model.cpu)
        tune_allocator()
    if hasattr(args, "workers"):  # auto: now that the device is known (CTranslate2: its threads, in this process)
        args.workers = 1 if ct2 else resolve_workers(args, model.device)
    if ct2:  # qkv's float32 model: the tokenizer, the limits and the trust signals; CTranslate2 searches
        return model, tokenizer
    if args.int8:
        return int8_model(model, in_place=True), tokenizer  # the float model is dropped: no copy of it held
    return model.to(decoding_dtype(args, model.device)), tokenizer


def engine_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["qkv", "ctranslate2"], default="qkv",
                   help="what runs the search: qkv, or CTranslate2 on the checkpoint's export, made "
                        "once into qkv's cache and checked against qkv on the first sentences; with --int8, CTranslate2's "
                        "int8; --confidence is still read by qkv's own pass (docs/translation.md)")


def translator_of(args: argparse.Namespace, model, tokenizer, config, **kwargs):
    """The Translator of translate/evaluate: qkv's, or with ``--engine ctranslate2`` one whose search runs
    in CTranslate2 (``qkv.interop.ct2_engine``), its own threads in one process."""
    from qkv.infer.translator import Translator

    if getattr(args, "engine", "qkv") == "qkv":
        return Translator(model, tokenizer, config, **kwargs)
    from qkv.interop.ct2_engine import CTranslate2Translator, ensure_export

    if len(args.checkpoint) > 1:
        raise QkvError("--engine ctranslate2 translates with one checkpoint: an ensemble runs on --engine qkv")
    from qkv.interop.ct2_engine import CT2_BATCH_TOKENS

    ct2_dir, fresh = ensure_export(args.checkpoint[0])
    kwargs["workers"] = 1  # CTranslate2's threads, not qkv's processes
    if isinstance(kwargs.get("max_tokens"), DefaultTokens):  # no --batch-tokens: CTranslate2's own best budget
        kwargs["max_tokens"] = CT2_BATCH_TOKENS
    return CTranslate2Translator(model, tokenizer, config, ct2_dir=ct2_dir, compute_type="int8" if args.int8 else "float32",
                                 check=fresh, **kwargs)


def shortlist_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shortlist", action="store_true",
                   help="search each sentence over the target pieces its source makes likely (the checkpoint's "
                        "shortlist, added by qkv shortlist): faster beam search, an approximation (measured in docs/benchmarks.md)")


def decoding_shortlist(args: argparse.Namespace, model):
    """With ``--shortlist``: the first checkpoint's shortlist (an ensemble shares its vocabulary); else None.
    Call it after ``decoding_model``, whose load verified every file of the manifest, the shortlist's too."""
    if not getattr(args, "shortlist", False):
        return None
    from qkv.infer import shortlist
    from qkv.io import checkpoint

    first = checkpoint.resolve(args.checkpoint[0] if isinstance(args.checkpoint, list) else args.checkpoint)
    if not (first / checkpoint.SHORTLIST).is_file():
        raise QkvError(f"{first} has no shortlist: add one with qkv shortlist --checkpoint {first}")
    return shortlist.load(first / checkpoint.SHORTLIST, src_vocab=model.config.src_vocab_size, tgt_vocab=model.config.tgt_vocab_size)


def decode_config(args: argparse.Namespace, n_best: int = 1):
    from qkv.infer.search import DecodeConfig

    sampling = {k: getattr(args, k) for k in ("sampling", "temperature", "top_k", "top_p", "seed") if hasattr(args, k)}
    alpha = args.length_penalty
    if alpha is None:  # the checkpoint's (an ensemble: the first's), else DecodeConfig's
        from qkv.io import checkpoint

        first = args.checkpoint[0] if isinstance(args.checkpoint, list) else args.checkpoint
        alpha = checkpoint.decode_defaults(checkpoint.read_config(first)).get("length_penalty", DecodeConfig.length_penalty)
    return DecodeConfig(
        beam_size=args.beam, length_penalty=alpha, max_len_a=args.max_len_a,
        max_len_b=args.max_len_b, n_best=n_best, stop_early=args.stop_early, loop_guard=getattr(args, "loop_guard", 0),
        no_repeat_ngram_size=getattr(args, "no_repeat_ngram", 0), **sampling,
    )

