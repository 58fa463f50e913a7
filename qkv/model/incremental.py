"""The decoder's cached inference step, one new token per sentence, with few operations.

A search calls ``Transformer.decode`` once per output token. At a decoding step's sizes the
arithmetic is small and the step's cost is mostly PyTorch's per-operation overhead: the general
layers (``qkv.model.attention``) run 925 operations a step for the preset's 4 decoder layers (64 rows,
counted with PyTorch's profiler), mostly views, reshapes and the masking that training needs; this
path runs 650. This is the same computation for the
one case a search meets, a single query per row without gradients or attention weights, written
with the reshapes it needs and no more:

    self-attention   one projection, the cache append, (B*H, 1, d) x (B*H, d, T) batched matmuls
    cross-attention  the query projection, the cached keys and values (B*H, S, d), the source
                     mask as an additive 0 / -inf bias made once per step for every layer
    feed-forward     the model's own module

Every product, scale and softmax is the general path's, in the same order; the logits agree to float
rounding (tested step by step against the general path; on 64 val sentences of the preset's model,
15 steps, at most 5.4e-6 on logits up to 15.5), and val's 1,014 translations came out the same at
greedy and beam 5. It requires every source row to hold a real token (the searches append EOS to
each), checked once per batch; otherwise the general path runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from qkv.model.attention import KVCache, MultiHeadAttention
from qkv.model.kernels import linear

# The model is a qkv.model.transformer.Transformer and the state its DecoderState; that module
# imports this one, so their types are named here only in words.


def applies(model: nn.Module, tgt: Tensor, src_mask: Tensor, state: Any, need_weights: bool) -> bool:
    """Whether ``decode_step`` computes this call: cached, one token per row, no gradients, no weights,
    and every source row with a real token (checked at the batch's first step, kept in ``state``)."""
    if state is None or need_weights or tgt.size(1) != 1 or model.training or torch.is_grad_enabled():
        return False
    if state.sources_nonempty is None:
        state.sources_nonempty = bool(src_mask.any(dim=-1).all())
    return state.sources_nonempty


# Graphs Dynamo may compile for the step before it runs it eagerly (its own default is 8).
RECOMPILE_LIMIT = 32
_compiled = None  # the compiled ``_step`` after ``compile_steps()``, else None


def compile_steps(on: bool = True) -> bool:
    """Run ``decode_step`` compiled (``torch.compile`` with dynamic shapes: one set of graphs serves
    every batch size, source length and position) from now on in this process, or eager again;
    returns the previous setting. The first steps compile (about a minute a run on two cores once
    PyTorch's on-disk cache holds the graphs, three the first time); docs/translation.md gives what
    it saves."""
    global _compiled
    previous = _compiled is not None
    if on:
        # Dynamo compiles a new graph where a guard fails: the caches' first step and growth, one beam
        # or several. A val run of the preset's model met more than its default limit of 8, past which
        # it would run the step eagerly and say so on stderr.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    _compiled = torch.compile(_step, dynamic=True) if on else None
    return previous


def compiled() -> bool:
    """Whether ``decode_step`` runs compiled (``compile_steps``)."""
    return _compiled is not None


def decode_step(model: nn.Module, tgt: Tensor, memory: Tensor, src_mask: Tensor, state: Any) -> Tensor:
    """tgt: (R, 1) the newest token of each row; memory: (B, S, D) with R = B x G (G beams of a
    sentence side by side); src_mask: (B, S). Returns the decoder's output (R, 1, D); the state advances.
    Compiled after ``compile_steps()``."""
    if _compiled is not None and not torch.compiler.is_compiling():
        return _compiled(model, tgt, memory, src_mask, state)
    return _step(model, tgt, memory, src_mask, state)


def _step(model: nn.Module, tgt: Tensor, memory: Tensor, src_mask: Tensor, state: Any) -> Tensor:
    x = model._embed(model.tgt_embed, tgt, state.position)  # (R, 1, D)
    bias = torch.zeros(src_mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~src_mask, float("-inf"))
    x = _layers(model, x, memory, bias[:, None, None, :], state.layers)  # bias (B, 1, 1, S), added to (B, H, G, S) scores
    state.position += 1
    return x


def ragged_step(model: nn.Module, tgt: Tensor, positions: Tensor, memory_bias: Tensor, self_bias: Tensor,
                layers: list[dict[str, KVCache]]) -> Tensor:
    """The step of a search whose rows are at different positions (``qkv.infer.continuous``: sentences
    join it as others finish). tgt: (R, 1) the newest token of each row; positions: (R,) its position
    in its own output; memory_bias: (B, 1, 1, S) 0 / -inf over the source positions, with R = B x G;
    self_bias: (R, 1, 1, T) 0 / -inf over the self-attention caches' T positions once this step's are
    appended (-inf before a row's first); ``layers``: each layer's caches, the cross-attention ones
    already stored (``cross_keys_values``). Returns the decoder's output (R, 1, D)."""
    x = model.tgt_embed(tgt) * model.embed_scale + model.positions.table[positions][:, None]  # _embed, row by row
    return _layers(model, x, None, memory_bias, layers, self_bias)


def _layers(model: nn.Module, x: Tensor, memory: Tensor | None, bias: Tensor, layers: list[dict[str, KVCache]],
            self_bias: Tensor | None = None) -> Tensor:
    for layer, cache in zip(model.decoder_layers, layers):
        x = _residual(layer.self_sublayer, x, lambda h: _self_attention(layer.self_attn, h, cache["self"], self_bias))
        x = _residual(layer.cross_sublayer, x, lambda h: _cross_attention(layer.cross_attn, h, memory, bias, cache["cross"]))
        x = _residual(layer.ff_sublayer, x, layer.feed_forward)
    return model.decoder_norm(x)


def cross_keys_values(att: MultiHeadAttention, memory: Tensor) -> tuple[Tensor, Tensor]:
    """The keys and values of ``memory`` (B, S, D) for the cross-attention ``att``: (B, H, S, d) each,
    contiguous (viewed by ``_cross_attention``), projected once per sentence."""
    H, dk, dv = att.n_heads, att.d_k, att.d_v
    Hk = H * dk
    w, b = att.in_proj.weight[Hk:], None if att.in_proj.bias is None else att.in_proj.bias[Hk:]
    k, v = linear(memory, w, b).split([Hk, H * dv], dim=-1)
    return att._split_heads(k, dk).contiguous(), att._split_heads(v, dv).contiguous()


def _residual(sublayer: nn.Module, x: Tensor, fn) -> Tensor:
    """``Sublayer`` in eval mode (its dropout is the identity): pre-LN x + f(LN(x)), post-LN LN(x + f(x))."""
    if sublayer.norm_first:
        return x + fn(sublayer.norm(x))
    return sublayer.norm(x + fn(x))


def _self_attention(att: MultiHeadAttention, h: Tensor, cache: KVCache, bias: Tensor | None = None) -> Tensor:
    R, H, dk, dv = h.size(0), att.n_heads, att.d_k, att.d_v
    q, k, v = att.in_proj(h).split([H * dk, H * dk, H * dv], dim=-1)  # (R, 1, H*d) each
    k, v = cache.append(k.view(R, 1, H, dk).transpose(1, 2), v.view(R, 1, H, dv).transpose(1, 2))  # (R, H, T, d)
    T = k.size(2)
    q = q.reshape(R * H, 1, dk)
    scores = torch.bmm(q, k.reshape(R * H, T, dk).transpose(1, 2)) / math.sqrt(dk)  # (R*H, 1, T)
    if bias is not None:  # (R, 1, 1, T): a ragged step's rows start at different positions
        scores = (scores.view(R, H, 1, T) + bias).view(R * H, 1, T)
    out = torch.bmm(scores.softmax(dim=-1), v.reshape(R * H, T, dv))  # (R*H, 1, dv)
    return att.out_proj(out.view(R, 1, H * dv))


def _cross_attention(att: MultiHeadAttention, h: Tensor, memory: Tensor, bias: Tensor, cache: KVCache) -> Tensor:
    R, H, dk, dv = h.size(0), att.n_heads, att.d_k, att.d_v
    Hk = H * dk
    if cache.empty:  # the memory's keys and values, projected once per batch
        cache.store(*cross_keys_values(att, memory))
    k, v = cache.k, cache.v  # (B, H, S, d)
    B, S = k.size(0), k.size(2)
    G = R // B
    q = linear(h, att.in_proj.weight[:Hk], None if att.in_proj.bias is None else att.in_proj.bias[:Hk])  # (R, 1, H*dk)
    q = q.view(B, G, H, dk).transpose(1, 2).reshape(B * H, G, dk)  # the G beams' queries of a sentence together
    scores = torch.bmm(q, k.reshape(B * H, S, dk).transpose(1, 2)) / math.sqrt(dk)  # (B*H, G, S)
    weights = (scores.view(B, H, G, S) + bias).softmax(dim=-1)
    out = torch.bmm(weights.view(B * H, G, S), v.reshape(B * H, S, dv))  # (B*H, G, dv)
    return att.out_proj(out.view(B, H, G, dv).transpose(1, 2).reshape(R, 1, H * dv))
