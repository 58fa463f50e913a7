"""The ``qkv`` commands that look inside a model: doctor, explain, score, align, attend and demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkv.errors import QkvError
from qkv.cli.common import bf16_arg, decode_args, decode_config, device_of, device_arg, command


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="also check decoding on this model: greedy == beam 1, batch invariance")
    device_arg(p)
    p.add_argument(
        "--resume", action="store_true",
        help="also prove resume is exact here: kill a tiny training run with SIGKILL, resume it, compare bitwise (~1 min)",
    )


@command("doctor", "self-checks of the attention mechanism and the model on this install", _doctor_args)
def doctor(args: argparse.Namespace) -> int:
    from qkv.inspect.doctor import check_resume_exactness, checkpoint_checks, run_checks

    from qkv.model.devices import describe

    device = device_of(args)
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



def _explain_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--json", metavar="FILE", help='inputs {"q": [[..]], "k": [[..]], "v": [[..]], "mask": ..}')
    source.add_argument("--random", action="store_true", help="seeded random inputs sized by --m --n --d-k --d-v")
    p.add_argument("--m", type=int, help="with --random: number of queries (default 2)")
    p.add_argument("--n", type=int, help="with --random: number of keys and values (default 3)")
    p.add_argument("--d-k", type=int, help="with --random: query/key width (default 4)")
    p.add_argument("--d-v", type=int, help="with --random: value width (default 2)")
    p.add_argument("--mask", help="'causal', a keep pattern over the keys such as 1,1,0, or a JSON m x n matrix")
    p.add_argument("--heads", type=int, help="also show multi-head attention with this many heads")
    p.add_argument("--head-d-k", type=int, help="per-head query/key width (default ceil(d_model / heads))")
    p.add_argument("--head-d-v", type=int, help="per-head value width (default: the per-head d_k)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random inputs and the projections")
    p.add_argument("--precision", type=int, default=4, help="decimals printed (default 4)")


@command("explain", "attention step by step on concrete numbers (default: the tutorials' example)", _explain_args)
def explain_command(args: argparse.Namespace) -> int:
    from qkv.inspect.explain import WORKED_EXAMPLE, explain, format_explanation, load_inputs, random_inputs

    sizes = {"m": args.m, "n": args.n, "d_k": args.d_k, "d_v": args.d_v}
    if not args.random and any(size is not None for size in sizes.values()):
        raise QkvError("--m, --n, --d-k and --d-v set the sizes of --random inputs; add --random")
    mask = None
    if args.json:
        q, k, v, mask = load_inputs(args.json)
    elif args.random:
        defaults = {"m": 2, "n": 3, "d_k": 4, "d_v": 2}
        sizes = {key: defaults[key] if size is None else size for key, size in sizes.items()}
        q, k, v = random_inputs(**sizes, seed=args.seed)
    else:
        q, k, v = WORKED_EXAMPLE["q"], WORKED_EXAMPLE["k"], WORKED_EXAMPLE["v"]
    if args.mask is not None:
        mask = args.mask  # the command line overrides a mask in the JSON file
    expl = explain(
        q, k, v, mask=mask, heads=args.heads, head_d_k=args.head_d_k, head_d_v=args.head_d_v, seed=args.seed
    )
    print(format_explanation(expl, precision=args.precision))
    return 0

def _score_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/)")
    p.add_argument("--input", "-i", required=True, help="source sentences, one per line")
    p.add_argument("--reference", "-r", required=True, help="the target sentences to score, line by line")
    p.add_argument("--output", "-o", help="write the scores to this file (default: stdout)")
    p.add_argument("--tokens", action="store_true", help="also each target token's log-probability, and the tokens")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output file that qkv wrote")
    bf16_arg(p)
    p.add_argument("--confidence", action="store_true",
                   help="instead of the scores, whether to trust each given translation (from qkv, another engine or a "
                        "person): one JSON object a line with confidence, flags, features and per-word marks (docs/trust.md)")


@command("score", "forced decoding: the model's log-probability of given translations, and perplexity", _score_args)
def score_command(args: argparse.Namespace) -> int:
    from qkv.io import checkpoint
    from qkv.data.corpus import read_parallel
    from qkv.io.outputs import check_output, output_or_stdout, read_dirs
    from qkv.infer.score import perplexity, score_pairs

    inputs, reads = (args.input, args.reference), read_dirs([args.checkpoint])
    if args.output:
        check_output(args.output, force=args.force, inputs=inputs, reads=reads)
    loaded = checkpoint.load(args.checkpoint)
    pairs = read_parallel(args.input, args.reference, keep_empty=True)  # line N in is line N out
    if args.confidence:
        from qkv.inspect.trust import assess, calibration_of

        if args.tokens:
            raise QkvError("--tokens goes with the scores, not with --confidence (its JSON has per-word marks)")
        from qkv.cli.trust import say_uncalibrated

        calibration = calibration_of(loaded.path)
        say_uncalibrated(loaded.path, calibration)  # as qkv translate --confidence says it
        trusts = assess(loaded.model, loaded.tokenizer, pairs.src, pairs.tgt, calibration=calibration)
        with output_or_stdout(args.output, force=args.force, inputs=inputs, reads=reads) as sink:
            sink.writelines(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in trusts)
        flagged = sum(bool(t.flags) for t in trusts)
        print(f"judged {len(trusts)} pairs: {flagged} flagged", file=sys.stderr)
        return 0
    if args.bf16:  # the confidence above reads the float32 model's internals
        from qkv.cli.common import decoding_dtype

        loaded.model.to(decoding_dtype(args, loaded.model.device))
    scores = score_pairs(loaded.model, loaded.tokenizer, pairs.src, pairs.tgt, max_tokens=args.batch_tokens)
    with output_or_stdout(args.output, force=args.force, inputs=inputs, reads=reads) as sink:
        sink.writelines(s.line(tokens=args.tokens) + "\n" for s in scores)
    tokens = sum(s.n_tokens for s in scores)
    print(f"scored {len(scores)} pairs, {tokens} target tokens (EOS included): perplexity {perplexity(scores):.3f}", file=sys.stderr)
    return 0


def _align_args(p: argparse.ArgumentParser) -> None:
    decode_args(p, batch_tokens="padded tokens per batch of the alignment pass, each pair counting the longer of its "
                                 "source and target (default 2048); without -r, the translations are batched as "
                                 "qkv translate's default")
    p.add_argument("--input", "-i", required=True, help="source sentences, one per line")
    p.add_argument("--reference", "-r", help="target sentences to align with (default: the model's own translations)")
    p.add_argument("--output", "-o", help="write the alignments to this file (default: stdout)")
    p.add_argument("--method", choices=["attention", "norm", "alti", "eflomal"],
                   help="what aligns: the cross-attention weights, the norms of what each source token adds, "
                        "ALTI+ contributions rolled out through the model (default: a model trained with guided "
                        "alignment is read at its alignment head; any other by value norms), or eflomal, the "
                        "statistical aligner, run on the given pairs alone (words; the more pairs, the better it aligns)")
    p.add_argument("--read", choices=["input", "predict"], default="predict",
                   help="read a target word where it is predicted (default) or where it is the decoder's input")
    p.add_argument("--link", choices=["target", "source"],
                   help="which side chooses: each target word its best source word, or each source word the target word "
                        "that attends to it most (default: source for a model trained with guided alignment, else target)")
    p.add_argument("--layer", type=int, help="decoder layer, 1-based (default: the alignment head's; else the middle "
                                              "one, n // 2 of n; 1 of 1)")
    p.add_argument("--head", type=int, help="one head, 1-based (default: the alignment head; else the mean of the heads; "
                                             "not with --method alti)")
    p.add_argument("--pieces", action="store_true", help="align subword pieces (indices of the SentencePiece pieces, "
                                                        "EOS left out) instead of whitespace words")
    p.add_argument("--gold", help="a gold alignment file (one line a pair, i-j sure and ipj possible links, "
                                  "1-based, source first): print the alignment error rate to stderr")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output file that qkv wrote")


@command("align", "word alignments (cross-attention weights, value norms or ALTI+), one line per sentence pair, in the Pharaoh format", _align_args)
def align_command(args: argparse.Namespace) -> int:
    from qkv.io import checkpoint
    from qkv.inspect.align import align, alignment_error_rate, check_gold, pharaoh, read_gold
    from qkv.data.corpus import read_lines, read_parallel
    from qkv.io.outputs import check_output, output_or_stdout, read_dirs

    if args.gold and (not args.reference or args.pieces):  # gold links are words of the given references
        raise QkvError("--gold scores word alignments of the references it annotates: give -r, and not --pieces")
    inputs, reads = (args.input, args.reference, args.gold), read_dirs([args.checkpoint])
    if args.output:
        check_output(args.output, force=args.force, inputs=inputs, reads=reads)
    loaded = checkpoint.load(args.checkpoint)
    cfg = loaded.model.config
    if args.layer is not None and (not 1 <= abs(args.layer) <= cfg.n_decoder_layers or args.layer == 0):
        raise QkvError(f"--layer must be between 1 and {cfg.n_decoder_layers}")
    if args.head is not None and not 1 <= args.head <= cfg.n_heads:
        raise QkvError(f"--head must be between 1 and {cfg.n_heads}")
    if args.reference:
        pairs = read_parallel(args.input, args.reference, keep_empty=True)  # line N in is line N out
        sources, targets = pairs.src, pairs.tgt
    else:
        sources, targets = read_lines(Path(args.input)), None
    gold = read_gold(args.gold) if args.gold else None  # a malformed gold file fails before the work
    if gold is not None and len(gold) != len(sources):
        raise QkvError(f"--gold has {len(gold)} lines but --input {len(sources)}: one gold line per pair")
    if gold is not None:
        check_gold(gold, sources, targets, args.gold)
    layer = None if args.layer is None else args.layer - 1 if args.layer > 0 else args.layer
    if args.method == "eflomal":
        if args.pieces or args.layer is not None or args.head is not None or args.link is not None:
            raise QkvError("--method eflomal aligns words with a statistical aligner: not with --pieces, --layer, --head or --link")
        from qkv.train.alignment import align_words_eflomal

        if targets is None:  # the model's own translations, as the other methods align
            from qkv.infer.translator import Translator

            targets = Translator(loaded.model, loaded.tokenizer, decode_config(args)).translate(sources)
        alignments = align_words_eflomal(sources, targets)
    else:
        alignments = None
    alignments = alignments if alignments is not None else align(
        loaded.model, loaded.tokenizer, sources, targets, layer=layer, method=args.method, row=args.read,
        head=None if args.head is None else args.head - 1, config=decode_config(args),
        max_tokens=args.batch_tokens, pieces=args.pieces, link=args.link,
    )
    with output_or_stdout(args.output, force=args.force, inputs=inputs, reads=reads) as sink:
        sink.writelines(pharaoh(a) + "\n" for a in alignments)
    if gold is not None:
        rate = alignment_error_rate(alignments, gold)
        print(f"AER {100 * rate['aer']:.1f} (precision {100 * rate['precision']:.1f}, recall {100 * rate['recall']:.1f}) "
              f"on {len(gold)} pairs", file=sys.stderr)
    return 0


def _attend_args(p: argparse.ArgumentParser) -> None:
    decode_args(p, batch_tokens=None)  # one sentence: no batches
    device_arg(p)
    p.add_argument("sentence", help="the source sentence to translate and inspect")
    p.add_argument("--kind", choices=["cross", "enc-self", "dec-self", "norm", "alti"], default="cross",
                   help="what to draw: attention weights (cross, enc-self, dec-self), or what each source token "
                        "contributed to each prediction (norm: value norms; alti: ALTI+, the source's share); "
                        "the HTML page holds them all")
    p.add_argument("--layer", type=int, default=-1, help="layer to draw, 1-based (default: the last)")
    p.add_argument("--head", type=int, help="draw only this head, 1-based like --layer (default: every head and their average)")
    p.add_argument("--out", default="attention", help="output path without extension: writes OUT.png and OUT.html")
    p.add_argument("--json", help="also write every layer's and head's weights, with the tokens, to this JSON file")
    p.add_argument("--trace", metavar="TRACE", help="also write the beam search, step by step: TRACE.png, TRACE.html, TRACE.json")
    p.add_argument("--force", action="store_true", help="overwrite existing OUT.png, OUT.html, --json and --trace files that qkv wrote")


@command("attend", "translate a sentence and draw its attention (PNG and interactive HTML), with a word alignment", _attend_args)
def attend(args: argparse.Namespace) -> int:
    from qkv.io import checkpoint
    from qkv.io.outputs import check_output, output_file, read_dirs
    from qkv.inspect.align import default_reading
    from qkv.inspect.trust import assess, calibration_of
    from qkv.inspect.visualize import align_words, capture_attention, group_words, plot_attention, write_html

    if args.trace and Path(args.trace).resolve() == Path(args.out).resolve():
        raise QkvError("--trace and --out name the same files (OUT.png, OUT.html): give them different names")
    reads = read_dirs([args.checkpoint])
    for path in (f"{args.out}.png", f"{args.out}.html", args.json, *trace_paths(args.trace)):
        if path:
            check_output(path, force=args.force, reads=reads)
    loaded = checkpoint.load(args.checkpoint, device=device_of(args))
    capture = capture_attention(loaded.model, loaded.tokenizer, args.sentence, decode_config(args), contributions=True)
    n_layers = capture.weights(args.kind).size(0)
    layer = args.layer - 1 if args.layer > 0 else args.layer
    if not -n_layers <= layer < n_layers:
        raise QkvError(f"--layer must be between 1 and {n_layers}")
    n_heads = capture.cross.size(1)
    if args.head is not None and not 1 <= args.head <= n_heads:
        raise QkvError(f"--head must be between 1 and {n_heads}")
    head = None if args.head is None else args.head - 1
    png = plot_attention(capture, f"{args.out}.png", kind=args.kind, layer=layer, head=head)
    page = write_html(capture, f"{args.out}.html", kind=args.kind, layer=layer)
    if args.json:
        with output_file(args.json, force=args.force) as handle:
            json.dump(capture.to_json(), handle)
    (trust,) = assess(loaded.model, loaded.tokenizer, [capture.source], [capture.translation],
                      calibration=calibration_of(loaded.path))
    print(f"source:      {capture.source}")
    print(f"translation: {capture.translation}")
    print(f"confidence:  {trust.confidence:.2f} (0 to 1, higher is more trustworthy); flags: {', '.join(trust.flags) or 'none'}")
    for flag, why in trust.why.items():
        print(f"  {flag}: {why}")
    method, at, head_at = default_reading(loaded.model.config)
    scores = capture.alignment if method == "attention" else capture.norms[at, 0]  # (T, S)
    reading = (f"the alignment head (layer {at + 1}, head {head_at + 1})" if method == "attention"
               else f"value-norm contributions at decoder layer {at + 1}")
    print(f"word alignment ({reading}, as qkv align), and how much of "
          "each word came from the source (ALTI+; ! marks a word not to trust):")
    src_words = [w for w, _ in group_words(capture.src_tokens) if w != "</s>"]
    tgt_words = [w for w, _ in group_words(capture.tgt_tokens) if w != "</s>"]
    for (i, j, weight), word in zip(align_words(scores, capture.src_tokens, capture.tgt_tokens), trust.words):
        mark = "!" if word["marked"] else " "
        print(f"  {tgt_words[j]:>20}  <-  {src_words[i]:<20} {weight:.2f}   from source {word['source']:.2f} {mark}")
    if trust.unused_words:
        print(f"source words no target word used: {', '.join(src_words[i] for i in trust.unused_words if i < len(src_words))}")
    print(f"wrote {png} and {page}")
    if args.trace:
        print(f"beam trace: {', '.join(map(str, write_trace(loaded.model, loaded.tokenizer, args.sentence, decode_config(args), args.trace, force=args.force)))}")
    return 0


def trace_paths(trace: str | None) -> list[str]:
    return [f"{trace}.{ext}" for ext in ("png", "html", "json")] if trace else []


def write_trace(model, tokenizer, sentence: str, config, trace: str, *, force: bool) -> list[Path]:
    """``--trace TRACE``: the beam search of ``sentence``, step by step, as TRACE.png/.html/.json."""
    from qkv.inspect.beam_trace import draw_trace, trace_beam, trace_html
    from qkv.io.outputs import output_file

    result = trace_beam(model, tokenizer, sentence, config)
    png, page, data = trace_paths(trace)
    draw_trace(result, png)
    for path, text in ((page, trace_html(result)), (data, result.to_json())):
        with output_file(path, force=force) as handle:
            handle.write(text)
    return [Path(png), Path(page), Path(data)]


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="where the demo model and pictures go (reused next time)")
    p.add_argument("--retrain", action="store_true", help="train again even if a demo model exists")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")


@command("demo", "learn to read dates in many formats and languages, then show the attention (no download)", _demo_args)
def demo(args: argparse.Namespace) -> int:
    from qkv.inspect.demo import run_demo

    if not args.retrain and not (Path(args.out) / "final").exists():
        print(f"training a small Transformer on generated dates (about a minute) -> {args.out}", file=sys.stderr)
    result = run_demo(args.out, retrain=args.retrain, seed=args.seed, progress=not args.no_progress)
    how = f"trained in {result.train_seconds:.0f}s" if result.trained else "reused the cached model; --retrain to train again"
    print(f"dates model: {result.run_dir / 'final'} ({how})")
    for source, output in result.examples:
        print(f"  {source:>28}  ->  {output}")
    print(f"exact match on {result.n_test} held-out dates: {100 * result.accuracy:.1f}%")
    print(f"where each output piece looked, for {result.examples[0][0]!r} (last layer, heads averaged):")
    for tgt_piece, src_piece, weight in result.alignment:
        print(f"  {tgt_piece:>4}  <-  {src_piece:<10} {weight:.2f}")
    print(f"attention picture: {result.picture}  (interactive: {result.page})")
    return 0
