"""--device: auto takes a GPU when there is one, asking for a missing GPU is a one-line error, and
(where a GPU exists) the GPU paths give the CPU's results. CI has no GPU: those tests skip there."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qkv.model.devices import resolve_device

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine: the CUDA paths run only where one exists")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the no-GPU errors cannot be seen here")


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("cuda:x")


@no_gpu
def test_asking_for_a_missing_gpu_is_an_error_not_a_cpu_run():
    with pytest.raises(ValueError, match="use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="use --device cpu"):
        resolve_device("cuda:1")


@no_gpu
@pytest.mark.parametrize("command", ["translate", "evaluate", "attend", "serve", "doctor", "train"])
def test_every_command_refuses_a_missing_gpu_in_one_line_before_writing(random_checkpoint, tmp_path, command):
    src = tmp_path / "src.txt"
    src.write_text("A dog runs.\n")
    ckpt = ["--checkpoint", str(random_checkpoint)]
    extra = {
        "translate": [*ckpt, "-i", str(src)], "evaluate": [*ckpt, "--src-file", str(src), "--ref-file", str(src)],
        "attend": [*ckpt, "A dog runs.", "--out", str(tmp_path / "att")], "serve": ckpt, "doctor": ckpt,
        "train": ["--preset", "tiny", "--train-src", str(src), "--out", str(tmp_path / "run")],
    }[command]
    out = subprocess.run([sys.executable, "-m", "qkv", command, "--device", "cuda", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "--device cuda" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.txt"]  # nothing written


@needs_gpu
def test_translations_on_the_gpu_equal_the_cpus(random_checkpoint):
    from qkv.io import checkpoint
    from qkv.infer.search import DecodeConfig
    from qkv.infer.translator import Translator

    sentences = ["A dog runs across the green field.", "Two children play.", ""]
    results = []
    for device in ("cpu", "cuda"):
        loaded = checkpoint.load(random_checkpoint, device=device)
        results.append(Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=3)).translate(sentences))
    assert results[0] == results[1]


@needs_gpu
def test_a_training_step_runs_on_the_gpu(tmp_path):
    from conftest import MULTI30K, require_multi30k

    from qkv.train.trainer import Trainer
    from qkv.train.recipes import build_configs

    require_multi30k()
    model, train, data = build_configs("tiny", model={}, train={"max_steps": 3, "eval_every": 3},
                                       data={"data_dir": str(MULTI30K), "train_limit": 200, "valid_limit": 10})
    trainer = Trainer(tmp_path / "run", model, train, data)
    assert trainer.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
    trainer.run(progress=False)
    assert trainer.step == 3
