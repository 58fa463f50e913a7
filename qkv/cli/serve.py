"""``qkv serve``: the HTTP server's command line (``qkv.serve.app``)."""

from __future__ import annotations

import argparse

from qkv.cli.common import LOOP_GUARD, bf16_arg, decoding_dtype, device_of, device_arg, command


def _serve_args(p: argparse.ArgumentParser) -> None:
    device_arg(p)
    # The defaults are qkv.serve.app.DEFAULT_LIMITS, written out so that parsing does not import the server
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
        help="decoding work per request and per batch, in decoder steps of one token: source tokens, plus the most output tokens x their cost (the beam size for beam search), plus attention, summed over texts (docs/serving.md; default 20000)",
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
    bf16_arg(p)
    p.add_argument("--engine", choices=["qkv", "ctranslate2"], default="qkv",
                   help="what runs the search: qkv, or CTranslate2 on the checkpoint's export (as qkv translate's; beam and "
                        "greedy search only, no n_best above 1 or sampling); confidence and attention are read by qkv")
    p.add_argument("--searches", type=int, default=None, metavar="N",
                   help="batches searched at once, each in its own thread (default: on the CPU, 2 where there are 2 or more "
                        "threads, qkv's search then running each on half of them; on a GPU, 1)")
    p.add_argument("--batching", choices=["batches", "continuous"], default="batches",
                   help="on qkv's engine, how beam searches without a glossary are grouped: batches (the default), or "
                        "continuous: a sentence joins the running search at its next step and leaves when done (no "
                        "faster on 2 CPU cores: docs/serving.md)")
    p.add_argument("--loop-guard", type=int, default=LOOP_GUARD, metavar="N",
                   help=f"as qkv translate's: a sentence whose output loops is searched again with no repeated N-gram of "
                        f"tokens; 0: off, the exact search (default {LOOP_GUARD}, chosen on val: docs/robustness.md)")


@command("serve", "serve translations over HTTP: JSON API with dynamic batching, docs and an attention page", _serve_args)
def serve_command(args: argparse.Namespace) -> int:
    from qkv.serve.app import DEFAULT_LIMITS, serve

    device = device_of(args)
    serve(
        args.checkpoint, host=args.host, port=args.port, log_level=args.log_level, device=device,
        dtype=decoding_dtype(args, device), loop_guard=args.loop_guard, engine=args.engine, searches=args.searches, batching=args.batching,
        graceful_timeout=args.graceful_timeout, **{name: getattr(args, name) for name in DEFAULT_LIMITS},
    )
    return 0

