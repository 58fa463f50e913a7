"""A scripted hostile client for ``qkv serve``: oversized bodies, the largest requests the limits allow,
and a flood of clients that hang up, while polite clients and a ``/health`` probe measure the damage.

    python benchmarks/hostile_client.py --checkpoint runs/en-de/final     # starts and stops a server
    python benchmarks/hostile_client.py --url http://127.0.0.1:8000       # a server already running

Prints what each attack got back and how long it took, /health latency percentiles during the run,
the polite clients' results and the server's counters. Only loopback addresses are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import ServerProcess, check_loopback, percentile  # noqa: E402

SENTENCE = "Le 14 juillet 1989, un homme en chemise bleue est monté sur une échelle."
POLITE = ["9 mai 2017", "3. Oktober 1990", "le 14 juillet 1989", "Tuesday, 9th of May 2017"]


def _address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def _status(sock: socket.socket, timeout: float) -> int | None:
    """The status code of the response on ``sock``, or None if the server closed without one."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    # A 100 Continue may come first; the final status is the last status line received so far.
    lines = [line for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    return int(lines[-1].split()[1]) if lines and lines[-1].split()[1] != b"100" else None


def oversized_declared(url: str, declared: int = 1 << 30, timeout: float = 10.0) -> tuple[int | None, float]:
    """Declare a 1 GiB body, send 64 KiB of it, and read the answer: (status, seconds)."""
    head = (
        f"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    with socket.create_connection(_address(url)) as sock:
        sock.sendall(head + b'{"texts": ["' + b"a" * 65536)
        return _status(sock, timeout), time.perf_counter() - started


def oversized_chunked(url: str, total: int = 64 << 20, chunk: int = 1 << 16, timeout: float = 10.0) -> tuple[int | None, float, int]:
    """Stream a chunked body of up to ``total`` bytes until the server answers: (status, seconds, bytes sent)."""
    head = b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = f"{chunk:x}\r\n".encode() + b"a" * chunk + b"\r\n"
    sent, started = 0, time.perf_counter()
    with socket.create_connection(_address(url), timeout=timeout) as sock:
        sock.sendall(head)
        while sent < total and not select.select([sock], [], [], 0)[0]:  # until the server answers or closes
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):  # it stopped reading
                break
            sent += chunk
        return _status(sock, timeout), time.perf_counter() - started, sent


async def largest_accepted(http: httpx.AsyncClient, url: str, candidates: list[dict]) -> tuple[dict, httpx.Response]:
    """Send candidates, largest first, until one is not refused with 422: the largest request the limits
    allow (refusals cost the server only a tokenization)."""
    for body in candidates:
        response = await http.post(f"{url}/v1/translate", json=body)
        if response.status_code != 422:
            return body, response
    raise RuntimeError("the server refused every candidate request")


def work_candidates(limits: dict, max_output: int) -> list[dict]:
    """Two long texts at beam 16 with max_length as large as --max-request-work allows, then smaller.
    The server charges each text's source tokens too (at most ``max_output`` + 1 of them, EOS
    included): room is left for them."""
    text = (SENTENCE + " ") * (limits["max_chars"] // (len(SENTENCE) + 1))
    length = min(max_output, (limits["max_request_work"] - 2 * (max_output + 1)) // (16 * 2))
    return [{"texts": [text, text], "beam_size": 16, "max_length": max(1, length - k)} for k in range(0, length, max(1, length // 20))]


def attention_candidates(limits: dict) -> list[dict]:
    """Long texts with attention at beam 16: as many and as long as the limits allow."""
    out = []
    for chars in (limits["max_chars"], limits["max_chars"] // 2, limits["max_chars"] // 4, 100, 30):
        text = (SENTENCE + " ") * max(1, chars // (len(SENTENCE) + 1))
        out += [{"texts": [text] * n, "beam_size": 16, "attention": True} for n in range(min(limits["max_texts"], 8), 0, -1)]
    return out


def flood(url: str, body: dict, n: int, linger: float) -> None:
    """``n`` clients send ``body`` and hang up after ``linger`` seconds, without reading an answer."""
    data = json.dumps(body).encode()
    head = f"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"

    def one() -> None:
        with socket.create_connection(_address(url)) as sock:
            sock.sendall(head.encode() + data)
            time.sleep(linger)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


async def probe_health(url: str, stop: asyncio.Event, latencies: list[float], failures: list[str]) -> None:
    """GET /health every 20 ms (one at a time) until ``stop``; record each latency."""
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                response = await http.get(f"{url}/health")
                if response.status_code != 200:
                    failures.append(f"HTTP {response.status_code}")
            except httpx.HTTPError as error:
                failures.append(f"{type(error).__name__}: {error}")
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)


async def run_hostile(url: str, *, flood_clients: int = 20, polite_clients: int = 8, linger: float = 0.5) -> dict:
    """The whole attack; returns what each part got back, /health latencies and the server's counters."""
    check_loopback(url)
    result: dict = {}
    async with httpx.AsyncClient(timeout=120) as http:
        before = (await http.get(f"{url}/v1/stats")).json()
        limits = before["limits"]
        max_output = (await http.get(f"{url}/v1/model")).json()["max_len"] - 1
        stop, latencies, failures = asyncio.Event(), [], []
        probe = asyncio.create_task(probe_health(url, stop, latencies, failures))

        result["declared_1GiB"] = await asyncio.to_thread(oversized_declared, url)
        result["chunked"] = await asyncio.to_thread(oversized_chunked, url)

        started = time.perf_counter()
        heavy = [
            asyncio.create_task(largest_accepted(http, url, work_candidates(limits, max_output))),
            asyncio.create_task(largest_accepted(http, url, attention_candidates(limits))),
        ]
        # The two largest requests are in the queue before the flood (waiting on the server's counter,
        # not a sleep: on a busy machine finding the largest accepted size takes longer).
        deadline = time.perf_counter() + 60
        while (await http.get(f"{url}/v1/stats")).json()["requests"] < before["requests"] + 2 and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
        flood_body = work_candidates(limits, max_output)[0]
        flooding = asyncio.create_task(asyncio.to_thread(flood, url, flood_body, flood_clients, linger))
        await asyncio.sleep(linger + 0.3)  # the flood has hung up

        async def polite(text: str) -> tuple[int, float]:
            t = time.perf_counter()
            response = await http.post(f"{url}/v1/translate", json={"texts": [text], "beam_size": 4})
            ok = response.status_code == 200 and len(response.json()["translations"]) == 1
            return (response.status_code if ok else -response.status_code), time.perf_counter() - t

        polite_results = await asyncio.gather(*[polite(POLITE[i % len(POLITE)]) for i in range(polite_clients)])
        heavy_results = await asyncio.gather(*heavy)
        await flooding
        stop.set()
        await probe
        after = (await http.get(f"{url}/v1/stats")).json()

    (work_body, work_response), (attention_body, attention_response) = heavy_results
    result["work_request"] = {
        "status": work_response.status_code, "body": {**work_body, "texts": f"{len(work_body['texts'])} texts"},
    }
    result["attention_request"] = {
        "status": attention_response.status_code,
        "bytes": len(attention_response.content),
        "texts": len(attention_body["texts"]),
        "chars": len(attention_body["texts"][0]),
    }
    result["polite"] = [{"status": s, "seconds": round(t, 3)} for s, t in polite_results]
    result["seconds"] = time.perf_counter() - started
    result["health"] = {
        "n": len(latencies), "failures": failures,
        "p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99), "max_ms": 1000 * max(latencies),
    }
    counters = ("requests", "rejected", "cancelled", "timed_out", "failed", "aborted_batches", "batches", "sentences")
    result["server"] = {k: after[k] - before[k] for k in counters}
    result["flood_clients"], result["polite_clients"] = flood_clients, polite_clients
    return result


def format_report(r: dict) -> str:
    h = r["health"]
    return "\n".join([
        f"1 GiB declared body: HTTP {r['declared_1GiB'][0]} after {1000 * r['declared_1GiB'][1]:.0f} ms",
        f"chunked body: HTTP {r['chunked'][0]} after {1000 * r['chunked'][1]:.0f} ms ({r['chunked'][2] >> 10} KiB written to the socket by then)",
        f"largest work request: HTTP {r['work_request']['status']} {r['work_request']['body']}",
        f"largest attention request: HTTP {r['attention_request']['status']}, {r['attention_request']['texts']} texts of "
        f"{r['attention_request']['chars']} characters, {r['attention_request']['bytes']} bytes",
        f"polite clients: {[p['status'] for p in r['polite']]}, slowest {max(p['seconds'] for p in r['polite']):.2f}s",
        f"/health during {r['seconds']:.1f}s: {h['n']} probes, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, "
        f"max {h['max_ms']:.1f} ms, failures {len(h['failures'])}",
        f"server counters: {r['server']} ({r['flood_clients']} flood clients hung up)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--checkpoint", help="start `qkv serve` on this checkpoint for the run, then stop it")
    p.add_argument("--flood", type=int, default=20, help="clients that send the largest request and hang up")
    p.add_argument("--polite", type=int, default=8, help="well-behaved clients sending one short request each")
    p.add_argument("--server-args", default="", help="extra `qkv serve` flags with --checkpoint")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    kwargs = dict(flood_clients=args.flood, polite_clients=args.polite)
    if args.url:
        result = asyncio.run(run_hostile(args.url.rstrip("/"), **kwargs))
    else:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"qkv-hostile-{os.getpid()}.log"
        with ServerProcess(args.checkpoint, *args.server_args.split(), "--log-level", "warning", log_path=log) as server:
            result = asyncio.run(run_hostile(server.url, **kwargs))
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    healthy = not result["health"]["failures"] and all(p["status"] == 200 for p in result["polite"])
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
