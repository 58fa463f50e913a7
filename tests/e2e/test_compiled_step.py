"""The compiled decoder step (``--compile``, ``qkv.model.incremental.compile_steps``): the same
translations as the eager step, greedy and beam, over batches of different sizes and lengths, and a
bounded number of compiled graphs; the flag's refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_decode import BOS, EOS, batch, make_model, sources

from qkv.infer.search import DecodeConfig, search
from qkv.model import incremental


@pytest.fixture
def compiled():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    incremental.compile_steps(True)
    yield torch._dynamo.utils.counters
    incremental.compile_steps(False)


def test_compiled_steps_search_exactly_as_the_eager_steps(compiled):
    model = make_model(3).eval()
    batches = [batch(sources(lengths, seed=i)) for i, lengths in enumerate(([5, 9, 3], [7], [4, 6, 8, 11, 2]))]
    for beam in (1, 3):
        config = DecodeConfig(beam_size=beam, max_len_b=8)
        incremental.compile_steps(False)
        eager = [search(model, src, bos_id=BOS, eos_id=EOS, config=config) for src in batches]
        incremental.compile_steps(True)
        fast = [search(model, src, bos_id=BOS, eos_id=EOS, config=config) for src in batches]
        assert [[h.tokens for hs in b for h in hs] for b in fast] == [[h.tokens for hs in b for h in hs] for b in eager]
        for b, f in zip(eager, fast):  # the same scores, to float rounding (greedy: none, NaN)
            assert torch.allclose(torch.tensor([h.score for hs in b for h in hs]), torch.tensor([h.score for hs in f for h in hs]), atol=1e-4, equal_nan=True)
    # dynamic shapes: every batch size, source length and position shares a few graphs
    # (10 here: the caches' first step and growth, one beam or several), all under the limit past
    # which Dynamo would run a step eagerly
    assert 0 < compiled["stats"]["unique_graphs"] <= 16 < incremental.RECOMPILE_LIMIT


def test_compile_refuses_int8_ctranslate2_and_workers_in_one_line(random_checkpoint, tmp_path):
    src = tmp_path / "in.en"
    src.write_text("A dog runs.\n")
    several_cpus = len(os.sched_getaffinity(0)) >= 2  # else argparse refuses --workers 2 first
    for extra in (["--int8"], ["--engine", "ctranslate2"], *([["--workers", "2"]] if several_cpus else [])):
        out = subprocess.run([sys.executable, "-m", "qkv", "translate", "--checkpoint", str(random_checkpoint), "--compile",
                              *extra, "-i", str(src)], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and out.stdout == "" and out.stderr.count("\n") == 1 and "--compile" in out.stderr


def test_a_compiled_step_is_not_forked_into_decoding_workers(compiled):
    """Workers forked after the parent compiled would wait on its compile workers forever."""
    from qkv.errors import QkvError
    from qkv.infer.translator import Translator

    with pytest.raises(QkvError, match="one process"):
        Translator(make_model(0), None, workers=2)
