"""One GPU status everywhere: README.md, CHANGELOG.md, docs/distributed.md and the record's own README
say what benchmarks/results/gpu-check/ holds (the test run's exit status, its failures, its PyTorch).
Fast: reads files only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmarks" / "results" / "gpu-check"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "docs" / "distributed.md", RECORD / "README.md"]


def _flat(path: Path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split())


def test_every_page_states_the_recorded_gpu_test_run_and_none_says_the_tests_passed():
    status = dict(re.findall(r"^(\S+) rc=(\d+)", (RECORD / "summary.txt").read_text(), re.M))
    failed = re.findall(r"^FAILED (\S+?)(?:\s|$)", (RECORD / "tests.log").read_text(), re.M)
    torch = re.search(r"(\d+\.\d+\.\d+)\+cu", (RECORD / "env.log").read_text()).group(1)  # "2.11.0+cu130 13.0 ..."
    assert status["tests"] == "124" and len(failed) == 5 and torch == "2.11.0"  # what ran, as recorded
    for page in PAGES:
        text = _flat(page)
        assert not re.search(r"(GPU )?tests passed(?! in)", text) or "did not pass" in text, page
        assert "not yet run on a GPU" not in text, page
        assert re.search(r"tim(ed|ing) out|timed out|150 s limit", text), page
        assert re.search(r"\b5 fail(ed|ures)", text), page
        assert "2.11" in text, page
