"""Import Hugging Face Marian (OPUS-MT) models into qkv, and export qkv models to Marian.

Marian is the paper's architecture with a few departures, each expressed as a ``ModelConfig``
field rather than a special case:
- positions: the same sinusoids with all sines before all cosines -> ``position_layout="split"``;
- a final-logits bias added to the output projection -> ``output_bias=True``;
- embedding scaling is a config switch there too -> ``scale_embeddings``;
- the activation is configurable (OPUS-MT uses swish) -> ``activation="silu"``.
``from_marian`` takes the model object, so importing qkv never imports ``transformers``; the export
(``to_marian``, ``to_pegasus`` for pre-LN models) imports it only when called.
"""

from __future__ import annotations

from typing import Any

import torch

from qkv.errors import MissingPackage, QkvError
from qkv.model.config import ModelConfig
from qkv.model.transformer import Transformer

_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}


def marian_config(hf_config: Any) -> ModelConfig:
    """The qkv ``ModelConfig`` equivalent to a ``transformers.MarianConfig``."""
    if hf_config.activation_function not in _ACTIVATIONS:
        raise QkvError(f"unsupported Marian activation {hf_config.activation_function!r}")
    if hf_config.encoder_attention_heads != hf_config.decoder_attention_heads:
        raise QkvError("qkv needs the same number of heads in encoder and decoder")
    if hf_config.encoder_ffn_dim != hf_config.decoder_ffn_dim:
        raise QkvError("qkv needs the same d_ff in encoder and decoder")
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
        activation_dropout=hf_config.activation_dropout,
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
        raise QkvError(f"Marian import mismatch: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    lm_head = sd.get("lm_head.weight")
    if lm_head is not None and not torch.equal(lm_head, model.generator.weight.detach()):
        raise QkvError("this Marian model's lm_head is not tied to its embeddings; qkv cannot represent it")
    return model.eval()


# ---- qkv -> Hugging Face (the reverse) ---------------------------------------------------------------


def with_position_layout(model: Transformer, layout: str) -> Transformer:
    """An exactly equivalent copy of ``model`` whose positional table uses ``layout``.

    The two layouts hold the same sines and cosines in different coordinates of the residual stream.
    Permuting those coordinates everywhere (embedding columns, the inputs of every linear map that
    reads the stream, the outputs of every one that writes it, layer-norm parameters, which LayerNorm
    permits) gives the same function, so an interleaved model can be exported to Marian's split one.
    """
    config = model.config
    if layout == config.position_layout:
        return model
    D = config.d_model
    to_split = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])  # split coordinate j = interleaved to_split[j]
    perm = to_split if layout == "split" else torch.argsort(to_split)
    reads = ("_embed.weight", "in_proj.weight", "linear1.weight", "generator.weight")
    writes = ("out_proj.weight", "linear2.weight", "out_proj.bias", "linear2.bias", "norm.weight", "norm.bias")
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(reads):
            tensor = tensor[:, perm]
        elif name.endswith(writes):
            tensor = tensor[perm]
        state[name] = tensor.clone()
    other = Transformer(config.replace(position_layout=layout))
    other.load_state_dict(state)
    return other.train(model.training)


def _huggingface_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """qkv's weights under Marian's (and Pegasus's) parameter names; in_proj is split into q, k, v."""
    cfg = model.config
    sd = {name: t.detach().clone() for name, t in model.state_dict().items()}
    Hk, Hv = cfg.n_heads * cfg.head_dim_k, cfg.n_heads * cfg.head_dim_v
    out: dict[str, torch.Tensor] = {
        "model.encoder.embed_tokens.weight": sd["src_embed.weight"],
        "model.decoder.embed_tokens.weight": sd["tgt_embed.weight"],
        "lm_head.weight": sd["generator.weight"],
        "final_logits_bias": sd.get("generator.bias", torch.zeros(cfg.tgt_vocab_size))[None],
    }
    if cfg.share_embeddings:
        out["model.shared.weight"] = sd["src_embed.weight"]

    def attention(hf: str, ours: str) -> None:
        for part, rows in zip("qkv", (slice(0, Hk), slice(Hk, 2 * Hk), slice(2 * Hk, 2 * Hk + Hv))):
            out[f"{hf}.{part}_proj.weight"] = sd[f"{ours}.in_proj.weight"][rows]
            out[f"{hf}.{part}_proj.bias"] = sd[f"{ours}.in_proj.bias"][rows]
        out[f"{hf}.out_proj.weight"] = sd[f"{ours}.out_proj.weight"]
        out[f"{hf}.out_proj.bias"] = sd[f"{ours}.out_proj.bias"]

    def norm(hf: str, ours: str) -> None:
        out[f"{hf}.weight"], out[f"{hf}.bias"] = sd[f"{ours}.weight"], sd[f"{ours}.bias"]

    def feed_forward(hf: str, ours: str) -> None:
        for hf_name, our_name in (("fc1", "linear1"), ("fc2", "linear2")):
            out[f"{hf}.{hf_name}.weight"] = sd[f"{ours}.feed_forward.{our_name}.weight"]
            out[f"{hf}.{hf_name}.bias"] = sd[f"{ours}.feed_forward.{our_name}.bias"]

    for i in range(cfg.n_encoder_layers):
        hf, ours = f"model.encoder.layers.{i}", f"encoder_layers.{i}"
        attention(f"{hf}.self_attn", f"{ours}.self_attn")
        norm(f"{hf}.self_attn_layer_norm", f"{ours}.attn_sublayer.norm")
        feed_forward(hf, ours)
        norm(f"{hf}.final_layer_norm", f"{ours}.ff_sublayer.norm")
    for i in range(cfg.n_decoder_layers):
        hf, ours = f"model.decoder.layers.{i}", f"decoder_layers.{i}"
        attention(f"{hf}.self_attn", f"{ours}.self_attn")
        norm(f"{hf}.self_attn_layer_norm", f"{ours}.self_sublayer.norm")
        attention(f"{hf}.encoder_attn", f"{ours}.cross_attn")
        norm(f"{hf}.encoder_attn_layer_norm", f"{ours}.cross_sublayer.norm")
        feed_forward(hf, ours)
        norm(f"{hf}.final_layer_norm", f"{ours}.ff_sublayer.norm")
    if cfg.norm_first:
        norm("model.encoder.layer_norm", "encoder_norm")
        norm("model.decoder.layer_norm", "decoder_norm")
    return out


