"""A run directory's layout: what qkv writes there, what makes a directory a run, and what qkv may delete in it.

A run directory holds ``qkv-run.json`` (the run marker, written before anything else), ``log.jsonl``
(one JSON object per event), ``curves.png``, ``tokenizer.model``, ``last/`` (the newest checkpoint,
resumable), ``step-NNNNNN/`` (the last few, for averaging), ``best/`` and ``final/``, each possibly
with a ``.tmp``/``.old`` twin (marked as qkv's) while it is being replaced. A directory is a run only
when its marker says so (or, for runs made before the marker existed, its log starts with qkv's start
event), never because its file names look like qkv's; nothing else in it is qkv's, and
``--overwrite`` deletes only these.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from qkv.errors import QkvError
from qkv.io import checkpoint

LOG, CURVES, MARKER = "log.jsonl", "curves.png", "qkv-run.json"
ALIGNMENT_LINKS = "alignment-links.npz"  # guided alignment's links of the training pieces (qkv.train.alignment)
QKV_FILES = (LOG, CURVES, checkpoint.TOKENIZER, MARKER, ALIGNMENT_LINKS)
# last/, best/, final/, step-NNNNNN/ and their .tmp/.old twins (a save in progress, or interrupted).
CHECKPOINT_DIR = re.compile(r"(last|best|final|step-\d+)(\.tmp|\.old)?")
CHECKPOINT_FILES = checkpoint.FILES | {checkpoint.MARKER}  # every file qkv writes into a checkpoint directory


def mark_run(directory: Path) -> None:
    """Make ``directory`` (new or empty) a run: write the marker that ``is_run`` looks for."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / MARKER
    if not marker.is_file():
        marker.write_text(json.dumps({"qkv_run": 1, "created": round(time.time(), 3)}) + "\n", encoding="utf-8")


def is_run(directory: Path) -> bool:
    """True when ``directory`` holds a qkv run: qkv's run marker, or (a run made before the marker
    existed) a log whose first line is qkv's start event. Names alone never make a run."""
    marker = directory / MARKER
    if marker.is_file() and not marker.is_symlink():
        try:
            if json.loads(marker.read_text(encoding="utf-8", errors="replace")).get("qkv_run") == 1:
                return True
        except (json.JSONDecodeError, AttributeError, OSError):
            pass
    log = directory / LOG
    if log.is_file() and not log.is_symlink():
        with open(log, encoding="utf-8", errors="replace") as handle:
            first = handle.readline(4096)
        try:
            return json.loads(first).get("event") == "start"
        except (json.JSONDecodeError, AttributeError):
            pass
    return False


def qkv_entries(directory: Path) -> list[Path]:
    """What qkv wrote in ``directory``: its files and checkpoint directories, nothing else.

    A checkpoint-named directory holding a file qkv never writes is not qkv's, nor is a ``.tmp``/``.old``
    twin without qkv's marker (a user's backup): ValueError, before anything is deleted.
    """
    entries = []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and (match := CHECKPOINT_DIR.fullmatch(entry.name)):
            foreign = [f.name for f in entry.iterdir() if f.name not in CHECKPOINT_FILES or not f.is_file()]
            if foreign:
                raise QkvError(
                    f"{entry} holds files qkv did not write ({', '.join(sorted(foreign)[:3])}): move them away, "
                    "or choose another --out"
                )
            if match.group(2) and not checkpoint.is_save_residue(entry):
                raise QkvError(
                    f"{entry} was not left by a qkv save (no {checkpoint.MARKER} marker in it): move it away, "
                    "or choose another --out"
                )
            entries.append(entry)
        elif entry.is_file() and not entry.is_symlink() and entry.name in QKV_FILES:
            entries.append(entry)
    return entries


def run_entries(directory: Path) -> list[Path]:
    """The paths in ``directory`` that qkv writes when it is a run (its checkpoints, log, tokenizer,
    marker), whether or not they exist yet: what an output of the user's must stay out of."""
    names = [*QKV_FILES, *(f"{n}{twin}" for n in ("last", "best", "final") for twin in ("", ".tmp", ".old"))]
    steps = [e for e in directory.iterdir() if CHECKPOINT_DIR.fullmatch(e.name)] if directory.is_dir() else []
    return [directory / name for name in names] + steps


def check_new_run(out: Path, *, overwrite: bool) -> str | None:
    """Why ``out`` cannot take a new run (a one-line message), or None when it can.

    An existing run is continued with ``--resume``, or started over with ``--overwrite``; a non-empty
    directory that is not a qkv run (``is_run``: the marker decides, not the names of the files) is
    never used, with or without ``--overwrite``.
    """
    if not out.exists():
        return None
    if not out.is_dir():
        return f"--out {out} is a file, not a directory"
    entries = list(out.iterdir())
    if not entries:
        return None
    if not is_run(out):
        return f"--out {out} is not empty and holds no qkv run: choose a new or empty directory"
    if not overwrite:
        if (out / "last" / checkpoint.CONFIG).is_file() or checkpoint.moved_aside(out / "last.old"):  # what --resume loads
            return (
                f"--out {out} already holds a run: continue it with qkv train --resume {out}, or start over "
                "with --overwrite (deletes only what qkv wrote there)"
            )
        return (
            f"--out {out} holds a run that saved no checkpoint to resume from: start it over with --overwrite "
            "(deletes only what qkv wrote there)"
        )
    try:
        qkv_entries(out)
    except ValueError as error:
        return str(error)
    return None


def clear_run(out: Path) -> list[str]:
    """Delete what qkv wrote in the run directory ``out`` (--overwrite); return the names deleted."""
    deleted = []
    for entry in qkv_entries(out):
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        deleted.append(entry.name)
    return deleted
