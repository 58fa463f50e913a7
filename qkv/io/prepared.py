"""Prepared corpora: parallel text encoded once into memory-mapped arrays, for corpora of millions of pairs.

``qkv prepare`` reads the text (plain, ``.gz`` or ``.xz``; two files or one TSV per corpus, one corpus
or several) twice, streaming:
first to draw a seeded sample of sentences and train the tokenizer on it, then to encode every pair
in worker processes. A pair is kept unless a filter drops it (each counted, each switchable). The
directory it writes holds

    prepared.json            what was prepared, the counts, and every other file's size and SHA-256
    tokenizer.model          the joint SentencePiece model
    train.src.ids            the source token ids of every kept pair, one after another (uint16 or int32)
    train.src.offsets        int64, N + 1: pair i's ids are ids[offsets[i]:offsets[i + 1]]
    train.tgt.ids, train.tgt.offsets
    valid.src.txt, valid.tgt.txt   the validation pairs as text (validation scores real translations)

The directory is built as ``OUT.tmp/`` (marked as qkv's with ``.qkv-save``) and renamed to ``OUT``
only when complete, so a killed preparation never leaves a directory that looks prepared; the next
run deletes the marked ``OUT.tmp/`` and starts again. Training maps the arrays instead of loading
them (``load_prepared``): its memory and start-up time do not grow with the corpus.

Dimension legend: N pairs kept, L tokens of one side of one pair.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import lzma
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from qkv.data.corpus import MAX_HELD_OUT, DataError, EncodedCorpus, ParallelCorpus, held_out, read_parallel, read_tsv
from qkv.data.tokenizer import Tokenizer
from qkv.io.checkpoint import sha256

FORMAT_VERSION = 1
MANIFEST, TOKENIZER, MARKER = "prepared.json", "tokenizer.model", ".qkv-save"
CHUNK = 20_000  # pairs a worker encodes at a time


@dataclass(frozen=True)
class Filters:
    """Which pairs ``qkv prepare`` drops (each on by default, as a careful practitioner would want)."""

    empty: bool = True  # a side empty or blank
    too_long: bool = True  # a side longer than max_len tokens (otherwise: truncated to max_len)
    ratio: float = 3.0  # one side more than this many times the other's tokens (0: keep all)
    duplicates: bool = True  # the same (source, target) pair seen before
    copies: bool = True  # the source equals the target


@dataclass
class Counts:
    read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {"empty": 0, "too_long": 0, "ratio": 0, "duplicates": 0, "copies": 0})


# ---- reading ---------------------------------------------------------------------------------


def _open_text(path: Path) -> IO[str]:
    opener = gzip.open if path.suffix == ".gz" else lzma.open if path.suffix == ".xz" else open
    return opener(path, "rt", encoding="utf-8", errors="strict", newline="\n")


def read_pairs(src: str | Path, tgt: str | Path | None) -> Iterator[tuple[str, str]]:
    """(source, target) line pairs of two aligned files, or of one TSV when ``tgt`` is None, streamed."""
    src = Path(src)
    try:
        if tgt is None:
            with _open_text(src) as handle:
                for number, line in enumerate(handle, 1):
                    parts = line.rstrip("\n").split("\t")
                    if len(parts) != 2:
                        raise DataError(f"{src} line {number}: expected source<TAB>target, got {len(parts)} field(s)")
                    yield parts[0], parts[1]
            return
        tgt = Path(tgt)
        with _open_text(src) as a, _open_text(tgt) as b:
            number = 0
            for number, (s, t) in enumerate(zip(a, b), 1):
                yield s.rstrip("\n"), t.rstrip("\n")
            if next(a, None) is not None or next(b, None) is not None:
                raise DataError(f"{src} and {tgt} have different numbers of lines (they differ after line {number})")
    except UnicodeDecodeError as error:
        raise DataError(f"{src if tgt is None else f'{src} or {tgt}'} is not valid UTF-8 ({error.reason})") from None
    except FileNotFoundError as error:
        raise DataError(f"{error.filename} does not exist") from None


def read_corpora(srcs: Sequence[Path], tgts: Sequence[Path] | None) -> Iterator[tuple[str, str]]:
    """The pairs of several corpora, one after another: ``srcs[i]`` with ``tgts[i]``, or TSVs when ``tgts`` is None."""
    for i, src in enumerate(srcs):
        yield from read_pairs(src, tgts[i] if tgts else None)


def _sample(pairs: Iterator[tuple[str, str]], k: int, seed: int, *, hold_out: bool) -> tuple[list[str], int]:
    """A seeded uniform sample of at most ``k`` pairs (reservoir sampling), as the sample's sources then
    its targets (the order ``qkv train`` gives its tokenizer the text files); the pairs read. With
    ``hold_out``, the pairs :func:`held_out` keeps for validation are left out of the sample: each pair
    is offered to the reservoir only once ``MAX_HELD_OUT`` more have been read, or at the end if it is not held out."""
    rng = random.Random(seed)
    reservoir: list[tuple[str, str]] = []
    offered = 0

    def offer(pair: tuple[str, str]) -> None:
        nonlocal offered
        offered += 1
        if len(reservoir) < k:
            reservoir.append(pair)
        elif (j := rng.randrange(offered)) < k:
            reservoir[j] = pair

    waiting: deque[tuple[str, str]] = deque()
    n = 0
    for n, pair in enumerate(pairs, 1):
        waiting.append(pair)
        if len(waiting) > (MAX_HELD_OUT if hold_out else 0):
            offer(waiting.popleft())
    for pair in itertools.islice(waiting, len(waiting) - (held_out(n) if hold_out and n else 0)):
        offer(pair)
    return [s for s, _ in reservoir] + [t for _, t in reservoir], n


# ---- encoding in worker processes --------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _start_worker(model_proto: bytes) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_bytes(model_proto)


def _encode_chunk(args: tuple[list[tuple[str, str]], int, Filters]) -> tuple[list[list[int]], list[list[int]], list[bytes], dict[str, int], int]:
    """Encode a chunk of pairs and apply the filters that need no memory of other chunks."""
    pairs, max_len, filters = args
    tok = _worker_tokenizer
    src_ids = tok.encode_batch([s for s, _ in pairs])
    tgt_ids = tok.encode_target_batch([t for _, t in pairs])
    dropped = dict.fromkeys(Counts().dropped, 0)
    kept_src, kept_tgt, digests, truncated = [], [], [], 0
    for (s, t), a, b in zip(pairs, src_ids, tgt_ids):
        if not s.strip() or not t.strip() or not a or not b:
            if filters.empty:
                dropped["empty"] += 1
                continue
        if filters.copies and s.strip() == t.strip():
            dropped["copies"] += 1
            continue
        if len(a) > max_len or len(b) > max_len:
            if filters.too_long:
                dropped["too_long"] += 1
                continue
            a, b, truncated = a[:max_len], b[:max_len], truncated + 1
        if filters.ratio and max(len(a), len(b)) > filters.ratio * max(1, min(len(a), len(b))):
            dropped["ratio"] += 1
            continue
        kept_src.append(a)
        kept_tgt.append(b)
        digests.append(hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=16).digest())
    return kept_src, kept_tgt, digests, dropped, truncated


def _chunks(pairs: Iterator[tuple[str, str]], max_len: int, filters: Filters) -> Iterator[tuple[list[tuple[str, str]], int, Filters]]:
    chunk: list[tuple[str, str]] = []
    for pair in pairs:
        chunk.append(pair)
        if len(chunk) == CHUNK:
            yield chunk, max_len, filters
            chunk = []
    if chunk:
        yield chunk, max_len, filters


class _Side:
    """One side's ids and offsets, appended to two files as the chunks arrive."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype) -> None:
        self.ids = open(directory / f"{name}.ids", "wb")
        self.offsets = open(directory / f"{name}.offsets", "wb")
        self.dtype, self.end = dtype, 0
        np.zeros(1, dtype=np.int64).tofile(self.offsets)

    def append(self, sequences: list[list[int]]) -> None:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        np.fromiter((i for s in sequences for i in s), dtype=self.dtype, count=int(lengths.sum())).tofile(self.ids)
        (self.end + np.cumsum(lengths)).tofile(self.offsets)
        self.end += int(lengths.sum())

    def close(self) -> None:
        for handle in (self.ids, self.offsets):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()


