"""Dynamic batching for ``qkv serve``: a queue bounded by work, one worker, ``searches`` model threads.

Requests wait in a queue; a single worker takes what has arrived (up to ``max_batch_sentences``
sentences, ``max_batch_tokens`` source tokens and ``max_batch_work`` units of work, waiting at most
``max_wait_ms`` for more), groups it by decoding settings and translates each group as one batch in a
model thread. With ``searches`` above 1, that many batches are searched at once, each in its own
thread: the worker forms the next batch while a thread is free and hands it over, so that on the CPU
two single-threaded searches of 16 sentences run side by side instead of one two-threaded search of 32
(small matrices gain little from a second thread; qkv translate's ``--workers`` layout, in threads).
While every thread is busy, requests wait in the queue and make the next batch larger. The answer is
serialized to JSON in the model thread too, never on the event loop.

Work is what the server computes for a request, in units of one decoder step of one output token
(``Work``): for each non-empty text, its source tokens once for each pass of the encoder over them
(the search, and the teacher-forced pass that scores a greedy or sampled output or captures the
attention), plus the most output tokens the search may produce for it (``qkv.infer.search.max_output_length``)
times the units each costs (``Settings.work_per_token``: the beam size, or the price of a sampled
token, plus one when a greedy or sampled output is scored); with attention, also the attention
pass's output tokens and every attention weight it computes (the encoder's, the decoder's and the
cross weights, ``ATTENTION_WEIGHTS_PER_UNIT`` to a unit). An empty text counts 1. The queue counts
work, admitted and not yet answered, so a full queue means a bounded wait, not a long list. The
prices of the units are in ``qkv.serve.work``.

Requests share a batch only when they ask for the same search (``Settings.search``); what changes
only the answer (how many of the n best, attention) is applied to each request's share of the results.

A request whose client went away (or timed out) is dropped from the queue, and a batch nobody waits
for any more stops at its next decoding step (a hook on the model's output layer checks between steps).

With ``continuous`` (``qkv serve --batching continuous``, qkv's engine), the requests a beam search answers
without a glossary skip the batches: each goes at once to one of ``searches`` lanes, model threads
whose searches sentences join and leave at every step (``qkv.serve.lanes``), the lane with the
fewest sentences; the queue's limits count them all the same.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from qkv.data.sentences import Line, TextOptions
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.continuous import supports
from qkv.infer.search import DecodeConfig, Hypothesis, max_output_length
from qkv.infer.terms import CONSTRAINED_BEAM, constraint_forms, translate_with_glossary
from qkv.infer.translator import Translator
from qkv.inspect.terms import alignment_substitution, place
from qkv.model.transformer import Transformer

from qkv.serve.answers import Answers
from qkv.serve.lanes import Lane
from qkv.serve.work import (
    ATTENTION_WEIGHTS_PER_UNIT, CONTRIBUTION_ELEMENTS_PER_UNIT, CONTRIBUTION_TEXT_WORK, GLOSSARY_CHARS_PER_UNIT,
    GLOSSARY_ENTRY_WORK, GLOSSARY_MATCHES_PER_UNIT, SOURCE_TOKEN_WORK, Settings, Work,
)

log = logging.getLogger("qkv.serve.app")

class Busy(Exception):
    """The queue is full, or the server is shutting down: answer 503 with Retry-After."""


class BatchAbandoned(Exception):
    """Raised inside the model between decoding steps: nobody waits for this batch any more."""


@dataclass
class Job:
    """One request: its texts, their token ids, its settings, its cost and the future its handler awaits.
    The future's result is the response body, JSON bytes; a cancelled future means nobody waits."""

    texts: list[str]
    src_ids: list[list[int]]  # of each text, or with ``lines`` of each sentence of the texts
    settings: Settings
    work: int
    future: asyncio.Future
    lines: list[Line] | None = None  # the texts cut into the sentences that ``src_ids`` encode (qkv.data.sentences)
    text: TextOptions | None = None  # how ``lines`` were cut and cased: a glossary's translation cuts the texts the same way
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
    aborted_batches: int = 0  # stopped before the end because nobody waited for them (a continuous search: a request's sentences)
    batches: int = 0
    sentences: int = 0  # texts answered
    continuous_requests: int = 0  # of them, answered by a continuous search (``qkv.serve.lanes``)
    steps: int = 0  # steps of the continuous searches
    step_sentences: int = 0  # sentences those steps decoded, summed
    step_sizes: Counter = field(default_factory=Counter)  # sentences a continuous step decoded -> how many steps
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
            "continuous_requests": self.continuous_requests,
            "steps": self.steps,
            "mean_step_sentences": self.step_sentences / self.steps if self.steps else 0.0,
            "step_sizes": {str(k): v for k, v in sorted(self.step_sizes.items())},
            "mean_batch_size": self.sentences / self.batches if self.batches else 0.0,
            "mean_batch_requests": self.batch_requests / self.batches if self.batches else 0.0,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
        }


