"""Worker processes of one thread each, forked from the process that holds what they need: the
decoding workers of ``translate``/``evaluate --workers`` (``qkv.infer.workers``) and the encoding
workers of ``qkv prepare --workers``.

The workers are forked, so they share the parent's objects (a model's weights, a tokenizer)
copy-on-write and load nothing; an item travels to a worker pickled (lists of ids, sentences) and its
result comes back the same way. Each sets one PyTorch thread before its first operation (as PyTorch's
DataLoader workers do), so a worker never uses the parent's thread pool, and its sums round exactly as
those of one process running one thread. The workers live as long as the ``Workers`` and end on their
own within a second when the process that made them is killed.

Ctrl-C reaches every process of the terminal's process group, the workers too. They ignore SIGINT
(they are forked with it blocked and ignore it before anything else), so only the parent sees it:
its ``KeyboardInterrupt`` ends the work, and ``close()`` then ends workers still busy at once instead
of waiting for them. One message, from the parent; no traceback from each worker.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

from qkv.errors import QkvError

_task: Callable[..., Any] | None = None  # in a worker: the function every batch is handed to


def _start_worker(task: Callable[..., Any], parent: int) -> None:
    global _task
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (module docstring)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked across the fork; now ignored
    torch.set_num_threads(1)
    _task = task
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()


def _end_with(parent: int) -> None:
    """End this worker when the process that made it is gone (killed, say): the workers hold each
    other's ends of the task pipe, so they would otherwise wait for tasks forever."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _run(item: Any) -> Any:
    return _task(item)


_END = object()


def _nothing() -> None:
    return None


class Workers:
    """``workers`` forked processes of one PyTorch thread each, each running ``task(item)`` for the
    items it is given.

    ``task`` and what it holds (the model) reach the workers by the fork, never pickled; the items
    and results are pickled, so they should be plain data (lists of ids, hypotheses).
    """

    def __init__(self, task: Callable[..., Any], workers: int) -> None:
        if workers < 2:
            raise QkvError(f"workers are for 2 or more processes, got {workers}")
        if "fork" not in multiprocessing.get_all_start_methods():
            raise QkvError("workers need the fork start method (Linux or macOS); use one worker")
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                         initializer=_start_worker, initargs=(task, os.getpid()))
        self._futures: list[Future] = []
        # The pool forks all its workers at the first submit. SIGINT is blocked meanwhile, so that a
        # Ctrl-C at that moment waits for the parent instead of striking a worker before it ignores it.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._pool.submit(_nothing)
        except BaseException:
            self._end_now()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def map(self, items: Iterable[Any], *, ahead: int | None = None) -> Iterator[Any]:
        """``task(item)`` for every item, in their order; each goes to the next free worker.
        ``ahead``: at most this many items handed out and not yet returned (a stream of any length in
        bounded memory); None: all at once."""
        if ahead is None:
            self._futures = [self._pool.submit(_run, item) for item in items]
            return (future.result() for future in self._futures)
        return self._stream(iter(items), ahead)

    def _stream(self, items: Iterator[Any], ahead: int) -> Iterator[Any]:
        self._futures = []
        pending: deque[Future] = deque()
        while True:
            while len(pending) < ahead and (item := next(items, _END)) is not _END:
                pending.append(self._pool.submit(_run, item))
                self._futures.append(pending[-1])
            if not pending:
                return
            yield pending.popleft().result()
            self._futures = list(pending)  # the finished ones are not kept

    def close(self) -> None:
        """End the workers. Those still searching (the caller stopped reading results: an interrupt,
        an error) are ended at once, not waited for."""
        if any(not future.done() for future in self._futures):
            self._end_now()
        else:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._futures = []

    def _end_now(self) -> None:
        # No future is cancelled here: the pool, broken once its workers are gone, fails the ones left
        # (and a cancelled one would make it raise InvalidStateError in its manager thread).
        processes = list((getattr(self._pool, "_processes", None) or {}).values())  # as 3.14's terminate_workers()
        for process in processes:
            process.terminate()  # SIGTERM: the worker ignores only SIGINT
        for process in processes:
            process.join()
        # A worker ended while writing its result leaves half a message in the result pipe, and the pool's
        # manager thread waits for the rest forever (shutdown then never returns). With every worker gone,
        # closing this process's own end of that pipe turns the wait into an end of file: the pool sees
        # itself broken and cleans up (concurrent.futures' terminate_broken).
        writer = getattr(getattr(self._pool, "_result_queue", None), "_writer", None)
        if writer is not None:
            writer.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
