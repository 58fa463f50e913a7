"""`qkv train --train alignment=W`: the head a run trains, in the pass its context names, recorded in the
checkpoint (qkv.train.alignment.default_context: a full-context pass for a model trained from its first
update, the causal pass for a head added by fine-tuning, or what --model alignment_context says)."""

from __future__ import annotations

import pytest

from qkv.cli.main import main
from qkv.io import checkpoint
from qkv.train.alignment import default_alignment_layer


def train(dates_tsv, out, *extra: str) -> None:
    args = ["train", "--preset", "tiny", "--train-src", str(dates_tsv), "--out", str(out), "--no-progress",
            "--max-steps", "4", "--train", "eval_every=4", "threads=1", *extra]  # fmt: skip
    assert main(args) == 0


def head_of(run) -> tuple[int | None, str | None]:
    config = checkpoint.load(run / "final").model.config
    return config.alignment_layer, config.alignment_context


def test_a_new_head_is_trained_in_a_full_context_pass_unless_told(dates_tsv, tmp_path):
    pytest.importorskip("eflomal")
    train(dates_tsv, tmp_path / "full", "--train", "alignment=0.5")
    layer, context = head_of(tmp_path / "full")
    n_layers = checkpoint.load(tmp_path / "full" / "final").model.config.n_decoder_layers
    assert (layer, context) == (default_alignment_layer(n_layers), "full")
    assert (tmp_path / "full" / "alignment-links.npz").is_file()
    train(dates_tsv, tmp_path / "causal", "--train", "alignment=0.5", "--model", "alignment_context=causal")
    assert head_of(tmp_path / "causal") == (layer, "causal")


def test_a_head_added_by_fine_tuning_is_trained_in_the_causal_pass(dates_tsv, tmp_path):
    pytest.importorskip("eflomal")
    train(dates_tsv, tmp_path / "parent")
    assert head_of(tmp_path / "parent") == (None, None)  # no head without --train alignment
    train(dates_tsv, tmp_path / "child", "--init-from", str(tmp_path / "parent" / "final"), "--train", "alignment=0.5")
    layer, context = head_of(tmp_path / "child")
    assert layer is not None and context == "causal"
