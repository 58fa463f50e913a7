"""The Transformer encoder-decoder (section 3 of the paper).

Dimension legend used in shape comments:
    B batch, S source length, T target length, D d_model, F d_ff, V vocabulary size, H heads.

The model exposes ``encode`` and ``decode``; search (greedy, beam) lives in ``qkv.infer.search``.
Masks follow ``qkv.model.attention``: True means a real token / a key that may be attended to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.model import incremental
from qkv.model.attention import KVCache, MultiHeadAttention
from qkv.model.config import ModelConfig
from qkv.model.kernels import Linear, linear
from qkv.model.quantize import is_int8

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def sinusoidal_table(max_len: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """(max_len, D) positional encodings, section 3.5.

    PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)).
    ``layout="split"`` stores the same values with all sines first, then all cosines (Marian).
    """
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (D/2,)
    angles = position * inv_freq  # (max_len, D/2)
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()
    else:
        table[:, : d_model // 2], table[:, d_model // 2 :] = angles.sin(), angles.cos()
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds the sinusoidal table; a non-persistent buffer, so it follows .to(device) and is not saved."""

    def __init__(self, d_model: int, max_len: int, layout: str = "interleaved") -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_len, d_model, layout), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        T = x.size(1)
        if offset + T > self.table.size(0):
            raise QkvError(f"sequence of length {offset + T} exceeds max_len {self.table.size(0)}")
        return x + self.table[offset : offset + T]  # (B, T, D) + (T, D)


class LearnedPositions(nn.Module):
    """Learned positional embeddings: a trained (max_len, D) table added like the sinusoids (the
    paper's table 3, row E). Initialised N(0, 1/D), on the scale of the scaled token embeddings' rows."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_len, d_model) * d_model**-0.5)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        T = x.size(1)
        if offset + T > self.table.size(0):
            raise QkvError(f"sequence of length {offset + T} exceeds max_len {self.table.size(0)}")
        return x + self.table[offset : offset + T]  # (B, T, D) + (T, D)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position separately (section 3.3).

    ``dropout`` (the config's ``activation_dropout``, not in the paper; 0 by default): dropout on the
    d_ff activations, in training only."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        self.linear1 = Linear(d_model, d_ff)
        self.linear2 = Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation(self.linear1(x))  # (B, L, D) -> (B, L, F)
        if self.training:  # in eval the dropout is the identity: a decoding step skips the call
            h = self.dropout(h)
        return self.linear2(h)  # (B, L, F) -> (B, L, D)


class Sublayer(nn.Module):
    """Residual connection and layer norm around a sublayer, with dropout on the sublayer's output.

    Post-LN (the paper, section 5.4): LayerNorm(x + Dropout(f(x))).
    Pre-LN (``norm_first``, a departure): x + Dropout(f(LayerNorm(x))), trains more stably without warm-up.
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, fn) -> tuple[Tensor, Tensor | None]:
        if self.norm_first:
            y, weights = fn(self.norm(x))
            return x + self.dropout(y), weights
        y, weights = fn(x)
        return self.norm(x + self.dropout(y)), weights


