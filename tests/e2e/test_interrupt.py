"""Ctrl-C during ``qkv translate --workers 2`` (and ``prepare --workers 2``): one line from the command, no traceback from its
workers, no process and no file left behind.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group, the forked workers
included; the test does the same to a command started in a process group of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RANDOM_MODEL_SENTENCES

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
pytestmark = [pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc"),
              pytest.mark.skipif(CPUS < 2, reason="two workers need two CPUs")]


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _busy_input(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A work directory, an input in it that keeps the random model searching for minutes, and the
    directory's listing before any command ran."""
    work = tmp_path / "work"
    work.mkdir()
    src = work / "in.txt"
    src.write_text("\n".join(RANDOM_MODEL_SENTENCES * 200) + "\n")
    return work, src, sorted(os.listdir(work))


def _wait_until_searching(process: subprocess.Popen) -> None:
    """Until the command and its two workers run, then a second more: searching by then."""
    deadline = time.monotonic() + 120
    while len(_group(process.pid)) < 3:
        assert process.poll() is None, process.communicate() if process.stderr else "the command ended first"
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    time.sleep(1.0)
    assert process.poll() is None, "the input must keep the command busy for this test to mean anything"


def _ctrl_c_ends_it_in_one_line(args: list[str]) -> None:
    """Run ``qkv ARGS``, press Ctrl-C once its workers are busy: one line, exit 130, no traceback, and
    the command's whole process group gone within 5 seconds."""
    process = subprocess.Popen([sys.executable, "-m", "qkv", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               # SIGINT as in a terminal, even when the suite runs as a background job (which ignores it)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_until_searching(process)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.splitlines() == ["interrupted"], err
    assert process.returncode == 130 and out == ""
    deadline = time.monotonic() + 5  # the workers are gone with the command, not a second later
    while _group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group(process.pid) == []


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_ctrl_c_with_workers_prints_one_line_and_leaves_nothing_behind(random_checkpoint, tmp_path, command):
    work, src, before = _busy_input(tmp_path)
    common = ["--checkpoint", str(random_checkpoint), "--beam", "4", "--batch-tokens", "100", "--workers", "2"]
    args = (["translate", *common, "-i", str(src), "-o", str(work / "out.txt")] if command == "translate" else
            ["evaluate", *common, "--src-file", str(src), "--ref-file", str(src), "--save", str(work / "out.txt")])
    _ctrl_c_ends_it_in_one_line(args)
    assert sorted(os.listdir(work)) == before  # no output, no temporary file


def test_workers_end_when_the_command_is_killed_and_leave_no_file(random_checkpoint, tmp_path):
    """SIGKILL reaches the command alone (kill -9 PID, the OOM killer): no handler runs in it, and its
    workers, which watch their parent, end on their own."""
    work, src, before = _busy_input(tmp_path)
    args = ["translate", "--checkpoint", str(random_checkpoint), "--beam", "4", "--batch-tokens", "100",
            "--workers", "2", "-i", str(src), "-o", str(work / "out.txt")]  # fmt: skip
    process = subprocess.Popen([sys.executable, "-m", "qkv", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_until_searching(process)
        os.kill(process.pid, signal.SIGKILL)  # the command only, not its group
        process.wait(timeout=10)
        deadline = time.monotonic() + 5  # the workers look for their parent twice a second
        while _group(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _group(process.pid) == []
    finally:
        if _group(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    assert sorted(os.listdir(work)) == before  # no output, no temporary file


def test_ctrl_c_on_prepare_with_workers_prints_one_line_and_leaves_nothing_behind(tmp_path):
    """``qkv prepare --workers 2`` ends its encoding workers as ``translate`` does: one line, no traceback
    from a worker, no hang (a Pool's terminate() used to wait on a pipe no worker read), no OUT.tmp."""
    from qkv.data.tasks import date_pairs

    work = tmp_path / "work"
    work.mkdir()
    corpus = tmp_path / "big.tsv"  # enough pairs to keep two workers encoding for seconds
    corpus.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(2000, seed=1)) * 200, encoding="utf-8")
    args = ["prepare", "--train-src", str(corpus), "--out", str(work / "prep"), "--vocab-size", "120", "--sample", "2000",
            "--workers", "2", "--no-progress"]  # fmt: skip
    _ctrl_c_ends_it_in_one_line(args)
    assert os.listdir(work) == []  # neither OUT nor OUT.tmp
