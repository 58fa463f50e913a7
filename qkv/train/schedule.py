"""The learning-rate schedule: warm-up, then the paper's inverse square root or the peak held, and a
linear cool-down at the end of the run (section 5.3). Small pure functions of the step."""

from __future__ import annotations

import math


def inverse_sqrt_lr(step: int, *, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` at ``warmup`` steps, then decay with 1/sqrt(step) (section 5.3, rescaled)."""
    step = max(step, 1)
    if warmup == 0:
        return peak
    return peak * min(step / warmup, math.sqrt(warmup / step))


def constant_lr(step: int, *, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` at ``warmup`` steps, then ``peak`` held (with a cool-down at the end
    of the run: "warm-up, stable, decay")."""
    step = max(step, 1)
    return peak if warmup == 0 else peak * min(1.0, step / warmup)


def cooldown_factor(progress: float | None, cooldown: float) -> float:
    """1 until the last ``cooldown`` fraction of the run, then falling linearly to 0 at its end.

    ``progress`` is the fraction of the run's steps done (of max_steps, or of the steps planned from
    the time budget), None while the run has no known end. A short linear decay at the end of a fixed budget ("warm-up, stable, decay")
    lands in a sharper minimum than stopping at a still-high learning rate; measured on Multi30k in docs/recipes.md.
    """
    if progress is None or cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))


def budget_steps(time_budget: float, elapsed: float, step: int, cooldown: float) -> int:
    """The steps that fit in ``time_budget`` seconds at the pace of the first ``step`` (``elapsed``
    seconds): at least ``step``, and enough that the last ``cooldown`` fraction of the run starts
    after the measured steps, which ran at the full schedule."""
    planned = max(step, int(time_budget / (elapsed / step)))
    if cooldown:
        planned = max(planned, math.ceil((step - 1) / (1 - cooldown)) + 1)
    return planned
