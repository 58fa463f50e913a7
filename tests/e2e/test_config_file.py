"""`qkv train --config run.toml` and `--dump-config`: a file and the equivalent flags give one config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qkv.train.recipes import TrainConfig, build_configs, dump_config

tomllib = pytest.importorskip("tomllib", reason="--config needs Python 3.11 (tomllib)")


def qkv_train(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", "train", *map(str, args)], capture_output=True, text=True, timeout=60)


def test_a_config_file_and_the_equivalent_flags_give_the_same_config(tmp_path):
    flags = ["--preset", "tiny", "--src", "de", "--tgt", "fr", "--model", "d_model=48", "activation=gelu",
             "--train", "lr=5e-4", "label_smoothing=0.2", "--data", "vocab_size=300"]  # fmt: skip
    from_flags = qkv_train(*flags, "--dump-config")
    assert from_flags.returncode == 0, from_flags.stderr
    run = tmp_path / "run.toml"
    run.write_text(
        'preset = "tiny"\n[model]\nd_model = 48\nactivation = "gelu"\n'
        "[train]\nlr = 5e-4\nlabel_smoothing = 0.2\n[data]\nsrc_lang = \"de\"\ntgt_lang = \"fr\"\nvocab_size = 300\n"
    )
    from_file = qkv_train("--config", run, "--dump-config")
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == from_flags.stdout
    dumped = tomllib.loads(from_flags.stdout)
    assert dumped["model"]["d_model"] == 48 and dumped["train"]["lr"] == 5e-4 and dumped["data"]["tgt_lang"] == "fr"
    # the dump is itself a config file that gives the same config back
    (tmp_path / "dump.toml").write_text(from_flags.stdout)
    assert qkv_train("--config", tmp_path / "dump.toml", "--dump-config").stdout == from_flags.stdout


def test_flags_override_the_file(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('preset = "tiny"\n[train]\nlr = 5e-4\nseed = 3\n')
    result = qkv_train("--config", run, "--train", "lr=1e-3", "--preset", "multi30k", "--dump-config")
    dumped = tomllib.loads(result.stdout)
    assert dumped["preset"] == "multi30k" and dumped["train"]["lr"] == 1e-3 and dumped["train"]["seed"] == 3


def test_unknown_keys_and_bad_files_are_one_line_with_a_hint(tmp_path):
    cases = [
        ('[train]\nlrr = 1e-3\n', "unknown TrainConfig key 'lrr' (did you mean 'lr'?)"),
        ('[trian]\nlr = 1e-3\n', "unknown key 'trian' (did you mean 'train'?)"),
        ('[train\nlr = 1\n', "is not valid TOML"),
        ('train = 3\n', "'train' must be a table, [train]"),
    ]
    for text, message in cases:
        run = tmp_path / "run.toml"
        run.write_text(text)
        result = qkv_train("--config", run, "--dump-config")
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_dump_config_round_trips_every_value_type():
    model, train, data = build_configs("multi30k", model={"d_k": 16}, train={"eps": 1e-9, "on_nan": "stop"}, data={})
    parsed = tomllib.loads(dump_config("multi30k", model, train, data))
    again = build_configs(parsed["preset"], model=parsed["model"], train=parsed["train"], data=parsed["data"])
    assert again == (model, train, data)
    assert isinstance(again[1], TrainConfig) and again[1].eps == 1e-9 and again[0].d_k == 16 and again[0].d_v is None
