"""An exponential moving average (EMA) of the weights during training, a candidate for final/.

After the run's update t, every parameter's average moves toward the parameter:

    average <- decay_t * average + (1 - decay_t) * weight,    decay_t = min(decay, (1 + t) / (10 + t))

so the first updates, far from where training ends, are forgotten fast (the warm-up of TensorFlow's
``ExponentialMovingAverage`` with ``num_updates``). With decay 0.999 the average spans about the last
1,000 updates; checkpoint averaging (``checkpoint.average``) can only mean a few checkpoints that are
``eval_every`` updates apart. At the end of training the average is validated beside the checkpoint
averages and becomes final/ if it is the best (``qkv.train.validation.write_final``); it is saved in last/
so that a resumed run continues the same average.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.errors import QkvError


def ema_decay(decay: float, update: int) -> float:
    """The weight kept by the average at the run's ``update``-th update (1-based)."""
    return min(decay, (1 + update) / (10 + update))


class WeightEMA:
    """The running average of ``model``'s parameters (float32, on the parameters' device)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise QkvError(f"the EMA's decay must be in (0, 1), got {decay}")
        self.decay = decay
        named = list(model.named_parameters())  # a tied weight once, under its first name
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.average = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, update: int) -> None:
        """Move the average toward the weights after the run's ``update``-th update."""
        keep = ema_decay(self.decay, update)
        for average, param in zip(self.average, self.params):
            average.lerp_(param.detach().float(), 1 - keep)

    def weights(self) -> dict[str, Tensor]:
        """The averaged parameters by name, for ``model.load_state_dict(..., strict=False)`` (buffers,
        such as the sinusoidal positions, are the model's own)."""
        return {name: average.to(param.dtype) for name, average, param in zip(self.names, self.average, self.params)}

    def state_dict(self) -> dict[str, Tensor]:
        return {name: average.cpu() for name, average in zip(self.names, self.average)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if set(state) != set(self.names):
            raise QkvError(f"the saved EMA holds other weights than the model: {sorted(set(state) ^ set(self.names))[:3]}")
        for name, average in zip(self.names, self.average):
            if state[name].shape != average.shape:
                raise QkvError(f"the saved EMA's {name} has shape {tuple(state[name].shape)}, the model's {tuple(average.shape)}")
            average.copy_(state[name])
