"""What a checkpoint directory may hold, and its manifest: every other file's size and SHA-256.

The manifest is written last, once every other file is whole, and checked before anything in the
directory is parsed: it must name only checkpoint files, each a regular file (no symlinks, devices
or paths outside the directory) of the recorded size and checksum. ``qkv.io.checkpoint`` writes and
loads checkpoints through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from qkv.errors import CheckpointError

FORMAT_VERSION = 1
WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.model"
TRAINER_TENSORS, TRAINER_JSON = "trainer.safetensors", "trainer.json"
SHORTLIST = "shortlist.safetensors"  # optional: a vocabulary shortlist for decoding (qkv.infer.shortlist)
CONFIDENCE = "confidence.json"  # optional: the model's trust calibration (qkv calibrate; qkv.inspect.trust)
MANIFEST = "manifest.json"
MARKER = ".qkv-save"  # inside NAME.tmp/ and NAME.old/ while qkv writes or replaces NAME: proof they are qkv's
REQUIRED = (WEIGHTS, CONFIG, TOKENIZER)
FILES = frozenset((*REQUIRED, TRAINER_TENSORS, TRAINER_JSON, SHORTLIST, CONFIDENCE, MANIFEST))  # all a checkpoint may hold
MAX_MANIFEST_BYTES = 1 << 20


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def sha256(path: Path, *, follow_symlinks: bool = True) -> str:
    """The SHA-256 of ``path``'s bytes, read in 1 MiB blocks; without ``follow_symlinks`` a symlink
    is refused by the open itself (OSError), so a file swapped for one after its lstat is never read."""
    opener = None if follow_symlinks else (lambda p, flags: os.open(p, flags | os.O_NOFOLLOW))
    digest = hashlib.sha256()
    with open(path, "rb", opener=opener) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write(directory: Path) -> None:
    """Write ``directory/manifest.json`` for the files ``directory`` holds now (but the marker)."""
    files = {
        f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
        for f in sorted(directory.iterdir())
        if f.name not in (MANIFEST, MARKER)
    }
    write_json(directory / MANIFEST, {"format": FORMAT_VERSION, "files": files})


def _regular_file(path: Path, hint: str) -> os.stat_result:
    """lstat ``path`` and refuse anything but a regular file (a symlink, a FIFO, /dev/zero ...)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint{hint}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a symlink or special file): refused{hint}")
    return info


def listed(directory: Path, hint: str = "") -> dict[str, dict[str, Any]]:
    """The validated ``files`` table of ``directory/manifest.json``; ``hint`` ends its error messages."""
    path = directory / MANIFEST
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(
            f"{directory} has no {MANIFEST}, so its files cannot be verified: refused "
            f"(qkv writes one into every checkpoint; a directory without it is incomplete or not from qkv){hint}"
        )
    if _regular_file(path, hint).st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a qkv manifest{hint}")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
        files = manifest["files"]
        valid = manifest["format"] == FORMAT_VERSION and isinstance(files, dict) and all(
            isinstance(e, dict) and type(e.get("bytes")) is int and e["bytes"] >= 0
            and isinstance(e.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
            for e in files.values()
        )
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        valid = False
    if not valid:
        raise CheckpointError(f"{path} is not a valid manifest; the checkpoint is corrupted{hint}")
    unknown = sorted(name for name in files if name not in FILES - {MANIFEST})
    if unknown:  # names are never used as paths unless they are one of ours: no "../x", no "/dev/zero"
        raise CheckpointError(f"{path} lists files a checkpoint does not hold ({', '.join(map(repr, unknown[:3]))}): refused{hint}")
    missing = [name for name in REQUIRED if name not in files]
    if missing:
        raise CheckpointError(f"{path} does not list {', '.join(missing)}: not a complete checkpoint{hint}")
    return files


def verify(directory: Path, hint: str = "") -> None:
    """Check every file against ``manifest.json``; raise CheckpointError naming the first that
    differs, its message ending with ``hint``.

    A directory without a valid manifest is refused, as is one whose manifest names anything but
    checkpoint files, leaves out a checkpoint file the directory holds, or whose files are symlinks or
    special files.
    """
    files = listed(directory, hint)
    unlisted = sorted(name for name in FILES - {MANIFEST} - set(files) if os.path.lexists(directory / name))
    if unlisted:  # it could not be verified, and a later step (--resume) would read it
        raise CheckpointError(f"{directory / unlisted[0]} is not in the checkpoint's manifest, so it cannot be verified: refused{hint}")
    for name, entry in files.items():
        file = directory / name
        size = _regular_file(file, hint).st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file} is {size} bytes, its manifest says {entry['bytes']}: the file is truncated or corrupted{hint}")
        if sha256(file, follow_symlinks=False) != entry["sha256"]:
            raise CheckpointError(f"{file} fails its SHA-256 check: the file is corrupted{hint}")
