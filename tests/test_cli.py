"""The command line itself: entry points, errors."""

import subprocess
import sys

from qkv.cli import main


def test_doctor_passes_every_check(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "6/6 checks passed" in out and "FAIL" not in out


def test_python_dash_m_entry_point_and_help():
    result = subprocess.run([sys.executable, "-m", "qkv", "--help"], capture_output=True, text=True, check=True)
    assert "doctor" in result.stdout


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out
