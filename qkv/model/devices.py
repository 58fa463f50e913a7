"""Which device a command runs on: ``--device auto|cpu|cuda|cuda:N``.

``auto`` takes the first GPU when PyTorch sees one (a CUDA build and a visible device), else the
CPU. Asking for a GPU that is not there is an error that says why, never a silent CPU run.
"""

from __future__ import annotations

import torch

from qkv.errors import QkvError

CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str = "auto") -> torch.device:
    """The torch.device that ``name`` asks for on this machine (ValueError when it cannot be had)."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise QkvError(f"unknown device {name!r}: use {CHOICES}")
    if not torch.cuda.is_available():
        why = "this PyTorch is a CPU build" if torch.version.cuda is None else "PyTorch sees no GPU here"
        raise QkvError(f"--device {name}: {why}; use --device cpu (or auto)")
    index = int(name[5:]) if ":" in name else 0
    if index >= torch.cuda.device_count():
        raise QkvError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu (2 threads)``, for the line a command prints."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n != 1 else ''})"
