"""What pyproject.toml declares agrees with what the tests run on."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_declared_torch_bound_is_the_release_the_suite_installs():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bound = next(re.fullmatch(r"torch>=(\d+)\.(\d+)", d) for d in dependencies if d.startswith("torch"))
    pinned = re.search(r"^TORCH_VERSION := (\d+)\.(\d+)\.\d+$", (ROOT / "Makefile").read_text(), re.M)
    assert bound and pinned and bound.groups() == pinned.groups()  # no untested older release admitted


def test_the_entry_point_and_the_server_page_are_where_the_package_says():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, function = project["project"]["scripts"]["qkv"].partition(":")
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file() and function == "main"
    for package, files in project["tool"]["setuptools"]["package-data"].items():
        assert all((ROOT / package.replace(".", "/") / name).is_file() for name in files)


def test_every_engine_the_commands_offer_comes_with_the_default_install():
    """`make demo` installs `pip install -e .` alone, and the README's student recipes and speed table
    run `--engine ctranslate2` after it: each engine's package is a dependency, not an extra."""
    from qkv.cli.main import build_parser

    packages = {"qkv": None, "ctranslate2": "ctranslate2"}  # what each engine imports
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {re.match(r"[\w.-]+", d).group(0).lower() for d in project["dependencies"]}
    translate = build_parser()._subparsers._group_actions[0].choices["translate"]  # private: argparse has no public list
    engines = next(a.choices for a in translate._actions if "--engine" in a.option_strings)
    assert set(engines) == set(packages), "a new engine: name the package it imports here"
    assert {p for p in packages.values() if p} <= installed
    assert project["optional-dependencies"]["export"] == []  # the old extra still installs


def test_a_missing_engine_package_is_named_before_the_checkpoint_loads(monkeypatch):
    import argparse
    import sys

    from qkv.cli import common
    from qkv.errors import MissingPackage
    from qkv.infer import ensemble

    def load_ensemble(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the engine was checked")

    monkeypatch.setattr(ensemble, "load_ensemble", load_ensemble)
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    args = argparse.Namespace(engine="ctranslate2", int8=False, bf16=False, device="cpu", workers="auto", checkpoint=["x"])
    with pytest.raises(MissingPackage, match="pip install") as error:
        common.decoding_model(args)
    assert "[export]" not in str(error.value)  # no extra to name: the package is one of qkv's requirements
