"""Every config field is checked for its type and range, wherever its value comes from: flags, a TOML
--config, a checkpoint's config.json, a config built in code. A wrong value is a one-line ConfigError
naming the key, never a traceback from deep inside and never a value kept as it came."""

from __future__ import annotations

import dataclasses
import json
import string
import types
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.io import checkpoint, manifest
from qkv.cli.main import main
from qkv.model.config import ConfigError, ModelConfig, config_from_dict, model_preset
from qkv.infer.search import DecodeConfig
from qkv.model.transformer import Transformer
from qkv.train.recipes import DataConfig, TrainConfig, build_configs
from qkv.data.tokenizer import Tokenizer

SECTIONS = {ModelConfig: "model", DataConfig: "data", TrainConfig: "train", DecodeConfig: "decode"}
FIELDS = [(cls, field.name) for cls in SECTIONS for field in dataclasses.fields(cls)]

# Values of each kind; a field's wrong values are those of every kind its annotation does not take.
# Integral floats (2.0) are wrong for an int field too, and bools for every number.
KINDS = {
    "int": st.integers(-(10**6), 10**6),
    "float": st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)) | st.sampled_from([0.0, 2.0, -1.0]),
    "non-finite": st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    "bool": st.booleans(),
    "str": st.text(max_size=8),
    "none": st.none(),
    "list": st.lists(st.integers(0, 3), max_size=3),
    "dict": st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
}


