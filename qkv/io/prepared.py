"""Prepared corpora: parallel text encoded once into memory-mapped arrays, for corpora of millions of pairs.

``qkv prepare`` reads the text (plain, ``.gz``, ``.xz`` or ``.bz2``; two files or one TSV per corpus,
one corpus or several; ``qkv.data.lines``) twice, streaming:
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

import hashlib
import itertools
import json
import os
import contextlib
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qkv.data import lines
from qkv.data.corpus import MAX_HELD_OUT, DataError, EncodedCorpus, ParallelCorpus, held_out, read_parallel, read_tsv
from qkv.data.tokenizer import Tokenizer
from qkv.data.workers import Workers
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


def read_pairs(src: str | Path, tgt: str | Path | None) -> Iterator[tuple[str, str]]:
    """(source, target) line pairs of two aligned files, or of one TSV when ``tgt`` is None, streamed by
    the reader ``qkv train`` uses too (``qkv.data.lines``): a blank TSV line is an empty pair, files of
    different lengths an error before the pair one lacks."""
    return lines.pairs(src, tgt) if tgt is not None else lines.tsv_pairs(src)


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

@dataclass(frozen=True)
class _Encoder:
    """Encodes a chunk of pairs and applies the filters that need no memory of other chunks; the
    encoding workers get it by the fork (``qkv.data.workers``), the tokenizer with it."""

    tokenizer: Tokenizer
    max_len: int
    filters: Filters

    def __call__(self, pairs: list[tuple[str, str]]) -> tuple[list[list[int]], list[list[int]], list[bytes], dict[str, int], int]:
        tok, max_len, filters = self.tokenizer, self.max_len, self.filters
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


def _chunks(pairs: Iterator[tuple[str, str]]) -> Iterator[list[tuple[str, str]]]:
    chunk: list[tuple[str, str]] = []
    for pair in pairs:
        chunk.append(pair)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


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
        # Read before any work: the validation files whole, then every training pair (the sample's
        # pass), so that a damaged file, a bad line or sides of different lengths stop it first.
        valid = _validation(valid_src, valid_tgt) if valid_src else None
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
        bar = tqdm(total=total - held, unit="pair", unit_scale=True, disable=not progress, desc="encoding")
        encode, n_workers = _Encoder(tokenizer, max_len, filters), workers or os.cpu_count() or 1
        with contextlib.ExitStack() as stack:  # the workers end (at once, after Ctrl-C) before OUT.tmp is removed
            if n_workers > 1:
                pool = stack.enter_context(contextlib.closing(Workers(encode, n_workers)))
                results = pool.map(_chunks(training), ahead=2 * n_workers)  # a few chunks in memory, not the corpus
            else:
                results = map(encode, _chunks(training))
            for src_ids, tgt_ids, digests, dropped, truncated in results:
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
        valid = _held_out(pairs, held) if valid is None else valid
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


def _validation(valid_src: str | Path, valid_tgt: str | Path | None) -> ParallelCorpus:
    """The validation pairs of the files given: two aligned files, or one TSV."""
    return read_parallel(valid_src, valid_tgt) if valid_tgt else read_tsv(valid_src)


def _held_out(pairs: Iterator[tuple[str, str]], held: int) -> ParallelCorpus:
    """The validation pairs held out: the ``held`` pairs left in ``pairs`` (the corpus's end)."""
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
    """A prepared directory, checked before anything in it is used: its manifest (every field's type,
    the dtype its vocabulary needs, exactly the files ``qkv prepare`` writes), each file regular and of
    the recorded size, the parsed ones (tokenizer, validation text) also their SHA-256, and the arrays'
    contents: offsets from 0, in order, ending at the ids' length, and every id inside the vocabulary.
    The arrays are not hashed (that would cost at every start what mapping saves), nor kept in memory."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, entry in manifest["files"].items():
        file = path / name
        if file.is_symlink() or (file.exists() and not file.is_file()):  # a FIFO would hang the reader, a device never end
            raise DataError(f"{file} is not a regular file: the directory is damaged")
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise DataError(f"{file} is missing or not the size {MANIFEST} records: the directory is damaged")
        if not name.startswith("train.") and sha256(file) != entry["sha256"]:
            raise DataError(f"{file} fails its SHA-256 check against {MANIFEST}: the directory is damaged")
    tokenizer = Tokenizer.load(path / TOKENIZER)
    if tokenizer.vocab_size != manifest["vocab_size"]:
        raise DataError(f"{path / MANIFEST} records a vocabulary of {manifest['vocab_size']}, its tokenizer has "
                        f"{tokenizer.vocab_size}: the directory is damaged")
    valid = read_parallel(path / "valid.src.txt", path / "valid.tgt.txt")
    prepared = Prepared(path, manifest, tokenizer, valid)
    for name in ("src", "tgt"):
        _check_arrays(prepared, name)
    return prepared


FILES = (TOKENIZER, "train.src.ids", "train.src.offsets", "train.tgt.ids", "train.tgt.offsets", "valid.src.txt", "valid.tgt.txt")


def _read_manifest(path: Path) -> dict[str, Any]:
    """``prepared.json``, every field the readers use checked for its type and range (one line each)."""
    where = path / MANIFEST
    try:
        manifest = json.loads(where.read_text(encoding="utf-8")) if where.is_file() else None
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or "files" not in manifest or "format" not in manifest:
        raise DataError(f"{path} is not a directory qkv prepare wrote (no valid {MANIFEST})")
    if manifest["format"] != FORMAT_VERSION:
        raise DataError(f"{where} has format {manifest['format']!r}; this qkv reads format {FORMAT_VERSION}")

    def count(value: Any, name: str, least: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise DataError(f"{where}: {name} must be an integer >= {least}, got {value!r}: the directory is damaged")
        return value

    vocab_size = count(manifest.get("vocab_size"), "vocab_size", 1)
    count(manifest.get("max_len"), "max_len", 1)
    counts = manifest.get("counts")
    dropped = counts.get("dropped") if isinstance(counts, dict) else None
    if not isinstance(dropped, dict):
        raise DataError(f"{where}: counts must hold kept, truncated and dropped: the directory is damaged")
    for name in ("kept", "truncated"):
        count(counts.get(name), f"counts.{name}")
    count(dropped.get("empty"), "counts.dropped.empty")
    dtype = "uint16" if vocab_size <= 1 << 16 else "int32"
    if manifest.get("dtype") != dtype:
        raise DataError(f"{where}: dtype must be {dtype} for a vocabulary of {vocab_size}, got {manifest.get('dtype')!r}: "
                        "the directory is damaged")
    files = manifest["files"]
    if not isinstance(files, dict) or sorted(files) != sorted(FILES):
        listed = sorted(files) if isinstance(files, dict) else files
        raise DataError(f"{where} must list exactly the files qkv prepare writes ({', '.join(FILES)}), "
                        f"got {listed!r}: the directory is damaged")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            raise DataError(f"{where}: the entry of {name} needs bytes and sha256: the directory is damaged")
        count(entry.get("bytes"), f"{name}'s bytes")
    return manifest


def _check_arrays(prepared: Prepared, name: str, chunk: int = 1 << 22) -> None:
    """One side's offsets start at 0, never decrease and end at its ids' length, and every id is inside
    the vocabulary, read in chunks (bounded memory) before training maps them: a damaged array would
    otherwise fail in the middle of a run (an id out of range), or after --overwrite cleared the old one."""
    dtype, files = np.dtype(prepared.manifest["dtype"]), prepared.manifest["files"]
    ids_bytes, offsets_bytes = files[f"train.{name}.ids"]["bytes"], files[f"train.{name}.offsets"]["bytes"]
    n_ids, damaged = ids_bytes // dtype.itemsize, f"{prepared.path}: train.{name}'s arrays are damaged"
    if ids_bytes % dtype.itemsize or offsets_bytes != 8 * (len(prepared) + 1):
        raise DataError(f"{damaged} (their sizes do not agree with {MANIFEST}'s {len(prepared)} pairs)")
    offsets = np.memmap(prepared.path / f"train.{name}.offsets", dtype=np.int64, mode="r")
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_ids:
        raise DataError(f"{damaged} (the offsets do not run from 0 to the {n_ids} ids)")
    for start in range(0, len(offsets) - 1, chunk):
        if len(backwards := np.flatnonzero(np.diff(offsets[start : start + chunk + 1]) < 0)):
            raise DataError(f"{damaged} (pair {start + int(backwards[0])} ends before it starts)")
    if n_ids:
        ids = np.memmap(prepared.path / f"train.{name}.ids", dtype=dtype, mode="r")
        for start in range(0, n_ids, chunk):
            part = ids[start : start + chunk]
            if int(part.max()) >= prepared.tokenizer.vocab_size or int(part.min()) < 0:
                raise DataError(f"{damaged} (ids outside the vocabulary of {prepared.tokenizer.vocab_size})")
