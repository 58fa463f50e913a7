"""The bfloat16 choice a run makes from its settings (``qkv.train.precision``) and the files a resume puts
back (``qkv.train.resume``), without a training run."""

import warnings

import pytest
import torch

from qkv.io.outputs import current_umask
from qkv.model import cpu
from qkv.model.config import ConfigError
from qkv.train.precision import Precision
from qkv.train.recipes import TrainConfig
from qkv.train.resume import resumed_train_config, restore_tokenizer

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("settings", "native", "device", "mode"),
    [
        ({}, True, CPU, None),
        ({"bf16": True}, True, CPU, "output layer"),
        ({"bf16": True, "bf16_layers": True}, True, CPU, "linear and output layers"),
        ({"bf16": True, "bf16_layers": True, "onednn": False}, True, CPU, "output layer"),
        ({"bf16": True, "rdrop": 5.0, "bf16_layers": True}, True, CPU, "linear and output layers"),
        ({"bf16": True}, False, CPU, None),
        ({"bf16": True}, True, GPU, "autocast"),
    ],
)
def test_the_bfloat16_mode_follows_the_settings_and_the_device(monkeypatch, settings, native, device, mode):
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: native)
    chosen = Precision.choose(TrainConfig(**settings), device, warn=False)
    assert chosen.mode == mode
    assert chosen.fused_loss is (not settings.get("rdrop") and device.type == "cpu")  # autocast and R-Drop compute the logits whole


def test_bf16_with_r_drop_but_no_bf16_layers_warns_that_it_stays_in_float32(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: True)
    with pytest.warns(UserWarning, match="R-Drop needs bf16_layers=true"):
        assert Precision.choose(TrainConfig(bf16=True, rdrop=5.0), CPU).mode is None


def test_a_rank_told_not_to_warn_does_not(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Precision.choose(TrainConfig(bf16=True, bf16_layers=True), CPU, warn=False)
    with pytest.warns(UserWarning, match="no native bfloat16"):
        Precision.choose(TrainConfig(bf16=True), CPU)


def test_resume_takes_what_it_may_and_refuses_what_it_cannot():
    saved = TrainConfig(seed=3, adam="fused")
    assert resumed_train_config(saved, {"max_steps": 50}).max_steps == 50
    with pytest.raises(ConfigError, match=r"seed \(3 -> 4\)"):
        resumed_train_config(saved, {"seed": 4})
    with pytest.warns(UserWarning, match="not be bitwise equal"):
        assert resumed_train_config(saved, {"adam": "for"}).adam == "for"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed_train_config(saved, {"adam": "for"}, warn=False)


def test_resume_puts_back_a_missing_or_changed_tokenizer_and_leaves_the_same_one(tmp_path):
    last = tmp_path / "last"
    last.mkdir()
    (last / "tokenizer.model").write_bytes(b"saved vocabulary")
    run_copy = tmp_path / "tokenizer.model"
    restore_tokenizer(tmp_path, last)
    assert run_copy.read_bytes() == b"saved vocabulary"
    assert run_copy.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # a usual file, as train first wrote it, not 0600
    run_copy.write_bytes(b"edited since")
    restore_tokenizer(tmp_path, last)
    assert run_copy.read_bytes() == b"saved vocabulary"
    before = run_copy.stat().st_ino
    restore_tokenizer(tmp_path, last)
    assert run_copy.stat().st_ino == before  # the same bytes: not rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "tokenizer.model"]  # no temporary file left
