"""Writing a user's output files without ever destroying one they did not ask to replace.

Every command that writes a file the user names (``translate -o``, ``evaluate --save``, ``score -o``,
``align -o``, ``attend --json``) goes through ``output_file``: an existing file is refused unless the
user passed ``--force``; a file that is also an input is always refused (writing it would truncate it
before it is read); and the new content goes to a temporary file in the same directory that replaces
the target only once it is complete, so a crash or a full disk leaves the previous file as it was.
(``attend``'s pictures are checked with ``check_output`` and written in place by matplotlib.)
Commands that write a checkpoint directory (``average``, ``import``) check it with ``check_checkpoint_out``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def check_output(path: str | Path, *, force: bool, inputs: tuple[str | Path | None, ...] = ()) -> Path:
    """Refuse to write ``path`` when it is one of ``inputs``, or exists and ``force`` is False."""
    path = Path(path)
    for source in inputs:
        if source is not None and path.exists() and Path(source).exists() and os.path.samefile(path, source):
            raise ValueError(f"{path} is also the input: write the output to another file")
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a file name")
    if path.exists() and not force:
        raise ValueError(f"{path} exists; pass --force to overwrite it")
    return path


@contextmanager
def output_file(path: str | Path, *, force: bool, inputs: tuple[str | Path | None, ...] = ()) -> Iterator[IO[str]]:
    """A text file to write into that becomes ``path`` when the block ends without an error."""
    path = check_output(path, force=force, inputs=inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a normal file gets the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_checkpoint_out(out: str | Path, *, force: bool) -> Path:
    """Refuse ``out`` for a new checkpoint (before any work) unless it is new, or ``force`` is given and
    it is a qkv checkpoint: the rule of ``average --out`` and ``import marian --out``."""
    from qkv.checkpoint import is_checkpoint_dir

    out = Path(out)
    if out.exists() or out.is_symlink():
        if not force:
            raise ValueError(f"{out} exists; pass --force to replace it (only if it is a qkv checkpoint)")
        if not is_checkpoint_dir(out):
            raise ValueError(f"{out} is not a qkv checkpoint (it holds other files): refusing to replace it even with --force")
    return out


def output_or_stdout(path: str | Path | None, *, force: bool, inputs: tuple[str | Path | None, ...] = ()):
    """``output_file(path)`` when the user named a file, else standard output (left open)."""
    if path is None:
        return contextlib.nullcontext(sys.stdout)
    return output_file(path, force=force, inputs=inputs)
