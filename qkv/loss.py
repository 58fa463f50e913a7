"""The training objective and its learning-rate schedule: small pure functions (section 5.3, 5.4)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def inverse_sqrt_lr(step: int, *, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` at ``warmup`` steps, then decay with 1/sqrt(step) (section 5.3, rescaled)."""
    step = max(step, 1)
    if warmup == 0:
        return peak
    return peak * min(step / warmup, math.sqrt(warmup / step))


def cooldown_factor(progress: float | None, cooldown: float) -> float:
    """1 until the last ``cooldown`` fraction of the run, then falling linearly to 0 at its end.

    ``progress`` is the fraction of the run's steps done (of max_steps, or of the steps planned from
    the time budget), None while the run has no known end. A short linear decay at the end of a fixed budget ("warm-up, stable, decay")
    lands in a sharper minimum than stopping at a still-high learning rate; measured on Multi30k in the README.
    """
    if progress is None or cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))


def label_smoothed_loss(logits: Tensor, target: Tensor, *, pad_id: int, smoothing: float) -> tuple[Tensor, Tensor]:
    """Sum of label-smoothed cross-entropy over non-padding targets (section 5.4), and the token count.

    logits: (B, T, V), target: (B, T). The true class gets 1 - smoothing + smoothing/V, every class
    smoothing/V; padding positions contribute nothing.
    """
    V = logits.size(-1)
    loss = F.cross_entropy(
        logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=pad_id, label_smoothing=smoothing, reduction="sum"
    )
    return loss, (target != pad_id).sum()


class _ProjectedLoss(torch.autograd.Function):
    """Sum of label-smoothed cross-entropy of ``hidden @ weight.T + bias``, computed in chunks of rows.

    The loss is the last thing before ``backward()``, so the gradients are computed in the forward
    pass, chunk by chunk, while each chunk's logits are at hand; backward only scales them by the
    incoming gradient. Per row with logits z, lse = logsumexp(z) and e = smoothing:
    loss = lse - (1 - e) z[target] - e/V sum(z) (as F.cross_entropy(label_smoothing=e)) and
    d loss / dz = softmax(z) - (1 - e) onehot(target) - e/V.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, smoothing: float, chunk: int, need_grad: bool
    ) -> Tensor:
        N, V = hidden.size(0), weight.size(0)
        loss = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight) if need_grad else None
        grad_bias = torch.zeros_like(bias) if need_grad and bias is not None else None
        for start in range(0, N, chunk):
            h, t = hidden[start : start + chunk], target[start : start + chunk]  # (n, D), (n,)
            z = torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()  # (n, V)
            lse = torch.logsumexp(z, dim=1)  # (n,)
            rows = lse - (1 - smoothing) * z.gather(1, t[:, None]).squeeze(1)  # (n,)
            if smoothing:
                rows = rows - smoothing / V * z.sum(1)
            loss += rows.sum().to(loss.dtype)
            if not need_grad:
                continue
            g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits: (n, V)
            if smoothing:
                g.sub_(smoothing / V)
            g.scatter_add_(1, t[:, None], g.new_full((t.size(0), 1), smoothing - 1))
            torch.mm(g, weight, out=grad_hidden[start : start + chunk])  # (n, V) @ (V, D)
            grad_weight.addmm_(g.t(), h)  # (V, n) @ (n, D)
            if grad_bias is not None:
                grad_bias += g.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.has_bias = bias is not None
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        if grad_hidden is None:
            raise RuntimeError("projected_label_smoothed_loss ran without gradients (under no_grad); it cannot be backpropagated")
        scale = grad_loss.to(grad_hidden.dtype)
        grads = [grad_hidden * scale, grad_weight * scale, grad_bias * scale if ctx.has_bias else None]
        return (*grads, None, None, None, None)


def projected_label_smoothed_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, *, pad_id: int, smoothing: float, chunk: int = 0
) -> tuple[Tensor, Tensor]:
    """``label_smoothed_loss(hidden @ weight.T + bias, target)`` without the logits of the whole batch.

    hidden: (B, T, D) decoder outputs before the output projection; weight: (V, D), bias: (V,) or
    None; target: (B, T). Only non-padding positions are projected, ``chunk`` rows at a time (0: a
    size that keeps each chunk's logits near 8 MB), so memory holds one (chunk, V) block instead of
    the (B*T, V) logits, their softmax and their gradient. Returns (loss sum, token count) as
    ``label_smoothed_loss`` does; gradients reach hidden, weight and bias.
    """
    V = weight.size(0)
    keep = (target != pad_id).reshape(-1)  # (B*T,)
    rows = hidden.reshape(-1, hidden.size(-1))[keep]  # (N, D): the real target positions
    labels = target.reshape(-1)[keep]  # (N,)
    chunk = chunk or max(64, (1 << 21) // V)
    need_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    loss = _ProjectedLoss.apply(rows, weight, bias, labels, float(smoothing), chunk, need_grad)
    return loss, keep.sum()
