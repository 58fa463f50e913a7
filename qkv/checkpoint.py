"""Checkpoints: self-contained directories that load without unpickling anything.

A checkpoint directory holds
    model.safetensors    the weights (tied tensors stored once)
    config.json          format version, the model config and the training/data configs
    tokenizer.model      the SentencePiece model, so the directory alone translates
and, for checkpoints a run can resume from,
    trainer.safetensors  optimizer moments and the torch RNG state
    trainer.json         step, epoch, position in the epoch, schedule, Python/NumPy RNG states, metrics
and last
    manifest.json        every other file's size and SHA-256, checked on load
Directories are written under a temporary name, fsynced and renamed into place, so a crash mid-write
never leaves a half-written checkpoint under the real name; a file damaged later (a truncated copy,
a flipped bit, a full disk) fails its checksum with an error naming the file and the run's other
checkpoints to use instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from qkv.config import ModelConfig
from qkv.model import Transformer
from qkv.tokenizer import Tokenizer

FORMAT_VERSION = 1
WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.model"
TRAINER_TENSORS, TRAINER_JSON = "trainer.safetensors", "trainer.json"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or from an unknown format."""


@dataclass
class Checkpoint:
    path: Path
    model: Transformer
    tokenizer: Tokenizer
    config: dict[str, Any]  # the whole config.json


def resolve(path: str | Path) -> Path:
    """The checkpoint directory for ``path``: the directory itself, or a run's ``final``/``best``/``last``."""
    path = Path(path)
    previous = path.with_name(path.name + ".old")
    if not path.exists() and (previous / CONFIG).exists():
        return previous  # a crash came between the two renames of _publish: the old one is whole
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / CONFIG).exists() or (path / WEIGHTS).exists():
        return path
    for name in ("final", "best", "last"):
        if (path / name / CONFIG).exists():
            return path / name
    raise CheckpointError(f"{path} is not a checkpoint directory (no {CONFIG} or {WEIGHTS} in it)")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(directory: Path) -> None:
    files = {
        f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
        for f in sorted(directory.iterdir())
        if f.name != MANIFEST
    }
    _write_json(directory / MANIFEST, {"format": FORMAT_VERSION, "files": files})


def _other_checkpoints(directory: Path) -> str:
    """The run's other checkpoint directories, as a hint after an error about ``directory``."""
    parent = directory.resolve().parent
    names = [d.name for d in (parent / n for n in ("final", "best", "last")) if (d / CONFIG).exists()]
    names += [d.name for d in sorted(parent.glob("step-[0-9]*[0-9]"), reverse=True) if (d / CONFIG).exists()]
    others = [str(parent / n) for n in names if n != directory.resolve().name]
    return f"; other checkpoints of this run: {', '.join(others)}" if others else ""


