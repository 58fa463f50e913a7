"""Stopping a run on a signal: Ctrl-C (SIGINT), a scheduler's pre-emption (SIGTERM), a closed terminal
(SIGHUP; unless the run was started under ``nohup``, which ignores it).

The first signal only raises a flag: the current optimizer step finishes, every rank sees the flag at
the same step boundary, and rank 0 saves ``last/``. Raising an exception at an arbitrary point instead
could leave a half-updated model and optimizer (and a rank that stops alone in the middle of a
collective leaves the others hanging). Validation, which changes nothing, is abandoned at once, so that
``last/`` is saved within torchrun's grace period (SIGKILL 30 s after it forwards the signal).

A second signal exits at once with status 128 + signal number and saves nothing: ``last/`` keeps the
previous good checkpoint (a save already under way is cut off as by SIGKILL; checkpoints are
published atomically, so that is safe).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class StopRequested(KeyboardInterrupt):
    """Training stopped at a step boundary after a signal; ``last/`` holds the state at that step."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP


class Abandoned(BaseException):
    """Raised inside an abandonable section (validation) when a stop signal arrives. A BaseException,
    so that no ``except Exception`` in library code can swallow it."""


class StopSignals:
    """While entered (in the main thread), SIGINT, SIGTERM and SIGHUP request a stop instead of killing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._abandonable = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                if signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) == signal.SIG_IGN:
                    continue  # started under nohup: closing the terminal must not stop the run
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            name = signal.Signals(signum).name
            os.write(2, f"qkv train: second signal ({name}): stopped at once; nothing was saved after the first\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if self._abandonable:
            self._abandonable = False
            raise Abandoned

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """A section a stop signal interrupts with ``Abandoned`` (at once, or on entry if one came before)."""
        if self.signum is not None:
            raise Abandoned
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False
