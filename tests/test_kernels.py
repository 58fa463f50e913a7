"""The linear layers' kernel: oneDNN for fp32 inference on the CPU, ``F.linear`` everywhere else."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv import kernels
from qkv.config import ModelConfig
from qkv.kernels import Linear, linear
from qkv.model import Transformer

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch has no oneDNN linear")


@pytest.fixture
def onednn_calls(monkeypatch) -> list[int]:
    calls = [0]
    onednn = kernels._onednn_linear

    def counted(*args):
        calls[0] += 1
        return onednn(*args)

    monkeypatch.setattr(kernels, "_onednn_linear", counted)
    return calls


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 16), (3, 5, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_runs_onednn_and_agrees_with_f_linear(shape, bias, onednn_calls):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(24, 16, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    with torch.no_grad():
        out = linear(x, w, b)
        columns = linear(torch.randn(16, 9, generator=g).t(), w, b)  # a transposed (non-contiguous) input
    assert onednn_calls[0] == 2
    assert out.shape == (*shape[:-1], 24)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert columns.shape == (9, 24)


def test_training_and_autocast_keep_f_linear(onednn_calls):
    layer = Linear(16, 8)
    reference = nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    reference(x).square().sum().backward()
    torch.testing.assert_close(grad, x.grad, atol=0, rtol=0)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, atol=0, rtol=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's cast happens in F.linear's dispatch
    assert onednn_calls[0] == 0


def test_prefer_onednn_false_keeps_f_linear(onednn_calls):
    previous = kernels.prefer_onednn(False)
    try:
        with torch.no_grad():
            linear(torch.randn(2, 4), torch.randn(3, 4))
    finally:
        assert kernels.prefer_onednn(previous) is False
    assert onednn_calls[0] == 0


def test_linear_has_nn_linears_state_dict():
    layer, plain = Linear(5, 3), nn.Linear(5, 3)
    assert layer.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5)
    torch.testing.assert_close(plain(x), layer(x), atol=0, rtol=0)


@needs_onednn
def test_a_models_logits_agree_across_the_two_kernels():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=50, tgt_vocab_size=50, d_model=32, n_heads=4, d_ff=64,
                                    n_encoder_layers=2, n_decoder_layers=2, dropout=0.0)).eval()
    src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 7))
    with torch.no_grad():
        onednn = model(src, tgt)
        previous = kernels.prefer_onednn(False)
        try:
            blas = model(src, tgt)
        finally:
            kernels.prefer_onednn(previous)
    torch.testing.assert_close(onednn, blas, atol=1e-4, rtol=1e-4)
    assert not torch.equal(onednn, torch.zeros_like(onednn))
