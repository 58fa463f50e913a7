"""Which kernel multiplies the matrices of a linear layer on the CPU: PyTorch's BLAS (MKL) or oneDNN.

PyTorch's CPU build runs fp32 ``F.linear`` on MKL, which takes its AVX2 code path on AMD
processors: about 110 GFLOP/s on one core of this project's AMD EPYC host. oneDNN, which ships
inside the same build (``torch.ops.mkldnn``) and picks the CPU's widest instructions whatever its
vendor, ran the model's products at 2-2.3x that (one core; 1.6-1.8x on two).

``Linear`` is ``nn.Linear`` with that choice made at each call: oneDNN for fp32 on the CPU (outside
autocast, whose casts happen in ``F.linear``'s dispatch), with the input's gradient on oneDNN too
(``_OneDNNLinear``: PyTorch gives its op no backward), ``F.linear`` everywhere else (a GPU, bf16,
int8, and products of fewer than ``MIN_OUTPUTS`` outputs, where oneDNN's call costs more than it saves). The two differ only in the order of their additions (a few ulps); ``tests/unit/test_kernels.py``
checks them against each other. ``prefer_onednn(False)`` (``--train onednn=false``) goes back to
``F.linear`` for the whole process. Within ``bf16_products`` (``--train bf16_layers=true``) training's
products run in bfloat16 instead (``_BF16Linear``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_prefer_onednn = True
_bf16_products = False  # set by bf16_products(): training's linear layers multiply in bfloat16


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's fp32 linear, and it agrees with ``F.linear`` on a small product."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)  # not the global generator: training's random state stays as it was
        x, w, b = torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
        with torch.no_grad():
            return torch.allclose(_onednn_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError):  # an op this build lacks, or one it cannot run here
        return False


def prefer_onednn(on: bool) -> bool:
    """Use oneDNN for fp32 on the CPU, in training and inference (``on``, the default), or ``F.linear``
    always; process-wide; returns the previous setting (benchmarks compare the two)."""
    global _prefer_onednn
    previous, _prefer_onednn = _prefer_onednn, on
    return previous


# oneDNN builds (and caches) a kernel for each shape it meets, about 0.5 ms each at the preset's
# shapes, and training meets a new number of positions nearly every step: past PAD_FROM positions
# they are padded with zero rows to a multiple of ROW_MULTIPLE (at most 12% more rows, under 4% at
# the preset's 3,000 to 4,000), so that a run meets a few dozen shapes.
PAD_FROM, ROW_MULTIPLE = 1024, 128


def _op(a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(a, weight, bias, "none", [], "")  # a W^T + b, no fused activation


def _padded_rows(a: Tensor) -> Tensor:
    """(n, k) -> (n', k): ``a`` with zero rows below it up to a multiple of ROW_MULTIPLE when n > PAD_FROM."""
    n = a.size(0)
    if n <= PAD_FROM or n % ROW_MULTIPLE == 0:
        return a
    padded = a.new_empty(-(-n // ROW_MULTIPLE) * ROW_MULTIPLE, a.size(1))
    padded[:n] = a
    padded[n:] = 0
    return padded


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows = x.reshape(-1, x.size(-1))  # (n, in), n = all leading positions
    out = _op(_padded_rows(rows), weight, bias)[: rows.size(0)]  # (n, out), contiguous
    return out.view(*x.shape[:-1], weight.size(0))


class _OneDNNLinear(torch.autograd.Function):
    """x W^T + b and its input gradient dx = dy W on oneDNN; dW = dy^T x on MKL; db = the sum of dy."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.size(-1))  # (n, out), n = all leading positions
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _onednn_linear(grad, weight.t(), None)  # (..., out) W -> (..., in)
        if ctx.needs_input_grad[1]:
            # MKL: its product of two transposed operands ran faster here than oneDNN's, which copies them
            dw = dy.t().mm(x.reshape(-1, x.size(-1)))  # (out, n) x (n, in) -> (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=0)  # (out,)
        return dx, dw, db


class _BF16Linear(torch.autograd.Function):
    """x W^T + b with its three products in bfloat16 on oneDNN (``bf16_products``): x W^T, dx = dy W
    and dW = dy^T x take bfloat16 operands and round their results to bfloat16, as the products of a
    GPU's autocast do; x, the output, the bias and every gradient stay float32. x is saved for
    backward in bfloat16 (half the memory)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)  # (..., in), (out, in)
        ctx.save_for_backward(x16, w16)
        ctx.has_bias = bias is not None
        out = _onednn_linear(x16, w16, None).float()  # (..., out)
        return out.add_(bias) if bias is not None else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x16, w16 = ctx.saved_tensors
        dy = grad.reshape(-1, grad.size(-1))  # (n, out)
        dy16 = dy.to(torch.bfloat16)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _onednn_linear(dy16, w16.t(), None).float().view(*grad.shape[:-1], w16.size(1))  # (..., in)
        if ctx.needs_input_grad[1]:
            dw = dy16.t().mm(x16.reshape(-1, x16.size(-1))).float()  # (out, n) x (n, in) -> (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=0)  # (out,), in float32
        return dx, dw, db


@contextlib.contextmanager
def bf16_products(on: bool = True):
    """Within it (``on``), the fp32 linear layers that training runs on oneDNN multiply in bfloat16
    (``_BF16Linear``): ``--train bf16_layers=true`` with ``--bf16`` on a CPU with native bfloat16
    matmuls (docs/cpu-speed.md). Products without gradients (validation, translation) stay float32.
    Not thread-safe: one training at a time per process."""
    global _bf16_products
    previous, _bf16_products = _bf16_products, on
    try:
        yield
    finally:
        _bf16_products = previous


# oneDNN's call costs about 14 us more than MKL's (2 threads): products with fewer outputs than
# this (a decoding step's small layers) stay on MKL, which also did (32, 128) x (128, 512) as fast.
MIN_OUTPUTS = 8192


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        _prefer_onednn
        and x.numel() // max(x.size(-1), 1) * weight.size(0) >= MIN_OUTPUTS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and onednn_available()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b, like ``F.linear``: (..., in) -> (..., out). oneDNN computes it (and its input
    gradient) for fp32 on the CPU where this PyTorch has it and the product is large enough. Inside
    ``torch.compile`` (a compiled decoder step) it is ``F.linear``, which the compiler lowers itself."""
    if torch.compiler.is_compiling() or not _use_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return (_BF16Linear if _bf16_products else _OneDNNLinear).apply(x, weight, bias)
    return _onednn_linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product goes through ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
