"""Typed, frozen configuration for qkv, with named presets.

Every config is a frozen dataclass validated in ``__post_init__``: first every field against its
annotation (``check_types``), then the ranges. ``from_dict`` rejects unknown keys with a "did you
mean" hint, so a typo in a JSON config or a checkpoint fails loudly.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from qkv.errors import QkvError

Activation = Literal["relu", "gelu", "silu"]
PositionLayout = Literal["interleaved", "split"]
AlignmentContext = Literal["causal", "full"]

C = TypeVar("C")


class ConfigError(QkvError):
    """A configuration value or key is invalid; the message says which and why."""


def did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def config_from_dict(cls: type[C], data: dict[str, Any]) -> C:
    """Build ``cls`` from a plain dict, rejecting keys the dataclass does not have."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {cls.__name__} must be a table of keys and values, got {_short(data)}")
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown {cls.__name__} key {key!r}{did_you_mean(key, names)}")
    return cls(**data)


_WRONG = object()  # what _checked returns for a value of the wrong type


@functools.cache
def _annotations(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_types(config: Any, section: str) -> None:
    """Check every field of the dataclass ``config`` against its annotation, wherever the value came
    from (flags, a TOML file, a checkpoint's config.json, an imported model), and normalise it in place:
    an integer for a float field becomes a float, so equal configs are saved alike.

    Annotations understood: int, float (finite), bool, str, Literal[...], ``X | None`` and Any. bool
    is not an int, and a string is not a number. Raises a one-line ConfigError naming ``section``'s key.
    """
    for field in dataclasses.fields(config):
        kind, value = _annotations(type(config))[field.name], getattr(config, field.name)
        checked = _checked(kind, value)
        if checked is _WRONG:
            raise ConfigError(f"{section} key {field.name} must be {_describe(kind)}, got {_short(value)}")
        if checked is not value:
            object.__setattr__(config, field.name, checked)  # the dataclass is frozen


def _checked(kind: Any, value: Any) -> Any:
    """``value`` as a ``kind`` (converted where that loses nothing), or _WRONG."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        return value if any(type(value) is type(choice) and value == choice for choice in typing.get_args(kind)) else _WRONG
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            return None if type(None) in typing.get_args(kind) else _WRONG
        for arg in typing.get_args(kind):
            checked = _checked(arg, value)
            if checked is not _WRONG:
                return checked
        return _WRONG
    if kind is Any:
        return value
    if kind is bool:
        return value if isinstance(value, bool) else _WRONG
    if kind is str:
        return value if isinstance(value, str) else _WRONG
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return _WRONG
        return value if type(value) is int else int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return _WRONG
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            return _WRONG
        if not math.isfinite(number):
            return _WRONG
        return value if type(value) is float else number
    if kind is type(None):
        return value if value is None else _WRONG
    raise TypeError(f"check_types has no rule for the annotation {kind!r}")  # a new kind of field: teach it


def _describe(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin is Literal:
        names = [str(choice) for choice in typing.get_args(kind)]
        return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(kind)
        return " or ".join(_describe(arg) for arg in args if arg is not type(None)) + (" or null" if type(None) in args else "")
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", type(None): "null"}[kind]


def _short(value: Any, limit: int = 60) -> str:
    """repr(value) on one line and at most ``limit`` characters: an error message stays one line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and architectural switches of the Transformer (paper defaults: section 3, table 3).

    Departures from the paper are named flags whose default is the paper's choice:
    ``norm_first`` (pre-LN; the paper is post-LN), ``activation`` (the paper uses ReLU),
    ``position_layout`` ("split" puts all sines before all cosines, as Marian does; the paper
    interleaves them), ``learned_positions`` (a trained table of position vectors, which the paper
    tried and found "nearly identical" to the sinusoids, table 3 row E), ``output_bias`` (Marian's
    final-logits bias).
    """

    src_vocab_size: int = 8000  # positive, above pad_id; source tokens, set from the tokenizer when a model is built for data
    tgt_vocab_size: int = 8000  # positive, above pad_id; target tokens, likewise (equal to src_vocab_size when share_embeddings)
    d_model: int = 512  # width of every layer's input and output; even, and divisible by n_heads unless d_k and d_v are given
    n_heads: int = 8  # >= 1; attention heads per attention layer (h in section 3.2.2)
    d_k: int | None = None  # per-head query/key size; None means d_model // n_heads
    d_v: int | None = None  # per-head value size; None means d_model // n_heads
    d_ff: int = 2048  # >= 1; inner width of the feed-forward networks (section 3.3)
    n_encoder_layers: int = 6  # >= 0; encoder layers (N in section 3.1)
    n_decoder_layers: int = 6  # >= 0; decoder layers
    dropout: float = 0.1  # in [0, 1); on each sub-layer's output and on the embeddings plus positions, in training (section 5.4)
    attention_dropout: float = 0.0  # in [0, 1); on the attention weights, in training (not in the paper)
    activation_dropout: float = 0.0  # in [0, 1); inside the feed-forward network, after the activation (fairseq's relu_dropout)
    word_dropout: float = 0.0  # in [0, 1); a source token's whole embedding dropped in training, the kept ones scaled up (Marian's --dropout-src; Sennrich and Zhang, 2019)
    activation: Activation = "relu"  # the feed-forward network's nonlinearity; the paper's is relu
    norm_first: bool = False  # pre-LN: layer norm before each sub-layer instead of after it (the paper is post-LN)
    layer_norm_eps: float = 1e-5  # > 0; added to the variance in every layer norm
    max_len: int = 1024  # >= 1; positions the model has: tokens per sentence, EOS and BOS included
    position_layout: PositionLayout = "interleaved"  # the sinusoids' order: sin and cos interleaved (the paper) or all sines, then all cosines (Marian)
    learned_positions: bool = False  # a learned (max_len, D) table instead of the sinusoids
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (section 3.4)
    share_embeddings: bool = True  # one embedding for source and target (joint vocabulary)
    tie_output: bool = True  # pre-softmax projection shares the target embedding (section 3.4)
    output_bias: bool = False  # a bias on the output projection (Marian's final-logits bias)
    pad_id: int = 0  # >= 0 and inside both vocabularies; read from the tokenizer when a model is built for data
    alignment_layer: int | None = None  # the decoder layer (0-based) whose first cross-attention head guided alignment trains to align (qkv.train.alignment); None: no such head
    alignment_context: AlignmentContext | None = None  # what that head's pass sees of the target: "full" (every target token, no causal mask; Garg et al. 2019's full-context alignment) or "causal" (the tokens before each, as the search does; None: causal, as checkpoints without the key were trained; a new head of qkv train gets qkv.train.alignment.default_context's, chosen on val: docs/training.md#guided-alignment)

    def __post_init__(self) -> None:
        check_types(self, "model")
        positive = ["src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "max_len"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ["n_encoder_layers", "n_decoder_layers"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.d_k is None or self.d_v is None) and self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless d_k and d_v are both given"
            )
        for name in ["d_k", "d_v"]:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        for name in ["dropout", "attention_dropout", "activation_dropout", "word_dropout"]:
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.layer_norm_eps <= 0:
            raise ConfigError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        if self.d_model % 2:
            raise ConfigError(f"d_model must be even for sinusoidal positions, got {self.d_model}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError("share_embeddings needs src_vocab_size == tgt_vocab_size")
        if not 0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size):
            raise ConfigError(f"pad_id {self.pad_id} is outside the vocabulary")
        if self.alignment_layer is not None and not 0 <= self.alignment_layer < self.n_decoder_layers:
            raise ConfigError(f"alignment_layer {self.alignment_layer} is not one of the {self.n_decoder_layers} decoder layers (0-based)")

    @property
    def head_dim_k(self) -> int:
        return self.d_k if self.d_k is not None else self.d_model // self.n_heads

    @property
    def head_dim_v(self) -> int:
        return self.d_v if self.d_v is not None else self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return config_from_dict(cls, data)

    def replace(self, **changes: Any) -> ModelConfig:
        return config_from_dict(ModelConfig, {**self.to_dict(), **changes})


# Named architectures. Vocabulary sizes and pad_id come from the tokenizer at build time.
MODEL_PRESETS: dict[str, ModelConfig] = {
    # Small enough that tests train it in seconds.
    "tiny": ModelConfig(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0),
    # The "tiny Transformer" of the Multi30k literature: 4+4 layers, d_model 128.
    "transformer-tiny": ModelConfig(d_model=128, n_heads=4, d_ff=256, n_encoder_layers=4, n_decoder_layers=4),
    # The paper's base model (table 3).
    "base": ModelConfig(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6, dropout=0.1),
    # The paper's big model (table 3).
    "big": ModelConfig(d_model=1024, n_heads=16, d_ff=4096, n_encoder_layers=6, n_decoder_layers=6, dropout=0.3),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """Return the named architecture, with ``overrides`` applied (for example vocabulary sizes)."""
    if name not in MODEL_PRESETS:
        names = sorted(MODEL_PRESETS)
        raise ConfigError(f"unknown model preset {name!r}{did_you_mean(name, names)}; choose from {', '.join(names)}")
    return MODEL_PRESETS[name].replace(**overrides)
