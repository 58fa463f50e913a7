"""CTranslate2 as the search engine behind qkv's commands (``--engine ctranslate2``).

The checkpoint is exported once (``export_ctranslate2``) into qkv's cache, a directory named for the
checkpoint's manifest and the version of qkv's export code: ``$XDG_CACHE_HOME/qkv/ctranslate2/<sha256>``
(``~/.cache`` by default; ``QKV_CT2_CACHE`` sets another root). A checkpoint whose files change has
another manifest, and a fixed export code another ``EXPORT_VERSION``, hence another export; the
checkpoint's own directory and any directory the user did not give are never written. A new export
(``<hash>.unchecked`` until then) is checked against qkv's own search, as ``qkv export`` checks it: the first
sentences it translates, greedy, must come out the same by both engines (``PARITY_SENTENCES``,
``PARITY_MIN``), or the export is removed and the command stops with an error.

A cache entry carries its own manifest (``CACHE_MANIFEST``: each file's size and SHA-256, the
checkpoint's manifest hash, the export version, qkv's and CTranslate2's versions), written before the
entry gets its name, and is verified against it every time it is used (``verify_entry``). An entry
that does not verify (a file changed or cut short, another checkpoint's export, another export
version or CTranslate2) but is provably qkv's (its manifest names every file it holds) is deleted and
exported again; one without qkv's manifest, or holding a file the manifest does not name, is refused
in one line naming the directory, and never deleted.

An export is written in a staging directory (``<hash>.unchecked.<random>.tmp``) holding a marker
(``STAGING_MARKER``: the host and the id of the process writing it), then renamed into place. A process
killed during an export leaves its staging directory behind; a later export removes every one that qkv
can prove it left (``stale_staging``: its marker names a process of this host that is no longer
running, and it holds nothing but the marker and the export), and never anything else.

``CTranslate2Translator`` is a ``Translator`` whose ``translate_ids`` runs CTranslate2 under qkv's
search rules (``ct2_translate_ids``: the checkpoint's beam and length penalty, beam-size finished
hypotheses, as ``--stop-early``); everything above it (sentence splitting, streams, scores, the
trust signals computed by qkv's own teacher-forced pass over CTranslate2's output) is qkv's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from qkv.errors import QkvError
from qkv.infer.loop_guard import loops, number_pieces
from qkv.infer.search import DecodeConfig, Hypothesis, max_output_length
from qkv.infer.translator import Translator
from qkv.interop.ctranslate2 import EXPORT_FILES, import_ctranslate2, ct2_translate_ids, export_ctranslate2, is_export_dir
from qkv.io import checkpoint
from qkv.io.manifest import MANIFEST, sha256

# Source tokens per batch when --batch-tokens is not given: CTranslate2's fastest budget at beam 5 and
# greedy in float32, and at beam 5 in int8, in benchmark (c)'s own-settings table (docs/benchmarks.md).
CT2_BATCH_TOKENS = 512
PARITY_SENTENCES = 20  # a new export is checked on this many of the first sentences it translates
PARITY_MIN = 0.9  # the share of them that must come out the same as qkv's greedy search
UNCHECKED = ".unchecked"  # an export not yet checked (a process killed before its check leaves one to check again)
# The version of what qkv's export code writes (qkv.interop.ctranslate2): raised with every change to it that
# changes an export, so that no entry an older export wrote (a conversion with a bug) is used again.
EXPORT_VERSION = 2
CACHE_MANIFEST = "qkv_cache.json"  # a cache entry's own manifest (module docstring)
CACHE_FORMAT = "qkv ctranslate2 cache"
STAGING_MARKER = "qkv_staging.json"  # inside a staging directory: who writes it (module docstring)
STAGING_FORMAT = "qkv ctranslate2 staging"
_STAGING_NAME = re.compile(rf"[0-9a-f]{{32}}{re.escape(UNCHECKED)}\.[a-z0-9_]+\.tmp")  # tempfile.mkdtemp's names


def cache_root() -> Path:
    if os.environ.get("QKV_CT2_CACHE"):
        return Path(os.environ["QKV_CT2_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv" / "ctranslate2"


def checkpoint_digest(checkpoint_dir: Path) -> str:
    """The SHA-256 of the checkpoint's manifest, which holds every file's: what an export was made from."""
    return hashlib.sha256((Path(checkpoint_dir) / MANIFEST).read_bytes()).hexdigest()


def export_dir(checkpoint_dir: Path) -> Path:
    """Where the checkpoint's export lives: named for its manifest and ``EXPORT_VERSION``, so an export is
    reused exactly while the checkpoint's files and qkv's export code are unchanged."""
    key = f"{checkpoint_digest(checkpoint_dir)} ctranslate2 export {EXPORT_VERSION}"
    return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:32]


def _versions() -> dict[str, object]:
    import qkv

    return {"export_version": EXPORT_VERSION, "qkv": qkv.__version__, "ctranslate2": import_ctranslate2().__version__}


def write_cache_manifest(directory: Path, digest: str) -> None:
    """Write ``directory``'s ``CACHE_MANIFEST``: each file's size and SHA-256, the checkpoint's manifest
    hash ``digest`` and the versions that wrote it (``_versions``)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(directory.iterdir()) if p.name != CACHE_MANIFEST}
    record = {"format": CACHE_FORMAT, **_versions(), "checkpoint_manifest": digest, "files": files}
    (directory / CACHE_MANIFEST).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def verify_entry(directory: Path, digest: str) -> str | None:
    """None when the cache entry ``directory`` is what its manifest says and was exported from the checkpoint
    whose manifest hash is ``digest`` by this export code; else why not (the entry is qkv's: it may be
    deleted and exported again). A directory qkv cannot prove it wrote (no manifest of qkv's, a file or a
    link the manifest does not name) is a QkvError naming it: qkv never deletes it."""
    def refuse(why: str) -> QkvError:
        return QkvError(f"{directory} is in qkv's CTranslate2 cache but {why}, so qkv cannot tell it wrote it: "
                        "move it away or delete it, and run again")

    if directory.is_symlink() or not directory.is_dir():
        raise refuse("is not a directory")
    path = directory / CACHE_MANIFEST
    if path.is_symlink() or not path.is_file():
        raise refuse(f"holds no {CACHE_MANIFEST}")
    try:
        record = json.loads(path.read_bytes()[:1_000_001])
        files = record["files"]
        assert record["format"] == CACHE_FORMAT and isinstance(files, dict)
        sizes = {str(name): (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
    except (ValueError, KeyError, TypeError, AssertionError, AttributeError):
        raise refuse(f"its {CACHE_MANIFEST} is not qkv's") from None
    present = {p.name: p for p in directory.iterdir() if p.name != CACHE_MANIFEST}
    strangers = sorted(n for n, p in present.items() if n not in sizes or n not in EXPORT_FILES or p.is_symlink() or not p.is_file())
    if strangers:
        raise refuse(f"holds what its {CACHE_MANIFEST} does not list ({', '.join(strangers)})")
    versions = _versions()
    for key in ("export_version", "ctranslate2"):
        if record.get(key) != versions[key]:
            return f"written with {key.replace('_', ' ')} {record.get(key)}, not {versions[key]}"
    if record.get("checkpoint_manifest") != digest:
        return "it is the export of another checkpoint"
    for name, (size, hexdigest) in sorted(sizes.items()):
        if name not in present:
            return f"{name} is missing"
        if present[name].stat().st_size != size:
            return f"{name} is {present[name].stat().st_size} bytes, its manifest says {size}"
        if sha256(present[name]) != hexdigest:
            return f"{name} fails its SHA-256 check"
    return None


def _verified(entry: Path, digest: str, log) -> bool:
    """Whether the cache entry ``entry`` may be used: absent, False; verified, True; qkv's but not verified,
    deleted (saying why) and False; not provably qkv's, a QkvError naming it."""
    if not (entry.exists() or entry.is_symlink()):
        return False
    problem = verify_entry(entry, digest)
    if problem is None:
        return True
    log(f"the CTranslate2 export {entry} does not verify ({problem}): exporting again")
    shutil.rmtree(entry)
    return False


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one that exists but is another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_staging(directory: Path) -> bool:
    """Whether ``directory`` is a staging directory that qkv provably left: named as ``ensure_export`` names
    them, a real directory holding only its ``STAGING_MARKER`` and the export (a directory), the marker
    naming this host and a process that no longer runs. Anything else, say one whose process runs or
    whose marker is missing (a process killed before it wrote it), is not."""
    if not _STAGING_NAME.fullmatch(directory.name) or directory.is_symlink() or not directory.is_dir():
        return False
    marker = directory / STAGING_MARKER
    try:
        if marker.is_symlink() or not marker.is_file():
            return False
        record = json.loads(marker.read_bytes()[:10_000])
        pid, host = record["pid"], record["host"]
        if record["format"] != STAGING_FORMAT or type(pid) is not int or pid <= 0 or host != socket.gethostname():
            return False
        for entry in directory.iterdir():
            if entry.name != STAGING_MARKER and (entry.name != "export" or entry.is_symlink() or not entry.is_dir()):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return pid != os.getpid() and not _running(pid)


def remove_stale_staging(root: Path, log) -> None:
    """Remove the staging directories in the cache ``root`` that killed exports left (``stale_staging``)."""
    try:
        entries = list(root.iterdir())
    except OSError:  # no cache yet
        return
    for entry in entries:
        if stale_staging(entry):
            log(f"removing {entry}, left by a CTranslate2 export that did not finish")
            shutil.rmtree(entry, ignore_errors=True)


def ensure_export(checkpoint_dir: str | Path, *, log=lambda m: print(m, file=sys.stderr)) -> tuple[Path, bool]:
    """The checkpoint's CTranslate2 export, verified (``verify_entry``), or made if the cache has none
    (or none that verifies); and whether it is not yet checked (then ``CTranslate2Translator(check=True)``
    checks it on the first sentences it translates)."""
    resolved = checkpoint.resolve(checkpoint_dir)
    digest = checkpoint_digest(resolved)
    out = export_dir(resolved)
    unchecked = out.with_name(out.name + UNCHECKED)  # renamed to ``out`` once it passed its check
    remove_stale_staging(out.parent, log)  # what exports killed before, of this checkpoint or another
    if _verified(out, digest, log):
        return out, False
    if _verified(unchecked, digest, log):
        return unchecked, True
    unchecked.parent.mkdir(parents=True, exist_ok=True)
    log(f"exporting {resolved} to CTranslate2 once, into {out}")
    # Written and given its manifest in a directory of its own, then renamed: an entry is whole or absent.
    # The marker says whose it is, so that a later run can remove it if this process is killed.
    staging = Path(tempfile.mkdtemp(prefix=f"{unchecked.name}.", suffix=".tmp", dir=unchecked.parent))
    try:
        marker = {"format": STAGING_FORMAT, "pid": os.getpid(), "host": socket.gethostname()}
        (staging / STAGING_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        made = export_ctranslate2(resolved, staging / "export")
        write_cache_manifest(made, digest)
        try:
            os.replace(made, unchecked)
        except OSError:  # another process put its export there first: used if it verifies
            if not _verified(unchecked, digest, log):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return unchecked, True


class CTranslate2Translator(Translator):
    """A ``Translator`` whose search runs in CTranslate2 (``compute_type`` "float32" or "int8"); the
    model is qkv's, for the tokenizer, the limits and whatever reads its internals."""

    def __init__(self, model, tokenizer, config: DecodeConfig | None, *, ct2_dir: Path, compute_type: str = "float32",
                 threads: int = 0, check: bool | dict = False, log=lambda m: print(m, file=sys.stderr), engine=None,
                 **kwargs) -> None:
        """``check``: True to check a new export on the first sentences translated; the server passes one
        dict ``{"pending": bool, "failed": message or None}`` to all its Translators, so that a failed
        check stops every later batch too. ``engine``: a ``ctranslate2.Translator`` of ``ct2_dir`` to reuse
        (the server makes one Translator per batch and loads the model once)."""
        super().__init__(model, tokenizer, config, **kwargs)
        self.ct2_dir, self.log = Path(ct2_dir), log
        self.parity = check if isinstance(check, dict) else {"pending": bool(check), "failed": None}
        if self.config.sampling or self.config.n_best > 1:
            raise QkvError("--engine ctranslate2 searches for the best translation: not with --sampling or --n-best")
        if self.workers > 1:
            raise QkvError("--engine ctranslate2 runs with its own threads: not with --workers")
        # --shortlist: CTranslate2 searches over the export's vocabulary map (the checkpoint's shortlist,
        # written into the export as vmap.txt), a batch over the union of its sentences' pieces.
        self.use_vmap, self.shortlist = self.shortlist is not None, None
        if self.use_vmap and not (Path(ct2_dir) / "vmap.txt").is_file():
            raise QkvError(f"{ct2_dir} holds no vocabulary map: --shortlist needs an export of a checkpoint with a shortlist (qkv shortlist)")
        ct2 = import_ctranslate2()
        supported = ct2.get_supported_compute_types("cpu")
        if compute_type not in supported:
            raise QkvError(f"CTranslate2 on this CPU computes in {', '.join(sorted(supported))}, not {compute_type}")
        self.compute_type, self.threads = compute_type, threads or torch.get_num_threads()
        # CTranslate2's throughput layout: one batch per thread (inter_threads), each on one thread.
        self.engine = engine or ct2.Translator(str(ct2_dir), device="cpu", compute_type=compute_type,
                                               inter_threads=self.threads, intra_threads=1)

    def translate_ids(self, src_ids: list[list[int]]) -> list[list[Hypothesis]]:
        """CTranslate2's best translation of each source (scores are not kept: NaN); empty sources give ''."""
        if self.parity["failed"]:
            raise QkvError(self.parity["failed"])
        if self.parity["pending"]:
            self._check_parity(src_ids)
        found = ct2_translate_ids(self.engine, self.tokenizer, src_ids, self.config, max_len=self.model.config.max_len,
                                  max_tokens=self.batch_tokens(src_ids), use_vmap=self.use_vmap)
        if self.config.loop_guard:  # the loop guard, as qkv's search runs it: a looping output searched again
            numbers = number_pieces(self.tokenizer)
            again = [i for i, (ids, out) in enumerate(zip(src_ids, found))
                     if ids and loops(out, max_output_length(self.model, len(ids) + 1, self.config), numbers=numbers, source=ids)]
            if again:
                guarded = replace(self.config, no_repeat_ngram_size=self.config.loop_guard, loop_guard=0)
                looping = [src_ids[i] for i in again]
                redone = ct2_translate_ids(self.engine, self.tokenizer, looping, guarded, max_len=self.model.config.max_len,
                                           max_tokens=self.batch_tokens(looping), use_vmap=self.use_vmap)
                for i, tokens in zip(again, redone):
                    found[i] = tokens
        return [[Hypothesis(tokens, math.nan, math.nan)] for tokens in found]

    def batch_tokens(self, src_ids: list[list[int]]) -> int:
        """CTranslate2's batches, in source tokens: ``max_tokens``, but small enough that a call has at
        least a batch for each of its threads (one batch per thread runs at a time: a server's batch of 32
        sentences in one CTranslate2 batch would leave the other thread idle)."""
        sizes = [len(ids) + 1 for ids in src_ids if ids]
        if not sizes:
            return self.max_tokens
        return min(self.max_tokens, max(max(sizes), -(-sum(sizes) // self.threads)))

    def _check_parity(self, src_ids: list[list[int]]) -> None:
        """A new export's check: the first sentences, greedy, by qkv and by CTranslate2 (module docstring)."""
        sample = [ids for ids in src_ids if ids][:PARITY_SENTENCES]
        if not sample:
            return
        greedy = DecodeConfig(beam_size=1, max_len_a=self.config.max_len_a, max_len_b=self.config.max_len_b)
        ours = [h[0].tokens for h in Translator(self.model, self.tokenizer, greedy).translate_ids(sample)]
        engine = self.engine  # the export is checked in float32, as qkv computes (int8 is an approximation of it)
        if self.compute_type != "float32":
            engine = import_ctranslate2().Translator(str(self.ct2_dir), device="cpu", intra_threads=self.threads)
        theirs = ct2_translate_ids(engine, self.tokenizer, sample, greedy, max_len=self.model.config.max_len)
        same = sum(a == b for a, b in zip(ours, theirs))
        self.log(f"parity: {same} of {len(sample)} sentences translated the same by qkv and CTranslate2 (greedy)")
        if same < PARITY_MIN * len(sample):
            if self._unchecked_in_cache():  # qkv's own export only: a directory the caller gave is left alone
                import shutil

                shutil.rmtree(self.ct2_dir, ignore_errors=True)
            self.parity["failed"] = (f"CTranslate2's export translated only {same} of {len(sample)} sentences as qkv does: "
                                     "not using it (qkv export --check shows the differences)")
            raise QkvError(self.parity["failed"])
        self.parity["pending"] = False
        if self._unchecked_in_cache():  # checked: the export is the checkpoint's from now on
            checked = self.ct2_dir.with_name(self.ct2_dir.name.removesuffix(UNCHECKED))
            try:
                os.replace(self.ct2_dir, checked)
                self.ct2_dir = checked
            except OSError:  # another process put its checked export there first
                pass

    def _unchecked_in_cache(self) -> bool:
        """Whether ``ct2_dir`` is an export ``ensure_export`` made and has not checked yet: the only
        directory this class renames or removes."""
        d = self.ct2_dir
        return d.parent == cache_root() and d.name.endswith(UNCHECKED) and is_export_dir(d)
