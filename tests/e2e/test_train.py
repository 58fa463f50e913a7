"""Training: the label-smoothed loss, the learning-rate schedule, presets, exact resumption, the choice
of final/, step checkpoints past a million, and time budgets planned as step counts."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import MULTI30K, needs_multi30k, require_multi30k

from qkv.io import checkpoint
from qkv.model.config import ConfigError
from qkv.io.checkpoint import step_dirs
from qkv.train.stopping import StopRequested
from qkv.train.recipes import TRAIN_PRESETS, TrainConfig, build_configs
from qkv.train.trainer import Trainer
from qkv.train.schedule import budget_steps, constant_lr, cooldown_factor, inverse_sqrt_lr
from qkv.train.loss import label_smoothed_loss
from qkv.train.validation import LENGTH_PENALTIES

PAD = 2  # not 0, so a loss that assumed pad 0 would be caught


# ---- loss ------------------------------------------------------------------------------------


def test_padding_positions_contribute_nothing():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    target = torch.tensor([[4, 5, 6, PAD, PAD], [1, 0, 3, 6, PAD]])
    loss, n_tokens = label_smoothed_loss(logits, target, pad_id=PAD, smoothing=0.1)

    changed = logits.clone()
    changed[target == PAD] = 100 * torch.randn(3, 7)  # wildly different logits where the target is padding
    loss_changed, _ = label_smoothed_loss(changed, target, pad_id=PAD, smoothing=0.1)

    assert loss_changed.item() == loss.item()
    assert n_tokens.item() == 7
    # and the real positions do count: changing one of them changes the loss
    changed[0, 0, 1] += 5.0
    assert label_smoothed_loss(changed, target, pad_id=PAD, smoothing=0.1)[0].item() != loss.item()


def test_label_smoothing_matches_a_hand_computation():
    logits = [[2.0, 0.5, -1.0, 0.0], [0.0, 1.0, 0.0, -2.0]]
    target = [0, 3]
    eps, V = 0.2, 4
    expected = 0.0
    for row, t in zip(logits, target):
        log_z = math.log(sum(math.exp(x) for x in row))
        for c, x in enumerate(row):
            q = 1 - eps + eps / V if c == t else eps / V  # the smoothed target distribution
            expected -= q * (x - log_z)
    loss, n_tokens = label_smoothed_loss(torch.tensor([logits]), torch.tensor([target]), pad_id=PAD, smoothing=eps)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert n_tokens.item() == 2


def test_zero_smoothing_is_plain_cross_entropy():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 9)
    target = torch.randint(3, 9, (3, 4))
    target[1, 2:] = PAD
    loss, n_tokens = label_smoothed_loss(logits, target, pad_id=PAD, smoothing=0.0)
    keep = target != PAD
    expected = -logits.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)[keep].sum()
    torch.testing.assert_close(loss, expected)
    assert n_tokens.item() == keep.sum().item() == 10
    torch.testing.assert_close(loss, F.cross_entropy(logits[keep], target[keep], reduction="sum"))


# ---- schedule --------------------------------------------------------------------------------


def test_schedule_warms_up_linearly_then_decays_with_inverse_sqrt():
    peak, w = 3e-3, 100
    lr = [inverse_sqrt_lr(step, peak=peak, warmup=w) for step in range(1, 4 * w + 1)]  # lr[i] is step i + 1
    for step in (1, 10, 50, 99):
        assert lr[step - 1] == pytest.approx(peak * step / w, rel=1e-12)
    assert all(a < b for a, b in zip(lr[: w - 1], lr[1:w]))  # rising during warm-up
    assert inverse_sqrt_lr(w, peak=peak, warmup=w) == peak  # the peak exactly at the end of warm-up
    assert all(a > b for a, b in zip(lr[w - 1 :], lr[w:]))  # falling after it
    assert inverse_sqrt_lr(4 * w, peak=peak, warmup=w) == peak / 2
    for step in (150, 250, 399):
        assert lr[step - 1] * math.sqrt(step) == pytest.approx(peak * math.sqrt(w), rel=1e-12)


def test_cooldown_is_flat_then_falls_linearly_to_zero_at_the_end_of_the_run():
    assert cooldown_factor(None, 0.2) == 1.0  # an open-ended run has no end to cool down towards
    assert cooldown_factor(0.5, 0.0) == 1.0  # disabled
    for progress in (0.0, 0.5, 0.79):
        assert cooldown_factor(progress, 0.2) == 1.0
    assert cooldown_factor(0.8, 0.2) == pytest.approx(1.0)
    assert cooldown_factor(0.9, 0.2) == pytest.approx(0.5)
    assert cooldown_factor(0.95, 0.2) == pytest.approx(0.25)
    assert cooldown_factor(1.0, 0.2) == 0.0
    assert cooldown_factor(1.3, 0.2) == 0.0  # past the budget (the last step runs over): never negative
    factors = [cooldown_factor(p / 100, 0.3) for p in range(70, 101)]
    assert all(a > b for a, b in zip(factors, factors[1:]))
    with pytest.raises(ValueError, match="cooldown"):
        TrainConfig(cooldown=1.5)


def test_a_time_budget_becomes_the_steps_that_fit_at_the_measured_pace():
    assert budget_steps(3600.0, 50.0, 100, 0.2) == 7200  # 0.5 s a step: 7,200 fit in the hour
    assert budget_steps(30.0, 50.0, 100, 0.0) == 100  # the budget already spent: the steps done, no fewer
    # A budget that ends soon after the measurement still starts its cool-down after the measured
    # steps, which ran at the full schedule: 125 steps put the last 20% (100 to 125) after step 99.
    assert budget_steps(55.0, 50.0, 100, 0.2) == 125
    assert cooldown_factor(99 / 125, 0.2) == 1.0


# ---- configs ---------------------------------------------------------------------------------


def test_build_configs_applies_overrides_and_rejects_unknown_keys():
    model, train, data = build_configs("tiny", model={"dropout": 0.1}, train={"lr": 1e-3}, data={"vocab_size": 300})
    assert (model.d_model, model.dropout, train.lr, data.vocab_size) == (32, 0.1, 1e-3, 300)
    assert train.warmup_steps == TRAIN_PRESETS["tiny"].train.warmup_steps  # untouched values come from the preset
    with pytest.raises(ConfigError, match="did you mean 'max_steps'"):
        build_configs("tiny", model={}, train={"max_step": 5}, data={})
    with pytest.raises(ValueError, match="did you mean 'tiny'"):
        build_configs("tiyn", model={}, train={}, data={})
    with pytest.raises(ValueError, match="label_smoothing"):
        TrainConfig(label_smoothing=1.0)
    with pytest.raises(ValueError, match="average_last"):
        TrainConfig(average_last=3, keep_last=2)


# ---- a run, and resuming it --------------------------------------------------------------------


class RecordingTrainer(Trainer):
    """A Trainer that remembers the loss of every step, and sends itself Ctrl-C (a real SIGINT) as a
    given step starts: the step still completes, and the run stops after it."""

    interrupt_at_step: int | None = None

    def train_step(self, indices):
        if self.step + 1 == self.interrupt_at_step:
            os.kill(os.getpid(), signal.SIGINT)
        result = super().train_step(indices)
        self.__dict__.setdefault("losses", []).append(result[0])
        self.__dict__.setdefault("lrs", []).append(self.optimizer.param_groups[0]["lr"])
        return result


def tiny_configs(max_steps: int):
    # Dropout on, so that resuming also has to restore the random generator, not only weights and Adam.
    return build_configs(
        "tiny",
        model={"dropout": 0.1},
        train={"max_steps": max_steps, "eval_every": 5, "tune_length_penalty": True},
        data={"data_dir": str(MULTI30K), "valid_limit": 10},
    )


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> RecordingTrainer:
    require_multi30k()
    trainer = RecordingTrainer(tmp_path_factory.mktemp("resume") / "whole", *tiny_configs(20))
    trainer.run(progress=False)
    return trainer


@needs_multi30k
def test_a_run_writes_its_checkpoints_log_and_averaged_final(uninterrupted):
    run = uninterrupted.run_dir
    assert len(uninterrupted.losses) == 20 and uninterrupted.step == 20
    # evaluations at 5, 10, 15, 20; keep_last=2 keeps the newest two
    assert [d.name for d in sorted(run.glob("step-*"))] == ["step-000015", "step-000020"]
    for name in ("last", "best", "final", "curves.png", "log.jsonl", "tokenizer.model"):
        assert (run / name).exists(), name
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "valid"] == [5, 10, 15, 20]
    assert [r["event"] for r in records][0] == "start" and records[-1]["event"] == "final"
    # both candidates for final/ were validated, and final/ holds the weights its log record names
    # (which one wins is test_final_is_the_best_validated_average_and_a_tie_goes_to_the_larger's)
    final_record = records[-1]
    assert set(final_record["tried_bleu"]) == {"2", "1"}
    # the length penalty of final/ is the one of the best validation BLEU, in its config.json
    tuning = next(r for r in records if r["event"] == "length_penalty")
    assert [float(alpha) for alpha in tuning["tried_bleu"]] == list(LENGTH_PENALTIES)
    assert tuning["tried_bleu"][str(tuning["chosen"])] == max(tuning["tried_bleu"].values())
    assert checkpoint.read_config(run / "final")["decode"] == {"length_penalty": tuning["chosen"]}
    final = checkpoint.load(run / "final").model.state_dict()
    mean = checkpoint.average([run / name for name in final_record["averaged"]])
    for name, value in mean.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0)
    # and after validating final/, the trainer's model holds its own (last/) weights again
    assert same_weights(uninterrupted.model, checkpoint.load(run / "last").model)
    # the schedule was applied: step 20 is the end of the tiny preset's warm-up, so the peak
    assert uninterrupted.optimizer.param_groups[0]["lr"] == inverse_sqrt_lr(20, peak=3e-3, warmup=20) == 3e-3


@needs_multi30k
def test_cooldown_brings_the_learning_rate_down_over_the_last_steps(tmp_path):
    model, train, data = tiny_configs(8)
    train = dataclasses.replace(train, cooldown=0.5, eval_every=8)
    trainer = RecordingTrainer(tmp_path / "run", model, train, data)
    trainer.run(progress=False)
    warm = [inverse_sqrt_lr(step, peak=train.lr, warmup=train.warmup_steps) for step in range(1, 9)]
    # step s starts at progress (s - 1) / 8: flat through step 5, then 3/4, 1/2, 1/4 of the schedule
    factors = [1, 1, 1, 1, 1, 0.75, 0.5, 0.25]
    assert trainer.lrs == pytest.approx([w * f for w, f in zip(warm, factors)], rel=1e-12)


@needs_multi30k
def test_decay_none_holds_the_peak_after_warm_up_until_the_cooldown(tmp_path):
    model, train, data = tiny_configs(8)
    train = dataclasses.replace(train, decay="none", warmup_steps=2, lr=1e-3, cooldown=0.5, eval_every=8)
    trainer = RecordingTrainer(tmp_path / "run", model, train, data)
    trainer.run(progress=False)
    # warm-up over 2 steps, the peak held (not 1/sqrt(step)), then the cool-down's 3/4, 1/2, 1/4
    assert trainer.lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4], rel=1e-12)
    assert constant_lr(1000, peak=1e-3, warmup=0) == 1e-3
    with pytest.raises(ValueError, match="decay must be inverse_sqrt or none"):
        TrainConfig(decay="cosine")


@needs_multi30k
@pytest.mark.parametrize("end", [{}, {"max_steps": 8}, {"time_budget": 60.0}])
def test_decay_none_without_a_known_end_warns_that_the_peak_is_never_left(tmp_path, end):
    """The held peak comes down only in the cool-down, which needs the run's end: without one the
    trainer says so; with --max-steps or --time-budget it is silent."""
    model, train, data = tiny_configs(8)
    train = dataclasses.replace(train, decay="none", cooldown=0.2, **{"max_steps": 0, **end})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(tmp_path / "run", model, train, data)
    held = [w for w in caught if "stays at its peak" in str(w.message)]
    assert len(held) == (0 if end else 1)


@needs_multi30k
def test_resume_from_last_gives_the_same_losses_and_weights(uninterrupted, tmp_path):
    first = RecordingTrainer(tmp_path / "run", *tiny_configs(10))
    first.run(progress=False)
    assert first.losses == uninterrupted.losses[:10]

    resumed = RecordingTrainer.resume(tmp_path / "run", max_steps=20)
    assert (resumed.step, resumed.epoch, resumed.position) == (10, 0, 10)
    resumed.run(progress=False)
    assert resumed.losses == uninterrupted.losses[10:]  # the next loss, and every one after it
    assert same_weights(resumed.model, uninterrupted.model)


@needs_multi30k
def test_ctrl_c_during_a_step_saves_after_it_a_checkpoint_that_resumes_exactly(uninterrupted, tmp_path):
    interrupted = RecordingTrainer(tmp_path / "run", *tiny_configs(20))
    interrupted.interrupt_at_step = 13
    with pytest.raises(StopRequested) as stopped:
        interrupted.run(progress=False)
    assert stopped.value.exit_status == 130
    assert json.loads((tmp_path / "run" / "last" / "trainer.json").read_text())["step"] == 13
    assert interrupted.losses == uninterrupted.losses[:13]  # step 13 was finished, not cut short

    resumed = RecordingTrainer.resume(tmp_path / "run")
    resumed.run(progress=False)
    assert resumed.losses == uninterrupted.losses[13:]
    assert same_weights(resumed.model, uninterrupted.model)


@needs_multi30k
def test_a_checkpoint_without_training_state_cannot_be_resumed(uninterrupted):
    with pytest.raises(checkpoint.CheckpointError, match="cannot be resumed"):
        checkpoint.load_trainer(uninterrupted.run_dir / "final")


# ---- final/, step checkpoints, time budgets, resume overrides (generated dates: no download) -------


def dates_configs(data: Path, **train):
    return build_configs(
        "tiny", model={"dropout": 0.1}, train={"threads": 1, **train},
        data={"corpus": "files", "train_src": str(data), "vocab_size": 120},
    )  # fmt: skip


def test_subword_dropout_draws_every_epochs_segmentation_afresh_and_resumes_exactly(tmp_path, dates_tsv):
    model, train, data = dates_configs(dates_tsv, eval_every=1000, tune_length_penalty=False)
    data = dataclasses.replace(data, subword_dropout=0.3)
    probe = Trainer(tmp_path / "probe", model, train, data)
    per_epoch = len(probe.batches(0))
    fixed, first, second = probe.train_ids, probe.epoch_ids(0), probe.epoch_ids(1)
    assert first.tgt_ids != second.tgt_ids and first.tgt_ids != fixed.tgt_ids  # drawn, and drawn again
    assert sum(map(len, first.tgt_ids)) > sum(map(len, fixed.tgt_ids))  # skipped merges: more, smaller pieces
    decode = probe.tokenizer.decode
    assert [decode(ids) for ids in second.tgt_ids] == [decode(ids) for ids in fixed.tgt_ids]  # the same text
    assert Trainer(tmp_path / "again", model, train, data).epoch_ids(1) == second  # from the seed and epoch alone

    end = per_epoch + 3  # into the second epoch, interrupted there
    whole = RecordingTrainer(tmp_path / "whole", model, dataclasses.replace(train, max_steps=end), data)
    whole.run(progress=False)
    part = RecordingTrainer(tmp_path / "run", model, dataclasses.replace(train, max_steps=per_epoch + 1), data)
    part.run(progress=False)
    resumed = RecordingTrainer.resume(tmp_path / "run", max_steps=end)
    resumed.run(progress=False)
    assert part.losses + resumed.losses == whole.losses
    assert same_weights(resumed.model, whole.model)


def test_final_is_the_best_validated_average_and_a_tie_goes_to_the_larger(monkeypatch, tmp_path, dates_tsv):
    run = tmp_path / "run"
    trainer = Trainer(run, *dates_configs(dates_tsv, max_steps=6, eval_every=2, keep_last=3, average_last=3))
    trainer.run(progress=False)
    assert [d.name for d in step_dirs(run)] == ["step-000002", "step-000004", "step-000006"]
    newest = [r for r in trainer.log.records if r["event"] == "valid"][-1]
    assert newest["step"] == 6

    def final_given(bleu_of_3: float, bleu_of_2: float, bleu_of_1: float) -> tuple[list[str], dict]:
        """finish() when the averages of the newest 3 and 2 validate at these BLEUs (in that order)
        and the newest alone validated at bleu_of_1 (its log record is reused, not validated again)."""
        scores = iter([bleu_of_3, bleu_of_2])
        monkeypatch.setattr(trainer, "validate", lambda: {"valid_loss": 1.0, "bleu": next(scores), "bleu_lc": 0.0, "chrf": 0.0})
        newest["bleu"] = bleu_of_1
        metrics = trainer.finish()
        record = trainer.log.records[-1]
        assert record["tried_bleu"] == {"3": bleu_of_3, "2": bleu_of_2, "1": bleu_of_1}
        assert metrics["bleu"] == record["bleu"] == max(bleu_of_3, bleu_of_2, bleu_of_1)
        return record["averaged"], checkpoint.load(run / "final").model.state_dict()

    def assert_final_is_the_mean_of(names: list[str], final: dict) -> None:
        mean = checkpoint.average([run / name for name in names])
        assert all(torch.equal(final[name], value) for name, value in mean.items())

    averaged, final = final_given(10.0, 20.0, 15.0)
    assert averaged == ["step-000004", "step-000006"]
    assert_final_is_the_mean_of(averaged, final)
    averaged, final = final_given(20.0, 20.0, 20.0)  # a three-way tie: the largest average
    assert averaged == ["step-000002", "step-000004", "step-000006"]
    assert_final_is_the_mean_of(averaged, final)
    averaged, final = final_given(10.0, 20.0, 30.0)
    assert averaged == ["step-000006"]
    assert same_weights(checkpoint.load(run / "final").model, checkpoint.load(run / "step-000006").model)
    # the choices were different weights: the tests above could tell them apart
    mean = checkpoint.average([run / "step-000004", run / "step-000006"])
    assert any(not torch.equal(mean[name], final[name]) for name in mean)


def test_step_checkpoints_sort_by_number_past_a_million(tmp_path, dates_tsv):
    run = tmp_path / "run"
    trainer = Trainer(run, *dates_configs(dates_tsv, keep_last=2, average_last=2))
    for trainer.step in (999_998, 999_999, 1_000_000):
        trainer.checkpoint_and_validate()
    # rotation kept the two newest (as text, "step-1000000" sorts first and was the one deleted)
    assert sorted(d.name for d in run.glob("step-*")) == ["step-1000000", "step-999999"]
    trainer.finish()
    final = [r for r in trainer.log.records if r["event"] == "final"][-1]
    assert final["averaged"] in (["step-999999", "step-1000000"], ["step-1000000"])  # never an older one
    assert [d.name for d in step_dirs(run)] == ["step-999999", "step-1000000"]


def test_a_time_budget_becomes_a_step_count_and_the_run_resumes_to_exactly_those_steps(tmp_path, dates_tsv):
    """A budgeted run times its first measure_steps updates, then plans a step count once (logged, and
    saved in last/); interrupted after that and resumed, it ends bitwise equal to --max-steps N."""
    # No step cap (the tiny preset's is 100): on a fast machine 1 s plans more than 100 steps.
    budget = {"time_budget": 1.0, "max_steps": 0, "measure_steps": 5, "cooldown": 0.5, "eval_every": 1000}
    first = RecordingTrainer(tmp_path / "budget", *dates_configs(dates_tsv, **budget))
    first.interrupt_at_step = 8  # after the plan; the plan is at least 9 steps: ceil(4 / (1 - 0.5)) + 1
    with pytest.raises(StopRequested):
        first.run(progress=False)
    planned = first.planned_steps
    assert planned is not None and planned >= 9
    assert [(r["step"], r["planned_steps"]) for r in first.log.records if r["event"] == "budget"] == [(5, planned)]
    saved = json.loads((tmp_path / "budget" / "last" / "trainer.json").read_text())
    assert (saved["step"], saved["planned_steps"]) == (8, planned)

    assert RecordingTrainer.resume(tmp_path / "budget", time_budget=5.0).planned_steps is None  # a new budget: a new plan
    resumed = RecordingTrainer.resume(tmp_path / "budget")
    assert resumed.planned_steps == planned
    result = resumed.run(progress=False)
    assert (result.step, result.stopped_because) == (planned, "time_budget")

    steps = RecordingTrainer(tmp_path / "steps", *dates_configs(dates_tsv, max_steps=planned, cooldown=0.5, eval_every=1000))
    steps.run(progress=False)
    assert first.lrs + resumed.lrs == steps.lrs  # the schedule, cool-down included, followed the steps
    assert first.lrs[-1] > steps.lrs[-1] > 0  # ... and the cool-down did bring it down
    assert first.losses + resumed.losses == steps.losses
    assert same_weights(resumed.model, steps.model)
    adam, adam_steps = resumed.optimizer.state_dict()["state"], steps.optimizer.state_dict()["state"]
    assert all(torch.equal(adam[i][k], adam_steps[i][k]) for i in adam for k in adam[i])


def test_resume_refuses_overrides_that_could_not_take_effect(tmp_path, dates_tsv):
    run = tmp_path / "run"
    Trainer(run, *dates_configs(dates_tsv, max_steps=2, eval_every=2)).run(progress=False)
    for key, value in [("beta1", 0.8), ("beta2", 0.99), ("eps", 1e-6), ("weight_decay", 0.01), ("max_tokens", 256), ("seed", 7)]:
        with pytest.raises(ValueError, match=rf"--resume cannot change {key} \("):
            Trainer.resume(run, **{key: value})
    # the saved values themselves, and settings that do take effect, are accepted
    resumed = Trainer.resume(run, seed=1, beta2=0.98, max_steps=4, lr=1e-3)
    assert resumed.step == 2
    assert resumed.run(progress=False).step == 4
    assert resumed.optimizer.param_groups[0]["lr"] == inverse_sqrt_lr(4, peak=1e-3, warmup=resumed.train_cfg.warmup_steps)
    with pytest.raises(ValueError, match="cooldown must be < 1 with a time budget"):
        TrainConfig(time_budget=60, cooldown=1.0)


def test_by_default_the_budget_is_planned_after_the_first_validation_whose_time_it_includes(tmp_path, dates_tsv):
    trainer = Trainer(tmp_path / "run", *dates_configs(dates_tsv, time_budget=0.5, eval_every=3))
    result = trainer.run(progress=False)
    events = [(r["event"], r["step"]) for r in trainer.log.records if r["event"] in ("valid", "budget")]
    assert events[:2] == [("valid", 3), ("budget", 3)]
    planned = trainer.log.records[[r["event"] for r in trainer.log.records].index("budget")]["planned_steps"]
    assert (result.step, result.stopped_because) == (planned, "time_budget")


def test_case_augmentation_draws_each_epochs_recased_pairs_from_the_seed(tmp_path, dates_tsv):
    """--data case_augment=P: each epoch's training ids hold a fresh share of pairs in capitals or Title
    Case (the same text otherwise), drawn from the seed and the epoch alone; a prepared corpus refuses it."""
    model, train, data = dates_configs(dates_tsv, eval_every=1000, tune_length_penalty=False)
    data = dataclasses.replace(data, case_augment=0.5)
    probe = Trainer(tmp_path / "probe", model, train, data)
    from qkv.data.sentences import case_augmented

    fixed, first, second = probe.train_ids, probe.epoch_ids(0), probe.epoch_ids(1)
    assert first.src_ids != fixed.src_ids and first.src_ids != second.src_ids
    src, tgt = probe.train_data.src, probe.train_data.tgt
    for epoch, ids in ((0, first), (1, second)):  # exactly this epoch's recased pairs, encoded
        recased_src, recased_tgt = case_augmented(src, tgt, 0.5, seed=train.seed * 1_000_003 + epoch)
        assert ids.src_ids == [probe.tokenizer.encode(s)[: probe.max_len] for s in recased_src]
        assert ids.tgt_ids == [probe.tokenizer.encode_target(t)[: probe.max_len] for t in recased_tgt]
    assert Trainer(tmp_path / "again", model, train, data).epoch_ids(1) == second  # from the seed and epoch alone
    with pytest.raises(ConfigError, match="case_augment applies to text corpora"):
        dataclasses.replace(data, corpus="prepared", data_dir=str(tmp_path))


def test_a_preset_that_caps_the_data_says_so_when_the_run_starts(tmp_path, dates_tsv, capsys):
    """--preset tiny reads only the first 500 training and 50 validation pairs: the run says so on
    stderr, with the vocabulary and step count it keeps small; a recipe without caps says nothing."""
    from qkv.cli.main import main
    from qkv.cli.train import data_caps_notice

    assert main(["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(tmp_path / "capped"),
                 "--max-steps", "2", "--no-progress"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == ["note: this run reads only the first 500 training pairs and the first 50 validation pairs "
                     "(train_limit=500, valid_limit=50), with a 200-piece vocabulary and stops after 2 steps, "
                     "without tune_length_penalty or calibrate; "
                     "--data train_limit=0 valid_limit=0 reads all"]
    _, train, data = build_configs("tiny", model={}, train={}, data={"train_limit": 0, "valid_limit": 0})
    assert data_caps_notice(data, train) is None
    _, train, data = build_configs("multi30k", model={}, train={}, data={})
    assert data_caps_notice(data, train) is None
    _, train, data = build_configs("tiny", model={}, train={}, data={"corpus": "prepared", "data_dir": str(tmp_path)})
    assert "vocabulary" not in data_caps_notice(data, train)  # a prepared corpus brings its own tokenizer