def accepted_kinds(annotation: typing.Any) -> set[str]:
    """The kinds of value a field's annotation takes (a Literal takes only its own strings)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(accepted_kinds(arg) for arg in typing.get_args(annotation)))
    if typing.get_origin(annotation) is typing.Literal:
        return {"literal"}
    return {int: {"int"}, float: {"int", "float"}, bool: {"bool"}, str: {"str"}, type(None): {"none"}}[annotation]


def wrong_values(cls: type, name: str) -> st.SearchStrategy:
    annotation = typing.get_type_hints(cls)[name]
    kinds = [KINDS[kind] for kind in KINDS if kind not in accepted_kinds(annotation)]
    if typing.get_origin(annotation) is typing.Literal:  # a string, but not one of its own
        kinds.remove(KINDS["str"])
        kinds.append(st.text(max_size=8).filter(lambda text: text not in typing.get_args(annotation)))
    if (cls, name) == (TrainConfig, "time_budget"):
        # a duration string is taken ("60m"); letters alone never make a finite one ("inf" is refused)
        kinds = [kind for kind in kinds if kind is not KINDS["str"]] + [st.text(string.ascii_letters, max_size=8)]
    return st.one_of(kinds)


def build(cls: type, name: str, value: typing.Any, path: str):
    """A config with one key set, the way each source sets it."""
    if path == "constructor":  # a config made in code (an imported Hugging Face model, the server)
        return cls(**{name: value})
    if path == "from_dict":  # a checkpoint's config.json
        return config_from_dict(cls, {name: value})
    if path == "replace" and cls is ModelConfig:  # a preset with overrides
        return model_preset("tiny", **{name: value})
    if path == "flags" and cls is not DecodeConfig:  # --model/--train/--data KEY=VALUE and a TOML --config
        return build_configs("tiny", **{section: ({name: value} if section == SECTIONS[cls] else {}) for section in ("model", "train", "data")})
    return cls(**{name: value})


def test_every_field_of_every_config_is_covered():
    for cls, name in FIELDS:  # an annotation the test (and so check_types) does not know fails here
        assert accepted_kinds(typing.get_type_hints(cls)[name]), (cls, name)
    assert {cls for cls, _ in FIELDS} == set(SECTIONS) and len(FIELDS) > 70


@pytest.mark.parametrize(("cls", "name"), FIELDS, ids=[f"{SECTIONS[cls]}.{name}" for cls, name in FIELDS])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), path=st.sampled_from(["constructor", "from_dict", "replace", "flags"]))
def test_a_value_of_the_wrong_type_is_a_one_line_error_naming_the_key(cls, name, data, path):
    value = data.draw(wrong_values(cls, name), label="value")
    with pytest.raises(ConfigError) as error:
        build(cls, name, value, path)
    message = str(error.value)
    assert f"{SECTIONS[cls]} key {name} must be " in message and "\n" not in message, message


def test_the_message_says_which_type_the_key_wants():
    cases = [
        (TrainConfig, {"keep_last": 2.5}, "train key keep_last must be an integer, got 2.5"),
        (ModelConfig, {"d_model": "64"}, "model key d_model must be an integer, got '64'"),
        (ModelConfig, {"d_model": True}, "model key d_model must be an integer, got True"),
        (ModelConfig, {"norm_first": "false"}, "model key norm_first must be true or false, got 'false'"),
        (ModelConfig, {"d_k": "8"}, "model key d_k must be an integer or null, got '8'"),
        (ModelConfig, {"activation": "tanh"}, "model key activation must be relu, gelu or silu, got 'tanh'"),
        (DataConfig, {"src_lang": 3}, "data key src_lang must be a string or null, got 3"),
        (DecodeConfig, {"top_p": float("nan")}, "decode key top_p must be a finite number, got nan"),
        (TrainConfig, {"lr": "1e-3"}, "train key lr must be a finite number, got '1e-3'"),
    ]
    for cls, data, message in cases:
        with pytest.raises(ConfigError) as error:
            config_from_dict(cls, data)
        assert str(error.value) == message


def test_right_values_are_kept_and_an_integer_for_a_float_field_becomes_a_float():
    config = ModelConfig(dropout=0, d_k=None, activation="gelu", norm_first=True, d_model=64)
    assert type(config.dropout) is float and config.dropout == 0.0 and config.norm_first is True and config.d_model == 64
    assert config == ModelConfig(dropout=0.0, activation="gelu", norm_first=True, d_model=64)
    train = TrainConfig(lr=1, time_budget=60)
    assert (type(train.lr), type(train.time_budget)) == (float, float)
    assert DecodeConfig(max_len_a=2).max_len_a == 2.0 and DataConfig(data_dir=None).data_dir is None


@pytest.mark.parametrize(
    ("cls", "data", "message"),
    [
        (ModelConfig, {"layer_norm_eps": 0.0}, "layer_norm_eps must be positive"),
        (DataConfig, {"max_len": 0}, "max_len must be >= 1"),
        (DataConfig, {"train_limit": -1}, "train_limit must be >= 0"),
        (TrainConfig, {"beta2": 1.0}, r"beta2 must be in \[0, 1\)"),
        (TrainConfig, {"weight_decay": -0.1}, "weight_decay must be >= 0"),
        (TrainConfig, {"clip_norm": -1.0}, "clip_norm must be >= 0"),
        (TrainConfig, {"max_steps": -5}, "max_steps must be >= 0"),
        (TrainConfig, {"warmup_steps": -5}, "train key warmup_steps must be >= 0, got -5"),
        (TrainConfig, {"lr": 0.0}, "train key lr must be positive, got 0.0"),
        (TrainConfig, {"time_budget": "-5m"}, "time_budget must be >= 0"),
        (TrainConfig, {"valid_beam": 0}, "valid_beam must be >= 1"),
        (TrainConfig, {"max_epochs": 0}, "max_epochs must be >= 1"),
        (TrainConfig, {"threads": -1}, "threads must be >= 0"),
        (DecodeConfig, {"max_len_a": -1.0}, "max_len_a must be >= 0"),
    ],
)
def test_values_out_of_range_are_refused(cls, data, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cls, data)


def test_time_budget_takes_the_durations_the_flag_takes():
    assert [TrainConfig(time_budget=text).time_budget for text in ("60m", "90s", "1.5h", "120")] == [3600.0, 90.0, 5400.0, 120.0]
    _, train, _ = build_configs("tiny", model={}, train={"time_budget": "2m"}, data={})
    assert train.time_budget == 120.0
    for text in ("60x", "inf", "5mm", ""):
        with pytest.raises(ConfigError, match="time_budget must be"):
            TrainConfig(time_budget=text)


# ---- through the real command line ----------------------------------------------------------


def run_cli(capsys, *args: str | Path) -> tuple[int, str, str]:
    code = main(["train", "--dump-config", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "d_model=abc"], "model key d_model must be an integer, got 'abc'"),
        (["--model", "norm_first=True"], "model key norm_first must be true or false, got 'True'"),
        (["--train", "keep_last=2.5"], "train key keep_last must be an integer, got 2.5"),
        (["--train", "lr=NaN"], "train key lr must be a finite number, got nan"),
        (["--data", "vocab_size=[1]"], "data key vocab_size must be an integer, got [1]"),
        (["--train", "time_budget=soon"], "train key time_budget must be a number of seconds or a duration"),
    ],
)
def test_a_wrong_flag_value_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == "" and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[model]\nd_model = "64"\n', "model key d_model must be an integer, got '64'"),
        ('[model]\nnorm_first = "false"\n', "model key norm_first must be true or false, got 'false'"),
        ("[train]\nkeep_last = 2.5\n", "train key keep_last must be an integer, got 2.5"),
        ("[train]\nseed = true\n", "train key seed must be an integer, got True"),
        ("[data]\nvalid_src = 7\n", "data key valid_src must be a string or null, got 7"),
        ("[model]\ndropout = nan\n", "model key dropout must be a finite number, got nan"),
        ("[model.d_model]\nx = 1\n", "model key d_model must be an integer, got {'x': 1}"),
    ],
)
def test_a_wrong_value_in_a_config_file_is_one_line_and_exit_2(capsys, tmp_path, toml, message):
    (tmp_path / "run.toml").write_text(toml)
    code, out, err = run_cli(capsys, "--config", tmp_path / "run.toml")
    assert code == 2 and out == "" and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_duration_for_time_budget_is_taken_from_a_config_file_and_from_flags(capsys, tmp_path):
    (tmp_path / "run.toml").write_text('[train]\ntime_budget = "60m"\n')
    code, out, _ = run_cli(capsys, "--config", tmp_path / "run.toml")
    assert code == 0 and "\ntime_budget = 3600.0\n" in out
    code, flags, _ = run_cli(capsys, "--train", "time_budget=60m")
    assert code == 0 and flags == out
    code, flag, _ = run_cli(capsys, "--time-budget", "60m")
    assert code == 0 and flag == out


# ---- a checkpoint's config.json -------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> Path:
    sentences = ["A dog runs across the green field.", "Ein Hund rennt über die grüne Wiese."] * 10
    tok = Tokenizer.train(sentences, vocab_size=40, path=tmp_path / "spm.model")
    config = model_preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    return checkpoint.save(tmp_path / "ckpt", Transformer(config), tok, configs={"data": {"src_lang": "en"}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"norm_first": "false"}, "model key norm_first must be true or false, got 'false'"),  # was a pre-LN model
        ({"d_model": "32"}, "model key d_model must be an integer, got '32'"),
        ({"dropout": None}, "model key dropout must be a finite number, got None"),
    ],
)
def test_a_checkpoint_config_of_the_wrong_type_is_a_one_line_error(saved, change, message):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    config["model"].update(change)
    (saved / checkpoint.CONFIG).write_text(json.dumps(config))
    manifest.write(saved)  # crafted with checksums that agree, so the config is what is read
    with pytest.raises(ValueError) as error:
        checkpoint.load(saved)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_repeated_override_flag_adds_its_keys_to_the_first_ones(capsys):
    """`--data vocab_size=1000 train_limit=8000 --data case_augment=0.1` keeps all three keys (argparse
    used to keep only the last flag's, training on the defaults without a word); so do --model and --train."""
    code, out, err = run_cli(capsys, "--preset", "tiny", "--data", "vocab_size=1000", "train_limit=8000",
                             "--data", "case_augment=0.1", "--model", "d_model=64", "--model", "n_heads=2",
                             "--train", "lr=0.001", "--train", "warmup_steps=7")
    assert code == 0, err
    for line in ("vocab_size = 1000", "train_limit = 8000", "case_augment = 0.1", "d_model = 64", "n_heads = 2",
                 "lr = 0.001", "warmup_steps = 7"):
        assert line in out.splitlines(), line
    # the same key twice: with one value it is one setting, with two values one line naming the flag
    code, out, _ = run_cli(capsys, "--preset", "tiny", "--data", "vocab_size=1000", "--data", "vocab_size=1000")
    assert code == 0 and "vocab_size = 1000" in out.splitlines()
    code, out, err = run_cli(capsys, "--preset", "tiny", "--data", "vocab_size=1000", "--data", "vocab_size=2000")
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "vocab_size is given twice to --data (1000 and 2000): give it once" in err
