"""A run's log: ``log.jsonl`` (one JSON object per event), its TensorBoard copy, and the curves picture.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

from qkv.errors import QkvError


class RunLog:
    """Appends JSON lines to ``log.jsonl``; keeps the records for the curves plot.

    With ``enabled=False`` (ranks other than 0) records are kept in memory only, so a run's log is
    written once however many processes train it. A last line torn by a crash or a full disk is
    dropped (with a warning) when the log is opened again, so that the run can be resumed.
    """

    def __init__(self, path: Path, *, enabled: bool = True, writer: Any = None) -> None:
        """``writer``: a TensorBoard ``SummaryWriter`` (``open_tensorboard``) that also gets the numbers."""
        self.path = path
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self.tensorboard = writer if enabled else None
        if not enabled or not path.exists():  # other ranks never read the records
            return
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        for number, line in enumerate(complete.decode("utf-8", errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise QkvError(f"{path} line {number} is not valid JSON: the log is corrupted") from None
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
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise QkvError("--tensorboard needs the tensorboard package: pip install tensorboard (in qkv's clone: pip install -e '.[tensorboard]')") from None
    try:
        return SummaryWriter(str(directory))
    except OSError as error:
        raise QkvError(f"--tensorboard {directory}: cannot write there ({error.strerror or error})") from None


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
