"""bfloat16 decoding: a copy of the model whose weights and activations are bfloat16, where the
hardware multiplies bfloat16 natively.

A CPU with AVX-512 BF16 or AMX (``qkv.model.cpu.cpu_has_bf16``; Zen 4, Sapphire Rapids and later)
does twice float32's multiply-adds per instruction in bfloat16, and oneDNN uses them for the linear
layers and attention; a GPU with bfloat16 (``torch.cuda.is_bf16_supported``) does too. Elsewhere
PyTorch emulates bfloat16, slower than float32, so ``decoding_dtype`` keeps float32 there and says why.

What stays exact: the search. Every search reads the logits through ``.float()`` before its
log-softmax (``qkv.infer.search``, ``qkv.infer.ensemble``, ``qkv.infer.score``), so scores, length
penalties and beams accumulate in float32; only the logits themselves are rounded to bfloat16 (8
bits of mantissa). The translations are an approximation of float32's: their BLEU against float32's
is measured in docs/cpu-speed.md, never assumed. In the library: ``model.to(torch.bfloat16)`` and
a ``Translator`` over it.
"""

from __future__ import annotations

import torch

from qkv.model.cpu import cpu_has_bf16


def bf16_native(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (see the module docstring)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_bf16()


def decoding_dtype(device: torch.device, requested: bool | None) -> tuple[torch.dtype, str | None]:
    """The dtype to decode in, and a one-line note when a request for bfloat16 cannot be honoured.
    ``requested``: True (``--bf16``), False (``--no-bf16``), None (the default: bfloat16 where native)."""
    if requested is False:
        return torch.float32, None
    if bf16_native(device):
        return torch.bfloat16, None
    if requested:
        where = "this CPU has no AVX-512 BF16 or AMX" if device.type == "cpu" else f"{device} has no native bfloat16"
        return torch.float32, f"--bf16: {where}, where bfloat16 is emulated and slower; decoding in float32"
    return torch.float32, None
