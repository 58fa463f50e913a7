"""A weight file against a model config: the sizes and shapes checked before any memory is
allocated, and the weights loaded strictly.

A checkpoint's config, or an imported model's, says how large a model to build; a hostile or broken
one could ask for gigabytes next to a small weight file. ``check_size`` and ``check_shapes`` build
the config's model on the meta device (shapes without memory) and compare it with the file, so a
refusal comes before anything is allocated (``qkv.io.checkpoint.load``, ``qkv.interop.marian``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qkv.errors import CheckpointError
from qkv.model.config import ModelConfig
from qkv.model.transformer import Transformer

MAX_LAYERS = 1000  # a config asking for more is refused before even a shape-only model is built


def load_weights(model: Transformer, weights: dict[str, torch.Tensor], where: str) -> None:
    """Load ``weights`` into ``model`` strictly, except that a tied weight may appear under one name only."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # a shape mismatch
        raise CheckpointError(f"{where} does not match the model: {str(error).splitlines()[-1].strip()}") from None
    storage = {name: t.data_ptr() for name, t in model.state_dict().items()}
    present = {storage[name] for name in weights if name in storage}
    missing = [name for name in missing if storage[name] not in present]  # tied to a loaded weight: fine
    if missing or unexpected:
        raise CheckpointError(f"{where} does not match the model: missing {_some(missing)}; unexpected {_some(unexpected)}")


def _some(names: list[str], k: int = 3) -> str:
    """At most k names, and how many more: an error message stays one readable line."""
    if not names:
        return "none"
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def check_size(model_config: ModelConfig, weights: Path, *, what: str = "its config") -> None:
    """Refuse a config that asks for more than ``MAX_LAYERS`` layers, or for much more memory than the
    weight file ``weights`` holds, before anything is allocated. ``what`` names the config in the message."""
    _check_memory(_meta_model(model_config, weights, what), weights, what)


def _meta_model(model_config: ModelConfig, weights: Path, what: str) -> Transformer:
    """The model of ``model_config`` on the meta device (shapes without memory), once its number of
    layers is known to be sane."""
    if model_config.n_encoder_layers + model_config.n_decoder_layers > MAX_LAYERS:
        raise CheckpointError(f"{weights}: {what} asks for more than {MAX_LAYERS} layers: refused")
    with torch.device("meta"):
        return Transformer(model_config)


def _check_memory(meta: Transformer, weights: Path, what: str) -> None:
    """Everything the model will allocate, the positional table (not stored) included, against the
    file: a config may not ask for much more memory than the weights it comes with."""
    needed = sum(t.numel() * t.element_size() for t in (*meta.parameters(), *meta.buffers()))
    size = weights.stat().st_size
    if needed > 2 * size + (64 << 20):
        raise CheckpointError(
            f"{weights}: {what} asks for {needed / 2**20:,.0f} MiB of weights and tables, the file holds "
            f"{size / 2**20:,.1f} MiB: refused before allocating"
        )


def check_shapes(model_config: ModelConfig, weights: Path) -> None:
    """Compare the config's parameter shapes with the weight file's header before allocating anything,
    so that a config asking for a huge model cannot allocate more than the file holds."""
    meta = _meta_model(model_config, weights, "its config")
    expected = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            stored = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{weights} cannot be read as safetensors ({error}); the file is corrupted") from None
    wrong = [name for name, shape in stored.items() if expected.get(name) != shape]
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"{weights} does not match its config: {name} is {list(stored[name])}, the config makes it "
            f"{list(expected[name]) if name in expected else 'absent'}"
        )
    aliases: dict[int, list[str]] = {}  # a tied weight is stored under one of its names
    for name, parameter in meta.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    missing = [names[0] for names in aliases.values() if not any(n in stored for n in names)]
    if missing:
        raise CheckpointError(f"{weights} lacks {len(missing)} weights its config needs ({_some(missing)})")
    _check_memory(meta, weights, "its config")
