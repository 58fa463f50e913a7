"""Shared test fixtures: where Multi30k lives, and one tiny training run reused by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest

MULTI30K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"
needs_multi30k = pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run directory of the "tiny" preset trained for 60 steps (a few seconds): step-000050,
    step-000060, last/, best/, final/ (the average of the two step checkpoints) and the tokenizer."""
    if not MULTI30K.is_dir():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    from qkv.train import Trainer, build_configs

    model, train, data = build_configs(
        "tiny", model={}, train={"max_steps": 60}, data={"data_dir": str(MULTI30K), "valid_limit": 20}
    )
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    Trainer(run_dir, model, train, data).run(progress=False)
    return run_dir
