"""Text files of one sentence, or one ``source<TAB>target`` pair, per line: the one reader of every
command that reads a corpus (``train``, ``prepare``, ``shortlist``, ``evaluate``, ``distill``, ``score``).

A file is plain text, or compressed by its name's ending: ``.gz``, ``.xz`` or ``.bz2``. It is streamed,
read as bytes and split on ``\\n`` only: Python's text-mode line splitting also breaks on ``\\r``,
U+0085 and U+2028, which occur inside real sentences and would silently misalign the two sides of a
corpus. Every line is bounded (``MAX_LINE_BYTES``: memory never follows a file without line ends), is
checked as UTF-8, and loses its line end (``\\r\\n`` too) and, on the first line, a byte-order mark. A
damaged archive is an error naming the file and the line where it broke, raised as it is read, so a
command that reads its input before working (``qkv prepare``) fails before it works.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from qkv.errors import DataError

MAX_LINE_BYTES = 1 << 20  # a sentence is never a mebibyte; a file with longer lines is not one sentence per line
COMPRESSED = {".gz": ("gzip", gzip.open), ".xz": ("xz", lzma.open), ".bz2": ("bzip2", bz2.open)}
_ARCHIVE_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)  # truncated, corrupt, or not that format


def _open(path: Path) -> IO[bytes]:
    kind = COMPRESSED.get(path.suffix)
    return kind[1](path, "rb") if kind else open(path, "rb")


def lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (module docstring), without line ends, streamed."""
    path = Path(path)
    kind = COMPRESSED.get(path.suffix, ("", None))[0]
    number = 0
    try:
        with _open(path) as handle:
            while raw := handle.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    raise DataError(f"{path}: line {number} is longer than {MAX_LINE_BYTES:,} bytes: "
                                    "a corpus holds one sentence per line")
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as error:
                    raise DataError(f"{path}: line {number} is not valid UTF-8 (byte {error.start + 1} of the line); "
                                    "re-encode the file as UTF-8") from None
                yield line[1:] if number == 1 and line.startswith("\ufeff") else line  # a BOM is not part of the sentence
    except FileNotFoundError:
        raise DataError(f"{path} does not exist") from None
    except _ARCHIVE_ERRORS as error:
        if kind:
            raise DataError(f"{path}: corrupt or truncated {kind} file near line {number + 1} ({error})") from None
        raise DataError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None


def pairs(src: str | Path, tgt: str | Path) -> Iterator[tuple[str, str]]:
    """(source, target) lines of two aligned files, streamed; files of different lengths are an error
    when the shorter one ends, before the pair it lacks is given out."""
    source, target = lines(src), lines(tgt)
    n = 0
    for n, s in enumerate(source, 1):
        t = next(target, None)
        if t is None:
            _differ(src, n + sum(1 for _ in source), tgt, n - 1)
        yield s, t
    if next(target, None) is not None:
        _differ(src, n, tgt, n + 1 + sum(1 for _ in target))


def _differ(src: str | Path, n_src: int, tgt: str | Path, n_tgt: int) -> None:
    raise DataError(f"line counts differ: {src} has {n_src} lines but {tgt} has {n_tgt}; "
                    "a parallel corpus needs one sentence per line on each side")


def tsv_pairs(path: str | Path) -> Iterator[tuple[str, str]]:
    """(source, target) of ``source<TAB>target`` lines, streamed. A blank line is an empty pair
    (``("", "")``, which the readers skip and count); any other line needs exactly one tab."""
    for number, line in enumerate(lines(path), 1):
        if not line.strip():
            yield "", ""
            continue
        if line.count("\t") != 1:
            raise DataError(f"{path}: line {number} has {line.count(chr(9))} tabs; expected exactly one (source<TAB>target)")
        src, tgt = line.split("\t")
        yield src, tgt
