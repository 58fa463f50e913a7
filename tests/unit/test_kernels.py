"""The linear layers' kernel: oneDNN for fp32 on the CPU (forward and gradients), ``F.linear`` everywhere else."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.model import kernels
from qkv.model.bf16 import bf16_native
from qkv.model.config import ModelConfig
from qkv.model.kernels import Linear, linear
from qkv.model.transformer import Transformer

needs_onednn = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch has no oneDNN linear")
# oneDNN's bfloat16 inner product needs a CPU with AVX-512 (BF16 or AMX natively); on an AVX2-only CPU it
# cannot make the primitive, and training never asks for it there (bf16_layers needs native bfloat16).
needs_bf16 = pytest.mark.skipif(not bf16_native(torch.device("cpu")), reason="this CPU has no native bfloat16 (AVX-512 BF16 or AMX)")


@pytest.fixture(autouse=True)
def small_products_too(monkeypatch):
    """The tests' products are small: let oneDNN take them (``MIN_OUTPUTS`` has a test of its own)."""
    monkeypatch.setattr(kernels, "MIN_OUTPUTS", 0)


@pytest.fixture
def onednn_calls(monkeypatch) -> list[int]:
    calls = [0]
    onednn = kernels._op

    def counted(*args):
        calls[0] += 1
        return onednn(*args)

    monkeypatch.setattr(kernels, "_op", counted)  # every oneDNN product goes through _op
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


@needs_onednn
def test_training_runs_onednn_with_f_linears_gradients(onednn_calls):
    g = torch.Generator().manual_seed(1)
    layer = Linear(16, 8)
    reference = nn.Linear(16, 8)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(3, 4, 16, generator=g, requires_grad=True)
    torch.testing.assert_close(layer(x), reference(x), atol=1e-5, rtol=1e-5)
    layer(x).square().sum().backward()
    assert onednn_calls[0] == 2 + 1  # the comparison's forward, then this forward and its dx (dW: MKL)
    grad = x.grad.clone()
    x.grad = None
    reference(x).square().sum().backward()
    for ours, theirs in ((grad, x.grad), (layer.weight.grad, reference.weight.grad), (layer.bias.grad, reference.bias.grad)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)
    frozen = torch.randn(5, 16, generator=g, requires_grad=True)
    layer.requires_grad_(False)
    layer(frozen).sum().backward()  # only dx is asked for
    assert layer.weight.grad is not None and frozen.grad.shape == (5, 16)