def verify(directory: str | Path) -> None:
    """Check every file against ``manifest.json``; raise CheckpointError naming the first that differs.

    Directories written before manifests existed (none in the manifest) pass unchecked.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        return
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{path} is not a valid manifest; the checkpoint is corrupted{_other_checkpoints(directory)}") from None
    for name, entry in files.items():
        file = directory / name
        if not file.exists():
            raise CheckpointError(f"{file} is missing: not a complete checkpoint{_other_checkpoints(directory)}")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{file} is {size} bytes, its manifest says {entry['bytes']}: the file is truncated or corrupted"
                + _other_checkpoints(directory)
            )
        if sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{file} fails its SHA-256 check: the file is corrupted{_other_checkpoints(directory)}")


def _fsync_dir(directory: Path) -> None:
    for file in directory.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def _publish(tmp: Path, final: Path) -> None:
    """Atomically replace ``final`` by the fully written ``tmp`` directory."""
    _write_manifest(tmp)
    _fsync_dir(tmp)
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    parent = os.open(final.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(parent)
    finally:
        os.close(parent)
    if old.exists():
        shutil.rmtree(old)


def save(
    directory: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    *,
    configs: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint directory. ``configs`` (e.g. train/data configs as dicts) go into config.json.

    With ``trainer`` (a JSON-able dict) and ``optimizer``, also the state needed to resume, including
    every random generator's state. ``state_dict`` saves other weights than the model's (averaging).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if state_dict is None:
        save_model(model, str(tmp / WEIGHTS))
    else:
        # Tied weights appear once in a safetensors file, so some names are absent: strict=False.
        other = Transformer(model.config)
        _, unexpected = other.load_state_dict(state_dict, strict=False)
        if unexpected:
            raise CheckpointError(f"weights do not match the model: unexpected {unexpected}")
        save_model(other, str(tmp / WEIGHTS))
    _write_json(tmp / CONFIG, {"format": FORMAT_VERSION, "model": model.config.to_dict(), **(configs or {})})
    tokenizer.save(tmp / TOKENIZER)
    if trainer is not None:
        tensors = {"rng.torch": torch.get_rng_state()}
        if optimizer is not None:
            opt = optimizer.state_dict()
            for index, state in opt["state"].items():
                for name, value in state.items():
                    tensors[f"optimizer.{index}.{name}"] = torch.as_tensor(value).contiguous()
            trainer = {**trainer, "optimizer_param_groups": opt["param_groups"]}
        np_state = np.random.get_state()
        rng = {
            "python": _to_json(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *map(_scalar, np_state[2:])],
        }
        save_file(tensors, str(tmp / TRAINER_TENSORS))
        _write_json(tmp / TRAINER_JSON, {**trainer, "rng": rng})
    _publish(tmp, directory)
    return directory


def _to_json(value: Any) -> Any:
    return [_to_json(v) for v in value] if isinstance(value, (tuple, list)) else value


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value


def read_config(directory: str | Path) -> dict[str, Any]:
    directory = resolve(directory)
    path = directory / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the checkpoint is corrupted") from None
    version = config.get("format")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version!r}; this qkv reads format {FORMAT_VERSION}"
            + (" (written by a newer qkv: upgrade qkv)" if isinstance(version, int) and version > FORMAT_VERSION else "")
        )
    return config


def load(directory: str | Path, *, device: str | torch.device = "cpu") -> Checkpoint:
    """Rebuild the model and tokenizer from a checkpoint directory alone (no pickle anywhere)."""
    directory = resolve(directory)
    config = read_config(directory)
    model = Transformer(ModelConfig.from_dict(config["model"]))
    weights = directory / WEIGHTS
    if not weights.exists():
        raise CheckpointError(f"{weights} is missing: not a complete checkpoint")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{weights} cannot be read as safetensors ({error}); the file is corrupted") from None
    if missing or unexpected:
        raise CheckpointError(f"{weights} does not match its config: missing {missing}, unexpected {unexpected}")
    tokenizer_path = directory / TOKENIZER
    if not tokenizer_path.exists():
        raise CheckpointError(f"{tokenizer_path} is missing: the checkpoint cannot tokenize text")
    tokenizer = Tokenizer.load(tokenizer_path)
    verify(directory)  # last, so that the checks above keep their more specific messages
    return Checkpoint(directory, model.to(device).eval(), tokenizer, config)


def load_trainer(directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore the optimizer and every RNG from a checkpoint; return trainer.json (step, epoch, ...)."""
    directory = resolve(directory)
    json_path, tensor_path = directory / TRAINER_JSON, directory / TRAINER_TENSORS
    if not json_path.exists() or not tensor_path.exists():
        raise CheckpointError(f"{directory} has no training state ({TRAINER_JSON}); it cannot be resumed")
    verify(directory)
    trainer = json.loads(json_path.read_text(encoding="utf-8"))
    tensors = load_file(str(tensor_path))
    if optimizer is not None:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        optimizer.load_state_dict({"state": state, "param_groups": trainer["optimizer_param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    random.setstate(_to_tuple(trainer["rng"]["python"]))
    kind, keys, *rest = trainer["rng"]["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return trainer


def average(directories: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints of one model (averaging)."""
    if not directories:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for directory in directories:
        tensors = load_file(str(Path(directory) / WEIGHTS))
        for name, value in tensors.items():
            total[name] = total[name] + value.double() if name in total else value.double()
    return {name: (value / len(directories)).float() for name, value in total.items()}
