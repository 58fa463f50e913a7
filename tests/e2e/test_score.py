"""`qkv score`: forced decoding gives the model's own teacher-forced log-probabilities, line by line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.io import checkpoint
from qkv.model.transformer import Transformer
from qkv.infer.score import perplexity, score_pairs
from qkv.data.tokenizer import Tokenizer

SOURCES = ["A dog runs.", "", "Two children play with a red ball on the green field.", "A ball."]
TARGETS = ["Ein Hund rennt.", "Ein Satz ohne Quelle.", "Zwei Kinder spielen.", ""]


@pytest.fixture(scope="module")
def ckpt(random_checkpoint) -> Path:
    return random_checkpoint


def direct_log_probs(model: Transformer, tok: Tokenizer, source: str, target: str) -> list[float]:
    """log p(y_t | y_<t, x) for each target token and EOS, one sentence alone, step by step from logits."""
    src = torch.tensor([[*tok.encode(source), tok.eos_id]])
    ids = tok.encode(target)
    with torch.no_grad():
        logits = model(src, torch.tensor([[tok.bos_id, *ids]]))[0]  # (T, V)
    return [float(logits[t].double().log_softmax(-1)[y]) for t, y in enumerate([*ids, tok.eos_id])]


def test_scores_are_the_models_teacher_forced_log_probabilities(ckpt):
    loaded = checkpoint.load(ckpt)
    scores = score_pairs(loaded.model, loaded.tokenizer, SOURCES, TARGETS, max_tokens=40)  # several padded batches
    assert len(scores) == len(SOURCES)
    for s, source, target in zip(scores, SOURCES, TARGETS):
        expected = direct_log_probs(loaded.model, loaded.tokenizer, source, target)
        assert s.token_log_probs == pytest.approx(expected, abs=1e-4)
        assert s.log_prob == pytest.approx(sum(expected), abs=1e-4)
        assert s.pieces[-1] == loaded.tokenizer.pieces([loaded.tokenizer.eos_id])[0]
        assert len(s.pieces) == s.n_tokens == len(loaded.tokenizer.encode(target)) + 1
    total = sum(sum(direct_log_probs(loaded.model, loaded.tokenizer, x, y)) for x, y in zip(SOURCES, TARGETS))
    n = sum(len(loaded.tokenizer.encode(y)) + 1 for y in TARGETS)
    assert perplexity(scores) == pytest.approx(math.exp(-total / n), rel=1e-5)


def test_a_better_translation_scores_higher_after_the_model_learned_it(ckpt):
    """A check that could fail: train the tiny model on one pair, and its reference must then
    outscore a shuffled version of itself."""
    loaded = checkpoint.load(ckpt)
    model, tok = loaded.model.train(), loaded.tokenizer
    src = torch.tensor([[*tok.encode("A dog runs."), tok.eos_id]])
    ids = tok.encode("Ein Hund rennt.")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        logits = model(src, torch.tensor([[tok.bos_id, *ids]]))
        loss = torch.nn.functional.cross_entropy(logits[0], torch.tensor([*ids, tok.eos_id]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    right, shuffled = score_pairs(model, tok, ["A dog runs."] * 2, ["Ein Hund rennt.", "rennt. Hund Ein"])
    assert right.log_prob > shuffled.log_prob + 1.0


def test_score_command_writes_one_line_per_pair(ckpt, tmp_path):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("".join(s + "\n" for s in SOURCES), encoding="utf-8")
    ref.write_text("".join(t + "\n" for t in TARGETS), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "score", "--checkpoint", str(ckpt), "-i", str(src), "-r", str(ref), "--tokens"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(SOURCES)
    loaded = checkpoint.load(ckpt)
    for line, source, target in zip(lines, SOURCES, TARGETS):
        total, n, per_token, token_lps, pieces = line.split("\t")
        expected = direct_log_probs(loaded.model, loaded.tokenizer, source, target)
        assert int(n) == len(expected) == len(pieces.split(" ")) == len(token_lps.split(" "))
        assert float(total) == pytest.approx(sum(expected), abs=2e-4)
        assert float(per_token) == pytest.approx(sum(expected) / len(expected), abs=2e-4)
    assert result.stderr.startswith(f"scored {len(SOURCES)} pairs, ") and "perplexity" in result.stderr


def test_score_files_of_different_lengths_are_one_line(ckpt, tmp_path):
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("a\nb\n", encoding="utf-8")
    ref.write_text("a\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "score", "--checkpoint", str(ckpt), "-i", str(src), "-r", str(ref)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and result.stderr.startswith("qkv score: error: line counts differ")
