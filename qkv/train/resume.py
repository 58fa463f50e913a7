"""What ``qkv train --resume`` may change in a saved run, and how the run's files are put back before it
continues (``qkv.train.trainer.Trainer.resume`` restores the weights, optimizer, generators and data position).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from qkv.errors import DataError
from qkv.io import checkpoint
from qkv.io.outputs import replace_whole
from qkv.model.config import ConfigError, config_from_dict
from qkv.train.recipes import TrainConfig

# Settings a resumed run cannot change: Adam's state holds the first four, the batches depend on max_tokens
# and seed, and the last three change the numbers an exact resume repeats (dropout's draws, the products' rounding).
FIXED_ON_RESUME = ("beta1", "beta2", "eps", "weight_decay", "max_tokens", "seed", "fast_dropout", "dropout_bits", "onednn",
                   "bf16_layers")
# Settings a resumed run may change (tests/e2e/test_speed.py), though its numbers then differ from an uninterrupted run's.
NOT_BITWISE_ON_RESUME = ("adam",)
# What a run saved before a setting existed, or before its default changed, ran with: fast_dropout
# became the default on 2026-11-26, so a saved config without the key drew nn.Dropout's masks, and
# one without dropout_bits (16 since later that day) drew 32 bits per element.
SAVED_BEFORE = {"fast_dropout": False, "dropout_bits": 32}


def saved_train_config(saved: dict[str, Any]) -> TrainConfig:
    """The ``train`` section of a run's config.json as the run ran it (``SAVED_BEFORE`` for the keys it lacks)."""
    return config_from_dict(TrainConfig, {**SAVED_BEFORE, **saved})


def resumed_train_config(saved: TrainConfig, overrides: dict[str, Any], *, warn: bool = True) -> TrainConfig:
    """``saved`` with ``overrides`` applied (their types checked). ``FIXED_ON_RESUME`` settings that
    would change are refused (ConfigError); a change to a ``NOT_BITWISE_ON_RESUME`` one is taken,
    with a warning when ``warn``."""
    train = config_from_dict(TrainConfig, {**saved.__dict__, **overrides})
    fixed = [f"{key} ({getattr(saved, key)} -> {getattr(train, key)})" for key in FIXED_ON_RESUME if getattr(train, key) != getattr(saved, key)]
    if fixed:
        raise ConfigError(
            f"--resume cannot change {', '.join(fixed)}: Adam's saved state, the order of the batches and the numbers "
            "of an exact resume depend on them; start a new run with --out to train with other values"
        )
    changed = [f"{key} {getattr(saved, key)} -> {getattr(train, key)}" for key in NOT_BITWISE_ON_RESUME if getattr(train, key) != getattr(saved, key)]
    if changed and warn:
        warnings.warn(f"--resume with {', '.join(changed)}: the resumed run will not be bitwise equal to an uninterrupted one", stacklevel=3)
    return train


def restore_tokenizer(run_dir: Path, last: Path) -> None:
    """Put ``last/``'s verified copy of the tokenizer back as ``run_dir/tokenizer.model`` if that file is
    missing or differs (the run's own copy is in no manifest), whole or not at all."""
    tokenizer_path, saved_tokenizer = run_dir / checkpoint.TOKENIZER, (last / checkpoint.TOKENIZER).read_bytes()
    if tokenizer_path.is_file() and tokenizer_path.read_bytes() == saved_tokenizer:
        return
    replace_whole(tokenizer_path, saved_tokenizer)


def check_sources(run_dir: Path, saved: dict[str, dict[str, Any]] | None, current: dict[str, dict[str, Any]]) -> None:
    """Refuse (one line) to resume on data other than the run started on: a file (a prepared directory's
    manifest) of another size or SHA-256 than the run recorded (``qkv.train.recipes.data_sources``), or
    read from another place. ``saved`` None: a run from before qkv recorded its data, not checked."""
    if saved is None:
        return
    changed = [
        f"{role} {was['path']}" + (f" (now {now['path']})" if now and now["path"] != was["path"] else "")
        for role, was in saved.items()
        if not (now := current.get(role)) or (now["bytes"], now["sha256"]) != (was["bytes"], was["sha256"])
    ] + [f"{role} {now['path']} (new)" for role, now in current.items() if role not in saved]
    if changed:
        raise DataError(f"--resume {run_dir}: the data is not what the run started on: {', '.join(changed)} changed since; "
                        "put it back as it was, or start a new run with --out")
