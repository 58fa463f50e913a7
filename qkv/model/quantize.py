"""int8 inference: the model's linear layers with int8 weights, for translating on a CPU.

Each weight is quantized once, symmetrically per output row (channel), through torchao's
``quantize_`` API (``Int8WeightOnlyConfig``), the quantization PyTorch maintains now that
``torch.ao.quantization`` is deprecated. Activations stay in the model's float type: the product runs
on PyTorch's int8-weight CPU kernel (``_weight_int8pack_mm``), which reads a quarter of fp32's weight
bytes. torchao's other CPU mode, int8 activations too (``Int8DynamicActivationInt8WeightConfig``),
decoded at 0.62x fp32's speed in eager PyTorch here, and the deprecated dynamic quantization qkv
used before at 1.01x (Multi30k val; docs/translation.md gives the measurement). The result approximates
the fp32 model: its BLEU cost is measured in docs/benchmarks.md, never assumed.

Left in fp32: the layer norms, and each attention's stacked input projection ``in_proj``, whose rows
cross-attention uses in two slices (queries from the decoder, keys and values from the memory); the
output projection, the feed-forward layers and W^O get int8 weights. When the output projection is
tied to the target embedding (``tie_output``, the presets' default), the embedding reads the output
projection's int8 rows (``Int8Embedding``: one int8 table, as the float model has one float table);
an untied embedding stays fp32. On the ``multi30k`` preset's model the parameters take 0.45x fp32's
bytes (``parameter_bytes``; tested), not a quarter: the ``in_proj`` weights stay fp32.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn

from qkv.errors import QkvError

M = TypeVar("M", bound=nn.Module)

# The loggers that speak while torchao is imported: torchao's own, about optional GPU kernels a CPU
# build cannot load, and PyTorch's pytree registry, about how torchao registers an enum.
IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def int8_supported() -> bool:
    """Whether torchao is installed (``pip install torchao``, part of qkv's requirements)."""
    try:
        _torchao()
    except QkvError:
        return False
    return True


def int8_model(model: M, *, in_place: bool = False) -> M:
    """A copy of ``model`` (a ``Transformer`` or an ``Ensemble`` of them) for inference with int8
    linear weights (see the module docstring); ``model`` itself is untouched. ``in_place``: convert
    ``model`` itself instead, for a caller that drops the float model (no float copy held meanwhile)."""
    quantization = _torchao()
    if next(model.parameters()).device.type != "cpu":
        raise QkvError("int8 decoding runs on the CPU: load the model there")
    model = (model if in_place else copy.deepcopy(model)).eval()
    for name, module in model.named_modules():
        if _quantized_here(module, name):
            module.__class__ = nn.Linear  # qkv.model.kernels.Linear calls oneDNN, which knows no int8 weight
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(), filter_fn=_quantized_here)
    # each Transformer (found by its parts: qkv.model.transformer imports this module, not the reverse)
    for transformer in [m for m in model.modules() if hasattr(m, "generator") and hasattr(m, "tgt_embed")]:
        if transformer.config.tie_output and is_int8(transformer.generator.weight):  # one int8 table, not an fp32 one beside it
            embedding = Int8Embedding(transformer.generator.weight)
            transformer.tgt_embed = embedding
            if transformer.config.share_embeddings:
                transformer.src_embed = embedding
    return model


class Int8Embedding(nn.Module):
    """An embedding whose table is a tied output projection's int8 weight: row i is
    ``qdata[i] * scale[i]`` (one scale per vocabulary row), what ``weight.dequantize()[i]`` gives."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = weight  # the output projection's own parameter, shared (V, D)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (B, L) ids. Returns (B, L, D) in the scale's float type."""
        w = self.weight
        rows = w.qdata[tokens].to(w.scale.dtype)  # (B, L, D)
        if getattr(w, "zero_point", None) is not None:
            rows = rows - w.zero_point[tokens].to(w.scale.dtype)
        return rows * w.scale[tokens]  # scale (B, L, 1)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters (buffers such as positional tables aside), each shared tensor
    once; an int8 weight counts its int8 values and scales (torchao's inner tensors), not the float
    tensor it stands for."""

    def inner(t: Tensor) -> list[Tensor]:
        if type(t) in (Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
            return [t]
        return [x for name in t.__tensor_flatten__()[0] for x in inner(getattr(t, name))]

    unique = {id(t): t for t in model.parameters()}.values()
    return sum(x.numel() * x.element_size() for t in unique for x in inner(t))


def is_int8(weight: Tensor) -> bool:
    """Whether ``weight`` is one ``int8_model`` made (a torchao tensor, which ``dequantize()`` restores).
    Every tensor has a ``dequantize`` method; a plain tensor or parameter is not int8."""
    return type(weight) is not torch.Tensor and type(weight) is not nn.Parameter and hasattr(weight, "dequantize")


def _quantized_here(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and not name.endswith("in_proj")


def _torchao():
    """torchao's quantization module, imported without its import-time notices (``IMPORT_LOGGERS``)."""
    try:
        with quiet_loggers(IMPORT_LOGGERS):
            import torchao.quantization as quantization
    except ImportError as e:
        raise QkvError(f"--int8 needs torchao (pip install torchao): {e}") from None
    return quantization


@contextlib.contextmanager
def quiet_loggers(names: tuple[str, ...] = IMPORT_LOGGERS) -> Iterator[None]:
    """Loggers ``names`` (default: those that speak while torchao is imported) at ERROR meanwhile;
    for every import that reaches torchao (``qkv.interop.marian``: transformers imports it when installed)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
