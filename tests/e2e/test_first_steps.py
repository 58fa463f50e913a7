"""First steps on someone else's computer: what `make demo` and `make test` install, and the quickstart's
first track run as written.

The Makefile is run for real, on a virtual environment of stand-ins (``python``, ``pip``, ``qkv`` and,
where a case needs one, ``nvidia-smi``: shell scripts that write down how they were called), so the test
sees every pip command without installing anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def stand_in(path: Path, log: Path, body: str = "") -> None:
    """An executable at ``path`` that appends ``NAME ARGS`` to ``log``, then runs ``body``."""
    path.write_text(f'#!/bin/sh\necho "${{0##*/}} $*" >> "{log}"\n{body}\n')
    path.chmod(0o755)


def run_make(tmp_path: Path, target: str, *, local_wheel: bool, gpu: bool) -> list[str]:
    """The calls ``make TARGET`` makes on a fresh .venv whose python has no torch yet, with or without a
    torch wheel that pip finds without an index, and with or without nvidia-smi on the PATH."""
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    log = tmp_path / "calls"
    stand_in(venv / "bin" / "python", log, 'case "$*" in *"import torch"*) exit 1;; esac')
    stand_in(venv / "bin" / "pip", log, 'case "$*" in *--no-index*) exit %d;; esac' % (0 if local_wheel else 1))
    stand_in(venv / "bin" / "qkv", log)
    os.symlink(shutil.which("touch"), tools / "touch")
    if gpu:
        stand_in(tools / "nvidia-smi", log)
    make = subprocess.run([shutil.which("make"), "-C", str(ROOT), f"VENV={venv}", target],
                          env={"PATH": str(tools), "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert make.returncode == 0, make.stdout + make.stderr
    return [line for line in log.read_text().splitlines() if not line.startswith("nvidia-smi")]


def test_make_demo_installs_the_cpu_build_and_no_test_stack_on_a_machine_without_a_gpu(tmp_path):
    assert run_make(tmp_path, "demo", local_wheel=False, gpu=False) == [
        "python -c import torch",
        "pip install --quiet --no-index --no-deps torch==2.13.0",  # no wheel on this machine
        f"pip install --quiet torch==2.13.0 {CPU_INDEX}",  # was: PyPI's torch, a CUDA build on Linux
        "pip install --quiet -e .",  # was: -e .[dev], the whole test stack
        "qkv demo",
    ]


def test_make_test_takes_the_wheel_on_this_machine_and_the_test_stack(tmp_path):
    calls = run_make(tmp_path, "test", local_wheel=True, gpu=False)
    assert calls == [
        "python -c import torch",
        "pip install --quiet --no-index --no-deps torch==2.13.0",  # found without an index: this project's machines
        "pip install --quiet torch==2.13.0",  # its dependencies, from the indexes pip is configured with
        "pip install --quiet -e .",
        "pip install --quiet -e .[dev]",
        "python -m pytest -n 2 --dist loadfile",  # two pytest-xdist workers (TEST_WORKERS)
    ]


def test_make_with_a_gpu_driver_takes_pypis_build(tmp_path):
    calls = run_make(tmp_path, "demo", local_wheel=False, gpu=True)
    assert calls[2] == "pip install --quiet torch==2.13.0" and not any(CPU_INDEX in call for call in calls)


# --- What the pages tell a user to install and download -------------------------------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_hf_line_of_the_docs_parses_with_the_hub_client_qkv_installs():
    hf = Path(sys.executable).parent / "hf"  # huggingface_hub's, installed with transformers (the marian extra)
    lines = [line.split("  #")[0].strip() for page in PAGES for line in page.read_text(encoding="utf-8").splitlines()
             if line.startswith("hf ")]  # fmt: skip
    assert len(lines) >= 2, lines  # README and the quickstart
    for line in lines:  # --help: the arguments are parsed (an unknown option or command fails), nothing downloaded
        done = subprocess.run(f"{hf} {line[3:]} --help", shell=True, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{line}\n{done.stderr[-500:]}"
    assert not [page.name for page in PAGES if "huggingface-cli" in page.read_text(encoding="utf-8")]


def test_no_page_or_message_installs_qkv_from_pypi():
    """qkv is not on PyPI: `pip install qkv` or `pip install 'qkv[marian]'` would fail (or install someone else's)."""
    from_pypi = re.compile(r"pip install\s+['\"]?qkv\b")
    files = [*PAGES, *sorted((ROOT / "qkv").rglob("*.py"))]
    assert not [f"{f.relative_to(ROOT)}" for f in files if from_pypi.search(f.read_text(encoding="utf-8"))]


def test_the_tests_read_multi30k_from_qkvs_download_cache_on_a_machine_with_only_the_clone(tmp_path, monkeypatch):
    from conftest import multi30k_location

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shared = tmp_path / "shared"
    assert multi30k_location(None, shared) == (tmp_path / "cache" / "qkv" / "multi30k", True)  # was: a failure
    shared.mkdir()
    assert multi30k_location(None, shared) == (shared, False)
    assert multi30k_location(str(tmp_path / "env"), shared) == (tmp_path / "env", False)


# --- The quickstart's first track, as written -----------------------------------------------------------

def quickstart_track(number: int) -> list[str]:
    """The shell lines of the quickstart's track NUMBER (its first bash block), continuations joined."""
    text = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    section = re.split(r"^## ", text, flags=re.M)[number]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


SET_UP = ("make demo", ". .venv/bin/activate")  # done by the test: a CI-sized demo model and qkv on the PATH


def test_the_quickstarts_first_track_runs_as_written(tmp_path):
    from qkv.inspect.demo import DEMO_TRAIN, run_demo

    lines = quickstart_track(1)
    assert [line.split("#")[0].strip() for line in lines[:2]] == list(SET_UP)
    run_demo(tmp_path / "runs" / "demo", n_train=2000, n_test=100, progress=False,
             train=replace(DEMO_TRAIN, max_steps=150, eval_every=150, threads=1))  # fmt: skip
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    outputs = {}
    for line in lines[2:]:
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        outputs[line.split("#")[0].strip()] = done.stdout
    translate = next(out for line, out in outputs.items() if line.startswith("qkv translate"))
    assert len(translate.splitlines()) == 2 and all(re.fullmatch(r"\d{4}-\d\d-\d\d", t) for t in translate.split())
    assert "reused the cached model" in next(out for line, out in outputs.items() if line.startswith("qkv demo"))
    assert (tmp_path / "runs" / "mai.png").is_file() and (tmp_path / "runs" / "mai.html").is_file()
