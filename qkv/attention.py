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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KVCache = dict[str, Tensor]


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
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """softmax(Q K^T / sqrt(d_k)) V, equation (1) of the paper.

    q: (..., m, d_k), k: (..., n, d_k), v: (..., n, d_v); mask: bool, broadcastable to (..., m, n),
    True = may attend. Returns the output (..., m, d_v) and, if ``need_weights``, the attention
    weights (..., m, n) (before dropout), else None. Without weights PyTorch's fused kernel runs.
    """
    m, n = q.size(-2), k.size(-2)
    if causal:
        future = causal_mask(m, n, q.device)  # (m, n)
        mask = future if mask is None else mask & future

    # A query with no visible key would softmax over all -inf (NaN). Let such rows see every key,
    # then zero their output: the result is 0 and so are the gradients through it.
    empty_rows = None
    if mask is not None:
        empty_rows = ~mask.any(dim=-1, keepdim=True)  # (..., m or 1, 1)
        mask = mask | empty_rows

    if not need_weights:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        weights = None
    else:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (..., m, n)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)  # each row is a distribution over the n keys
        if empty_rows is not None:
            weights = weights.masked_fill(empty_rows, 0.0)
        dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
        out = dropped @ v  # (..., m, d_v)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out, weights


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
            raise ValueError(f"d_model ({d_model}) is not divisible by n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_k if d_k is not None else d_model // n_heads
        self.d_v = d_v if d_v is not None else d_model // n_heads
        self.dropout = dropout
        self.in_proj = nn.Linear(d_model, n_heads * (2 * self.d_k + self.d_v), bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_v, d_model, bias=bias)  # W^O
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
        cache: a dict this layer fills for incremental decoding. For self-attention the new keys
        and values are appended to it each call; for cross-attention the memory is projected on
        the first call and the cached keys and values are reused after that.
        Returns the output (B, m, D) and, if ``need_weights``, per-head weights (B, H, m, n).
        """
        Hk = self.n_heads * self.d_k
        if memory is None:
            q, k, v = self.in_proj(query).split([Hk, Hk, self.n_heads * self.d_v], dim=-1)
            k, v = self._split_heads(k, self.d_k), self._split_heads(v, self.d_v)  # (B, H, m, d)
            if cache is not None:
                if "k" in cache:
                    k = torch.cat([cache["k"], k], dim=2)  # (B, H, past + m, d_k)
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        else:
            q = F.linear(query, self.in_proj.weight[:Hk], None if self.in_proj.bias is None else self.in_proj.bias[:Hk])
            if cache is not None and "k" in cache:
                k, v = cache["k"], cache["v"]
            else:
                w, b = self.in_proj.weight[Hk:], None if self.in_proj.bias is None else self.in_proj.bias[Hk:]
                k, v = F.linear(memory, w, b).split([Hk, self.n_heads * self.d_v], dim=-1)
                k, v = self._split_heads(k, self.d_k), self._split_heads(v, self.d_v)  # (B, H, n, d)
                if cache is not None:
                    cache["k"], cache["v"] = k, v
        q = self._split_heads(q, self.d_k)  # (B, H, m, d_k)

        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, n) -> (B, 1, 1, n)
        out, weights = scaled_dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
        )
        B, _, m, _ = out.shape
        out = out.transpose(1, 2).reshape(B, m, self.n_heads * self.d_v)  # (B, H, m, d_v) -> (B, m, H*d_v)
        return self.out_proj(out), weights
