"""A run directory: its log, its curves, its step checkpoints, and what qkv may delete in it.

A run directory holds ``log.jsonl`` (one JSON object per event), ``curves.png``, ``tokenizer.model``,
``last/`` (the newest checkpoint, resumable), ``step-NNNNNN/`` (the last few, for averaging), ``best/``
and ``final/``, each possibly with a ``.tmp``/``.old`` twin while it is being replaced. Nothing else
in the directory is qkv's, and ``--overwrite`` deletes only these.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from qkv import checkpoint
from qkv.checkpoint import step_dirs  # by step number: step-1000000 after step-999999

LOG, CURVES = "log.jsonl", "curves.png"
QKV_FILES = (LOG, CURVES, checkpoint.TOKENIZER)
# last/, best/, final/, step-NNNNNN/ and their .tmp/.old twins (a save in progress, or interrupted).
CHECKPOINT_DIR = re.compile(r"(last|best|final|step-\d+)(\.tmp|\.old)?")
CHECKPOINT_FILES = checkpoint.FILES  # every file qkv writes into a checkpoint directory


def is_run(directory: Path) -> bool:
    """True when ``directory`` holds a qkv run: a log that starts with qkv's start event, or a checkpoint."""
    log = directory / LOG
    if log.is_file():
        with open(log, encoding="utf-8", errors="replace") as handle:
            first = handle.readline()
        try:
            if json.loads(first).get("event") == "start":
                return True
        except (json.JSONDecodeError, AttributeError):
            pass
    return any(
        CHECKPOINT_DIR.fullmatch(d.name) and (d / checkpoint.CONFIG).is_file() for d in directory.iterdir() if d.is_dir()
    )


def qkv_entries(directory: Path) -> list[Path]:
    """What qkv wrote in ``directory``: its files and checkpoint directories, nothing else.

    A checkpoint-named directory holding a file qkv never writes is not qkv's: ValueError, before
    anything is deleted.
    """
    entries = []
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and CHECKPOINT_DIR.fullmatch(entry.name):
            foreign = [f.name for f in entry.iterdir() if f.name not in CHECKPOINT_FILES or not f.is_file()]
            if foreign:
                raise ValueError(
                    f"{entry} holds files qkv did not write ({', '.join(sorted(foreign)[:3])}): move them away, "
                    "or choose another --out"
                )
            entries.append(entry)
        elif entry.is_file() and not entry.is_symlink() and entry.name in QKV_FILES:
            entries.append(entry)
    return entries


def check_new_run(out: Path, *, overwrite: bool) -> str | None:
    """Why ``out`` cannot take a new run (a one-line message), or None when it can.

    An existing run is continued with ``--resume``, or started over with ``--overwrite``; a non-empty
    directory that is not a qkv run is never used, with or without ``--overwrite``. A directory
    holding nothing but qkv's names (a run stopped before its first checkpoint, say while its
    tokenizer was trained) counts as a run.
    """
    if not out.exists():
        return None
    if not out.is_dir():
        return f"--out {out} is a file, not a directory"
    entries = list(out.iterdir())
    if not entries:
        return None
    only_qkv_names = all(e.name in QKV_FILES or CHECKPOINT_DIR.fullmatch(e.name) for e in entries)
    if not (only_qkv_names or is_run(out)):
        return f"--out {out} is not empty and holds no qkv run: choose a new or empty directory"
    if not overwrite:
        if any((out / name / checkpoint.CONFIG).is_file() for name in ("last", "last.old")):
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


class RunLog:
    """Appends JSON lines to ``log.jsonl``; keeps the records for the curves plot.

    With ``enabled=False`` (ranks other than 0) records are kept in memory only, so a run's log is
    written once however many processes train it. A last line torn by a crash or a full disk is
    dropped (with a warning) when the log is opened again, so that the run can be resumed.
    """

    def __init__(self, path: Path, *, enabled: bool = True, tensorboard: str | Path | None = None) -> None:
        self.path = path
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self.tensorboard = open_tensorboard(tensorboard) if tensorboard and enabled else None
        if not enabled or not path.exists():  # other ranks never read the records
            return
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        for number, line in enumerate(complete.decode("utf-8", errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ValueError(f"{path} line {number} is not valid JSON: the log is corrupted") from None
        if len(complete) < len(data):
            torn = len(data) - len(complete)
            warnings.warn(f"{path}: dropped a torn last line ({torn} bytes) left by an interrupted write", stacklevel=2)
            with open(path, "r+b") as handle:
                handle.truncate(len(complete))

    def write(self, **record: Any) -> None:
        """Append one record. The file is written first: when the write fails (a full disk), the
        record is not kept in memory either, and the error says so."""
        record = {"time": round(time.time(), 3), **record}
        if self.enabled:
            try:
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")
            except OSError as error:
                failure = OSError(f"cannot append to {self.path} ({error.strerror or error}); the run stops here")
                failure.errno = error.errno
                raise failure from None
        self.records.append(record)
        if self.tensorboard is not None and record.get("event") in ("train", "valid") and "step" in record:
            for key, value in record.items():
                if key not in ("time", "event", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(f"{record['event']}/{key}", value, record["step"])
            if record["event"] == "valid":
                self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def open_tensorboard(directory: str | Path):
    """A TensorBoard ``SummaryWriter`` for ``--tensorboard DIR`` (the optional tensorboard package)."""
    return _summary_writer()(str(directory))


def check_tensorboard() -> None:
    """Refuse ``--tensorboard`` without the package, before a run deletes or writes anything."""
    _summary_writer()


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install 'qkv[tensorboard]'") from None
    return SummaryWriter


def plot_curves(records: list[dict[str, Any]], path: Path) -> None:
    """Training loss, validation loss and validation BLEU against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("event") == "train"]
    valid = [r for r in records if r.get("event") == "valid"]
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", alpha=0.7)
    ax_loss.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (label-smoothed, per token)", title="loss")
    ax_loss.legend()
    ax_bleu.plot([r["step"] for r in valid], [r["bleu"] for r in valid], "o-", color="tab:green")
    ax_bleu.set(xlabel="step", ylabel="BLEU", title="validation BLEU (real decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
