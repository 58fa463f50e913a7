"""The training objective and its learning-rate schedule: small pure functions (section 5.3, 5.4)."""

from __future__ import annotations

import math

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
