"""int8 inference: the model's linear layers as 8-bit integer matmuls, for translating on a CPU.

Weights are quantized once, per output row (channel); activations are quantized per batch at run
time (PyTorch's dynamic quantization, on the x86/fbgemm kernels). The result is an approximation of
the fp32 model: its BLEU cost is measured in docs/benchmarks.md, never assumed.

Left in fp32: the embeddings, the layer norms, and each attention's stacked input projection
``in_proj``, whose rows cross-attention uses in two slices (queries from the decoder, keys and
values from the memory); the output projection, the feed-forward layers and W^O run in int8.

PyTorch marks this path (``torch.ao.quantization.quantize_dynamic`` and its quantized tensors) as
deprecated, in favour of torchao's ``quantize_`` API; it still works in the PyTorch qkv pins. qkv
silences exactly those two deprecation notices, nothing else; when PyTorch removes the API,
``int8_model`` fails with a one-line error that says so (``tests/e2e/test_quantize.py`` fails loudly on
such a PyTorch), and the int8 path is to move to torchao's int8 dynamic quantization.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import nn

from qkv.errors import QkvError

M = TypeVar("M", bound=nn.Module)


def int8_supported() -> bool:
    """Whether this PyTorch has a CPU engine for dynamically quantized linear layers."""
    return bool({"x86", "fbgemm", "qnnpack"} & set(torch.backends.quantized.supported_engines))


def int8_model(model: M) -> M:
    """A copy of ``model`` (a ``Transformer`` or an ``Ensemble`` of them) for inference with int8
    linear layers (see the module docstring)."""
    if not int8_supported():
        raise QkvError("this PyTorch build has no quantized CPU engine: int8 decoding is unavailable")
    if next(model.parameters()).device.type != "cpu":
        raise QkvError("int8 decoding runs on the CPU: load the model there")
    try:
        with _deprecation_notices_silenced():
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError:
        raise QkvError(
            f"this PyTorch ({torch.__version__}) no longer has torch.ao.quantization.quantize_dynamic: "
            "int8 decoding needs a PyTorch that does (qkv pins 2.13.0)"
        ) from None
    model = copy.deepcopy(model).eval()
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("in_proj"):
            names[name] = per_channel_dynamic_qconfig
            module.__class__ = nn.Linear  # qkv.model.kernels.Linear: quantize_dynamic swaps only torch's own class
    with _deprecation_notices_silenced():
        return quantize_dynamic(model, names, inplace=True)


# The two notices PyTorch gives for this path (module docstring); any other warning goes through.
DEPRECATION_NOTICES = (
    (DeprecationWarning, r"torch\.ao\.quantization is deprecated"),
    (UserWarning, r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation functions"),
)


@contextlib.contextmanager
def _deprecation_notices_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        for category, message in DEPRECATION_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
