"""The attention mechanism: scaled dot-product attention and multi-head attention (section 3.2).

Dimension legend used in shape comments:
    B batch, H heads, m queries, n keys, D d_model, d_k query/key size per head, d_v value size per head.

Mask convention everywhere in qkv: a boolean tensor in which True means "may attend" (a real key,
or a position that is not in the future). Masked keys get a score of -inf before the softmax, so
their weight is exactly zero; a query whose keys are all masked gets zero weights and a zero output,
never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.model.kernels import Linear, linear


class KVCache:
    """The keys and values a layer has computed so far, kept for incremental decoding.

    Self-attention appends each step's keys and values in place, into buffers with room for
    ``capacity`` positions (doubled when a step would overflow them). Beam search reorders and
    drops rows every step: ``reorder`` copies only the filled positions of the kept rows into a
    spare pair of buffers, which then take the place of the first. Cross-attention ``store``s the
    projected memory once. ``k``, ``v``: (N, H, length, d) views of the filled positions.
    """

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = max(1, capacity)
        self.length = 0
        self._buffers: tuple[Tensor, Tensor] | None = None  # (N, H, capacity, d) each, rows may exceed N
        self._spare: tuple[Tensor, Tensor] | None = None
        self.rows = 0

    @property
    def k(self) -> Tensor:
        return self._buffers[0][: self.rows, :, : self.length]

    @property
    def v(self) -> Tensor:
        return self._buffers[1][: self.rows, :, : self.length]

    @property
    def empty(self) -> bool:
        return self._buffers is None

    @property
    def allocated(self) -> int:
        """Positions the buffers hold before they grow (0 while empty)."""
        return 0 if self._buffers is None else self._buffers[0].size(2)

    def store(self, k: Tensor, v: Tensor) -> None:
        """Hold ``k`` (N, H, n, d_k) and ``v`` (N, H, n, d_v) as they are (cross-attention's memory)."""
        self._buffers, self._spare, self.rows, self.length = (k, v), None, k.size(0), k.size(2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the keys (N, H, m, d_k) and values (N, H, m, d_v) of m new positions after the
        cached ones; return all keys and values so far, (N, H, length + m, d)."""
        end = self.length + k.size(2)
        if self.empty or end > self._buffers[0].size(2):
            capacity = max(self.capacity, end if self.empty else 2 * end)  # doubles when it overflows
            grown = tuple(x.new_empty(x.size(0), x.size(1), capacity, x.size(3)) for x in (k, v))
            if not self.empty:
                for new, old in zip(grown, (self.k, self.v)):
                    new[:, :, : self.length] = old
            self._buffers, self._spare, self.rows = grown, None, k.size(0)
        for buffer, x in zip(self._buffers, (k, v)):
            buffer[: self.rows, :, self.length : end] = x
        self.length = end
        return self.k, self.v

    def join(self, n: int) -> None:
        """Add ``n`` rows after the cached ones, zero at every filled position: the rows of sentences
        that join a running search (``qkv.infer.continuous``), which mask those positions out. The
        buffers grow to twice the rows when full, so that most joins copy nothing."""
        if self.empty or n == 0:
            return
        rows = self.rows + n
        if rows > self._buffers[0].size(0):
            grown = tuple(x.new_empty(2 * rows, *x.shape[1:]) for x in self._buffers)
            for new, old in zip(grown, (self.k, self.v)):
                new[: self.rows, :, : self.length] = old
            self._buffers, self._spare = grown, None
        for buffer in self._buffers:
            buffer[self.rows : rows, :, : self.length] = 0
        self.rows = rows

    def join_memory(self, k: Tensor, v: Tensor) -> None:
        """Add the memory keys (n, H, S', d_k) and values (n, H, S', d_v) of ``n`` rows after the stored
        ones (cross-attention in a continuous search): the length becomes the longest row's, every row
        zero past its own. Rows grow as ``join``'s; the positions stay exactly the length, so that the
        rows' view stays contiguous (``qkv.model.incremental`` views it)."""
        if self.empty:
            self.store(k, v)
            return
        n, S = k.size(0), max(self.length, k.size(2))
        rows = self.rows + n
        if rows > self._buffers[0].size(0) or S > self.length:
            grown = tuple(x.new_zeros(x.size(0) if rows <= x.size(0) else 2 * rows, x.size(1), S, x.size(3))
                          for x in self._buffers)
            for new, old in zip(grown, (self.k, self.v)):
                new[: self.rows, :, : self.length] = old
            self._buffers, self._spare = grown, None
        for buffer, x in zip(self._buffers, (k, v)):
            buffer[self.rows : rows, :, : x.size(2)] = x
            buffer[self.rows : rows, :, x.size(2) :] = 0
        self.rows, self.length = rows, S

    def shorten(self, length: int) -> None:
        """Keep the first ``length`` positions of every row, contiguous (the memory once the longest source has left)."""
        if self.empty or length >= self.length:
            return
        self._buffers = tuple(x[:, :, :length].contiguous() for x in self._buffers)
        self._spare, self.length = None, length

    def trim(self, n: int) -> None:
        """Drop the first ``n`` filled positions of every row (positions no row attends to any more)."""
        if self.empty or n == 0:
            return
        for buffer, kept in zip(self._buffers, (self.k[:, :, n:].clone(), self.v[:, :, n:].clone())):
            buffer[: self.rows, :, : self.length - n] = kept
        self.length -= n

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (in that order) of the cached keys and values."""
        if self.empty:
            return
        if self._spare is None or self._spare[0].size(0) < index.numel() or self._spare[0].size(2) != self._buffers[0].size(2):
            self._spare = tuple(x.new_empty(max(index.numel(), x.size(0)), *x.shape[1:]) for x in self._buffers)
        for spare, cached in zip(self._spare, (self.k, self.v)):
            torch.index_select(cached, 0, index, out=spare[: index.numel(), :, : self.length])
        self._buffers, self._spare, self.rows = self._spare, self._buffers, index.numel()


# m * n per head up to which inference takes the explicit steps instead of the fused kernel: the
# two ran about even at m = n = 256 (B 4, 4 heads of 32, 2 threads, AMD EPYC), the explicit steps
# 1.3x to 4x faster at decoding's m of 1 to 10 queries.
SHORT_ATTENTION = 128 * 128
# The same limit with gradients (training): forward and backward of the explicit steps ran 1.6x to
# 2.0x as fast as the fused kernel's at the multi30k preset's 16 to 28 positions, even at 64, and
# 0.76x at 128 (batches of about 4,000 positions, 4 heads of 32, 2 threads, AMD EPYC, 2026-11-26:
# python -m benchmarks.training_attention, benchmarks/results/training_attention.jsonl).
SHORT_TRAINING_ATTENTION = 64 * 64


def causal_mask(m: int, n: int, device: torch.device | None = None) -> Tensor:
    """(m, n) bool, True where query i may see key j.

    Queries are aligned with the *last* m keys, so with a key/value cache (n > m) the newest
    query sees every cached key, and with m == n this is the usual lower triangle.
    """
    return torch.ones(m, n, dtype=torch.bool, device=device).tril(diagonal=n - m)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    dropout: Callable[[Tensor], Tensor] | None = None,
    need_weights: bool = False,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """softmax(Q K^T / sqrt(d_k)) V, equation (1) of the paper.

    q: (..., m, d_k), k: (..., n, d_k), v: (..., n, d_v); mask: bool, broadcastable to (..., m, n),
    True = may attend. Returns the output (..., m, d_v) and, if ``need_weights``, the attention
    weights (..., m, n) (before dropout), else None. ``dropout``: what drops the weights in the explicit
    steps when ``dropout_p`` > 0 (a module of that p: ``MultiHeadAttention`` passes its own, which
    ``fast_dropout`` replaces like every other); None: ``F.dropout``. The fused kernel draws its own.

    ``fused``: whether PyTorch's fused kernel (``F.scaled_dot_product_attention``) computes it, or
    the explicit four steps (matmul, scale, softmax, matmul). Weights need the explicit steps. By
    default (None) the fused kernel runs, except on short inputs: ``m * n`` at most
    ``SHORT_ATTENTION`` per head without gradients (a decoding step's few queries, which the explicit
    steps computed 1.3x to 4x faster on this project's 2-core CPU, a side measurement of 2026-11-25)
    and at most ``SHORT_TRAINING_ATTENTION`` with them (a training batch of short sentences).
    """
    m, n = q.size(-2), k.size(-2)
    if fused is None:
        fused = not need_weights and m * n > (SHORT_TRAINING_ATTENTION if torch.is_grad_enabled() else SHORT_ATTENTION)
    elif fused and need_weights:
        raise QkvError("the fused kernel returns no weights: need_weights needs fused=False (or None)")
    if causal and m > 1:  # a single query is the newest position: it sees every key
        future = causal_mask(m, n, q.device)  # (m, n)
        mask = future if mask is None else mask & future

    # A query with no visible key would softmax over all -inf (NaN). Let such rows see every key,
    # then zero their output: the result is 0 and so are the gradients through it.
    empty_rows = None
    if mask is not None:
        empty_rows = ~mask.any(dim=-1, keepdim=True)  # (..., m or 1, 1)
        mask = mask | empty_rows

    if fused:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        weights = None
    else:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., m, n)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)  # each row is a distribution over the n keys
        if empty_rows is not None and need_weights:
            weights = weights.masked_fill(empty_rows, 0.0)
        if dropout_p > 0:
            dropped = dropout(weights) if dropout is not None else F.dropout(weights, p=dropout_p)
        else:
            dropped = weights
        out = dropped @ v  # (..., m, d_v)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out, weights if need_weights else None


def fold_groups(x: Tensor, G: int) -> Tensor:
    """(B*G, H, m, d) -> (B, H, G*m, d): the queries of G consecutive rows side by side."""
    BG, H, m, d = x.shape
    return x.view(BG // G, G, H, m, d).transpose(1, 2).reshape(BG // G, H, G * m, d)


def unfold_groups(x: Tensor, G: int) -> Tensor:
    """(B, H, G*m, d) -> (B*G, H, m, d), the inverse of ``fold_groups``."""
    B, H, Gm, d = x.shape
    return x.view(B, H, G, Gm // G, d).transpose(1, 2).reshape(B * G, H, Gm // G, d)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The per-head projections W_i^Q, W_i^K, W_i^V are stored stacked in one matrix ``in_proj``
    (rows: all query heads, then all key heads, then all value heads), so self-attention projects
    with a single matmul; cross-attention uses the query rows for the decoder states and the
    key/value rows for the encoder output.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        d_k: int | None = None,
        d_v: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if (d_k is None or d_v is None) and d_model % n_heads:
            raise QkvError(f"d_model ({d_model}) is not divisible by n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_k if d_k is not None else d_model // n_heads
        self.d_v = d_v if d_v is not None else d_model // n_heads
        self.dropout = nn.Dropout(dropout)  # on the attention weights, in training
        self.in_proj = Linear(d_model, n_heads * (2 * self.d_k + self.d_v), bias=bias)
        self.out_proj = Linear(n_heads * self.d_v, d_model, bias=bias)  # W^O
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj.weight)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.in_proj.bias is not None:
            nn.init.zeros_(self.in_proj.bias)
            nn.init.zeros_(self.out_proj.bias)

    def _split_heads(self, x: Tensor, d_head: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, d_head).transpose(1, 2)  # (B, L, H*d) -> (B, H, L, d)

    def forward(
        self,
        query: Tensor,
        memory: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Self-attention when ``memory`` is None, otherwise cross-attention over ``memory``.

        query: (B, m, D); memory: (B, n, D); key_mask: (B, n) bool, True for real (unpadded) keys.
        In cross-attention the query may hold G rows per memory row, (B*G, m, D): the G beams of a
        sentence in beam search, which share that sentence's memory (and its cached keys and values).
        cache: a ``KVCache`` this layer fills for incremental decoding. For self-attention the new
        keys and values are appended to it each call; for cross-attention the memory is projected
        on the first call and the cached keys and values are reused after that.
        Returns the output (B, m, D) and, if ``need_weights``, per-head weights (B, H, m, n).
        """
        Hk = self.n_heads * self.d_k
        if memory is None:
            q, k, v = self.in_proj(query).split([Hk, Hk, self.n_heads * self.d_v], dim=-1)
            k, v = self._split_heads(k, self.d_k), self._split_heads(v, self.d_v)  # (B, H, m, d)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, past + m, d)
        else:
            q = linear(query, self.in_proj.weight[:Hk], None if self.in_proj.bias is None else self.in_proj.bias[:Hk])
            if cache is not None and not cache.empty:
                k, v = cache.k, cache.v
            else:
                w, b = self.in_proj.weight[Hk:], None if self.in_proj.bias is None else self.in_proj.bias[Hk:]
                k, v = linear(memory, w, b).split([Hk, self.n_heads * self.d_v], dim=-1)
                k, v = self._split_heads(k, self.d_k), self._split_heads(v, self.d_v)  # (B, H, n, d)
                if cache is not None:
                    cache.store(k, v)
        q = self._split_heads(q, self.d_k)  # (B, H, m, d_k)
        # Beam search keeps G rows per sentence but one copy of its memory: the G beams' queries
        # then attend together, as G * m queries of one sentence, to its keys and values.
        G = q.size(0) // k.size(0)
        if G * k.size(0) != q.size(0):
            raise QkvError(f"{q.size(0)} query rows do not divide into the {k.size(0)} rows of keys")
        if G > 1:
            q = fold_groups(q, G)  # (B*G, H, m, d_k) -> (B, H, G*m, d_k)

        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, n) -> (B, 1, 1, n)
        out, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            dropout_p=self.dropout.p if self.training else 0.0,
            dropout=self.dropout,
            need_weights=need_weights,
        )
        if G > 1:
            out = unfold_groups(out, G)  # (B, H, G*m, d_v) -> (B*G, H, m, d_v)
            weights = None if weights is None else unfold_groups(weights, G)  # (B*G, H, m, n)
        B, _, m, _ = out.shape
        out = out.transpose(1, 2).reshape(B, m, self.n_heads * self.d_v)  # (B, H, m, d_v) -> (B, m, H*d_v)
        return self.out_proj(out), weights
