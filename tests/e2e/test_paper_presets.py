"""The paper's training recipes as presets (section 5, table 3): paper-base and paper-big. Their
models are counted on the meta device (no memory), and a few updates of paper-base's recipe run on
the CPU with a tiny model and tiny batches."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from qkv.infer.search import DecodeConfig
from qkv.model.config import ConfigError
from qkv.model.transformer import Transformer
from qkv.train.recipes import build_configs
from qkv.train.schedule import inverse_sqrt_lr
from qkv.train.trainer import Trainer

PAPER = {  # table 3 and section 5
    "paper-base": {"model": "base", "d_model": 512, "d_ff": 2048, "heads": 8, "dropout": 0.1, "steps": 100_000, "average": 5, "every": 1400, "params": 65e6},
    "paper-big": {"model": "big", "d_model": 1024, "d_ff": 4096, "heads": 16, "dropout": 0.3, "steps": 300_000, "average": 20, "every": 600, "params": 213e6},
}


@pytest.mark.parametrize("preset", PAPER)
def test_the_paper_presets_hold_section_5s_recipe(preset):
    paper = PAPER[preset]
    model, train, data = build_configs(preset, model={}, train={}, data={})
    assert (model.d_model, model.d_ff, model.n_heads, model.n_encoder_layers, model.n_decoder_layers) == (paper["d_model"], paper["d_ff"], paper["heads"], 6, 6)
    assert (model.dropout, model.norm_first, model.share_embeddings, model.tie_output) == (paper["dropout"], False, True, True)
    assert data.vocab_size == 37000  # one vocabulary shared by both sides
    assert (train.beta1, train.beta2, train.eps, train.label_smoothing, train.clip_norm) == (0.9, 0.98, 1e-9, 0.1, 0.0)
    assert (train.max_steps, train.average_last, train.keep_last, train.warmup_steps) == (paper["steps"], paper["average"], paper["average"], 4000)
    assert (train.valid_beam, train.tune_length_penalty, train.decay) == (4, False, "inverse_sqrt")  # beam 4, alpha 0.6 untuned:
    assert DecodeConfig().length_penalty == 0.6  # what a final/ without a tuned penalty is searched with
    assert train.eval_every == paper["every"]  # about 10 minutes at the paper's pace: 100,000 updates in 12 h, 300,000 in 3.5 days
    assert round(paper["steps"] / (12 if preset == "paper-base" else 84) / 6, -2) == paper["every"]
    for step in (1, 10, 1000, 3999, 4000, 4001, 50_000, paper["steps"]):  # lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
        paper_lr = paper["d_model"] ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        assert inverse_sqrt_lr(step, peak=train.lr, warmup=train.warmup_steps) == pytest.approx(paper_lr, rel=1e-12)
    # ~25,000 source and 25,000 target tokens per update (max_tokens counts a batch's longer side), on any number of processes
    assert [train.accumulation(n) * train.max_tokens * n for n in (1, 2, 4)] == [25_000] * 3


@pytest.mark.parametrize("preset", PAPER)
def test_the_paper_models_have_the_papers_parameter_counts(preset):
    model, _, data = build_configs(preset, model={}, train={}, data={})
    config = model.replace(src_vocab_size=data.vocab_size, tgt_vocab_size=data.vocab_size)
    with torch.device("meta"):  # shapes only: 213M parameters are counted, not allocated
        n = Transformer(config).num_parameters()
    assert n == {"paper-base": 63_082_496, "paper-big": 214_245_376}[preset]  # the counts docs/training.md gives
    assert abs(n - PAPER[preset]["params"]) / PAPER[preset]["params"] < 0.03  # table 3: 65M and 213M


def test_step_tokens_sets_the_accumulation_and_refuses_a_second_one():
    _, train, _ = build_configs("paper-base", model={}, train={"max_tokens": 3125}, data={})
    assert [train.accumulation(n) for n in (1, 2, 8)] == [8, 4, 1]
    with pytest.raises(ConfigError, match="step_tokens=25000 sets the accumulation itself"):
        build_configs("paper-base", model={}, train={"accumulate": 2}, data={})
    _, plain, _ = build_configs("tiny", model={}, train={"accumulate": 3}, data={})
    assert plain.accumulation(2) == 3  # without step_tokens, accumulate as given


def test_a_few_updates_of_the_paper_base_recipe_run_on_the_cpu(dates_tsv, tmp_path):
    tiny_model = {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_encoder_layers": 1, "n_decoder_layers": 1}
    tiny_run = {"max_tokens": 64, "step_tokens": 256, "max_steps": 2, "eval_every": 1, "keep_last": 2, "average_last": 2, "threads": 1}
    data = {"corpus": "files", "train_src": str(dates_tsv), "vocab_size": 60, "train_limit": 60, "src_lang": "fr", "tgt_lang": "en"}
    model, train, data_cfg = build_configs("paper-base", model=tiny_model, train=tiny_run, data=data)
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(tmp_path / "run", model, train, data_cfg)
        assert trainer.accumulate == 4  # 256 tokens per update from micro-batches of 64
        result = trainer.run(progress=False)
    finally:
        torch.set_num_threads(threads)
    assert result.step == 2 and math.isfinite(result.final["chrf"])
    events = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    assert start["accumulate"] == 4
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(512 ** -0.5 * 2 * 4000 ** -1.5)  # the paper's schedule at step 2
    assert dataclasses.asdict(trainer.train_cfg)["step_tokens"] == 256
