"""Where a training step computes in bfloat16 (``--bf16``), decided once per run from its settings and device.

On a GPU, ``--bf16`` is autocast. On a CPU that multiplies bfloat16 natively (AVX-512 BF16 or AMX), whole-step
autocast, which casts around every op, was slower than float32; there ``--bf16`` puts the fused loss's three
products (the output layer's) in bfloat16, and ``bf16_layers`` the linear layers' products too, on oneDNN
(``qkv.model.kernels.bf16_products``). docs/cpu-speed.md gives the measured speeds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from qkv.model import cpu
from qkv.train.recipes import TrainConfig


def uses_fused_loss(train: TrainConfig, autocast: bool) -> bool:
    """Whether a train step computes the output layer and loss fused (``projected_label_smoothed_loss``):
    ``fused_loss`` asks for it; it computes in float32, so not under autocast; R-Drop needs both
    passes' whole distributions, so not with ``rdrop``."""
    return train.fused_loss and not autocast and not train.rdrop


def _cpu_bf16(train: TrainConfig, device: torch.device) -> bool:
    """``--bf16`` on a CPU that multiplies bfloat16 natively (a GPU uses autocast instead)."""
    return train.bf16 and device.type == "cpu" and cpu.cpu_has_bf16()


def cpu_bf16_loss(train: TrainConfig, device: torch.device) -> bool:
    """Whether ``--bf16`` puts the fused loss's products in bfloat16: on a CPU that multiplies
    bfloat16 natively, with the fused loss on and R-Drop off."""
    return _cpu_bf16(train, device) and train.fused_loss and not train.rdrop


def cpu_bf16_layers(train: TrainConfig, device: torch.device) -> bool:
    """Whether ``bf16_layers`` puts the linear layers' products in bfloat16 too: where ``--bf16``
    does so for the loss and the layers run on oneDNN (``kernels.bf16_products``). With R-Drop, whose
    loss is not the fused one, the output layer is one of those layers and multiplies in bfloat16 too."""
    return train.bf16_layers and train.onednn and _cpu_bf16(train, device) and (train.fused_loss or bool(train.rdrop))


@dataclass(frozen=True)
class Precision:
    """A run's choice: ``autocast`` (a GPU's), ``fused_loss`` (output layer and loss in one op),
    ``loss_bf16`` (that op's products in bfloat16) and ``linear_bf16`` (the linear layers' too)."""

    autocast: bool
    fused_loss: bool
    loss_bf16: bool
    linear_bf16: bool

    @classmethod
    def choose(cls, train: TrainConfig, device: torch.device, *, warn: bool = True) -> Precision:
        """The precision ``train`` asks for on ``device``; with ``warn``, a warning for each bfloat16
        setting this device cannot honour (training then stays in float32 there)."""
        autocast = train.bf16 and device.type == "cuda"
        chosen = cls(autocast, uses_fused_loss(train, autocast), cpu_bf16_loss(train, device), cpu_bf16_layers(train, device))
        if not warn:
            return chosen
        if train.bf16_layers and not chosen.linear_bf16 and device.type == "cpu":
            warnings.warn("bf16_layers needs --bf16 on a CPU with bfloat16 matmuls and onednn=true: the linear layers stay in float32",
                          stacklevel=3)
        if train.bf16 and chosen.mode is None:
            if train.rdrop and cpu.cpu_has_bf16():
                warnings.warn("bf16 on the CPU with R-Drop needs bf16_layers=true (R-Drop computes the logits whole, "
                              "not in the fused loss): training stays in float32", stacklevel=3)
            else:
                why = "fused_loss is off" if not chosen.fused_loss else "this CPU has no native bfloat16 (AVX-512 BF16 or AMX)"
                warnings.warn(f"bf16 on the CPU needs the fused loss and a CPU with bfloat16 matmuls ({why}): training stays in float32",
                              stacklevel=3)
        return chosen

    @property
    def mode(self) -> str | None:
        """Where training computes in bfloat16: "autocast" (a GPU), "output layer" (the CPU's fused
        loss), "linear and output layers" (the CPU with ``bf16_layers``: the linear layers' products
        too), or None (float32 throughout)."""
        if self.autocast:
            return "autocast"
        return "linear and output layers" if self.linear_bf16 else "output layer" if self.loss_bf16 else None