# ---- the command's library function ----------------------------------------------------------


@dataclass
class PrepareSummary:
    out: Path
    counts: Counts
    seconds: float
    valid_pairs: int


def prepare(
    train_src: str | Path | Sequence[str | Path], train_tgt: str | Path | Sequence[str | Path] | None, out: str | Path, *,
    valid_src: str | Path | None = None, valid_tgt: str | Path | None = None, vocab_size: int = 8000,
    max_len: int = 128, sample: int = 1_000_000, seed: int = 1, workers: int | None = None,
    filters: Filters = Filters(), progress: bool = True,
) -> PrepareSummary:
    """Write the prepared directory ``out`` (module docstring). ``out`` must not exist; a marked
    ``OUT.tmp/`` left by a killed run is deleted first. Without validation files, the last 5% of
    the training pairs (at most 1,000) are held out, as ``qkv train`` does with text files.

    Several corpora: ``train_src`` a list of files and ``train_tgt`` a list as long (aligned file by
    file), or None when every ``train_src`` is a TSV. They are read one after another, as one corpus."""
    from tqdm import tqdm

    started = time.monotonic()
    out = Path(out)
    srcs = [Path(train_src)] if isinstance(train_src, (str, Path)) else [Path(f) for f in train_src]
    tgts = None if train_tgt is None else [Path(train_tgt)] if isinstance(train_tgt, (str, Path)) else [Path(f) for f in train_tgt]
    if not srcs or (tgts is not None and len(tgts) != len(srcs)):
        raise DataError(f"{len(srcs)} source file(s) but {len(tgts or [])} target file(s): give one target file per source "
                        "file, or none when every source file is a TSV")
    if out.exists() or out.is_symlink():
        raise DataError(f"--out {out} exists: prepare into a new directory")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        if not (tmp / MARKER).is_file():
            raise DataError(f"{tmp} is in the way and qkv did not write it (no {MARKER} in it): move it and try again")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / MARKER).write_text("written by qkv prepare; safe to delete with this directory\n")
    try:
        sentences, total = _sample(read_corpora(srcs, tgts), sample, seed, hold_out=not valid_src)
        if total == 0:
            raise DataError(f"{', '.join(map(str, srcs))} hold(s) no pairs")
        held = 0 if valid_src else held_out(total)
        if held >= total:
            raise DataError(f"{', '.join(map(str, srcs))} hold(s) {total} pair(s): too few to hold some out for "
                            "validation and train on the rest; give --valid-src")
        with tempfile.TemporaryDirectory(prefix="qkv-prepare-") as aside:
            tokenizer = Tokenizer.train(sentences, vocab_size, Path(aside) / TOKENIZER, seed=seed)
        del sentences
        tokenizer.save(tmp / TOKENIZER)
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32)
        sides = {name: _Side(tmp, f"train.{name}", dtype) for name in ("src", "tgt")}
        counts, seen = Counts(), set()
        pairs = read_corpora(srcs, tgts)
        training = itertools.islice(pairs, total - held)  # the rest of ``pairs`` is the held-out validation
        context = multiprocessing.get_context("fork")
        bar = tqdm(total=total - held, unit="pair", unit_scale=True, disable=not progress, desc="encoding")
        with context.Pool(workers or os.cpu_count() or 1, _start_worker, (tokenizer.model_proto,)) as pool:
            for src_ids, tgt_ids, digests, dropped, truncated in pool.imap(_encode_chunk, _chunks(training, max_len, filters)):
                keep = [i for i, d in enumerate(digests) if not (filters.duplicates and (d in seen or seen.add(d)))]
                counts.dropped["duplicates"] += len(digests) - len(keep)
                for name, ids in (("src", src_ids), ("tgt", tgt_ids)):
                    sides[name].append([ids[i] for i in keep])
                n_read = len(digests) + sum(dropped.values())
                counts.read += n_read
                counts.kept += len(keep)
                counts.truncated += truncated
                for reason, n in dropped.items():
                    counts.dropped[reason] += n
                bar.update(n_read)
        bar.close()
        for side in sides.values():
            side.close()
        valid = _validation(pairs, held, valid_src, valid_tgt)
        (tmp / "valid.src.txt").write_text("".join(s + "\n" for s in valid.src), encoding="utf-8")
        (tmp / "valid.tgt.txt").write_text("".join(t + "\n" for t in valid.tgt), encoding="utf-8")
        if counts.kept == 0:
            raise DataError(f"every pair of {', '.join(map(str, srcs))} was dropped by a filter ({counts.dropped})")
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(tmp.iterdir()) if p.name != MARKER}
        manifest = {
            "format": FORMAT_VERSION, "vocab_size": tokenizer.vocab_size, "max_len": max_len, "dtype": dtype.name,
            "seed": seed, "sample": sample, "filters": asdict(filters), "counts": asdict(counts),
            "valid_pairs": len(valid), "sources": [str(p) for p in (*srcs, *(tgts or []), valid_src, valid_tgt) if p],
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        (tmp / MARKER).unlink()
        os.replace(tmp, out)  # the directory appears only now, whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareSummary(out, counts, time.monotonic() - started, len(valid))


def _validation(pairs: Iterator[tuple[str, str]], held: int, valid_src, valid_tgt) -> ParallelCorpus:
    """The validation pairs: the files given, or the ``held`` pairs left in ``pairs`` (the corpus's end)."""
    if valid_src:
        return read_parallel(valid_src, valid_tgt) if valid_tgt else read_tsv(valid_src)
    rest = [(s, t) for s, t in pairs if s.strip() and t.strip()]
    return ParallelCorpus([s for s, _ in rest], [t for _, t in rest], held - len(rest), "held out")


# ---- reading a prepared directory (training) ---------------------------------------------------


class MappedSide(Sequence):
    """One side's token ids, memory-mapped: ``side[i]`` is pair i's ids (a list, cut to ``max_len``)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, max_len: int) -> None:
        self.ids, self.offsets, self.max_len = ids, offsets, max_len

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        start = int(self.offsets[i])
        return self.ids[start : min(int(self.offsets[i + 1]), start + self.max_len)].tolist()

    def lengths(self) -> np.ndarray:
        """(N,) every pair's length on this side, cut to ``max_len``."""
        return np.minimum(np.diff(self.offsets), self.max_len)


@dataclass
class Prepared:
    path: Path
    manifest: dict[str, Any]
    tokenizer: Tokenizer
    valid: ParallelCorpus

    def __len__(self) -> int:
        return int(self.manifest["counts"]["kept"])

    @property
    def skipped_empty(self) -> int:
        return int(self.manifest["counts"]["dropped"]["empty"])

    def validation(self, limit: int = 0) -> ParallelCorpus:
        """The validation pairs (text), the first ``limit`` of them when ``limit`` > 0."""
        if not limit:
            return self.valid
        return ParallelCorpus(self.valid.src[:limit], self.valid.tgt[:limit], self.valid.skipped_empty, self.valid.name)

    def train_ids(self, max_len: int, limit: int = 0) -> EncodedCorpus:
        """The training pairs' ids (the first ``limit`` when > 0), mapped: nothing is read until a batch asks for it."""
        dtype = np.dtype(self.manifest["dtype"])
        sides = []
        for name in ("src", "tgt"):
            ids = np.memmap(self.path / f"train.{name}.ids", dtype=dtype, mode="r") if self._size(f"train.{name}.ids") else np.zeros(0, dtype)
            offsets = np.memmap(self.path / f"train.{name}.offsets", dtype=np.int64, mode="r")
            if len(offsets) != len(self) + 1 or int(offsets[-1]) != len(ids):
                raise DataError(f"{self.path}: train.{name}'s arrays do not agree with {MANIFEST}: the directory is damaged")
            sides.append(MappedSide(ids, offsets[: limit + 1] if limit else offsets, max_len))
        over = (np.diff(sides[0].offsets) > max_len) | (np.diff(sides[1].offsets) > max_len)  # cut by this run
        return EncodedCorpus(sides[0], sides[1], int(self.manifest["counts"]["truncated"]) + int(over.sum()))

    def _size(self, name: str) -> int:
        return int(self.manifest["files"][name]["bytes"])


def is_prepared(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def load_prepared(path: str | Path) -> Prepared:
    """A prepared directory: every file's size checked against its manifest, the files that are parsed
    (tokenizer, validation text) also their SHA-256; the arrays are not read."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files, version = manifest["files"], manifest["format"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{path} is not a directory qkv prepare wrote (no valid {MANIFEST})") from None
    if version != FORMAT_VERSION:
        raise DataError(f"{path / MANIFEST} has format {version!r}; this qkv reads format {FORMAT_VERSION}")
    for name, entry in files.items():
        if "/" in name or name.startswith(".") or not (path / name).is_file() or (path / name).stat().st_size != entry["bytes"]:
            raise DataError(f"{path / name} is missing or not the size {MANIFEST} records: the directory is damaged")
        # The small files are parsed: verify them first. The arrays are only mapped (hashing gigabytes at
        # every start would cost what mapping saves); their sizes are checked above and against the offsets.
        if not name.startswith("train.") and sha256(path / name) != entry["sha256"]:
            raise DataError(f"{path / name} fails its SHA-256 check against {MANIFEST}: the directory is damaged")
    if TOKENIZER not in files:
        raise DataError(f"{path / MANIFEST} does not list {TOKENIZER}: the directory is damaged")
    tokenizer = Tokenizer.load(path / TOKENIZER)
    valid = read_parallel(path / "valid.src.txt", path / "valid.tgt.txt")
    return Prepared(path, manifest, tokenizer, valid)
