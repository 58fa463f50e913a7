"""The EMA of the weights (qkv.train.ema): the running average it claims, saved and resumed exactly, and
chosen for final/ only when it validates best."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train import RecordingTrainer, dates_configs, same_weights

from qkv.io import checkpoint
from qkv.train.ema import WeightEMA, ema_decay
from qkv.train.trainer import Trainer


def test_the_average_follows_the_formula_with_its_warm_up():
    model = torch.nn.Linear(3, 2)
    ema = WeightEMA(model, decay=0.9)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for update in range(1, 40):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(update)
        keep = min(0.9, (1 + update) / (10 + update))
        for name, p in model.named_parameters():
            expected[name] = keep * expected[name] + (1 - keep) * p.detach()
    for name, value in ema.weights().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6)
    assert ema_decay(0.9, 1) == pytest.approx(2 / 11) and ema_decay(0.9, 1000) == 0.9  # warm-up, then the decay
    assert not torch.allclose(ema.weights()["weight"], model.weight)  # an average, not the weights


def test_a_saved_average_loads_only_into_the_same_weights():
    model = torch.nn.Linear(3, 2)
    ema = WeightEMA(model, decay=0.5)
    other = WeightEMA(torch.nn.Linear(3, 2), decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.average, ema.average))
    with pytest.raises(ValueError, match="other weights"):
        WeightEMA(torch.nn.Bilinear(3, 3, 2), 0.5).load_state_dict({"weight": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="shape"):
        WeightEMA(torch.nn.Linear(4, 2), 0.5).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="decay"):
        WeightEMA(model, 1.0)


def test_a_resumed_run_continues_the_same_average(tmp_path, dates_tsv):  # noqa: F811
    model, train, data = dates_configs(dates_tsv, ema=0.9, eval_every=3, tune_length_penalty=False)
    whole = RecordingTrainer(tmp_path / "whole", model, dataclasses.replace(train, max_steps=8), data)
    whole.run(progress=False)
    part = RecordingTrainer(tmp_path / "run", model, dataclasses.replace(train, max_steps=4), data)
    part.run(progress=False)
    resumed = RecordingTrainer.resume(tmp_path / "run", max_steps=8)
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.average, part.ema.average))  # loaded from last/
    resumed.run(progress=False)
    assert part.losses + resumed.losses == whole.losses
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.average, whole.ema.average))


def test_final_is_the_ema_only_when_it_validates_best(monkeypatch, tmp_path, dates_tsv):  # noqa: F811
    run = tmp_path / "run"
    trainer = Trainer(run, *dates_configs(dates_tsv, ema=0.9, max_steps=4, eval_every=2, keep_last=2, average_last=2,
                                          tune_length_penalty=False))
    trainer.run(progress=False)
    newest = [r for r in trainer.log.records if r["event"] == "valid"][-1]

    def final_given(bleu_of_2: float, bleu_of_1: float, bleu_of_ema: float) -> dict:
        scores = iter([bleu_of_2, bleu_of_ema])  # the newest alone reuses its log record
        monkeypatch.setattr(trainer, "validate", lambda: {"valid_loss": 1.0, "bleu": next(scores), "bleu_lc": 0.0, "chrf": 0.0})
        newest["bleu"] = bleu_of_1
        trainer.finish()
        record = trainer.log.records[-1]
        assert record["tried_bleu"] == {"2": bleu_of_2, "1": bleu_of_1, "ema": bleu_of_ema}
        return record

    record = final_given(10.0, 20.0, 30.0)
    assert record["ema"] and record["averaged"] == [] and record["bleu"] == 30.0
    final = checkpoint.load(run / "final").model.state_dict()
    assert all(torch.equal(final[name], value) for name, value in trainer.ema.weights().items())
    assert not same_weights(checkpoint.load(run / "final").model, checkpoint.load(run / "step-000004").model)
    record = final_given(10.0, 20.0, 20.0)  # a tie: not the EMA
    assert not record["ema"] and record["averaged"] == ["step-000004"]
    assert same_weights(checkpoint.load(run / "final").model, checkpoint.load(run / "step-000004").model)
    assert same_weights(trainer.model, checkpoint.load(run / "last").model)  # the live weights are back
