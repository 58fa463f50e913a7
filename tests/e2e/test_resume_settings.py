"""--resume's settings, checked for their type and against what a bitwise resume promises (on a real run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.data.tasks import date_pairs
from qkv.model.config import ConfigError
from qkv.train.recipes import build_configs
from qkv.train.resume import saved_train_config
from qkv.train.trainer import Trainer


# ---- --resume -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """Two updates of the tiny preset on 300 date pairs: a run that --resume can continue."""
    where = tmp_path_factory.mktemp("resume")
    data = where / "dates.tsv"
    data.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(300, seed=3)), encoding="utf-8")
    model, train, data_cfg = build_configs(
        "tiny", model={}, train={"threads": 1, "max_steps": 2, "eval_every": 2, "tune_length_penalty": False},
        data={"corpus": "files", "train_src": str(data), "vocab_size": 120},
    )
    Trainer(where / "run", model, train, data_cfg).run(progress=False)
    return where / "run"


@pytest.mark.parametrize(("key", "value"), [("fast_dropout", False), ("dropout_bits", 32), ("onednn", False), ("bf16_layers", True),
                                            ("seed", 2)])
def test_resume_refuses_what_would_change_the_numbers_of_an_exact_resume(short_run, key, value):
    with pytest.raises(ConfigError, match=f"--resume cannot change {key} "):
        Trainer.resume(short_run, **{key: value})


def test_resume_checks_the_types_of_its_overrides(short_run):
    with pytest.raises(ConfigError, match="train key max_steps must be an integer, got '4'"):
        Trainer.resume(short_run, max_steps="4")
    with pytest.raises(ConfigError, match="train key fast_dropout must be true or false, got 1"):
        Trainer.resume(short_run, fast_dropout=1)


def test_resume_with_another_adam_kernel_warns_that_it_is_not_bitwise(short_run, recwarn):
    Trainer.resume(short_run, adam="fused")  # the kernel it ran with: nothing to say
    assert not [w for w in recwarn if "bitwise" in str(w.message)]
    with pytest.warns(UserWarning, match="--resume with adam fused -> for: the resumed run will not be bitwise equal"):
        trainer = Trainer.resume(short_run, adam="for")
    assert trainer.optimizer.param_groups[0]["fused"] is False and trainer.train_cfg.adam == "for"


def test_resume_takes_a_duration_for_time_budget(short_run):
    assert Trainer.resume(short_run, time_budget="10m").train_cfg.time_budget == 600.0


def test_a_run_saved_before_fast_dropout_was_the_default_resumes_with_nn_dropouts_masks(short_run):
    """fast_dropout became the default later: a saved config without the key ran nn.Dropout."""
    assert Trainer.resume(short_run).train_cfg.fast_dropout is True  # saved by today's code, with the key
    assert saved_train_config({"seed": 3}).fast_dropout is False
    assert saved_train_config({"fast_dropout": True}).fast_dropout is True


def test_a_run_saved_before_16_bit_dropout_masks_resumes_with_32_bit_ones(short_run):
    """dropout_bits came later the same day as fast_dropout's default: a config without it drew 32 bits."""
    assert Trainer.resume(short_run).train_cfg.dropout_bits == 16
    assert saved_train_config({"fast_dropout": True}).dropout_bits == 32
    assert saved_train_config({"fast_dropout": True, "dropout_bits": 16}).dropout_bits == 16
