"""Long commands print a bar on a terminal and plain lines into a log file (no carriage returns)."""

from __future__ import annotations

import io
import subprocess
import sys

from qkv.train.progress import PlainProgress, progress
from qkv.data.tasks import date_pairs


def test_plain_progress_prints_whole_lines_with_the_step_the_postfix_and_an_eta():
    out = io.StringIO()
    bar = PlainProgress(total=10, initial=2, every=0.0, file=out)
    bar.set_postfix(loss="3.141", tok_s="812")
    bar.update(3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("step 5/10 (50%) loss 3.141 tok_s 812, elapsed ") and ", ETA " in lines[0]
    assert lines[-1].startswith("step 5/10 (50%)")


def test_plain_progress_is_quiet_between_its_intervals():
    out = io.StringIO()
    bar = PlainProgress(total=None, every=3600.0, file=out)
    for _ in range(1000):
        bar.update()
    assert out.getvalue() == ""  # nothing redrawn at every update
    bar.close()
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[0]] and out.getvalue().startswith("step 1,000, elapsed ")


def test_progress_is_plain_when_stderr_is_not_a_terminal(capsys):
    assert isinstance(progress(total=3), PlainProgress)  # pytest's captured stderr is no terminal


def test_a_training_log_written_to_a_file_holds_lines_not_a_redrawn_bar(tmp_path):
    data = tmp_path / "dates.tsv"
    data.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(200, seed=1)), encoding="utf-8")
    with open(tmp_path / "log", "w") as log:  # nohup qkv train ... > log 2>&1
        result = subprocess.run(
            [sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--train-src", str(data), "--out", str(tmp_path / "run"),
             "--max-steps", "4", "--train", "eval_every=2", "threads=1"], stdout=log, stderr=subprocess.STDOUT, timeout=300,
        )
    text = (tmp_path / "log").read_text()
    assert result.returncode == 0, text
    assert "\r" not in text
    assert "step 4/4 (100%)" in text
