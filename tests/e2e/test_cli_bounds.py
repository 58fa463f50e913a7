"""Upper bounds on the decoding flags: `--beam` at most qkv.cli.common.MAX_BEAM, `--workers` at most the
CPUs this process may use. Above them, one line and exit status 2, before anything is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qkv.cli.main import build_parser
from qkv.cli.common import MAX_BEAM
from qkv.serve.api import MAX_BEAM as SERVER_MAX_BEAM

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def qkv(*args: str) -> subprocess.CompletedProcess:
    # A checkpoint that does not exist: a bound is checked first, or the error names the checkpoint.
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", [
    ["translate", "--checkpoint", "missing"],
    ["evaluate", "--checkpoint", "missing"],
    ["attend", "--checkpoint", "missing", "A dog."],
])
def test_a_beam_above_the_bound_is_a_one_line_error(command):
    run = qkv(*command, "--beam", str(MAX_BEAM + 1))
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"qkv {command[0]}: error: --beam must be at most {MAX_BEAM}, got {MAX_BEAM + 1}"), line
    at_the_bound = qkv(*command, "--beam", str(MAX_BEAM))
    assert "--beam" not in at_the_bound.stderr and "missing" in at_the_bound.stderr  # it got as far as the checkpoint


@pytest.mark.parametrize("command", [["translate"], ["evaluate"]])
def test_more_workers_than_cpus_is_a_one_line_error(command):
    run = qkv(*command, "--checkpoint", "missing", "--workers", str(CPUS + 1))
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"qkv {command[0]}: error: --workers must be at most {CPUS}, got {CPUS + 1}"), line
    assert f"may use {CPUS} CPUs" in line
    at_the_bound = qkv(*command, "--checkpoint", "missing", "--workers", str(CPUS))
    assert "--workers" not in at_the_bound.stderr and "missing" in at_the_bound.stderr


def test_argparse_errors_are_one_line_naming_the_command():
    """An unknown option, a bad value and a missing one: one line naming the command, status 2 (not qkv's usage)."""
    for args, says in ((["translate", "--checkpoint", "missing", "--threads", "1"], "qkv translate: error: unrecognized arguments: --threads 1"),
                       (["evaluate", "--checkpoint", "missing", "--beam", "abc"], "qkv evaluate: error: argument --beam: invalid int value: 'abc'"),
                       (["train", "--no-such-flag"], "qkv train: error: unrecognized arguments: --no-such-flag"),
                       (["translate"], "qkv translate: error: the following arguments are required: --checkpoint")):
        run = qkv(*args)
        assert run.returncode == 2 and run.stdout == "" and run.stderr.splitlines() == [says], run.stderr


def test_the_help_states_the_bounds_and_the_server_beam_is_within_the_cli_one():
    parser = build_parser()
    translate = next(a for a in parser._subparsers._group_actions[0].choices["translate"]._actions if a.dest == "beam")
    assert f"at most {MAX_BEAM}" in translate.help
    # Whatever beam a client may ask of `qkv serve`, `qkv translate` reproduces it.
    assert SERVER_MAX_BEAM <= MAX_BEAM
    assert parser.parse_args(["translate", "--checkpoint", "x", "--beam", str(SERVER_MAX_BEAM)]).beam == SERVER_MAX_BEAM
