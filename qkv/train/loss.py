"""The training objective: label-smoothed cross-entropy (section 5.4), plain and fused with the output
layer, and R-Drop's consistency term between two dropout passes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


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
    incoming gradient. Per row h with logits z = W h + b, m = max(z), E = exp(z - m), s = sum(E) and
    e = smoothing: loss = m + log(s) - (1 - e) z[target] - e/V sum(z) (as F.cross_entropy with
    label_smoothing=e), and d loss / dz = E / s - (1 - e) onehot(target) - e/V.

    Only E is a (rows, V) block: one exponential per logit, and the rest of d loss / dz is applied
    where it is cheap, on (rows, D) blocks. With W summed over the vocabulary, w = sum_v W[v]:
    sum(z) = h.w + sum(b); the gradient of h is (E W) / s - (1 - e) W[target] - e/V w; of W,
    E^T (h / s) - (1 - e) h added at the target's row - e/V (the sum of the rows h) in every row.

    ``low`` (torch.bfloat16, or None for the inputs' dtype): the dtype of the three large products
    (the logits, E W and E^T (h / s)); the softmax, the loss and the accumulated gradients stay in
    float32, as under autocast.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, smoothing: float, chunk: int,
        need_grad: bool, low: torch.dtype | None,
    ) -> Tensor:
        N, V = hidden.size(0), weight.size(0)
        on_target, uniform = 1 - smoothing, smoothing / V  # the two parts of the smoothed target distribution
        loss = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight) if need_grad else None
        grad_bias = torch.zeros_like(bias) if need_grad and bias is not None else None
        if smoothing:  # sum(z) over the vocabulary is h . w_sum + b_sum
            w_sum, b_sum = weight.sum(0), (bias.sum() if bias is not None else 0)  # (D,), ()
        h_mm, w_mm = (hidden, weight) if low is None else (hidden.to(low), weight.to(low))  # the products' operands
        # Every chunk's (n, V) blocks go into the same buffers: a fresh block of this size costs page
        # faults each time (--bf16's step 1.06x faster with the buffers: docs/benchmarks.md, (b)).
        block = min(chunk, N)  # rows of the largest chunk
        z_buf = hidden.new_empty(block, V)  # the logits, then E, in the inputs' dtype
        low_buf = hidden.new_empty(block, V, dtype=low) if low is not None else None  # bf16: the product, then E
        for start in range(0, N, chunk):
            h, t = hidden[start : start + chunk], target[start : start + chunk]  # (n, D), (n,)
            n = h.size(0)
            if low is None:
                z = torch.mm(h, weight.t(), out=z_buf[:n])  # (n, V)
            else:  # the product in bf16, read into float32
                z = z_buf[:n].copy_(torch.mm(h_mm[start : start + chunk], w_mm.t(), out=low_buf[:n]))
            if bias is not None:
                z += bias
            rows = -on_target * z.gather(1, t[:, None]).squeeze(1)  # (n,)
            if smoothing:
                rows -= uniform * (h @ w_sum + b_sum)  # e/V sum(z)
            m = z.amax(dim=1, keepdim=True)  # (n, 1)
            E = z.sub_(m).exp_()  # exp(z - m), in place of the logits: (n, V)
            total = E.sum(dim=1, keepdim=True)  # (n, 1)
            loss += (rows + m.squeeze(1) + total.squeeze(1).log()).sum().to(loss.dtype)
            if not need_grad:
                continue
            inv = total.reciprocal_()  # (n, 1): the softmax is E * inv
            E_mm = E if low is None else low_buf[:n].copy_(E)
            scaled = h * inv  # (n, D)
            # the gradient of h: (E W) / s - (1 - e) W[target] - e/V w
            g_h = torch.mm(E_mm, w_mm).to(h.dtype).mul_(inv)  # (n, V) @ (V, D)
            g_h.sub_(weight[t], alpha=on_target)
            if smoothing:
                g_h.sub_(w_sum, alpha=uniform)
            grad_hidden[start : start + chunk] = g_h
            # the gradient of W: E^T (h / s), then the target rows (below the loop: the uniform part)
            grad_weight += E_mm.t() @ (scaled if low is None else scaled.to(low))  # (V, n) @ (n, D)
            grad_weight.index_add_(0, t, h, alpha=-on_target)
            if grad_bias is not None:
                grad_bias += E.t() @ inv.squeeze(1)  # (V, n) @ (n,): the softmax summed over rows
                grad_bias.index_add_(0, t, torch.ones_like(t, dtype=grad_bias.dtype), alpha=-on_target)
        if need_grad and smoothing:
            grad_weight.sub_(hidden.sum(0), alpha=uniform)  # every row of W: - e/V (the sum of the rows h)
            if grad_bias is not None:
                grad_bias.sub_(uniform * N)
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
        return (*grads, None, None, None, None, None)


def projected_label_smoothed_loss(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, *, pad_id: int, smoothing: float, chunk: int = 0,
    bf16: bool = False,
) -> tuple[Tensor, Tensor]:
    """``label_smoothed_loss(hidden @ weight.T + bias, target)`` without the logits of the whole batch.

    hidden: (B, T, D) decoder outputs before the output projection; weight: (V, D), bias: (V,) or
    None; target: (B, T). Only non-padding positions are projected, ``chunk`` rows at a time (0: a
    size that keeps each chunk's logits near 32 MB, 16 MB with bf16), so memory holds one (chunk, V) block instead of
    the (B*T, V) logits, their softmax and their gradient. Returns (loss sum, token count) as
    ``label_smoothed_loss`` does; gradients reach hidden, weight and bias. ``bf16``: the three matrix
    products in bfloat16 (the softmax, the loss and the gradients' sums in float32), rounding the
    logits to bfloat16's 8 bits: on this project's AVX-512 BF16 CPU the products ran 4x and the whole
    loss 2.4x faster (3,500 target positions, vocabulary 8,000); elsewhere bfloat16 may be slower.
    """
    V = weight.size(0)
    keep = (target != pad_id).reshape(-1)  # (B*T,)
    rows = hidden.reshape(-1, hidden.size(-1))[keep]  # (N, D): the real target positions
    labels = target.reshape(-1)[keep]  # (N,)
    # 1,048 rows at V = 8,000 (at 1,024 the loss ran 1.2x as fast as at 262: docs/benchmarks.md (b)), 524 with bf16
    chunk = chunk or max(64, (1 << (22 if bf16 else 23)) // V)
    need_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    loss = _ProjectedLoss.apply(rows, weight, bias, labels, float(smoothing), chunk, need_grad, torch.bfloat16 if bf16 else None)
    return loss, keep.sum()


def rdrop_loss(
    hidden: Tensor, project: Callable[[Tensor], Tensor], target: Tensor, *, pad_id: int, smoothing: float, alpha: float
) -> tuple[Tensor, Tensor, Tensor]:
    """R-Drop (Liang et al., 2021): the batch went through the model twice, with its own dropout
    masks each time, and the two passes' output distributions are pulled together.

    hidden: (2B, T, D) decoder outputs before the output projection, rows 0..B-1 the first pass and
    B..2B-1 the second pass of the same sentences; project: the output layer, (n, D) -> (n, V);
    target: (B, T). Per real target position, with p1 and p2 the two passes' distributions:

        objective = (CE(p1) + CE(p2)) / 2 + alpha / 4 * (KL(p1 || p2) + KL(p2 || p1))

    where CE is ``label_smoothed_loss``'s cross-entropy. This is R-Drop's published objective (both
    passes' cross-entropy plus alpha times the mean of the two KL divergences) halved, so that alpha
    means what it means there (5 in its translation recipe) and alpha = 0 is the plain loss's scale.
    Returns (objective summed over the real positions, the cross-entropy part alone, their count).
    The logits of both passes' real positions are held whole: (2N, V) floats, and their softmax.
    """
    if hidden.size(0) != 2 * target.size(0):
        raise ValueError(f"hidden must hold two passes of target's {target.size(0)} sentences, got {hidden.size(0)} rows")
    D = hidden.size(-1)
    keep = (target != pad_id).reshape(-1)  # (B*T,)
    rows = hidden.reshape(2, -1, D)[:, keep].reshape(-1, D)  # (2N, D): the first pass's N rows, then the second's
    logits = project(rows)  # (2N, V)
    logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # at least float32
    labels = target.reshape(-1)[keep].repeat(2)  # (2N,)
    # label smoothing as F.cross_entropy has it: (1 - e) (-log p[target]) + e * mean over the vocabulary of -log p
    nll = -logp.gather(1, labels[:, None]).squeeze(1)  # (2N,)
    ce = ((1 - smoothing) * nll - smoothing * logp.mean(dim=-1)).sum() / 2
    lp1, lp2 = logp.chunk(2)  # (N, V) each
    # KL(p1 || p2) + KL(p2 || p1) = sum_v p1 (lp1 - lp2) + p2 (lp2 - lp1) = sum_v (p1 - p2)(lp1 - lp2)
    kl = ((lp1.exp() - lp2.exp()) * (lp1 - lp2)).sum()
    return ce + alpha / 4 * kl, ce.detach(), keep.sum()
