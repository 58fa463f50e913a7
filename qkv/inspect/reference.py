"""A transparent NumPy rendering of attention, step by step, as the tutorials teach it.

Nothing here is fast or clever on purpose: it is the oracle the tests compare the PyTorch code
against, and what ``qkv explain`` prints. Every function returns the intermediate matrices too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AttentionSteps:
    """The four steps of scaled dot-product attention for one head."""

    scores: np.ndarray  # step 1: alignment scores e = Q K^T, (m, n)
    scaled: np.ndarray  # step 2: e / sqrt(d_k), (m, n); masked entries are -inf
    weights: np.ndarray  # step 3: row-wise softmax, (m, n); each row sums to 1 (or is all 0)
    output: np.ndarray  # step 4: weighted sum of value rows, (m, d_v)


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """Softmax over each row separately. A row that is entirely -inf becomes all zeros."""
    out = np.zeros_like(x, dtype=np.float64)
    for i, row in enumerate(x):
        if np.all(np.isneginf(row)):
            continue  # no key to attend to: zero weights, not NaN
        shifted = np.exp(row - row.max())  # subtracting the max keeps exp() from overflowing
        out[i] = shifted / shifted.sum()
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None) -> AttentionSteps:
    """Scaled dot-product attention for one head.

    q: (m, d_k), k: (n, d_k), v: (n, d_v); mask: (m, n) bool, True = may attend.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    d_k = q.shape[1]
    scores = q @ k.T  # step 1: how well each query aligns with each key
    scaled = scores / np.sqrt(d_k)  # step 2: keep the softmax out of its flat regions
    if mask is not None:
        scaled = np.where(np.asarray(mask, dtype=bool), scaled, -np.inf)  # masked keys: weight exactly 0
    weights = softmax_rows(scaled)  # step 3: one distribution over the keys per query
    output = weights @ v  # step 4: output row i = sum_j weights[i, j] * v[j]
    return AttentionSteps(scores=scores, scaled=scaled, weights=weights, output=output)


@dataclass
class MultiHeadSteps:
    """Multi-head attention: per-head projections and steps, the concatenation and W^O."""

    q_heads: list[np.ndarray]  # Q W_i^Q, each (m, d_k)
    k_heads: list[np.ndarray]  # K W_i^K, each (n, d_k)
    v_heads: list[np.ndarray]  # V W_i^V, each (n, d_v)
    heads: list[AttentionSteps]
    concat: np.ndarray  # (m, h * d_v)
    output: np.ndarray  # concat W^O, (m, d_model)


def multi_head_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    w_q: list[np.ndarray],
    w_k: list[np.ndarray],
    w_v: list[np.ndarray],
    w_o: np.ndarray,
    mask: np.ndarray | None = None,
    b_q: list[np.ndarray] | None = None,
    b_k: list[np.ndarray] | None = None,
    b_v: list[np.ndarray] | None = None,
    b_o: np.ndarray | None = None,
) -> MultiHeadSteps:
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    q: (m, d_model), k and v: (n, d_model); w_q[i], w_k[i]: (d_model, d_k); w_v[i]: (d_model, d_v);
    w_o: (h * d_v, d_model). Biases are optional (the paper has none; PyTorch layers do).
    """
    h = len(w_q)
    q_heads = [q @ w_q[i] + (0 if b_q is None else b_q[i]) for i in range(h)]
    k_heads = [k @ w_k[i] + (0 if b_k is None else b_k[i]) for i in range(h)]
    v_heads = [v @ w_v[i] + (0 if b_v is None else b_v[i]) for i in range(h)]
    heads = [attention(q_heads[i], k_heads[i], v_heads[i], mask) for i in range(h)]
    concat = np.concatenate([head.output for head in heads], axis=1)
    output = concat @ w_o + (0 if b_o is None else b_o)
    return MultiHeadSteps(q_heads, k_heads, v_heads, heads, concat, output)
