"""Import Hugging Face Marian (OPUS-MT) models into qkv.

Marian is the paper's architecture with a few departures, each expressed as a ``ModelConfig``
field rather than a special case:
- positions: the same sinusoids with all sines before all cosines -> ``position_layout="split"``;
- a final-logits bias added to the output projection -> ``output_bias=True``;
- embedding scaling is a config switch there too -> ``scale_embeddings``;
- the activation is configurable (OPUS-MT uses swish) -> ``activation="silu"``.
The function takes the model object, so qkv itself never imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch

from qkv.config import ModelConfig
from qkv.model import Transformer

_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}


def marian_config(hf_config: Any) -> ModelConfig:
    """The qkv ``ModelConfig`` equivalent to a ``transformers.MarianConfig``."""
    if hf_config.activation_function not in _ACTIVATIONS:
        raise ValueError(f"unsupported Marian activation {hf_config.activation_function!r}")
    if hf_config.encoder_attention_heads != hf_config.decoder_attention_heads:
        raise ValueError("qkv needs the same number of heads in encoder and decoder")
    if hf_config.encoder_ffn_dim != hf_config.decoder_ffn_dim:
        raise ValueError("qkv needs the same d_ff in encoder and decoder")
    shared = getattr(hf_config, "share_encoder_decoder_embeddings", True)
    tgt_vocab = getattr(hf_config, "decoder_vocab_size", None) or hf_config.vocab_size
    return ModelConfig(
        src_vocab_size=hf_config.vocab_size,
        tgt_vocab_size=tgt_vocab,
        d_model=hf_config.d_model,
        n_heads=hf_config.encoder_attention_heads,
        d_ff=hf_config.encoder_ffn_dim,
        n_encoder_layers=hf_config.encoder_layers,
        n_decoder_layers=hf_config.decoder_layers,
        dropout=hf_config.dropout,
        attention_dropout=hf_config.attention_dropout,
        activation=_ACTIVATIONS[hf_config.activation_function],
        norm_first=False,
        max_len=hf_config.max_position_embeddings,
        position_layout="split",
        scale_embeddings=hf_config.scale_embedding,
        share_embeddings=shared,
        tie_output=True,
        output_bias=True,
        pad_id=hf_config.pad_token_id,
    )


def _attention_weights(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Stack Marian's q/k/v projections into qkv's single ``in_proj`` (rows: q, then k, then v)."""
    return {
        "in_proj.weight": torch.cat([sd[f"{prefix}.{n}_proj.weight"] for n in "qkv"]),
        "in_proj.bias": torch.cat([sd[f"{prefix}.{n}_proj.bias"] for n in "qkv"]),
        "out_proj.weight": sd[f"{prefix}.out_proj.weight"],
        "out_proj.bias": sd[f"{prefix}.out_proj.bias"],
    }


def _layer_norm(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {"norm.weight": sd[f"{prefix}.weight"], "norm.bias": sd[f"{prefix}.bias"]}


def _feed_forward(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {
        "linear1.weight": sd[f"{prefix}.fc1.weight"],
        "linear1.bias": sd[f"{prefix}.fc1.bias"],
        "linear2.weight": sd[f"{prefix}.fc2.weight"],
        "linear2.bias": sd[f"{prefix}.fc2.bias"],
    }


def _prefixed(prefix: str, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": value for name, value in params.items()}


def from_marian(hf_model: Any) -> Transformer:
    """Build a qkv ``Transformer`` with the weights of a ``transformers.MarianMTModel``."""
    config = marian_config(hf_model.config)
    sd = {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()}
    ours: dict[str, torch.Tensor] = {
        "src_embed.weight": sd["model.encoder.embed_tokens.weight"],
        "generator.bias": sd["final_logits_bias"][0],
    }
    if not config.share_embeddings:
        ours["tgt_embed.weight"] = sd["model.decoder.embed_tokens.weight"]
    for i in range(config.n_encoder_layers):
        hf = f"model.encoder.layers.{i}"
        ours |= _prefixed(f"encoder_layers.{i}.self_attn", _attention_weights(sd, f"{hf}.self_attn"))
        ours |= _prefixed(f"encoder_layers.{i}.attn_sublayer", _layer_norm(sd, f"{hf}.self_attn_layer_norm"))
        ours |= _prefixed(f"encoder_layers.{i}.feed_forward", _feed_forward(sd, hf))
        ours |= _prefixed(f"encoder_layers.{i}.ff_sublayer", _layer_norm(sd, f"{hf}.final_layer_norm"))
    for i in range(config.n_decoder_layers):
        hf = f"model.decoder.layers.{i}"
        ours |= _prefixed(f"decoder_layers.{i}.self_attn", _attention_weights(sd, f"{hf}.self_attn"))
        ours |= _prefixed(f"decoder_layers.{i}.self_sublayer", _layer_norm(sd, f"{hf}.self_attn_layer_norm"))
        ours |= _prefixed(f"decoder_layers.{i}.cross_attn", _attention_weights(sd, f"{hf}.encoder_attn"))
        ours |= _prefixed(f"decoder_layers.{i}.cross_sublayer", _layer_norm(sd, f"{hf}.encoder_attn_layer_norm"))
        ours |= _prefixed(f"decoder_layers.{i}.feed_forward", _feed_forward(sd, hf))
        ours |= _prefixed(f"decoder_layers.{i}.ff_sublayer", _layer_norm(sd, f"{hf}.final_layer_norm"))
    model = Transformer(config)
    # tgt_embed and generator.weight are tied to src_embed (shared vocabulary), so they load with it.
    missing, unexpected = model.load_state_dict(ours, strict=False)
    tied = {"tgt_embed.weight", "generator.weight"}
    if set(missing) - tied or unexpected:
        raise ValueError(f"Marian import mismatch: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    lm_head = sd.get("lm_head.weight")
    if lm_head is not None and not torch.equal(lm_head, model.generator.weight.detach()):
        raise ValueError("this Marian model's lm_head is not tied to its embeddings; qkv cannot represent it")
    return model.eval()
