"""Sampling: draws only from the allowed tokens in the right proportions, repeats under a seed,
does not depend on batching, and becomes greedy search as the temperature goes to zero."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from test_decode import BOS, EOS, batch, make_model, sources

from qkv.infer.search import DecodeConfig, greedy_search, sample_tokens

LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))  # probabilities, as logits


def draws(config: DecodeConfig, n: int = 4000) -> Counter:
    return Counter(int(sample_tokens(LOGITS, [torch.Generator().manual_seed(i)], config)) for i in range(n))


def test_samples_follow_the_distribution_within_top_k_and_top_p():
    full = draws(DecodeConfig(beam_size=1, sampling=True))
    for token, p in enumerate([0.05, 0.4, 0.1, 0.3, 0.15]):
        assert abs(full[token] / 4000 - p) < 0.03, (token, full)  # 4000 draws: sd <= 0.008
    top2 = draws(DecodeConfig(beam_size=1, sampling=True, top_k=2))
    assert set(top2) == {1, 3} and abs(top2[1] / 4000 - 0.4 / 0.7) < 0.03
    nucleus = draws(DecodeConfig(beam_size=1, sampling=True, top_p=0.8))  # 0.4 + 0.3 < 0.8 <= 0.4 + 0.3 + 0.15
    assert set(nucleus) == {1, 3, 4} and abs(nucleus[4] / 4000 - 0.15 / 0.85) < 0.03
    hot = draws(DecodeConfig(beam_size=1, sampling=True, temperature=100.0))  # nearly uniform
    assert all(abs(hot[t] / 4000 - 0.2) < 0.03 for t in range(5))


def test_a_seed_repeats_a_sample_and_another_seed_changes_it():
    model, src = make_model(1), batch(sources([6, 9, 4, 7], seed=2))
    config = DecodeConfig(beam_size=1, sampling=True, temperature=1.5, max_len_b=12)
    first = greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=config, seeds=[1, 2, 3, 4])
    assert greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=config, seeds=[1, 2, 3, 4]) == first
    assert greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=config, seeds=[5, 6, 7, 8]) != first
    assert first != greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=DecodeConfig(beam_size=1, max_len_b=12))


def test_a_sentence_gets_the_same_sample_alone_or_in_a_batch():
    model, ids = make_model(2), sources([3, 8, 5, 11, 6], seed=4)
    config = DecodeConfig(beam_size=1, sampling=True, temperature=1.5, max_len_b=12)
    together = greedy_search(model, batch(ids), bos_id=BOS, eos_id=EOS, config=config, seeds=[10, 11, 12, 13, 14])
    alone = [greedy_search(model, batch([s]), bos_id=BOS, eos_id=EOS, config=config, seeds=[10 + i])[0] for i, s in enumerate(ids)]
    assert together == alone


@pytest.mark.parametrize("config", [
    DecodeConfig(beam_size=1, sampling=True, temperature=1e-6),
    DecodeConfig(beam_size=1, sampling=True, temperature=3.0, top_k=1),
    DecodeConfig(beam_size=1, sampling=True, temperature=3.0, top_p=1e-6),
])  # fmt: skip
def test_sampling_with_no_freedom_left_is_greedy(config):
    for seed in range(3):
        model, src = make_model(seed), batch(sources([2, 9, 5, 7], seed))
        assert greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=config) == greedy_search(
            model, src, bos_id=BOS, eos_id=EOS, config=DecodeConfig(beam_size=1)
        )


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="beam_size must be 1"):
        DecodeConfig(beam_size=4, sampling=True)
    for bad in ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match="temperature > 0"):
            DecodeConfig(beam_size=1, sampling=True, **bad)


def test_translate_sampling_through_the_command_line(tmp_path):
    from qkv.io import checkpoint
    from qkv.data.tokenizer import Tokenizer

    texts = ["a man rides a red bike", "two dogs play in the snow", "a woman reads a book"] * 6
    tok = Tokenizer.train(texts, 50, tmp_path / "tok.model")
    torch.manual_seed(0)
    from qkv.model.config import model_preset
    from qkv.model.transformer import Transformer

    config = model_preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    ckpt = checkpoint.save(tmp_path / "model", Transformer(config), tok)

    def run(*args: str, text: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qkv", "translate", "--checkpoint", str(ckpt), *args],
                              input=text, capture_output=True, text=True, timeout=120)  # fmt: skip

    lines = "a man rides\ntwo dogs play\na man rides\n"
    first = run("--sampling", "--temperature", "2", "--seed", "7", text=lines)
    assert first.returncode == 0, first.stderr
    out = first.stdout.split("\n")
    assert len(out) == 4 and out[0] == out[2]  # the same sentence, the same sample, wherever it stands
    assert run("--sampling", "--temperature", "2", "--seed", "7", text="a man rides\n").stdout.split("\n")[0] == out[0]
    greedy = run("--beam", "1", text=lines)
    assert greedy.returncode == 0 and greedy.stdout.count("\n") == 3
    assert run("--sampling", "--temperature", "1e-4", "--seed", "3", text=lines).stdout == greedy.stdout  # temperature -> 0
    refused = run("--sampling", "--beam", "3", text=lines)
    assert refused.returncode == 2 and "beam_size must be 1" in refused.stderr
