"""Dynamic batching for ``qkv serve``: a queue bounded by work, one worker, one model thread.

Requests wait in a queue; a single worker takes what has arrived (up to ``max_batch_sentences``
sentences, ``max_batch_tokens`` source tokens and ``max_batch_work`` units of work, waiting at most
``max_wait_ms`` for more), groups it by decoding settings and translates each group as one batch in a
worker thread. The answer is serialized to JSON in that thread too, never on the event loop.

Work is what a request asks the decoder for: for each non-empty text, beam size x the most output
tokens the search may produce for it (``qkv.decode.max_output_length``); an empty text counts 1. The
queue counts work, admitted and not yet answered, so a full queue means a bounded wait, not a long list.

A request whose client went away (or timed out) is dropped from the queue, and a batch nobody waits
for any more stops at its next decoding step (a hook on the model's output layer checks between steps).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from qkv.decode import DecodeConfig, max_output_length
from qkv.model import Transformer
from qkv.tokenizer import Tokenizer
from qkv.translate import Translator
from qkv.visualize import capture_attention

log = logging.getLogger("qkv.server")

# The decoding settings that must be equal for requests to share a batch: beam size, max length, attention.
Settings = tuple[int, int | None, bool]


class Busy(Exception):
    """The queue is full, or the server is shutting down: answer 503 with Retry-After."""


class Abandoned(Exception):
    """Raised inside the model between decoding steps: nobody waits for this batch any more."""


def decode_config(settings: Settings) -> DecodeConfig:
    beam_size, max_length, _ = settings
    if max_length is None:
        return DecodeConfig(beam_size=beam_size)
    return DecodeConfig(beam_size=beam_size, max_len_a=0.0, max_len_b=max_length)


@dataclass
class Job:
    """One request: its texts, their token ids, its settings, its cost and the future its handler awaits.
    The future's result is the response body, JSON bytes; a cancelled future means nobody waits."""

    texts: list[str]
    src_ids: list[list[int]]
    settings: Settings
    work: int
    future: asyncio.Future
    n_tokens: int = 0  # source tokens, each sentence's EOS included

    def __post_init__(self) -> None:
        self.n_tokens = sum(len(ids) + 1 for ids in self.src_ids)

    @property
    def abandoned(self) -> bool:
        # Read from the model thread too: a future's state is a plain attribute, safe to read there.
        return self.future.done()


@dataclass
class Stats:
    requests: int = 0  # accepted into the queue
    rejected: int = 0  # answered 503
    cancelled: int = 0  # the client went away before its answer
    timed_out: int = 0  # answered 504 after --request-timeout
    failed: int = 0  # answered 500 (the error is in the server log)
    aborted_batches: int = 0  # stopped before the end because nobody waited for them
    batches: int = 0
    sentences: int = 0
    batch_requests: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # sentences per batch -> how many batches

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "timed_out": self.timed_out,
            "failed": self.failed,
            "aborted_batches": self.aborted_batches,
            "batches": self.batches,
            "sentences": self.sentences,
            "mean_batch_size": self.sentences / self.batches if self.batches else 0.0,
            "mean_batch_requests": self.batch_requests / self.batches if self.batches else 0.0,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
        }


