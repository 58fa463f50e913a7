"""The command line itself: entry points, errors."""

import subprocess
import sys

from qkv.cli.main import DESCRIPTION, main


def test_doctor_passes_every_check(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "6/6 checks passed" in out and "FAIL" not in out


def test_python_dash_m_entry_point_and_help():
    result = subprocess.run([sys.executable, "-m", "qkv", "--help"], capture_output=True, text=True, check=True)
    assert "doctor" in result.stdout
    # It opens, after the usage, with what qkv does for a user, not the module docstring (for a developer).
    opening = result.stdout.split("\n\n")[1]
    assert " ".join(opening.split()) == DESCRIPTION and "``" not in opening and "library functions" not in opening


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_tests_that_need_multi30k_fail_without_it_unless_allowed(tmp_path):
    """A CI machine without ../shared/data/multi30k must not pass by skipping the core tests."""
    import os
    import shutil
    from pathlib import Path

    tests = tmp_path / "checkout" / "tests"  # no ../shared beside this checkout
    tests.mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tests / "conftest.py")
    (tests / "test_needs_data.py").write_text(
        "from conftest import needs_multi30k\n\n@needs_multi30k\ndef test_uses_the_data():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("QKV_ALLOW_MISSING_DATA", "QKV_DATA")}
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)]
    failed = subprocess.run(run, capture_output=True, text=True, cwd=tests, env=env, timeout=120)
    assert failed.returncode == 1 and "1 error" in failed.stdout and "Multi30k not found" in failed.stdout, failed.stdout
    skipped = subprocess.run(run, capture_output=True, text=True, cwd=tests, env={**env, "QKV_ALLOW_MISSING_DATA": "1"}, timeout=120)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout
    # With the data elsewhere, $QKV_DATA points the tests at it
    from conftest import require_multi30k

    found = subprocess.run(run, capture_output=True, text=True, cwd=tests, env={**env, "QKV_DATA": str(require_multi30k())}, timeout=120)
    assert found.returncode == 0 and "1 passed" in found.stdout, found.stdout
