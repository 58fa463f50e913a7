"""Progress of long commands: a redrawn bar on a terminal, plain lines in a log file.

``qkv train ... > log 2>&1`` must leave a log a person can read: tqdm's bar, redrawn at every
update, would fill it with carriage returns. When standard error is not a terminal, ``progress``
returns ``PlainProgress`` instead, which prints one line now and then (step, the bar's postfix such as
loss and tokens/s, elapsed time and ETA).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

PLAIN_EVERY = 60.0  # seconds between two plain lines


class PlainProgress:
    """The part of tqdm's interface that qkv uses (``update``, ``set_postfix``, ``total``, ``close``),
    printing a line at most every ``every`` seconds, and one when it closes."""

    def __init__(self, *, total: int | None, initial: int = 0, unit: str = "step", every: float = PLAIN_EVERY, file=None) -> None:
        self.total, self.n, self.unit, self.every = total, initial, unit, every
        self.file = file or sys.stderr
        self.started = self.last = time.monotonic()
        self.start_n = initial
        self.postfix: dict[str, Any] = {}
        self.closed = False

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every:
            self._line()

    def close(self) -> None:
        if not self.closed and self.n > self.start_n:
            self._line()
        self.closed = True

    def _line(self) -> None:
        self.last = now = time.monotonic()
        elapsed = now - self.started
        where = f"{self.unit} {self.n:,}" + (f"/{self.total:,} ({100 * self.n / self.total:.0f}%)" if self.total else "")
        fields = "".join(f" {key} {value}" for key, value in self.postfix.items())
        eta = ""
        if self.total and self.n > self.start_n:
            eta = f", ETA {_duration(elapsed / (self.n - self.start_n) * max(self.total - self.n, 0))}"
        print(f"{where}{fields}, elapsed {_duration(elapsed)}{eta}", file=self.file, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress(*, total: int | None, initial: int = 0, enabled: bool = True, unit: str = "step"):
    """A tqdm bar when standard error is a terminal, else ``PlainProgress``; with ``enabled=False`` a bar that shows nothing."""
    if not enabled:
        return tqdm(total=total, initial=initial, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True)
    return PlainProgress(total=total, initial=initial, unit=unit)