class Batcher:
    """The queue, the worker that forms batches from it, and the thread that runs the model."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        max_batch_sentences: int,
        max_batch_tokens: int,
        max_batch_work: int,
        max_wait_ms: float,
        max_queue: int,
        max_queue_work: int,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_sentences, self.max_batch_tokens = max_batch_sentences, max_batch_tokens
        self.max_batch_work = max_batch_work
        self.max_wait = max_wait_ms / 1000
        self.max_queue, self.max_queue_work = max_queue, max_queue_work
        self.stats = Stats()
        self.closing = False
        self.pending_requests = 0  # admitted and not yet answered (queued or being translated)
        self.pending_work = 0
        self._queue: asyncio.Queue[Job | None] | None = None
        self._held: Job | None = None  # taken from the queue but did not fit the last batch
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="qkv-translate")
        self._decoding: list[Job] = []  # the jobs the model thread works on now
        self._stop_all = False  # set at shutdown, once nobody can be waiting any more
        # The output layer runs once per decoding step: the place to notice that nobody waits.
        model.generator.register_forward_pre_hook(self._stop_if_abandoned)

    def _stop_if_abandoned(self, module: Any, args: Any) -> None:
        jobs = self._decoding
        if self._stop_all or (jobs and all(job.abandoned for job in jobs)):
            raise Abandoned

    # --- what a request costs -------------------------------------------------------------------

    def output_limits(self, src_ids: list[list[int]], settings: Settings) -> list[int]:
        """The most tokens the search may produce for each source (0 for an empty one: not searched)."""
        config = decode_config(settings)
        return [max_output_length(self.model, len(ids) + 1, config) if ids else 0 for ids in src_ids]

    def work(self, src_ids: list[list[int]], settings: Settings) -> int:
        """Decoder work: beam size x maximum output tokens, summed over texts; an empty text counts 1."""
        return sum(settings[0] * n if n else 1 for n in self.output_limits(src_ids, settings))

    def attention_weights(self, src_ids: list[list[int]], settings: Settings) -> int:
        """The most cross-attention weights the answer can hold: layers x heads x T x S, summed over texts."""
        c = self.model.config
        sizes = [(n + 1) * (len(ids) + 1) for n, ids in zip(self.output_limits(src_ids, settings), src_ids)]
        return c.n_decoder_layers * c.n_heads * sum(sizes)

    # --- the queue ------------------------------------------------------------------------------

    def start(self) -> None:
        # The queue is made here, inside the server's event loop.
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="qkv-batcher")

    async def close(self) -> None:
        """Stop the worker. The server calls this after its graceful period: every request has been
        answered or given up, so what is left in the queue or in the model has nobody waiting for it."""
        self.closing = True
        self._stop_all = True
        if self._task is not None:
            await self._queue.put(None)
            await self._task
        self._executor.shutdown(wait=True)

    def queue_depth(self) -> int:
        return self.pending_requests

    def submit(self, texts: list[str], src_ids: list[list[int]], settings: Settings, work: int) -> Job:
        if self.closing or self._queue is None:
            self.stats.rejected += 1
            raise Busy("the server is shutting down")
        if self.pending_requests >= self.max_queue or self.pending_work + work > self.max_queue_work:
            self.stats.rejected += 1
            raise Busy(
                f"the translation queue is full ({self.pending_requests} requests, {self.pending_work} units of "
                f"work waiting; limits {self.max_queue} and {self.max_queue_work})"
            )
        job = Job(texts, src_ids, settings, work, asyncio.get_running_loop().create_future())
        self.pending_requests += 1
        self.pending_work += work
        job.future.add_done_callback(lambda _: self._release(job))
        self._queue.put_nowait(job)
        self.stats.requests += 1
        return job

    def _release(self, job: Job) -> None:
        self.pending_requests -= 1
        self.pending_work -= job.work

    async def _next(self, timeout: float | None) -> Job | None:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return self._queue.get_nowait()  # raises QueueEmpty
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def _collect(self) -> tuple[list[Job], bool]:
        """The next batch: whatever arrives within max_wait of the first request, within the budgets.
        A request is never split; one larger than the budgets makes a batch on its own."""
        first = await self._next(None)
        if first is None:
            return [], True
        batch, sentences, tokens, work = [first], len(first.texts), first.n_tokens, first.work
        deadline = time.monotonic() + self.max_wait
        while sentences < self.max_batch_sentences and tokens < self.max_batch_tokens and work < self.max_batch_work:
            try:
                job = await self._next(max(deadline - time.monotonic(), 0.0))
            except (asyncio.TimeoutError, asyncio.QueueEmpty):  # the two differ on Python 3.10
                break
            if job is None:
                return batch, True
            if job.abandoned:  # its client went away while it waited: drop it, it takes no room
                continue
            if (
                sentences + len(job.texts) > self.max_batch_sentences
                or tokens + job.n_tokens > self.max_batch_tokens
                or work + job.work > self.max_batch_work
            ):
                self._held = job
                break
            batch.append(job)
            sentences, tokens, work = sentences + len(job.texts), tokens + job.n_tokens, work + job.work
        return batch, False

    async def _run(self) -> None:
        stopping = False
        while not stopping or self._held is not None:
            if stopping:  # the sentinel came while a request was held back: finish that one too
                batch = [self._held]
                self._held = None
            else:
                batch, stopping = await self._collect()
            groups: dict[Settings, list[Job]] = {}
            for job in batch:
                if not job.abandoned:  # a dropped request was counted by its handler
                    groups.setdefault(job.settings, []).append(job)
            for settings, jobs in groups.items():
                await self._translate(settings, jobs)

    async def _translate(self, settings: Settings, jobs: list[Job]) -> None:
        """One group in the model thread. If it fails, each request is retried alone, so that only the
        request that causes the failure fails; clients see a generic message, the log the traceback."""
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self.translate_group, settings, jobs)
        except Abandoned:
            self.stats.aborted_batches += 1
            for job in jobs:  # only at shutdown can someone still be waiting
                if not job.abandoned:
                    job.future.set_exception(Busy("the server is shutting down"))
            return
        except Exception:  # one failed batch must not stop the server
            if len(jobs) > 1:
                log.warning("a batch of %d requests failed; retrying them one at a time", len(jobs), exc_info=True)
                for job in jobs:
                    if not job.abandoned:
                        await self._translate(settings, [job])
                return
            log.exception("translation failed for a request of %d texts", len(jobs[0].texts))
            self.stats.failed += 1
            if not jobs[0].abandoned:
                jobs[0].future.set_exception(RuntimeError("translation failed"))
            return
        n = sum(len(job.texts) for job in jobs)
        self.stats.batches += 1
        self.stats.sentences += n
        self.stats.batch_requests += len(jobs)
        self.stats.batch_sizes[n] += 1
        for job, result in zip(jobs, results):
            if not job.abandoned:
                job.future.set_result(result)

    # --- the model thread -----------------------------------------------------------------------

    def translate_group(self, settings: Settings, jobs: list[Job]) -> list[bytes]:
        """Runs in the worker thread: one batch of requests with equal settings -> one JSON body each."""
        self._decoding = jobs
        try:
            return self._translate_group(settings, jobs)
        finally:
            self._decoding = []

    def _translate_group(self, settings: Settings, jobs: list[Job]) -> list[bytes]:
        config = decode_config(settings)
        if settings[2]:  # attention: captured one sentence at a time, the weights of exactly the returned output
            out = []
            for job in jobs:
                captures = []
                for text, ids in zip(job.texts, job.src_ids):
                    if job.abandoned:  # nobody waits: skip its remaining sentences
                        break
                    captures.append(self._capture_json(text, ids, config))
                translations = _compact([translation for translation, _ in captures])
                attention = ",".join(json_object for _, json_object in captures)
                out.append(f'{{"translations":{translations},"attention":[{attention}]}}'.encode("utf-8"))
            return out
        translator = Translator(
            self.model, self.tokenizer, config,
            max_tokens=self.max_batch_tokens, max_sentences=self.max_batch_sentences,
        )
        all_ids = [ids for job in jobs for ids in job.src_ids]
        hyps = translator.translate_ids(all_ids)
        texts = [self.tokenizer.decode(h[0].tokens) for h in hyps]
        out, start = [], 0
        for job in jobs:
            out.append(_compact({"translations": texts[start : start + len(job.texts)]}).encode("utf-8"))
            start += len(job.texts)
        return out

    def _capture_json(self, text: str, ids: list[int], config: DecodeConfig) -> tuple[str, str]:
        """(translation, the JSON of its attention object: source, translation, tokens and cross weights)."""
        if not ids:  # as Translator: an empty input translates to ''; one key gets all the weight
            c = self.model.config
            ones = [[[[1.0]] for _ in range(c.n_heads)] for _ in range(c.n_decoder_layers)]
            head = {"source": text, "translation": "", "src_tokens": ["</s>"], "tgt_tokens": ["</s>"]}
            return "", _compact({**head, "cross": ones})
        capture = capture_attention(self.model, self.tokenizer, text, config)
        head = {
            "source": text,
            "translation": capture.translation,
            "src_tokens": capture.src_tokens,
            "tgt_tokens": capture.tgt_tokens,
        }
        cross = _weights_json(capture.cross.double().round(decimals=4))  # (L, H, T, S)
        return capture.translation, _compact(head)[:-1] + f',"cross":{cross}}}'


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _weights_json(weights: Tensor) -> str:
    """A JSON array of (L, H, T, S) weights, written one row at a time: each call is short, so this
    thread gives the GIL back to the event loop often (one json.dumps of a large list would hold it)."""
    layers = []
    for layer in weights:
        heads = ["[" + ",".join(_compact(row) for row in head.tolist()) + "]" for head in layer]
        layers.append("[" + ",".join(heads) + "]")
    return "[" + ",".join(layers) + "]"
