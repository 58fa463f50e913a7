"""int8 decoding: the linear layers get int8 weights (torchao) in a copy of the model, the logits stay close
to fp32's, the fp32 model is untouched, and `qkv translate --int8` / `qkv evaluate --int8` run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_decode import BOS, EOS, batch, make_model, sources

from qkv.infer.search import DecodeConfig, search
from qkv.model.quantize import int8_model, is_int8

def test_int8_model_quantizes_a_copy_and_keeps_in_proj_in_fp32():
    model = make_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = int8_model(model)
    assert not any(is_int8(p) for p in model.parameters())  # the original is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    modules = dict(quantized.named_modules())
    for name in ("generator", "decoder_layers.0.feed_forward.linear1", "decoder_layers.0.cross_attn.out_proj"):
        weight = modules[name].weight
        assert is_int8(weight) and weight.shape == modules[name].weight.dequantize().shape, name
        assert weight.qdata.dtype == torch.int8 and weight.scale.shape == (weight.shape[0], 1), name  # 8 bits, a scale per row
    in_proj = modules["decoder_layers.0.cross_attn.in_proj"]  # sliced by cross-attention: kept in fp32
    assert not is_int8(in_proj.weight) and in_proj.weight.dtype == torch.float32


def test_int8_halves_the_multi30k_models_parameter_bytes_with_one_int8_table_for_embedding_and_output():
    """The memory claim of docs/translation.md and --int8's help, on the multi30k preset's model (random
    weights): 9,398,272 fp32 bytes -> 4,226,624 (0.45x); the tied embedding reads the output projection's
    int8 rows instead of keeping its fp32 table beside them (that kept 0.89x)."""
    from qkv.model.config import model_preset
    from qkv.model.quantize import Int8Embedding, parameter_bytes
    from qkv.model.transformer import Transformer
    from qkv.train.recipes import TRAIN_PRESETS

    preset = TRAIN_PRESETS["multi30k"]
    torch.manual_seed(0)
    model = Transformer(model_preset(preset.model, **dict(preset.model_overrides))).eval()
    fp32 = parameter_bytes(model)
    assert fp32 == 4 * model.num_parameters() == 9_398_272
    quantized = int8_model(model)
    assert parameter_bytes(quantized) / fp32 < 0.46
    assert isinstance(quantized.tgt_embed, Int8Embedding) and quantized.src_embed is quantized.tgt_embed
    assert quantized.tgt_embed.weight is quantized.generator.weight and is_int8(quantized.generator.weight)
    tokens = torch.tensor([[5, 9, 7999], [3, 3, 0]])
    with torch.inference_mode():
        assert torch.allclose(quantized.tgt_embed(tokens), quantized.generator.weight.dequantize()[tokens])
        exact, approx = model(tokens, tokens[:, :2]), quantized(tokens, tokens[:, :2])  # (B, 2, V)
    assert torch.nn.functional.cosine_similarity(approx.flatten(), exact.flatten(), dim=0) > 0.99
    assert int8_model(model, in_place=True) is model and is_int8(model.generator.weight)  # no float copy held


def test_int8_uses_no_deprecated_api_and_prints_nothing():
    """``int8_model`` raises no DeprecationWarning (torch.ao.quantization gave one) and, in a fresh
    process, writes nothing to stderr: torchao's import-time notices about GPU kernels are kept quiet."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        int8_model(make_model(0))
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from test_decode import make_model; "
            "from qkv.model.quantize import int8_model; int8_model(make_model(0))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True, check=True)
    assert out.stderr == ""


def test_int8_logits_are_close_to_fp32_and_search_runs():
    model = make_model(0)
    quantized = int8_model(model)
    src = batch(sources([6, 9, 4, 7], seed=3))
    tgt = torch.full((4, 1), BOS)
    with torch.inference_mode():
        exact, approx = model(src, tgt), quantized(src, tgt)  # (B, 1, V)
    # 8 bits per weight and activation: a few percent of the logits' spread, far from a broken layer
    assert (approx - exact).abs().max() < 0.1 * exact.std()
    assert torch.nn.functional.cosine_similarity(approx.flatten(), exact.flatten(), dim=0) > 0.99
    for beam in (1, 3):
        hyps = search(quantized, src, bos_id=BOS, eos_id=EOS, config=DecodeConfig(beam_size=beam, max_len_b=6))
        assert len(hyps) == 4 and all(h and all(0 <= t < model.config.tgt_vocab_size for t in h[0].tokens) for h in hyps)


def test_translate_and_evaluate_with_int8_through_the_command_line(random_checkpoint, tmp_path):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("A dog runs.\n\nTwo children play.\n")
    ref.write_text("Ein Hund rennt.\n\nZwei Kinder spielen.\n")
    qkv = [sys.executable, "-m", "qkv"]
    out = subprocess.run([*qkv, "translate", "--checkpoint", str(random_checkpoint), "--int8", "-i", str(src)],
                         capture_output=True, text=True, check=True)
    assert len(out.stdout.split("\n")) == 4 and out.stdout.split("\n")[1] == ""  # one line per input line
    out = subprocess.run([*qkv, "evaluate", "--checkpoint", str(random_checkpoint), "--int8",
                          "--src-file", str(src), "--ref-file", str(ref)], capture_output=True, text=True, check=True)
    assert "int8" in out.stdout and "BLEU" in out.stdout