class Batcher:
    """The queue, the worker that forms batches from it, and the thread that runs the model."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: TextTokenizer,
        *,
        max_batch_sentences: int,
        max_batch_tokens: int,
        max_batch_work: int,
        max_wait_ms: float,
        max_queue: int,
        max_queue_work: int,
        length_penalty: float = DecodeConfig.length_penalty,
        calibration: dict | None = None,
        loop_guard: int = 0,
        search_model: Transformer | None = None,
        make_translator: Callable[..., Translator] | None = None,
        searches: int = 1,
        continuous: bool = False,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer  # the float32 model: confidence and attention read it
        self.search_model = search_model or model  # what searches and scores (a bfloat16 copy with --bf16)
        # (config, max_tokens=, max_sentences=) -> the Translator of one batch: qkv's over search_model, or
        # with --engine ctranslate2 one that searches in CTranslate2 (qkv.interop.ct2_engine)
        self.make_translator = make_translator or (lambda config, **kw: Translator(self.search_model, self.tokenizer, config, **kw))
        self.loop_guard = loop_guard  # every search's DecodeConfig.loop_guard (qkv serve --loop-guard; 0: the exact search)
        self.calibration = calibration  # the checkpoint's confidence.json (None: qkv.inspect.trust's default)
        self.answers = Answers(model, tokenizer, self.search_model, calibration, max_batch_tokens)
        self.length_penalty = length_penalty  # the checkpoint's choice (qkv.io.checkpoint.decode_defaults)
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
        if searches < 1:
            raise ValueError(f"searches must be at least 1, got {searches}")
        self.searches = searches  # batches searched at once, each in a model thread
        self._executor = ThreadPoolExecutor(searches, thread_name_prefix="qkv-translate")
        self._running: set[asyncio.Task] = set()  # the batches handed to model threads, until answered
        self._decoding: dict[int, list[Job]] = {}  # model thread's ident -> the jobs it works on now
        self._stop_all = False  # set at shutdown, once nobody can be waiting any more
        if continuous and make_translator is not None:
            raise ValueError("a continuous search is qkv's own: not with another engine's translators")
        self.continuous = continuous
        self.lanes: list[Lane] = []  # started with the worker (start), when continuous
        # The output layer runs once per decoding step: the place to notice that nobody waits.
        self._hook = self.search_model.generator.register_forward_pre_hook(self._stop_if_abandoned)  # removed by close()

    @property
    def stopping(self) -> bool:
        """Set at shutdown: nobody waits for what is left in a search."""
        return self._stop_all

    def _stop_if_abandoned(self, module: Any, args: Any) -> None:
        jobs = self._decoding.get(threading.get_ident())
        if self._stop_all or (jobs and all(job.abandoned for job in jobs)):
            raise BatchAbandoned

    # --- what a request costs -------------------------------------------------------------------

    def output_limits(self, src_ids: list[list[int]], settings: Settings) -> list[int]:
        """The most tokens the search may produce for each source (0 for an empty one: not searched)."""
        config = settings.decode_config()
        return [max_output_length(self.model, len(ids) + 1, config) if ids else 0 for ids in src_ids]

    def work(self, src_ids: list[list[int]], settings: Settings) -> int:
        """The units of work of a request (``work_parts``), in all."""
        return self.work_parts(src_ids, settings).total

    def work_parts(self, src_ids: list[list[int]], settings: Settings, texts: list[str] | None = None,
                   matches: list[list] | None = None) -> Work:
        """What the server computes for these sources (module docstring), summed over texts: S source
        tokens (EOS included) and at most T output tokens each. With a glossary (``texts`` then given,
        one per source), the glossary's own work from its size and the texts' (``GLOSSARY_*``: nothing is
        matched here, so this is cheap on the event loop); and with ``matches`` (each text's, found in the
        model thread by ``glossary_work``), a text that holds terms may be searched again with constraints
        (at the constrained beam, over its limit lengthened by its terms' longest forms) and is read once
        more for the alignment check."""
        per_token = settings.work_per_token()
        c = self.model.config
        source = output = weights = elements = n_texts = 0
        for i, (ids, n) in enumerate(zip(src_ids, self.output_limits(src_ids, settings))):
            if not ids:  # not searched (and its attention is made up, not computed)
                output += 1
                continue
            extra = settings.attention + settings.confidence  # teacher-forced passes with contributions
            passes = 1 + settings.scored_apart + extra  # of the encoder over each source
            if settings.glossary is not None and matches is not None and matches[i]:
                matches_i = matches[i]
                beam = max(CONSTRAINED_BEAM, settings.beam_size, len(matches_i) + 1)
                longest = sum(max(len(self.tokenizer.encode_target(f)) for f in constraint_forms(m.term)) for m in matches_i)
                output += beam * (n + longest)
                n += longest  # the translation may be that much longer: its other passes read as much more
                passes += 2  # the constrained search's encoder, and the alignment check's pass
                extra += 1
            S = len(ids) + 1
            source += SOURCE_TOKEN_WORK * S * passes
            output += per_token * n
            T = n + 1  # a teacher-forced pass reads BOS and the output
            if settings.attention:
                weights += c.n_heads * (c.n_encoder_layers * S * S + c.n_decoder_layers * (T * T + T * S))
            output += T * extra
            elements += extra * c.d_model * (c.n_encoder_layers * S * S + c.n_decoder_layers * (T * T + T * (S + 1)))
            n_texts += extra
        glossary = 0
        if settings.glossary is not None and texts is not None:
            terms = settings.glossary.terms
            glossary = (GLOSSARY_ENTRY_WORK * len(terms) + -(-sum(len(t.source) for t in terms) // GLOSSARY_CHARS_PER_UNIT)
                        + -(-len(terms) * sum(map(len, texts)) // GLOSSARY_MATCHES_PER_UNIT))
        return Work(source, output, -(-weights // ATTENTION_WEIGHTS_PER_UNIT),
                    CONTRIBUTION_TEXT_WORK * n_texts + -(-elements // CONTRIBUTION_ELEMENTS_PER_UNIT), glossary)

    async def glossary_work(self, src_ids: list[list[int]], settings: Settings, texts: list[str], *, reserve: int) -> Work:
        """The work of a request with a glossary, its terms matched in the model thread, never on the event
        loop (issue 72, #11): ``work_parts`` with each text's matches. While it waits for that thread,
        ``reserve`` units (its work without the constrained searches) count in the queue as a request's:
        Busy if they do not fit, as ``submit``."""
        self._admit(reserve)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._matched_work, src_ids, settings, texts)
        finally:
            self.pending_requests -= 1
            self.pending_work -= reserve

    def _matched_work(self, src_ids: list[list[int]], settings: Settings, texts: list[str]) -> Work:
        assert settings.glossary is not None
        return self.work_parts(src_ids, settings, texts, [settings.glossary.matches(t) for t in texts])

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
        if self.continuous:
            loop = asyncio.get_running_loop()
            self.lanes = [Lane(self, loop, f"qkv-lane-{i}", self.max_batch_sentences, self.max_batch_work)
                          for i in range(self.searches)]

    async def close(self) -> None:
        """Stop the worker. The server calls this after its graceful period: every request has been
        answered or given up, so what is left in the queue or in the model has nobody waiting for it."""
        self.closing = True
        self._stop_all = True
        if self._task is not None:
            await self._queue.put(None)
            await self._task
        for lane in self.lanes:
            await asyncio.get_running_loop().run_in_executor(None, lane.close)
        self._executor.shutdown(wait=True)
        self._hook.remove()  # the model is the caller's again, as it was

    def queue_depth(self) -> int:
        return self.pending_requests

    def _admit(self, work: int) -> None:
        """Count a request of ``work`` units as waiting, or Busy (counted rejected) if the queue has no room."""
        if self.closing or self._queue is None:
            self.stats.rejected += 1
            raise Busy("the server is shutting down")
        if self.pending_requests >= self.max_queue or self.pending_work + work > self.max_queue_work:
            self.stats.rejected += 1
            raise Busy(
                f"the translation queue is full ({self.pending_requests} requests, {self.pending_work} units of "
                f"work waiting; limits {self.max_queue} and {self.max_queue_work})"
            )
        self.pending_requests += 1
        self.pending_work += work

    def submit(self, texts: list[str], src_ids: list[list[int]], settings: Settings, work: int,
               lines: list[Line] | None = None, text: TextOptions | None = None) -> Job:
        self._admit(work)
        job = Job(texts, src_ids, settings, work, asyncio.get_running_loop().create_future(), lines=lines, text=text)
        job.future.add_done_callback(lambda _: self._release(job))
        config = self.continuous_config(settings)
        if config is not None:
            min(self.lanes, key=lambda lane: lane.sentences).put(job, config)
        else:
            self._queue.put_nowait(job)
        self.stats.requests += 1
        return job

    def continuous_config(self, settings: Settings) -> DecodeConfig | None:
        """The search config a lane runs for ``settings``, or None where the batches search it: not
        continuous, a glossary, or what ``qkv.infer.continuous.supports`` does not (greedy, sampling)."""
        if not self.lanes or settings.glossary is not None:
            return None
        config = replace(settings.decode_config(n_best=settings.n_best or 1), length_penalty=self.length_penalty,
                         loop_guard=self.loop_guard)
        return config if supports(self.search_model, config) else None

    # What a lane's thread asks of the event loop (call_soon_threadsafe): a request's end.

    def deliver(self, job: Job, body: bytes, texts: int) -> None:
        self.stats.sentences += texts
        self.stats.continuous_requests += 1
        if not job.future.done():
            job.future.set_result(body)

    def fail(self, job: Job) -> None:
        self.stats.failed += 1
        if not job.future.done():
            job.future.set_exception(RuntimeError("translation failed"))

    def count_stopped(self) -> None:
        self.stats.aborted_batches += 1

    def shut_out(self, job: Job) -> None:
        if not job.future.done():
            job.future.set_exception(Busy("the server is shutting down"))

    async def retry_alone(self, job: Job) -> None:
        """Translate ``job`` in a batch of its own (a lane's search failed)."""
        await self._translate(job.settings.search(), [job])

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
        A request is never split; one larger than the budgets makes a batch on its own. While another
        model thread is idle, the batch takes only its share of what waits (the waiting requests over
        the idle threads, this one included) and does not wait for more: the idle thread takes the rest
        at once (32 requests and two idle threads: two batches of 16, side by side, not one of 32)."""
        first = await self._next(None)
        if first is None:
            return [], True
        batch, sentences, tokens, work = [first], len(first.src_ids), first.n_tokens, first.work
        deadline = time.monotonic() + self.max_wait
        idle = self.searches - 1 - len(self._running)  # model threads free besides the one this batch will take
        while sentences < self.max_batch_sentences and tokens < self.max_batch_tokens and work < self.max_batch_work:
            waiting = len(batch) + self._queue.qsize() + (self._held is not None)
            if idle and len(batch) >= -(-waiting // (idle + 1)):
                break
            try:
                job = await self._next(max(deadline - time.monotonic(), 0.0))
            except (asyncio.TimeoutError, asyncio.QueueEmpty):  # the two differ on Python 3.10
                break
            if job is None:
                return batch, True
            if job.abandoned:  # its client went away while it waited: drop it, it takes no room
                continue
            if (
                sentences + len(job.src_ids) > self.max_batch_sentences
                or tokens + job.n_tokens > self.max_batch_tokens
                or work + job.work > self.max_batch_work
            ):
                self._held = job
                break
            batch.append(job)
            sentences, tokens, work = sentences + len(job.src_ids), tokens + job.n_tokens, work + job.work
        return batch, False

    async def _run(self) -> None:
        stopping = False
        while not stopping or self._held is not None:
            while len(self._running) >= self.searches:  # a model thread is free: only then is the next batch formed
                await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
            if stopping:  # the sentinel came while a request was held back: finish that one too
                batch = [self._held]
                self._held = None
            else:
                batch, stopping = await self._collect()
            task = asyncio.create_task(self._translate_batch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        if self._running:
            await asyncio.gather(*self._running)

    async def _translate_batch(self, batch: list[Job]) -> None:
        """One batch's groups, one after the other in one model thread (its task leaves ``_running``
        when done: the thread is free again)."""
        groups: dict[Settings, list[Job]] = {}
        for job in batch:
            if not job.abandoned:  # a dropped request was counted by its handler
                groups.setdefault(job.settings.search(), []).append(job)
        for settings, jobs in groups.items():
            await self._translate(settings, jobs)

    async def _translate(self, settings: Settings, jobs: list[Job]) -> None:
        """One group in the model thread. If it fails, each request is retried alone, so that only the
        request that causes the failure fails; clients see a generic message, the log the traceback."""
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self.translate_group, settings, jobs)
        except BatchAbandoned:
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
        """Runs in the worker thread: one batch of requests with equal searches -> one JSON body each."""
        me = threading.get_ident()
        self._decoding[me] = jobs
        try:
            return self._translate_group(settings, jobs)
        finally:
            del self._decoding[me]

    def _translate_group(self, search: Settings, jobs: list[Job]) -> list[bytes]:
        # One search for the whole group, with as many of the n best as any request asks for.
        config = replace(search.decode_config(n_best=max(job.settings.n_best or 1 for job in jobs)), length_penalty=self.length_penalty,
                         loop_guard=self.loop_guard)
        translator = self.make_translator(config, max_tokens=self.max_batch_tokens, max_sentences=self.max_batch_sentences)
        if search.glossary is not None:  # its own group: the glossary's translation, then where each term went
            out = []
            for job in jobs:  # each text cut into sentences and recased as job.lines are (qkv translate --glossary's way)
                mine = translator if job.text is None else self.make_translator(
                    config, max_tokens=self.max_batch_tokens, max_sentences=self.max_batch_sentences, text=job.text)
                results = translate_with_glossary(mine, job.texts, search.glossary,
                                                  align=alignment_substitution(self.model, self.tokenizer))
                place(self.model, self.tokenizer, results)
                hyps = [[Hypothesis(s.tokens, math.nan, math.nan)] for r in results for s in r.sentences]
                out.append(self.answer(job, hyps, config, terms=[r.terms() for r in results]))
            return out
        hyps = translator.translate_ids([ids for job in jobs for ids in job.src_ids])
        out, start = [], 0
        for job in jobs:
            mine, start = hyps[start : start + len(job.src_ids)], start + len(job.src_ids)
            out.append(self.answer(job, mine, config) if not job.abandoned else b"")
        return out

    def answer(self, job: Job, hyps: list[list[Hypothesis]], config: DecodeConfig, terms: list | None = None) -> bytes:
        """One request's JSON body (``qkv.serve.answers.Answers.answer``)."""
        return self.answers.answer(job, hyps, config, terms)
