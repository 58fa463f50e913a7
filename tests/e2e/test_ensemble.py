"""Ensembles: the average of the models' log-probabilities at every step, each model with its own
cache; a model with itself is the model; one vocabulary is required; `--checkpoint A --checkpoint B`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_decode import BOS, EOS, V, batch, make_model, sources

from qkv.infer.search import DecodeConfig, greedy_search, search
from qkv.infer.ensemble import Ensemble
from qkv.model.transformer import Transformer


def naive_ensemble_greedy(models, src, limit: int) -> list[list[int]]:
    """Greedy search by hand: no cache, every step re-decodes the whole prefix in every model."""
    outputs = []
    for row in src:
        row = row[None]  # (1, S)
        prefix = [BOS]
        for _ in range(limit):
            tgt = torch.tensor([prefix])
            step = torch.stack([m(row, tgt)[0, -1].log_softmax(-1) for m in models]).mean(0)  # (V,)
            token = int(step.argmax())
            if token == EOS:
                break
            prefix.append(token)
        outputs.append(prefix[1:])
    return outputs


def test_an_ensemble_of_a_model_with_itself_is_the_model():
    model, src = make_model(0), batch(sources([5, 9, 3, 7], seed=1))
    config = DecodeConfig(beam_size=3, n_best=2, max_len_b=8)
    alone = search(model, src, bos_id=BOS, eos_id=EOS, config=config)
    doubled = search(Ensemble([model, model]), src, bos_id=BOS, eos_id=EOS, config=config)
    assert [[h.tokens for h in hs] for hs in alone] == [[h.tokens for h in hs] for hs in doubled]
    for a, b in zip(alone, doubled):
        for x, y in zip(a, b):
            assert x.score == pytest.approx(y.score, abs=1e-5)


@torch.inference_mode()
def test_ensemble_greedy_search_averages_log_probabilities_step_by_step():
    models = [make_model(1), make_model(2), make_model(3)]
    src = batch(sources([4, 8, 6], seed=4))
    config = DecodeConfig(beam_size=1, max_len_a=0.0, max_len_b=7)
    got = greedy_search(Ensemble(models), src, bos_id=BOS, eos_id=EOS, config=config)
    assert got == naive_ensemble_greedy(models, src, 7)
    # and the ensemble is not simply one of its members
    assert any(got != greedy_search(m, src, bos_id=BOS, eos_id=EOS, config=config) for m in models)


def test_models_with_other_vocabularies_are_refused():
    with pytest.raises(ValueError, match="one vocabulary"):
        Ensemble([make_model(0), Transformer(make_model(0).config.replace(src_vocab_size=V + 1, tgt_vocab_size=V + 1))])


def test_ensembles_through_the_command_line(random_checkpoint, tiny_run, tmp_path):
    src = tmp_path / "src.txt"
    src.write_text("A dog runs across the green field.\n\nTwo children play with a red ball.\n")
    run = lambda *ckpts: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "qkv", "translate", *[a for c in ckpts for a in ("--checkpoint", str(c))], "-i", str(src), "--beam", "3"],
        capture_output=True, text=True,
    )
    alone, doubled = run(random_checkpoint), run(random_checkpoint, random_checkpoint)
    assert alone.returncode == doubled.returncode == 0 and alone.stdout == doubled.stdout
    assert len(doubled.stdout.split("\n")) == 4
    other = run(random_checkpoint, tiny_run)  # trained with its own tokenizer
    assert other.returncode == 2 and other.stderr.count("\n") == 1 and "different tokenizers" in other.stderr


def test_an_ensemble_decodes_with_the_first_checkpoints_length_penalty_unless_one_is_given(random_checkpoint, tmp_path):
    from qkv.io import checkpoint

    loaded = checkpoint.load(random_checkpoint)
    low, high = (checkpoint.save(tmp_path / name, loaded.model, loaded.tokenizer,
                                 configs={"data": {"src_lang": "en", "tgt_lang": "de"}, "decode": {"length_penalty": alpha}})
                 for name, alpha in (("low", 0.3), ("high", 1.7)))
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("A dog runs across the green field.\n")
    ref.write_text("Ein Hund läuft über die grüne Wiese.\n")
    evaluate = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "qkv", "evaluate", *flags, "--src-file", str(src), "--ref-file", str(ref), "--beam", "2"],
        capture_output=True, text=True,
    )
    for first, second, alpha in ((low, high, "0.3"), (high, low, "1.7")):
        result = evaluate("--checkpoint", str(first), "--checkpoint", str(second))
        assert result.returncode == 0 and f"beam 2, length penalty {alpha}," in result.stdout
    given = evaluate("--checkpoint", str(low), "--checkpoint", str(high), "--length-penalty", "1.1")
    assert given.returncode == 0 and "beam 2, length penalty 1.1," in given.stdout