@needs_onednn
def test_padded_positions_change_nothing_but_the_kernels_shape(onednn_calls, monkeypatch):
    """Past PAD_FROM positions the rows are padded to a multiple of ROW_MULTIPLE (a few shapes for
    oneDNN to build kernels for); the output, dx, dW and db are those of the positions alone."""
    monkeypatch.setattr(kernels, "PAD_FROM", 4)
    monkeypatch.setattr(kernels, "ROW_MULTIPLE", 8)
    shapes = []
    onednn = kernels._op
    monkeypatch.setattr(kernels, "_op", lambda a, w, b: shapes.append(tuple(a.shape)) or onednn(a, w, b))
    g = torch.Generator().manual_seed(2)
    layer, reference = Linear(6, 5), nn.Linear(6, 5)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(13, 6, generator=g, requires_grad=True)  # 13 rows -> 16
    out = layer(x)
    assert out.shape == (13, 5) and shapes == [(16, 6)]
    torch.testing.assert_close(out, reference(x), atol=1e-5, rtol=1e-5)
    (out * torch.arange(5.0)).sum().backward()
    assert shapes[1:] == [(16, 5)]  # dx from the padded dy (dW: MKL, over the 13 positions)
    grads = x.grad.clone(), layer.weight.grad, layer.bias.grad
    x.grad = None
    (reference(x) * torch.arange(5.0)).sum().backward()
    for ours, theirs in zip(grads, (x.grad, reference.weight.grad, reference.bias.grad)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert layer(torch.randn(3, 4, 6, generator=g)).shape == (3, 4, 5)  # 12 rows -> 16, cut back
    assert shapes[-1] == (16, 6)


def test_autocast_keeps_f_linear(onednn_calls):
    layer = Linear(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(4, 16)).dtype == torch.bfloat16  # autocast's cast happens in F.linear's dispatch
    assert onednn_calls[0] == 0


def test_prefer_onednn_false_keeps_f_linear(onednn_calls):
    previous = kernels.prefer_onednn(False)
    try:
        with torch.no_grad():
            linear(torch.randn(2, 4), torch.randn(3, 4))
    finally:
        assert kernels.prefer_onednn(previous) is False
    assert onednn_calls[0] == 0


@needs_onednn
def test_products_with_few_outputs_stay_on_mkl(onednn_calls, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_OUTPUTS", 8192)
    with torch.no_grad():
        linear(torch.randn(5, 16), torch.randn(384, 16))  # 1,920 outputs: one decoding step's layer
        assert onednn_calls[0] == 0
        linear(torch.randn(1, 16), torch.randn(8000, 16))  # 8,000-piece output layer, one sentence
        assert onednn_calls[0] == 0
        linear(torch.randn(2, 16), torch.randn(8000, 16))
        assert onednn_calls[0] == 1


def test_linear_has_nn_linears_state_dict():
    layer, plain = Linear(5, 3), nn.Linear(5, 3)
    assert layer.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5)
    torch.testing.assert_close(plain(x), layer(x), atol=1e-6, rtol=1e-6)


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


def test_checking_for_onednn_leaves_the_global_random_state_alone():
    """A resumed run restores the random state and then makes its first product: the check that
    oneDNN works must not draw from the generator dropout draws from."""
    kernels.onednn_available.cache_clear()
    state = torch.get_rng_state()
    kernels.onednn_available()
    assert torch.equal(torch.get_rng_state(), state)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16, back in float32."""
    return x.to(torch.bfloat16).float()


@needs_onednn
@needs_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_products_multiply_in_bfloat16_and_keep_float32_around_them(bias, onednn_calls):
    """Within ``bf16_products`` a training product is x W^T on bfloat16 operands, rounded to bfloat16,
    plus the float32 bias; dx = dy W and dW = dy^T x on bfloat16 operands; db the float32 sum of dy.
    Every tensor that leaves the layer is float32, and the results are not float32's (really bf16)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(3, 5, 24, generator=g)
    with kernels.bf16_products():
        out = linear(x, w, b)
        out.backward(dy)
    assert onednn_calls[0] == 2  # the product and dx (dW: a bfloat16 mm)
    assert out.dtype == x.grad.dtype == w.grad.dtype == torch.float32
    want = _bf16(_bf16(x) @ _bf16(w).t()) + (b if bias else 0)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    assert (out - F.linear(x, w, b)).abs().max() > 1e-4  # not the float32 product
    torch.testing.assert_close(x.grad, _bf16(dy) @ _bf16(w), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, _bf16(dy).reshape(-1, 24).t() @ _bf16(x).reshape(-1, 16), rtol=1e-2, atol=5e-2)
    if bias:
        torch.testing.assert_close(b.grad, dy.reshape(-1, 24).sum(0))  # float32, exact to the order of the sum


@needs_onednn
def test_bf16_products_leave_inference_and_the_world_outside_in_float32():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 16, generator=g), torch.randn(8, 16, generator=g)
    with kernels.bf16_products(), torch.no_grad():
        inside = linear(x, w)  # no gradient: validation, translation
    torch.testing.assert_close(inside, F.linear(x, w), atol=1e-5, rtol=1e-5)
    with kernels.bf16_products(False):
        assert linear(x, w.requires_grad_()).grad_fn.name() == "_OneDNNLinearBackward"
    with pytest.raises(RuntimeError), kernels.bf16_products():
        raise RuntimeError("a failed step")
    assert linear(x, w).grad_fn.name() == "_OneDNNLinearBackward"  # restored, even after an error
