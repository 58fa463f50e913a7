"""A bounded load test of ``qkv serve`` on this machine: concurrent clients, each sending a fixed
number of requests one after another. Prints throughput, latency percentiles, errors, and the mean
batch size the server formed (from ``GET /v1/stats``), which shows whether dynamic batching batched.

    python benchmarks/load_test.py --checkpoint runs/en-de/final        # starts and stops a server
    python benchmarks/load_test.py --url http://127.0.0.1:8000          # a server already running
    python benchmarks/load_test.py --checkpoint DIR --clients 8 --requests 5 --beam 1

It stops by itself: every client sends exactly --requests requests, and the whole run is cut at
--max-seconds. Only loopback addresses are accepted as targets.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two young girls are playing in the sand.",
    "A dog runs through the snow.",
    "People are walking down a busy street.",
    "A woman is reading a book in the park.",
    "A group of men are playing soccer on a field.",
    "A child in a red jacket rides a bicycle.",
    "The chef is cooking dinner in a small kitchen.",
    "Tuesday, 9th of May 2017",
    "le 14 juillet 1989",
    "3. Oktober 1990",
    "A little boy is jumping into a swimming pool.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"refusing to load-test {host!r}: this test only targets this machine (127.0.0.1)")


class ServerProcess:
    """``python -m qkv serve`` in a child process on a free loopback port; a context manager.

    ``prelude`` is Python run in the child before the server starts (tests use it to slow the model)."""

    def __init__(self, checkpoint: str | Path, *args: str, log_path: str | Path | None = None, prelude: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        serve = ["serve", "--checkpoint", str(checkpoint), "--port", str(self.port), *args]
        if prelude is None:
            self.command = [sys.executable, "-m", "qkv", *serve]
        else:
            code = f"{prelude}\nimport sys\nfrom qkv.cli.main import main\nsys.exit(main(sys.argv[1:]))"
            self.command = [sys.executable, "-c", code, *serve]
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServerProcess:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f}s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def _client(http: httpx.AsyncClient, url: str, index: int, n_requests: int, texts_per_request: int, beam: int,
                  sentences: list[str], latencies: list[float], errors: list[str]) -> None:
    for r in range(n_requests):
        start = (index * n_requests + r) * texts_per_request
        texts = [sentences[(start + k) % len(sentences)] for k in range(texts_per_request)]
        started = time.perf_counter()
        try:
            response = await http.post(f"{url}/v1/translate", json={"texts": texts, "beam_size": beam})
            if response.status_code != 200:
                errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
            elif len(response.json()["translations"]) != len(texts):
                errors.append("wrong number of translations")
            else:
                latencies.append(time.perf_counter() - started)
        except httpx.HTTPError as error:
            errors.append(f"{type(error).__name__}: {error}")


async def run_load(
    url: str,
    *,
    clients: int = 32,
    requests: int = 20,
    texts_per_request: int = 1,
    beam: int = 5,
    sentences: list[str] | None = None,
    timeout: float = 120.0,
    max_seconds: float = 600.0,
) -> dict:
    """Send clients x requests requests (each client waits for its answer before the next) and
    return throughput, latency percentiles, errors and the server's batch sizes during the run."""
    check_loopback(url)
    sentences = sentences or SENTENCES
    latencies: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        before = (await http.get(f"{url}/v1/stats")).json()
        started = time.perf_counter()
        tasks = [
            _client(http, url, i, requests, texts_per_request, beam, sentences, latencies, errors)
            for i in range(clients)
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), max_seconds)
        except asyncio.TimeoutError:
            errors.append(f"stopped after --max-seconds {max_seconds:.0f}")
        seconds = time.perf_counter() - started
        after = (await http.get(f"{url}/v1/stats")).json()
    batches = after["batches"] - before["batches"]
    sentences_done = after["sentences"] - before["sentences"]
    return {
        "clients": clients,
        "requests": clients * requests,
        "ok": len(latencies),
        "errors": len(errors),
        "error_examples": errors[:5],
        "seconds": seconds,
        "requests_per_second": len(latencies) / seconds if seconds else 0.0,
        "sentences_per_second": len(latencies) * texts_per_request / seconds if seconds else 0.0,
        "p50_ms": 1000 * percentile(latencies, 50) if latencies else None,
        "p99_ms": 1000 * percentile(latencies, 99) if latencies else None,
        "max_ms": 1000 * max(latencies) if latencies else None,
        "batches": batches,
        "mean_batch_size": sentences_done / batches if batches else 0.0,
        "rejected_503": after["rejected"] - before["rejected"],
    }


def format_report(result: dict) -> str:
    lines = [
        f"{result['requests']} requests from {result['clients']} concurrent clients in {result['seconds']:.1f}s",
        f"  ok {result['ok']}, errors {result['errors']} (503 rejections {result['rejected_503']})",
        f"  throughput {result['requests_per_second']:.1f} requests/s ({result['sentences_per_second']:.1f} sentences/s)",
    ]
    if result["p50_ms"] is not None:
        lines.append(f"  latency p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms, max {result['max_ms']:.0f} ms")
    lines.append(f"  server batches {result['batches']}, mean batch size {result['mean_batch_size']:.2f} sentences")
    lines += [f"  error: {e}" for e in result["error_examples"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--checkpoint", help="start `qkv serve` on this checkpoint for the run, then stop it")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=20, help="requests per client")
    p.add_argument("--texts", type=int, default=1, help="sentences per request")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--input", help="sentences to send, one per line (default: a built-in list)")
    p.add_argument("--max-seconds", type=float, default=600, help="cut the whole run after this long")
    p.add_argument("--server-args", default="", help="extra `qkv serve` flags with --checkpoint, e.g. '--max-wait-ms 5'")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    sentences = None
    if args.input:
        sentences = [line.strip() for line in open(args.input, encoding="utf-8") if line.strip()]
    kwargs = dict(clients=args.clients, requests=args.requests, texts_per_request=args.texts, beam=args.beam,
                  sentences=sentences, max_seconds=args.max_seconds)
    if args.url:
        result = asyncio.run(run_load(args.url.rstrip("/"), **kwargs))
    else:
        server_args = [*args.server_args.split(), "--log-level", "warning"]
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"qkv-load-test-{os.getpid()}.log"
        with ServerProcess(args.checkpoint, *server_args, log_path=log) as server:
            result = asyncio.run(run_load(server.url, **kwargs))
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
