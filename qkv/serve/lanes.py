"""Continuous batching for ``qkv serve``: each lane is a model thread whose search sentences join and leave.

A lane runs ``qkv.infer.continuous.ContinuousBeamSearch``: a request's sentences join the search at
its next step and its answer is sent as soon as its last sentence is done, while the sentences of
the requests that came before and after it go on. Its 32 clients' sentences are thus searched
together at every step, instead of in batches that each wait for their longest output (and whose
last steps decode a few rows). The batcher hands a lane the requests it can search (a beam search
on qkv's engine, without a glossary: ``Batcher.continuous``) and the rest go to its batches as before.

A lane holds one search for each decoding config its requests ask for, stepped in turn, and in them
at most ``max_sentences`` sentences and ``max_work`` units of work (the requests' ``Job.work``, as a
batch holds at most the batcher's ``max_batch_work``); what does not fit waits in the lane, and a
request larger than either is searched alone. Before each step it drops
the sentences of requests nobody waits for any more. With the loop guard on, a sentence whose output
loops is searched again at once with repeated n-grams banned, as ``qkv.infer.search.search`` does.
A search that fails answers its requests through the batches, one request a batch, so that only a
request that causes a failure fails.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from qkv.infer.continuous import ContinuousBeamSearch
from qkv.infer.loop_guard import loops, number_pieces
from qkv.infer.search import DecodeConfig, Hypothesis, beam_search, loop_retry, max_output_length
from qkv.infer.translator import collate_sources, suppressed_tokens

# The batcher is a qkv.serve.batcher.Batcher and a job its Job; that module imports this one, so their
# types are named here only in words.

log = logging.getLogger("qkv.serve.app")


@dataclass
class _Request:
    job: Any  # the batcher's Job
    config: DecodeConfig
    hyps: list[list[Hypothesis] | None] = field(default_factory=list)  # of each sentence, once found
    left: int = 0  # sentences still searched


class Lane:
    """A model thread with its continuous searches; ``put`` a job, ``close`` at shutdown."""

    def __init__(self, batcher: Any, loop: asyncio.AbstractEventLoop, name: str, max_sentences: int, max_work: int) -> None:
        self.batcher, self.loop, self.max_sentences, self.max_work = batcher, loop, max_sentences, max_work
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[_Request] = deque()  # admitted to the lane, not yet to a search (it was full)
        self._searches: dict[DecodeConfig, ContinuousBeamSearch] = {}
        self._requests: dict[int, _Request] = {}  # id(job) -> the request, while any sentence of it is searched
        # Sentences given (counted by the event loop) and done with (by the lane): each counter has one writer.
        self._given = self._done = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def sentences(self) -> int:
        """Sentences of the requests given to this lane and not yet answered (the batcher's choice of lane)."""
        return self._given - self._done

    def put(self, job: Any, config: DecodeConfig) -> None:
        self._given += len(job.src_ids)
        self._inbox.put((job, config))

    def close(self) -> None:
        """Stop the thread (at shutdown: nobody waits for what is left) and wait for it."""
        self._inbox.put(None)
        self._thread.join()

    # --- the lane's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        tok = self.batcher.tokenizer
        self._suppress, self._numbers = suppressed_tokens(tok), number_pieces(tok)
        while True:
            idle = not self._requests and not self._waiting
            try:
                while True:
                    item = self._inbox.get(block=idle)
                    idle = False
                    if item is None:
                        self._stop()
                        return
                    self._waiting.append(_Request(*item))
            except queue.Empty:
                pass
            self._admit()
            for config, search in list(self._searches.items()):
                self._step(config, search)

    def _admit(self) -> None:
        """Let waiting requests join their searches while there is room (a request is never split)."""
        searched = sum(len(s) for s in self._searches.values())
        work = sum(r.job.work for r in self._requests.values())
        while self._waiting:
            request = self._waiting[0]
            job = request.job
            if job.abandoned:
                self._waiting.popleft()
                self._forget(request, stopped=False)
                continue
            n = sum(1 for ids in job.src_ids if ids)
            if searched and (searched + n > self.max_sentences or work + job.work > self.max_work):
                return
            self._waiting.popleft()
            request.hyps = [None if ids else [Hypothesis([], 0.0, 0.0)] for ids in job.src_ids]
            request.left = n
            if not n:
                self._answer(request)
                continue
            search = self._searches.get(request.config)
            if search is None:
                search = self._searches[request.config] = ContinuousBeamSearch(
                    self.batcher.search_model, bos_id=self.batcher.tokenizer.bos_id, eos_id=self.batcher.tokenizer.eos_id,
                    config=request.config, suppress=self._suppress)
            todo = [i for i, ids in enumerate(job.src_ids) if ids]
            search.add([job.src_ids[i] for i in todo], [(id(job), i) for i in todo])
            self._requests[id(job)] = request
            searched, work = searched + n, work + job.work

    def _step(self, config: DecodeConfig, search: ContinuousBeamSearch) -> None:
        gone = {key for key, request in self._requests.items() if request.config == config and request.job.abandoned}
        if gone:
            search.remove({(key, i) for key in gone for i in range(len(self._requests[key].job.src_ids))})
            for key in gone:
                self._forget(self._requests.pop(key), stopped=True)
        if not len(search):
            del self._searches[config]
            return
        stats = self.batcher.stats
        stats.steps, stats.step_sentences = stats.steps + 1, stats.step_sentences + len(search)
        stats.step_sizes[len(search)] += 1
        try:
            done = search.step()
        except Exception as error:  # noqa: BLE001 - one failed search must not stop the lane
            if self.batcher.stopping:  # the batcher's hook: shutdown, nobody waits any more
                self._stop()
                return
            log.warning("a continuous search of %d sentences failed (%s); answering its requests one at a time",
                        len(search), error)
            del self._searches[config]
            mine = [k for k, r in self._requests.items() if r.config == config]
            for key in mine:
                self._retry(self._requests.pop(key))
            return
        for (key, i), hyps in done:
            request = self._requests.get(key)
            if request is None:
                continue
            request.hyps[i] = self._guarded(request, i, hyps)
            request.left -= 1
            if not request.left:
                del self._requests[key]
                self._answer(request)

    def _guarded(self, request: _Request, i: int, hyps: list[Hypothesis]) -> list[Hypothesis]:
        """``hyps``, or with the loop guard on and a best output that loops, the search again without
        repeated n-grams of the guard's size (``qkv.infer.search.search``)."""
        config, ids = request.config, request.job.src_ids[i]
        limit = max_output_length(self.batcher.search_model, len(ids) + 1, config)
        if not config.loop_guard or not loops(hyps[0].tokens, limit, numbers=self._numbers, source=ids):
            return hyps
        tok = self.batcher.tokenizer
        src = collate_sources([ids], pad_id=tok.pad_id, eos_id=tok.eos_id).to(self.batcher.search_model.device)
        return beam_search(self.batcher.search_model, src, bos_id=tok.bos_id, eos_id=tok.eos_id, config=loop_retry(config),
                           suppress=self._suppress)[0]

    def _answer(self, request: _Request) -> None:
        """The request's JSON body (``Batcher.answer``), sent from the event loop; a failure fails it alone."""
        job = request.job
        try:
            body = self.batcher.answer(job, request.hyps, request.config)
        except Exception:  # noqa: BLE001
            log.exception("translation failed for a request of %d texts", len(job.texts))
            self.loop.call_soon_threadsafe(self.batcher.fail, job)
        else:
            self.loop.call_soon_threadsafe(self.batcher.deliver, job, body, len(job.texts))
        self._done += len(job.src_ids)

    def _retry(self, request: _Request) -> None:
        self._done += len(request.job.src_ids)
        asyncio.run_coroutine_threadsafe(self.batcher.retry_alone(request.job), self.loop)

    def _forget(self, request: _Request, *, stopped: bool) -> None:
        """A request nobody waits for: its handler counted it; ``stopped``: its search stopped midway."""
        self._done += len(request.job.src_ids)
        if stopped:
            self.loop.call_soon_threadsafe(self.batcher.count_stopped)

    def _stop(self) -> None:
        """Shutdown: what is left has nobody waiting (``Batcher.close``), or is told the server stops."""
        left = list(self._requests.values()) + list(self._waiting)
        self._requests.clear()
        self._waiting.clear()
        self._searches.clear()
        for request in left:
            self.loop.call_soon_threadsafe(self.batcher.shut_out, request.job)

