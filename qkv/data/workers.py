"""Decoding workers: batches searched side by side in processes of one thread each.

On two cores, two processes of one thread each, every one searching whole batches (CTranslate2's
``inter_threads`` layout), decoded the preset's model greedily 1.13x to 1.18x faster than one
process of two threads and int8 beam 5 1.09x to 1.12x; at fp32 beam 5 the faster layout changed
from one benchmark run to the next (docs/benchmarks.md, (c)). One thread each also makes a worker's sums round exactly as those
of one process running one thread, so the translations do not depend on the layout. The workers are
forked from the process that holds the model, so they share its weights copy-on-write and load
nothing; a batch travels to a worker as lists of token ids and comes back as hypotheses.

Forking a process that has already run PyTorch is safe here because a worker never uses the parent's
thread pool: it sets its own thread count before its first operation (as PyTorch's DataLoader workers
do). The workers live as long as the ``DecodingWorkers`` (a ``Translator`` closes them with itself),
and end on their own within a second when the process that made them is killed.

Ctrl-C reaches every process of the terminal's process group, the workers too. They ignore SIGINT
(they are forked with it blocked and ignore it before anything else), so only the parent sees it:
its ``KeyboardInterrupt`` ends the search, and ``close()`` then ends workers still searching a batch
at once instead of waiting for it. One message, from the parent; no traceback from each worker.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
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


def _nothing() -> None:
    return None


class DecodingWorkers:
    """``workers`` forked processes of one PyTorch thread each, each running ``task(item)`` for the
    items it is given.

    ``task`` and what it holds (the model) reach the workers by the fork, never pickled; the items
    and results are pickled, so they should be plain data (lists of ids, hypotheses).
    """

    def __init__(self, task: Callable[..., Any], workers: int) -> None:
        if workers < 2:
            raise QkvError(f"decoding workers are for 2 or more processes, got {workers}")
        if "fork" not in multiprocessing.get_all_start_methods():
            raise QkvError("decoding workers need the fork start method (Linux or macOS); use one worker")
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

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        """``task(item)`` for every item, in their order; each goes to the next free worker."""
        self._futures = [self._pool.submit(_run, item) for item in items]
        return (future.result() for future in self._futures)

    def close(self) -> None:
        """End the workers. Those still searching (the caller stopped reading results: an interrupt,
        an error) are ended at once, not waited for."""
        if any(not future.done() for future in self._futures):
            self._end_now()
        else:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._futures = []

    def _end_now(self) -> None:
        for future in self._futures:
            future.cancel()
        processes = list((getattr(self._pool, "_processes", None) or {}).values())  # as 3.14's terminate_workers()
        for process in processes:
            process.terminate()  # SIGTERM: the worker ignores only SIGINT
        self._pool.shutdown(wait=True, cancel_futures=True)
        for process in processes:
            process.join()
