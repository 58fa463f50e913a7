"""`qkv align`: Pharaoh word alignments from cross-attention, one line per input line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.io import checkpoint
from qkv.inspect.align import align, pharaoh
from qkv.model.config import model_preset
from qkv.infer.search import DecodeConfig
from qkv.model.transformer import Transformer
from qkv.data.tokenizer import Tokenizer
from qkv.inspect.visualize import align_words, capture_attention, word_alignment

SENTENCES = ["a man rides a red bike", "two dogs play in the snow", "a woman reads a book", "children run on the beach"]


def test_pieces_are_merged_into_words_on_hand_made_weights():
    src = ["▁a", "▁bi", "ke", "▁red", "</s>"]  # words: a, bike, red
    tgt = ["▁ein", "▁rot", "es", "▁Rad", "</s>"]  # words: ein, rotes, Rad
    w = torch.tensor([
        [0.7, 0.1, 0.1, 0.1, 0.0],  # ein -> a
        [0.0, 0.2, 0.2, 0.6, 0.0],  # rot  \\ rotes: mean of its rows -> red (0.55) over bike (0.35)
        [0.0, 0.3, 0.0, 0.5, 0.2],  # es   /
        [0.1, 0.3, 0.3, 0.3, 0.0],  # Rad -> bike: its two pieces together (0.6) beat red (0.3)
        [0.0, 0.0, 0.0, 0.0, 1.0],  # EOS: not aligned
    ])  # fmt: skip
    pairs = align_words(w, src, tgt)
    assert [(s, t) for s, t, _ in pairs] == [(0, 0), (2, 1), (1, 2)]
    assert [round(m, 2) for _, _, m in pairs] == [0.7, 0.55, 0.6]
    assert pharaoh([(s, t) for s, t, _ in pairs]) == "0-0 2-1 1-2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("align")
    tokenizer = Tokenizer.train(SENTENCES * 5, 60, directory / "tok.model")
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    return checkpoint.save(directory / "model", Transformer(config), tokenizer)


def test_aligning_own_translations_agrees_with_the_attention_picture(model_dir):
    loaded = checkpoint.load(model_dir)
    config = DecodeConfig(beam_size=2, max_len_b=6)
    batched = align(loaded.model, loaded.tokenizer, SENTENCES, config=config, max_tokens=30)  # several batches
    for sentence, pairs in zip(SENTENCES, batched):
        capture = capture_attention(loaded.model, loaded.tokenizer, sentence, config)
        src_words, tgt_words = capture.source.split(), capture.translation.split()
        assert [(src_words[s], tgt_words[t]) for s, t in pairs] == [(s, t) for t, s, _ in word_alignment(capture)]
        assert [t for _, t in pairs] == list(range(len(tgt_words)))  # every target word once, in order


def test_align_command_keeps_lines_and_indices_valid(model_dir, tmp_path):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    sources = ["a man rides a red bike", "", "two dogs play", "a book"]
    targets = ["ein Mann fährt ein rotes Rad", "nichts", "", "ein Buch"]
    src.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    ref.write_text("".join(t + "\n" for t in targets), encoding="utf-8")

    def run(*args: str | Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qkv", "align", "--checkpoint", str(model_dir), *map(str, args)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    result = run("-i", src, "-r", ref, "--layer", "1", "--head", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == len(sources) + 1 and lines[-1] == ""
    assert lines[1] == "" and lines[2] == ""  # an empty side gives an empty line
    for line, s, t in zip(lines, sources, targets):
        for pair in line.split():
            i, j = map(int, pair.split("-"))
            assert 0 <= i < len(s.split()) and 0 <= j < len(t.split())
        assert len(line.split()) == (len(t.split()) if s else 0)
    assert run("-i", src, "--layer", "3").stderr.startswith("qkv align: error: --layer must be between 1 and 2")
    ref.write_text("one line\n", encoding="utf-8")
    assert "line counts differ" in run("-i", src, "-r", ref).stderr
