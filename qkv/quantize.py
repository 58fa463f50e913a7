"""int8 inference: the model's linear layers as 8-bit integer matmuls, for translating on a CPU.

Weights are quantized once, per output row (channel); activations are quantized per batch at run
time (PyTorch's dynamic quantization, on the x86/fbgemm kernels). The result is an approximation of
the fp32 model: its BLEU cost is measured in the README's benchmarks, never assumed.

Left in fp32: the embeddings, the layer norms, and each attention's stacked input projection
``in_proj``, whose rows cross-attention uses in two slices (queries from the decoder, keys and
values from the memory); the output projection, the feed-forward layers and W^O run in int8.
"""

from __future__ import annotations

import copy
import warnings
from typing import TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def int8_supported() -> bool:
    """Whether this PyTorch has a CPU engine for dynamically quantized linear layers."""
    return bool({"x86", "fbgemm", "qnnpack"} & set(torch.backends.quantized.supported_engines))


def int8_model(model: M) -> M:
    """A copy of ``model`` (a ``Transformer`` or an ``Ensemble`` of them) for inference with int8
    linear layers (see the module docstring)."""
    if not int8_supported():
        raise RuntimeError("this PyTorch build has no quantized CPU engine: int8 decoding is unavailable")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 decoding runs on the CPU: load the model there")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    model = copy.deepcopy(model).eval()
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("in_proj"):
            names[name] = per_channel_dynamic_qconfig
            module.__class__ = nn.Linear  # qkv.kernels.Linear: quantize_dynamic swaps only torch's own class
    with warnings.catch_warnings():  # PyTorch marks its quantized tensors as deprecated (they still work in 2.13)
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, names, inplace=True)
