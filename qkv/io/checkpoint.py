"""Checkpoints: self-contained directories that load without unpickling anything.

A checkpoint directory holds
    model.safetensors    the weights (tied tensors stored once)
    config.json          format version, the model config and the training/data configs
    tokenizer.model      the tokenizer, so the directory alone translates: a SentencePiece model, or for
                         an imported Marian model a JSON document holding its two (qkv.data.tokenizer)
and, for checkpoints a run can resume from,
    trainer.safetensors  optimizer moments and the torch RNG states (CPU and CUDA)
    trainer.json         step, epoch, position in the epoch, schedule, Python/NumPy RNG states, metrics
and, once ``qkv shortlist`` or ``qkv calibrate`` has added it,
    shortlist.safetensors  a vocabulary shortlist for decoding (``add_file``)
    confidence.json      the trust calibration: the confidence's weights and the flags' thresholds
and last
    manifest.json        every other file's size and SHA-256

Loading verifies before it parses (qkv.io.manifest): the manifest must exist and name only the files above, each a
regular file (no symlinks, devices or paths outside the directory) of the recorded size and checksum;
only then are config.json, the weights and the tokenizer read, and the weights' shapes are checked
against the config before any model memory is allocated.

Writing goes to ``NAME.tmp/`` (each file and the directory fsynced), then ``NAME`` is moved aside to
``NAME.old/``, ``NAME.tmp/`` renamed into place and the parent fsynced, and only then is
``NAME.old/`` deleted. A crash between the two renames leaves ``NAME.old/``, which ``resolve`` loads
(with a warning) and the next save deletes once the new copy is in place. A lock on the parent
directory keeps two processes from writing into the same ``NAME.tmp/``.

Only what qkv can prove it wrote is ever deleted: ``NAME.tmp/`` and ``NAME.old/`` hold a marker file,
``.qkv-save``, from the moment qkv makes them, and a sibling without it (a user's ``mv ckpt ckpt.old``)
is never deleted, replaced or loaded in place of ``NAME``. A checkpoint itself is replaced only when
it holds nothing but checkpoint files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from qkv.errors import CheckpointError
from qkv.model.config import ModelConfig
from qkv.model.transformer import Transformer
from qkv.data.marian_tokenizer import MarianTokenizer
from qkv.data.tokenizer import Tokenizer, load_tokenizer
from qkv.io import manifest
from qkv.io.manifest import (  # noqa: F401 (the checkpoint's layout, named here too)
    CONFIG, FILES, FORMAT_VERSION, MANIFEST, MARKER, REQUIRED, SHORTLIST, TOKENIZER, TRAINER_JSON, TRAINER_TENSORS, WEIGHTS,
    sha256, write_json,
)
from qkv.io.weights import check_shapes, load_weights

LOCK_TIMEOUT = 60.0  # seconds a save waits for another process writing into the same directory


@dataclass
class Checkpoint:
    path: Path
    model: Transformer
    tokenizer: Tokenizer | MarianTokenizer
    config: dict[str, Any]  # the whole config.json


def resolve(path: str | Path) -> Path:
    """The checkpoint directory for ``path``: the directory itself, or a run's ``final``/``best``/``last``.

    When ``path`` is missing because a save was interrupted between its two renames, the whole
    previous copy that qkv moved aside (``NAME.old/`` with qkv's marker) is returned, with a warning.
    A ``NAME.old/`` without the marker is someone's backup and is never taken for ``NAME``.
    """
    path = Path(path)
    previous = _old(path)
    if not path.exists() and moved_aside(previous):
        warnings.warn(f"{path} is missing: using {previous}, the copy an interrupted save left", CheckpointWarning, stacklevel=2)
        return previous
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / CONFIG).exists() or (path / WEIGHTS).exists() or (path / MANIFEST).exists():
        return path
    for name in ("final", "best", "last"):
        if (path / name / CONFIG).exists() or moved_aside(_old(path / name)):
            return resolve(path / name)
    raise CheckpointError(f"{path} is not a checkpoint directory (no {CONFIG} or {WEIGHTS} in it)")


class CheckpointWarning(UserWarning):
    """A checkpoint was found in an unusual state that qkv could still use (an interrupted save)."""


def is_save_residue(path: Path) -> bool:
    """True for a ``NAME.tmp/`` or ``NAME.old/`` that qkv made: checkpoint files and qkv's marker
    (or nothing at all: a save killed between making the directory and marking it)."""
    if not is_checkpoint_dir(path):
        return False
    return (path / MARKER).is_file() or not any(path.iterdir())


def moved_aside(old: Path) -> bool:
    """True when ``old`` (a ``NAME.old/``) is a whole checkpoint that qkv moved aside during a save."""
    return is_checkpoint_dir(old) and (old / MARKER).is_file() and (old / CONFIG).is_file()


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def step_number(path: Path) -> int | None:
    """N for a ``step-N`` directory name, else None."""
    match = re.fullmatch(r"step-(\d+)", path.name)
    return int(match.group(1)) if match else None


def step_dirs(run_dir: Path) -> list[Path]:
    """A run's ``step-N`` checkpoints, oldest first, ordered by N (not as text: step-1000000 > step-999999)."""
    dirs = [d for d in run_dir.glob("step-*") if step_number(d) is not None and d.is_dir()]
    return sorted(dirs, key=step_number)


def is_checkpoint_dir(path: Path) -> bool:
    """True for a real directory that holds nothing but checkpoint files (or nothing): what qkv may
    replace or delete. A user's directory with any other file in it is never one."""
    if path.is_symlink() or not path.is_dir():
        return False
    return all(p.name in FILES | {MARKER} and p.is_file() and not p.is_symlink() for p in path.iterdir())


def _other_checkpoints(directory: Path) -> str:
    """The run's other checkpoint directories, as a hint after an error about ``directory``."""
    parent = directory.resolve().parent
    names = [d.name for d in (parent / n for n in ("final", "best", "last")) if (d / CONFIG).exists()]
    names += [d.name for d in reversed(step_dirs(parent)) if (d / CONFIG).exists()]
    others = [str(parent / n) for n in names if n != directory.resolve().name]
    return f"; other checkpoints of this run: {', '.join(others)}" if others else ""


def verify(directory: str | Path) -> None:
    """Check every file against ``manifest.json`` (``qkv.io.manifest.verify``); raise CheckpointError
    naming the first that differs and the run's other checkpoints."""
    directory = Path(directory)
    manifest.verify(directory, _other_checkpoints(directory))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _locked(parent: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``parent`` (the directory itself: no lock file is left behind)."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    raise CheckpointError(
                        f"another process has been writing a checkpoint into {parent} for {LOCK_TIMEOUT:.0f}s; "
                        "two runs must not share a directory"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_ours(path: Path) -> None:
    """Delete the ``NAME.tmp/`` or ``NAME.old/`` directory ``path`` only if qkv made it (``is_save_residue``);
    anything else there is the user's, and the save stops before touching it."""
    if not path.exists() and not path.is_symlink():
        return
    if not is_save_residue(path):
        raise CheckpointError(
            f"{path} is in the way and qkv did not write it (no {MARKER} marker in it): move it and try again"
        )
    shutil.rmtree(path)


def _mark(directory: Path) -> None:
    """Put qkv's marker into ``directory`` (durably) before it is renamed to ``NAME.tmp``/``NAME.old``."""
    (directory / MARKER).write_text("written by qkv while saving a checkpoint; safe to delete with this directory\n")
    _fsync(directory / MARKER)


def _publish(tmp: Path, final: Path) -> None:
    """Replace ``final`` by the fully written ``tmp`` directory, so that a crash at any point leaves a
    whole checkpoint under ``final`` or ``final.old``. Call it holding ``_locked(final.parent)``."""
    manifest.write(tmp)
    for file in tmp.iterdir():
        _fsync(file)
    _fsync(tmp)  # the directory entries themselves
    old = _old(final)
    if final.exists() or final.is_symlink():
        if not is_checkpoint_dir(final):
            raise CheckpointError(f"refusing to replace {final}: it is not a qkv checkpoint")
        _remove_ours(old)  # a stale copy of ours (final is whole); a user's backup stops the save here
        _mark(final)  # so that the copy moved aside is provably qkv's
        os.replace(final, old)
    # else, if old is ours, an earlier crash came between the renames: old is the only whole copy.
    # It stays until the new one is in place (deleted below, after the parent is fsynced).
    os.replace(tmp, final)
    _fsync(final.parent)  # make the renames durable before the old copy goes
    (final / MARKER).unlink()  # it came with tmp; final is a plain checkpoint again
    if moved_aside(old):
        shutil.rmtree(old)  # never a user's NAME.old: that one has no marker


def save(
    directory: str | Path,
    model: Transformer,
    tokenizer: Tokenizer | MarianTokenizer,
    *,
    configs: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    trainer_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint directory. ``configs`` (e.g. train/data configs as dicts) go into config.json.

    With ``trainer`` (a JSON-able dict) and ``optimizer``, also the state needed to resume, including
    every random generator's state; ``trainer_tensors``, more tensors of the training state (the
    weights' EMA), which ``load_trainer`` returns as "tensors". ``state_dict`` saves other weights than the model's (averaging);
    it must hold every weight of the model (a tied weight under one of its names).
    An existing ``directory`` is replaced only if it is a qkv checkpoint; if writing fails (a full
    disk), ``NAME.tmp/`` is removed and the previous checkpoint is untouched.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    if (directory.exists() or directory.is_symlink()) and not is_checkpoint_dir(directory):
        raise CheckpointError(f"refusing to write a checkpoint over {directory}: it exists and is not a qkv checkpoint")
    with _locked(directory.parent):
        tmp = _tmp(directory)
        _remove_ours(tmp)  # left by a crash: no other process is writing it (we hold the lock)
        tmp.mkdir()
        try:
            _mark(tmp)
            _write_files(tmp, model, tokenizer, configs, trainer, optimizer, state_dict, trainer_tensors)
            _publish(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return directory


def check_add_file(directory: str | Path, name: str, *, replace: bool = False) -> Path:
    """What ``add_file`` checks before it copies anything, for a command to call before its work (``qkv
    calibrate`` scores for minutes first): the resolved checkpoint directory, or a one-line error."""
    if name not in FILES - {*REQUIRED, MANIFEST}:
        raise CheckpointError(f"{name} is not an optional checkpoint file")
    directory = resolve(directory)
    if moved_aside(directory):
        raise CheckpointError(f"{directory} is the copy an interrupted save left: load it with qkv, or save it again, before adding to it")
    verify(directory)
    others = sorted(p.name for p in directory.iterdir() if p.name not in FILES)
    if others:  # the checkpoint is copied and replaced whole: never with someone's files in it
        raise CheckpointError(f"{directory} also holds {others[0]}, which is not a checkpoint file: refusing to rewrite it "
                              "(move that file out of the checkpoint first)")
    if (directory / name).exists() and not replace:
        raise CheckpointError(f"{directory} already holds {name}: give --force to replace it")
    if not os.access(directory.parent, os.W_OK | os.X_OK):  # the copy is made beside the checkpoint
        raise CheckpointError(f"cannot write in {directory.parent}: adding {name} copies the checkpoint beside itself")
    return directory


def add_file(directory: str | Path, name: str, write: Callable[[Path], None], *, replace: bool = False) -> Path:
    """Add the optional file ``name`` to a checkpoint, ``write(path)`` writing it, under the manifest.

    The checkpoint is verified, copied to ``NAME.tmp/`` with the new file, and put in place as
    ``save`` does: a crash leaves the checkpoint as it was (or its whole copy under ``NAME.old/``).
    An existing ``name`` is replaced only with ``replace``.
    """
    directory = check_add_file(directory, name, replace=replace)
    with _locked(directory.parent):
        tmp = _tmp(directory)
        _remove_ours(tmp)
        tmp.mkdir()
        try:
            _mark(tmp)
            for file in directory.iterdir():
                if file.name not in (MANIFEST, MARKER, name):
                    shutil.copy2(file, tmp / file.name)
            write(tmp / name)
            _publish(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return directory


def _write_files(tmp: Path, model, tokenizer, configs, trainer, optimizer, state_dict, trainer_tensors) -> None:
    if state_dict is None:
        save_model(model, str(tmp / WEIGHTS))
    else:
        other = Transformer(model.config)
        load_weights(other, state_dict, str(tmp / WEIGHTS))
        save_model(other, str(tmp / WEIGHTS))
    write_json(tmp / CONFIG, {"format": FORMAT_VERSION, "model": model.config.to_dict(), **(configs or {})})
    tokenizer.save(tmp / TOKENIZER)
    if trainer is not None:
        tensors = {"rng.torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()  # of the current device, also with one process
        if optimizer is not None:
            opt = optimizer.state_dict()
            for index, state in opt["state"].items():
                for name, value in state.items():
                    tensors[f"optimizer.{index}.{name}"] = torch.as_tensor(value).contiguous().cpu()
            trainer = {**trainer, "optimizer_param_groups": opt["param_groups"]}
        for name, value in (trainer_tensors or {}).items():
            tensors[f"state.{name}"] = value.contiguous().cpu()
        np_state = np.random.get_state()
        rng = {
            "python": _to_json(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *map(_scalar, np_state[2:])],
        }
        save_file(tensors, str(tmp / TRAINER_TENSORS))
        write_json(tmp / TRAINER_JSON, {**trainer, "rng": rng})


def _to_json(value: Any) -> Any:
    return [_to_json(v) for v in value] if isinstance(value, (tuple, list)) else value


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value


def decode_defaults(config: dict[str, Any]) -> dict[str, float]:
    """The decoding settings a checkpoint's config.json recommends (``"decode"``: the length penalty
    ``qkv train`` chose on validation), checked as a ``DecodeConfig`` would check them; {} when none."""
    decode = config.get("decode") or {}
    if not isinstance(decode, dict) or set(decode) - {"length_penalty"}:
        raise CheckpointError(f"config.json's \"decode\" must be an object holding only length_penalty, got {decode!r}")
    alpha = decode.get("length_penalty")
    if alpha is None:
        return {}
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 10:
        raise CheckpointError(f"config.json's decode length_penalty must be a number in [0, 10], got {alpha!r}")
    return {"length_penalty": float(alpha)}


def read_config(directory: str | Path, *, verified: bool = False) -> dict[str, Any]:
    """config.json of a checkpoint, after verifying the directory (``verified=True``: already done)."""
    directory = resolve(directory)
    if not verified:
        verify(directory)
    path = directory / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the checkpoint is corrupted") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object; the checkpoint is corrupted")
    version = config.get("format")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version!r}; this qkv reads format {FORMAT_VERSION}"
            + (" (written by a newer qkv: upgrade qkv)" if isinstance(version, int) and version > FORMAT_VERSION else "")
        )
    if not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{path} has no \"model\" section: the checkpoint is incomplete")
    return config


def _model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(config["model"])
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{path}: invalid model config ({error})") from None


def load(directory: str | Path, *, device: str | torch.device = "cpu") -> Checkpoint:
    """Rebuild the model and tokenizer from a checkpoint directory alone (no pickle anywhere). The
    model's ``decode_defaults`` are the decoding settings config.json recommends (``decode_defaults``),
    which a ``Translator`` made without a config uses.

    Every file is verified against the manifest first; parsing comes after.
    """
    directory = resolve(directory)
    verify(directory)
    config = read_config(directory, verified=True)
    model_config = _model_config(config, directory / CONFIG)
    weights = directory / WEIGHTS
    check_shapes(model_config, weights)
    model = Transformer(model_config)
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{weights} cannot be read as safetensors ({error}); the file is corrupted") from None
    load_weights(model, tensors, str(weights))
    tokenizer = load_tokenizer(directory / TOKENIZER)
    model.decode_defaults = decode_defaults(config)  # what a Translator of this model searches with by default
    # Trained with inline term annotations (DataConfig.term_share): a glossary's terms are written into its sources.
    model.term_aware = bool((config.get("data") or {}).get("term_share"))
    model.checkpoint_dir = directory  # whose confidence.json qkv.assess applies (qkv.inspect.trust)
    return Checkpoint(directory, model.to(device).eval(), tokenizer, config)


def load_trainer(directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore the optimizer and every RNG from a checkpoint; return trainer.json (step, epoch, ...),
    with the checkpoint's ``trainer_tensors`` under "tensors"."""
    directory = resolve(directory)
    verify(directory)
    json_path, tensor_path = directory / TRAINER_JSON, directory / TRAINER_TENSORS
    if not json_path.exists() or not tensor_path.exists():
        raise CheckpointError(f"{directory} has no training state ({TRAINER_JSON}); it cannot be resumed")
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
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    random.setstate(_to_tuple(trainer["rng"]["python"]))
    kind, keys, *rest = trainer["rng"]["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    trainer["tensors"] = {key.removeprefix("state."): value for key, value in tensors.items() if key.startswith("state.")}
    return trainer


def average(directories: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints of one model (averaging).

    Every checkpoint is verified, and all must have the same model config, weight names and shapes.
    """
    if not directories:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    first_dir, first_model = resolve(directories[0]), None
    for directory in directories:
        directory = resolve(directory)
        config = read_config(directory)  # verifies every file first
        first_model = first_model or config["model"]
        if config["model"] != first_model:
            raise CheckpointError(f"{directory} has another model config than {first_dir}: checkpoints of different models cannot be averaged")
        check_shapes(_model_config(config, directory / CONFIG), directory / WEIGHTS)
        tensors = load_file(str(directory / WEIGHTS))
        if total and set(tensors) != set(total):
            raise CheckpointError(f"{directory / WEIGHTS} holds other weights than {first_dir / WEIGHTS}: they cannot be averaged")
        for name, value in tensors.items():
            total[name] = total[name] + value.double() if name in total else value.double()
    return {name: (value / len(directories)).float() for name, value in total.items()}
