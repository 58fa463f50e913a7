"""Which kernel multiplies the matrices of a linear layer on the CPU: PyTorch's BLAS (MKL) or oneDNN.

PyTorch's CPU build runs fp32 ``F.linear`` on MKL, which takes its AVX2 code path on AMD
processors: about 110 GFLOP/s on one core of this project's AMD EPYC host. oneDNN, which ships
inside the same build (``torch.ops.mkldnn``) and picks the CPU's widest instructions whatever its
vendor, ran the model's products at 2-2.3x that (one core; 1.6-1.8x on two). ``Linear`` is
``nn.Linear`` with that choice made at each call: oneDNN for fp32 inference on the CPU (no
gradient, no autocast), ``F.linear`` everywhere else. The two differ only in the order of their
additions (a few ulps); ``tests/test_kernels.py`` checks them against each other.

Training keeps ``F.linear``: oneDNN's linear has no backward in PyTorch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_prefer_onednn = True


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's fp32 linear, and it agrees with ``F.linear`` on a small product."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        with torch.no_grad():
            return torch.allclose(_onednn_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError):  # an op this build lacks, or one it cannot run here
        return False


def prefer_onednn(on: bool) -> bool:
    """Use oneDNN for fp32 CPU inference (``on``, the default) or ``F.linear`` always; returns the
    previous setting (benchmarks compare the two)."""
    global _prefer_onednn
    previous, _prefer_onednn = _prefer_onednn, on
    return previous


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # x W^T + b, no fused activation


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    return (
        _prefer_onednn
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and onednn_available()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b, like ``F.linear``: (..., in) -> (..., out). oneDNN computes it for fp32 inference
    on the CPU where this PyTorch has it."""
    if _use_onednn(x, weight):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product goes through ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