def _check_exportable(config: ModelConfig) -> None:
    if config.learned_positions:
        raise QkvError("this model learned its positions; Hugging Face's Marian and Pegasus have sinusoidal ones")
    if config.head_dim_k != config.d_model // config.n_heads or config.head_dim_v != config.d_model // config.n_heads:
        raise QkvError("Hugging Face's Marian and Pegasus need d_k = d_v = d_model / n_heads")
    if config.layer_norm_eps != 1e-5:
        raise QkvError(f"Hugging Face's Marian and Pegasus use layer-norm eps 1e-5, this model {config.layer_norm_eps}")


def _to_huggingface(model: Transformer, family: str, *, bos_id: int, eos_id: int) -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingPackage("exporting to Hugging Face needs the transformers package") from None
    _check_exportable(model.config)
    model = with_position_layout(model, "split")
    cfg = model.config
    activation = {"relu": "relu", "gelu": "gelu", "silu": "swish"}[cfg.activation]
    common = dict(
        vocab_size=cfg.src_vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function=activation, dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout, scale_embedding=cfg.scale_embeddings,
        max_position_embeddings=cfg.max_len, pad_token_id=cfg.pad_id, eos_token_id=eos_id,
        # qkv starts the target with BOS (Marian with pad) and never forces EOS at the length limit.
        decoder_start_token_id=bos_id, forced_eos_token_id=None, tie_word_embeddings=cfg.tie_output,
    )
    if family == "marian":
        hf_config = transformers.MarianConfig(
            **common, decoder_vocab_size=cfg.tgt_vocab_size, share_encoder_decoder_embeddings=cfg.share_embeddings
        )
        hf = transformers.MarianMTModel(hf_config)
    else:
        if not cfg.share_embeddings:
            raise QkvError("Pegasus has one embedding for source and target; this model has two")
        hf = transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(**common))
    # The sinusoidal tables are the model's own (Marian's layout, as with_position_layout made ours).
    missing, unexpected = hf.load_state_dict(_huggingface_state_dict(model), strict=False)
    if [k for k in missing if "embed_positions" not in k] or unexpected:
        raise QkvError(f"{family} export mismatch: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def to_marian(model: Transformer, *, bos_id: int, eos_id: int) -> Any:
    """A ``transformers.MarianMTModel`` computing the same function as a post-LN qkv ``model``.

    The reverse of ``from_marian``. Marian starts the target from ``decoder_start_token_id``, here
    qkv's BOS; ``generate`` then stops at ``eos_id``. Interleaved positions are converted exactly
    (``with_position_layout``). Marian is post-LN only: a pre-LN model goes to ``to_pegasus``.
    """
    if model.config.norm_first:
        raise QkvError("Marian is post-LN; this model is pre-LN (norm_first): use to_pegasus or to_huggingface")
    return _to_huggingface(model, "marian", bos_id=bos_id, eos_id=eos_id)


def to_pegasus(model: Transformer, *, bos_id: int, eos_id: int) -> Any:
    """A ``transformers.PegasusForConditionalGeneration`` for a pre-LN qkv ``model``: Pegasus is Marian's
    architecture with pre-LN sublayers and a final layer norm on each stack, like qkv's ``norm_first``."""
    if not model.config.norm_first:
        raise QkvError("Pegasus is pre-LN; this model is post-LN: use to_marian or to_huggingface")
    return _to_huggingface(model, "pegasus", bos_id=bos_id, eos_id=eos_id)


def to_huggingface(model: Transformer, *, bos_id: int, eos_id: int) -> Any:
    """``to_marian`` for a post-LN model, ``to_pegasus`` for a pre-LN one."""
    convert = to_pegasus if model.config.norm_first else to_marian
    return convert(model, bos_id=bos_id, eos_id=eos_id)
