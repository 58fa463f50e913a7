"""Dropout from a faster source of random bits (``--train fast_dropout=true``, CPU only).

On the CPU, PyTorch draws dropout's mask element by element (``bernoulli_``, a fifth of the multi30k
preset's step, measured); ``FastDropout`` draws 64 random bits per two elements instead, with the
same distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _Dropout(torch.autograd.Function):
    """Inverted dropout whose mask comes from 32-bit random integers, two per 64-bit draw."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        n = x.numel()
        # Uniform over all 2^64 values (randint's upper bound is exclusive; missing one value in 2^64
        # changes nothing measurable), seen as two independent uniform int32 each.
        bits = torch.randint(-(2**63), 2**63 - 1, ((n + 1) // 2,), dtype=torch.int64, device=x.device).view(torch.int32)
        # keep where u >= p for u = (bits + 2^31) / 2^32, uniform on [0, 1) in steps of 2^-32
        keep = (bits[:n] >= round(p * 2**32) - 2**31).view(x.shape)  # bool, like x
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.mul(x, keep).mul_(ctx.scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return torch.mul(grad, keep).mul_(ctx.scale), None


class FastDropout(nn.Dropout):
    """``nn.Dropout`` with the same distribution (each element kept with probability 1 - p, to 2^-32,
    and scaled by 1 / (1 - p)) from a faster source of random bits: on the CPU, PyTorch draws the
    mask element by element (``bernoulli_``, a fifth of the multi30k preset's step, measured); this
    draws 64 random bits per two elements from the same generator (so ``torch.manual_seed`` and a
    checkpoint's saved generator state make it reproducible). The draws differ from ``nn.Dropout``'s:
    a run trains as the same model with other random masks, not as the same numbers."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return x * 0.0
        return _Dropout.apply(x, self.p)


def use_fast_dropout(model: nn.Module) -> int:
    """Replace every ``nn.Dropout`` in ``model`` by a ``FastDropout`` of the same p (no weights move:
    checkpoints are unchanged); returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, FastDropout(child.p))
                replaced += 1
    return replaced
