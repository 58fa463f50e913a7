"""What pyproject.toml declares agrees with what the tests run on."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