def _attention(config: ModelConfig) -> MultiHeadAttention:
    return MultiHeadAttention(
        config.d_model, config.n_heads, d_k=config.d_k, d_v=config.d_v, dropout=config.attention_dropout
    )


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward network, each wrapped in a ``Sublayer``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        args = (config.d_model, config.dropout, config.norm_first, config.layer_norm_eps)
        self.self_attn = _attention(config)
        self.feed_forward = FeedForward(config.d_model, config.d_ff, config.activation, config.activation_dropout)
        self.attn_sublayer, self.ff_sublayer = Sublayer(*args), Sublayer(*args)

    def forward(self, x: Tensor, src_mask: Tensor | None, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        x, weights = self.attn_sublayer(x, lambda h: self.self_attn(h, key_mask=src_mask, need_weights=need_weights))
        x, _ = self.ff_sublayer(x, lambda h: (self.feed_forward(h), None))
        return x, weights


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward (section 3.1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        args = (config.d_model, config.dropout, config.norm_first, config.layer_norm_eps)
        self.self_attn = _attention(config)
        self.cross_attn = _attention(config)
        self.feed_forward = FeedForward(config.d_model, config.d_ff, config.activation, config.activation_dropout)
        self.self_sublayer, self.cross_sublayer, self.ff_sublayer = Sublayer(*args), Sublayer(*args), Sublayer(*args)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        src_mask: Tensor | None,
        cache: dict[str, KVCache] | None = None,
        need_weights: bool = False,
        need_cross: bool = False,
        tgt_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``need_cross``: the cross-attention's weights only (guided alignment's training pass).
        ``tgt_mask`` (B, T), True for real target tokens: self-attention over the whole target
        (no causal mask; the full-context alignment pass), else over the tokens before each."""
        self_cache = None if cache is None else cache["self"]
        cross_cache = None if cache is None else cache["cross"]
        causal = tgt_mask is None
        x, self_w = self.self_sublayer(
            x, lambda h: self.self_attn(h, key_mask=tgt_mask, causal=causal, cache=self_cache, need_weights=need_weights)
        )
        cross_weights = need_weights or need_cross
        x, cross_w = self.cross_sublayer(
            x,
            lambda h: self.cross_attn(h, memory, key_mask=src_mask, cache=cross_cache, need_weights=cross_weights),
        )
        x, _ = self.ff_sublayer(x, lambda h: (self.feed_forward(h), None))
        return x, self_w, cross_w


@dataclass
class DecoderState:
    """Key/value caches of every decoder layer for incremental decoding, and the next position."""

    layers: list[dict[str, KVCache]]
    position: int = 0
    sources_nonempty: bool | None = None  # every source row holds a real token (``qkv.model.incremental``)

    @classmethod
    def empty(cls, n_layers: int, capacity: int = 16) -> DecoderState:
        """Caches with room for ``capacity`` positions before they grow (the longest output expected)."""
        return cls(layers=[{"self": KVCache(capacity), "cross": KVCache()} for _ in range(n_layers)])

    def reorder(self, index: Tensor, kinds: tuple[str, ...] = ("self", "cross")) -> None:
        """Keep batch rows ``index`` of the ``kinds`` caches (beam search reorders hypotheses and drops finished ones)."""
        for layer in self.layers:
            for kind in kinds:
                layer[kind].reorder(index)


class OutputSubset:
    """For each sentence of a batch, the only target ids a search scores (a vocabulary shortlist,
    ``qkv.infer.shortlist``): ``ids`` (B, U), each row padded past its valid entries, which an additive
    ``mask`` (B, U) of 0 / -inf marks (``from_valid``).

    ``project`` gives the logits of each sentence's own U ids, -inf at the padding: the rows of the
    output projection are gathered once per sentence and model (per generator) and kept while the
    subset lives (one batch); the decoder's R = B x k rows (k beams of a sentence, side by side)
    meet their sentence's rows in one batched matmul. An int8 generator's rows are dequantized, so
    the U rows run in fp32. Index a subset (``subset[keep]``) as the search drops finished sentences.
    """

    def __init__(self, ids: Tensor, mask: Tensor, rows: dict[int, tuple[Tensor, Tensor | None]] | None = None) -> None:
        self.ids = ids  # (B, U) int64, or (1, U): one list for all
        self.mask = mask  # (B, U): 0 where a sentence may produce the id, -inf elsewhere
        self._rows = {} if rows is None else rows

    @classmethod
    def from_valid(cls, ids: Tensor, valid: Tensor) -> OutputSubset:
        """``valid`` (B, U) bool: which of ``ids`` each sentence may produce."""
        return cls(ids, torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf")))

    @property
    def shared(self) -> bool:
        """Whether all sentences score the same U ids (their union), each masked to its own."""
        return self.ids.size(0) == 1 and self.mask.size(0) != 1

    def __getitem__(self, index: Tensor) -> OutputSubset:
        if self.shared:
            return OutputSubset(self.ids, self.mask[index], self._rows)
        rows = {key: (w[index], None if b is None else b[index]) for key, (w, b) in self._rows.items()}
        return OutputSubset(self.ids[index], self.mask[index], rows)

    def positions_to_ids(self, positions: Tensor) -> Tensor:
        """(B, n) positions in each sentence's U ids -> target ids."""
        return self.ids.expand(positions.size(0), -1).gather(1, positions)

    def project(self, generator: nn.Module, x: Tensor) -> Tensor:
        """x: (R, T, D), R = B x k. Returns (R, T, U)."""
        rows = self._rows.get(id(generator))
        if rows is None:
            weight, bias = generator.weight, generator.bias
            if is_int8(weight):  # an int8 generator (qkv.model.quantize): its rows run dequantized
                weight = weight.dequantize()
            ids = self.ids.to(weight.device)
            rows = self._rows[id(generator)] = (weight[ids].to(x.dtype), None if bias is None else bias[ids].to(x.dtype))
        weight, bias = rows  # (B, U, D), (B, U); shared: (1, U, D), (1, U)
        B, U = self.mask.shape
        R, T, D = x.shape
        if self.shared:  # one matmul over the union; each sentence's k*T rows masked to its own ids
            logits = linear(x, weight[0], None if bias is None else bias[0]).view(B, R // B * T, U)
            return (logits + self.mask[:, None, :].to(logits.dtype)).view(R, T, U)
        logits = torch.bmm(x.reshape(B, R // B * T, D), weight.transpose(1, 2))  # (B, k*T, U)
        logits = logits + self.mask[:, None, :].to(logits.dtype)
        if bias is not None:
            logits = logits + bias[:, None, :]
        return logits.view(R, T, U)


@dataclass
class AttentionWeights:
    """Per-layer attention weights, each (B, H, queries, keys)."""

    encoder: list[Tensor] = field(default_factory=list)
    decoder_self: list[Tensor] = field(default_factory=list)
    cross: list[Tensor] = field(default_factory=list)


class Transformer(nn.Module):
    """Encoder-decoder Transformer: embeddings + positions, N encoder layers, N decoder layers, output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        D = config.d_model
        self.src_embed = nn.Embedding(config.src_vocab_size, D)
        self.tgt_embed = self.src_embed if config.share_embeddings else nn.Embedding(config.tgt_vocab_size, D)
        self.embed_scale = math.sqrt(D) if config.scale_embeddings else 1.0
        self.positions = (
            LearnedPositions(D, config.max_len) if config.learned_positions
            else PositionalEncoding(D, config.max_len, config.position_layout)
        )
        self.dropout = nn.Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        # Pre-LN leaves the residual stream unnormalised, so each stack ends with a layer norm.
        self.encoder_norm = nn.LayerNorm(D, eps=config.layer_norm_eps) if config.norm_first else nn.Identity()
        self.decoder_norm = nn.LayerNorm(D, eps=config.layer_norm_eps) if config.norm_first else nn.Identity()
        self.generator = Linear(D, config.tgt_vocab_size, bias=config.output_bias)
        self._init_embeddings()
        if config.tie_output:
            self.generator.weight = self.tgt_embed.weight

    def _init_embeddings(self) -> None:
        # Embeddings are multiplied by sqrt(D), so N(0, 1/D) puts them on the scale of the positions.
        std = self.config.d_model**-0.5 if self.config.scale_embeddings else 1.0
        for embedding in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(embedding.weight, std=std)
        if not self.config.tie_output:
            nn.init.normal_(self.generator.weight, std=self.config.d_model**-0.5)
        if self.generator.bias is not None:
            nn.init.zeros_(self.generator.bias)

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, offset: int = 0, word_dropout: float = 0.0) -> Tensor:
        x = embedding(tokens) * self.embed_scale  # (B, L) -> (B, L, D)
        if word_dropout and self.training:  # a token's whole embedding, not its units: one draw per (B, L), scaled by 1/(1-p)
            x = x * F.dropout(x.new_ones(x.shape[:-1] + (1,)), word_dropout)
        return self.dropout(self.positions(x, offset))

    def encode(self, src: Tensor, *, need_weights: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """src: (B, S) token ids. Returns memory (B, S, D), src_mask (B, S), encoder self-attention weights."""
        src_mask = src != self.config.pad_id  # (B, S), True for real tokens
        x = self._embed(self.src_embed, src, word_dropout=self.config.word_dropout)
        weights = []
        for layer in self.encoder_layers:
            x, w = layer(x, src_mask, need_weights)
            if need_weights:
                weights.append(w)
        return self.encoder_norm(x), src_mask, weights

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        *,
        state: DecoderState | None = None,
        need_weights: bool = False,
        vocab: OutputSubset | None = None,
    ) -> tuple[Tensor, AttentionWeights | None]:
        """Target logits given the target prefix (teacher forcing) or the next tokens (with ``state``).

        tgt: (B, T) ids, starting with BOS. memory: (B, S, D). src_mask: (B, S).
        With a ``state``, ``tgt`` holds only the new tokens (usually T = 1), earlier positions come
        from the cache, and the state advances. Returns logits (B, T, V) and, if asked, weights;
        with ``vocab``, the logits of its U target ids only, (B, T, U), in its order.
        """
        x, weights = self.decode_hidden(tgt, memory, src_mask, state=state, need_weights=need_weights)
        if vocab is not None:
            return vocab.project(self.generator, x), weights  # (B, T, D) -> (B, T, U)
        return self.generator(x), weights  # (B, T, D) -> (B, T, V)

    def decode_hidden(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        *,
        state: DecoderState | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, AttentionWeights | None]:
        """``decode`` without the output projection: the decoder's output (B, T, D) and weights.
        A search's step (one token per row, with ``state``) goes through ``qkv.model.incremental``."""
        if incremental.applies(self, tgt, src_mask, state, need_weights):
            return incremental.decode_step(self, tgt, memory, src_mask, state), None
        offset = 0 if state is None else state.position
        x = self._embed(self.tgt_embed, tgt, offset)
        weights = AttentionWeights() if need_weights else None
        for i, layer in enumerate(self.decoder_layers):
            cache = None if state is None else state.layers[i]
            x, self_w, cross_w = layer(x, memory, src_mask, cache, need_weights)
            if weights is not None:
                weights.decoder_self.append(self_w)
                weights.cross.append(cross_w)
        if state is not None:
            state.position += tgt.size(1)
        return self.decoder_norm(x), weights

    def forward(self, src: Tensor, tgt: Tensor, *, project: bool = True, alignment: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Teacher-forced logits: src (B, S), tgt (B, T) = BOS + target[:-1]. Returns (B, T, V), or
        with ``project=False`` the decoder's output before ``generator`` (B, T, D), for a loss that
        applies the output projection itself (``qkv.train.loss.projected_label_smoothed_loss``).
        With ``alignment``, also the alignment head's weights (B, T, S) (``aligned_decode``)."""
        memory, src_mask, _ = self.encode(src)
        if alignment:
            x, head = self.aligned_decode(tgt, memory, src_mask)
            return (self.generator(x) if project else x), head
        if project:
            logits, _ = self.decode(tgt, memory, src_mask)
            return logits
        return self.decode_hidden(tgt, memory, src_mask)[0]

    def aligned_decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The teacher-forced decoder pass with the alignment head's weights: the decoder's output
        (B, T, D) and the first cross-attention head of layer ``config.alignment_layer``, (B, T, S).
        With ``alignment_context`` "full" the head comes from a second pass (``alignment_head``)."""
        index = self.config.alignment_layer
        if index is None:
            raise QkvError("this model has no alignment head (model key alignment_layer)")
        full = self.config.alignment_context == "full"
        x = self._embed(self.tgt_embed, tgt)
        head = None
        for i, layer in enumerate(self.decoder_layers):
            x, _, cross = layer(x, memory, src_mask, need_cross=i == index and not full)
            if i == index and not full:
                head = cross[:, 0]  # (B, H, T, S) -> (B, T, S)
        if full:
            head = self.alignment_head(tgt, memory, src_mask)
        return self.decoder_norm(x), head

    def alignment_head(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """The alignment head's weights (B, T, S) for the teacher-forced target ``tgt`` (B, T) = BOS +
        target: row t aligns the token the decoder predicts at t. With ``alignment_context`` "full",
        from a pass through the layers up to the head's in which each position sees the whole target
        (fairseq's ``full_context_alignment``; no output is predicted from it), else the search's own
        causal pass."""
        index = self.config.alignment_layer
        if index is None:
            raise QkvError("this model has no alignment head (model key alignment_layer)")
        tgt_mask = (tgt != self.config.pad_id) if self.config.alignment_context == "full" else None  # (B, T)
        x = self._embed(self.tgt_embed, tgt)
        for layer in self.decoder_layers[:index]:
            x, _, _ = layer(x, memory, src_mask, tgt_mask=tgt_mask)
        _, _, cross = self.decoder_layers[index](x, memory, src_mask, need_cross=True, tgt_mask=tgt_mask)
        return cross[:, 0]  # (B, H, T, S) -> (B, T, S)

    @property
    def device(self) -> torch.device:
        """Where the weights are (the embeddings: they stay fp32 even in an int8 copy)."""
        return self.src_embed.weight.device

    def new_state(self, capacity: int = 16) -> DecoderState:
        """An empty ``DecoderState``; ``capacity``: the output length its caches hold without growing."""
        return DecoderState.empty(len(self.decoder_layers), capacity)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
