"""Dropout from a faster source of random bits (``--train fast_dropout=true``, CPU only).

On the CPU, PyTorch draws dropout's mask element by element (``bernoulli_``, a fifth of the multi30k
preset's step, measured); ``FastDropout`` draws 64 random bits per four elements instead (16 bits
each; per two, 32 bits each, with ``--train dropout_bits=32``), with the same distribution to 2^-16.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _Dropout(torch.autograd.Function):
    """Inverted dropout whose mask comes from ``bits``-bit random integers (16 or 32), 64 / bits per 64-bit draw."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, bits: int) -> Tensor:
        n, per_draw = x.numel(), 64 // bits
        # Uniform over all 2^64 values (randint's upper bound is exclusive; missing one value in 2^64
        # changes nothing measurable), seen as 64 / bits independent uniform integers of ``bits`` bits.
        draws = torch.randint(-(2**63), 2**63 - 1, (-(-n // per_draw),), dtype=torch.int64, device=x.device)
        u = draws.view(torch.int16 if bits == 16 else torch.int32)
        # keep where (u + 2^(bits-1)) / 2^bits >= p, uniform on [0, 1) in steps of 2^-bits
        keep = (u[:n] >= round(p * 2**bits) - 2 ** (bits - 1)).view(x.shape)  # bool, like x
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.mul(x, keep).mul_(ctx.scale)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return torch.mul(grad, keep).mul_(ctx.scale), None, None


class FastDropout(nn.Dropout):
    """``nn.Dropout`` with the same distribution (each element kept with probability 1 - p, to 2^-16,
    and scaled by 1 / (1 - p)) from a faster source of random bits: on the CPU, PyTorch draws the
    mask element by element (``bernoulli_``, a fifth of the multi30k preset's step, measured); this
    draws 64 random bits per four elements from the same generator (so ``torch.manual_seed`` and a
    checkpoint's saved generator state make it reproducible). The draws differ from ``nn.Dropout``'s:
    a run trains as the same model with other random masks, not as the same numbers.

    ``bits``: 16 (the default since 2026-11-26: p to 2^-16, a quarter of a 64-bit draw per element) or
    32 (p to 2^-32, half a draw per element: the masks of runs saved before). A p below 2^-8 or above
    1 - 2^-8 always takes 32 bits, where 2^-16 would be a coarse step of p."""

    def __init__(self, p: float = 0.5, bits: int = 16) -> None:
        super().__init__(p)
        if bits not in (16, 32):
            raise ValueError(f"bits must be 16 or 32, got {bits}")
        self.bits = bits if 2**-8 <= p <= 1 - 2**-8 else 32

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return x * 0.0
        return _Dropout.apply(x, self.p, self.bits)

    def extra_repr(self) -> str:
        return f"p={self.p}, bits={self.bits}"


def use_fast_dropout(model: nn.Module, bits: int = 16) -> int:
    """Replace every ``nn.Dropout`` in ``model`` by a ``FastDropout`` of the same p drawing ``bits`` random
    bits per element (no weights move: checkpoints are unchanged); returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, FastDropout(child.p, bits))
                replaced += 1
    return replaced
