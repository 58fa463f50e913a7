"""What qkv is measured against: the tutorial's literal attention and model, and PyTorch's own modules.

Dimension legend: B batch, H heads, S source length, T target length, L any length, D d_model,
F d_ff, V vocabulary size.

``TutorialAttention`` and ``TutorialTransformer`` follow the from-scratch implementation the source
documents cite, step by step: separate q/k/v projections, ``q @ k^T``, scale, ``masked_fill`` with a
small constant, softmax, ``@ v``; post-LN layers; batches of a fixed number of sentences padded to
the longest. No fused kernels and no length bucketing. ``TorchTransformer`` wraps
``torch.nn.Transformer`` with the same embeddings and output layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.model.config import ModelConfig
from qkv.model.transformer import sinusoidal_table


class TutorialAttention(nn.Module):
    """Multi-head attention exactly as the tutorial writes it (matmul, scale, masked_fill, softmax, matmul)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.w_q, self.w_k, self.w_v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_concat = nn.Linear(d_model, d_model)

    def split(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, self.d_head).transpose(1, 2)  # (B, L, D) -> (B, H, L, d)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """q: (B, m, D), k and v: (B, n, D); mask broadcastable to (B, H, m, n), 0 = masked."""
        q, k, v = self.split(self.w_q(q)), self.split(self.w_k(k)), self.split(self.w_v(v))
        score = q @ k.transpose(2, 3) / math.sqrt(self.d_head)  # (B, H, m, n)
        if mask is not None:
            score = score.masked_fill(mask == 0, -10000)  # the tutorial's constant, not -inf
        score = torch.softmax(score, dim=-1)
        out = score @ v  # (B, H, m, d)
        B, H, m, d = out.shape
        return self.w_concat(out.transpose(1, 2).contiguous().view(B, m, H * d))


class _FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.linear1, self.linear2, self.dropout = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(F.relu(self.linear1(x))))


class _EncoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.attention, self.ffn = TutorialAttention(d_model, n_heads), _FeedForward(d_model, d_ff, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout1(self.attention(x, x, x, src_mask)))
        return self.norm2(x + self.dropout2(self.ffn(x)))


class _DecoderLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attention, self.cross_attention = TutorialAttention(d_model, n_heads), TutorialAttention(d_model, n_heads)
        self.ffn = _FeedForward(d_model, d_ff, dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3))
        self.dropouts = nn.ModuleList(nn.Dropout(dropout) for _ in range(3))

    def forward(self, x: Tensor, memory: Tensor, tgt_mask: Tensor, src_mask: Tensor) -> Tensor:
        x = self.norms[0](x + self.dropouts[0](self.self_attention(x, x, x, tgt_mask)))
        x = self.norms[1](x + self.dropouts[1](self.cross_attention(x, memory, memory, src_mask)))
        return self.norms[2](x + self.dropouts[2](self.ffn(x)))


class _Embeddings(nn.Module):
    """Token embedding plus a sinusoidal table; the tutorial does not scale by sqrt(D)."""

    def __init__(self, vocab: int, d_model: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.tok(x) + self.table[: x.size(1)])


class TutorialTransformer(nn.Module):
    """The tutorial's encoder-decoder, with its masks built from the padding id each forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.pad_id = c.pad_id
        self.src_emb = _Embeddings(c.src_vocab_size, c.d_model, c.max_len, c.dropout)
        self.tgt_emb = _Embeddings(c.tgt_vocab_size, c.d_model, c.max_len, c.dropout)
        self.encoder = nn.ModuleList(_EncoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout) for _ in range(c.n_encoder_layers))
        self.decoder = nn.ModuleList(_DecoderLayer(c.d_model, c.n_heads, c.d_ff, c.dropout) for _ in range(c.n_decoder_layers))
        self.linear = nn.Linear(c.d_model, c.tgt_vocab_size)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        src_mask = (src != self.pad_id)[:, None, None, :]  # (B, 1, 1, S)
        T = tgt.size(1)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=tgt.device))  # (T, T)
        tgt_mask = (tgt != self.pad_id)[:, None, :, None] & causal  # (B, 1, T, T), the tutorial's query-padding form
        x = self.src_emb(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        y = self.tgt_emb(tgt)
        for layer in self.decoder:
            y = layer(y, x, tgt_mask, src_mask)
        return self.linear(y)  # (B, T, V)


class TorchTransformer(nn.Module):
    """``torch.nn.Transformer`` (post-LN unless ``config.norm_first``, batch_first) between the same kind of embeddings and output layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.pad_id, self.scale = c.pad_id, math.sqrt(c.d_model)
        self.embed = nn.Embedding(c.src_vocab_size, c.d_model)
        self.register_buffer("table", sinusoidal_table(c.max_len, c.d_model), persistent=False)
        self.dropout = nn.Dropout(c.dropout)
        self.transformer = nn.Transformer(
            d_model=c.d_model, nhead=c.n_heads, num_encoder_layers=c.n_encoder_layers,
            num_decoder_layers=c.n_decoder_layers, dim_feedforward=c.d_ff, dropout=c.dropout, batch_first=True, norm_first=c.norm_first,
        )
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size, bias=False)
        self.generator.weight = self.embed.weight

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        src_pad, tgt_pad = src == self.pad_id, tgt == self.pad_id  # True = padding (PyTorch's convention)
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # True = future: masked
        x = self.dropout(self.embed(src) * self.scale + self.table[: src.size(1)])
        y = self.dropout(self.embed(tgt) * self.scale + self.table[: tgt.size(1)])
        out = self.transformer(
            x, y, tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad, tgt_is_causal=True,
        )
        return self.generator(out)


def fixed_batches(n_examples: int, batch_size: int, *, seed: int) -> list[list[int]]:
    """The tutorial's batching: shuffled examples, ``batch_size`` sentences each, whatever their lengths."""
    order = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i : i + batch_size] for i in range(0, n_examples, batch_size)]


def forward_flops(config: ModelConfig, src_lengths: list[int], tgt_lengths: list[int]) -> float:
    """Matmul FLOPs of one teacher-forced forward pass over real (unpadded) tokens.

    2 FLOPs per multiply-add. Per sentence with S source and T target positions (EOS/BOS included):
    encoder layers 2S(4D^2 + 2DF) + 4S^2 D; decoder layers 2T(4D^2 + 2DF) + 2(2TD^2 + 2SD^2) + 4T^2 D
    + 4TSD; output layer 2TDV. Training is counted as 3x the forward pass (backward ~ 2x).
    """
    D, F_, V = config.d_model, config.d_ff, config.tgt_vocab_size
    total = 0.0
    for S, T in zip(src_lengths, tgt_lengths):
        enc = 2 * S * (4 * D * D + 2 * D * F_) + 4 * S * S * D
        dec = 2 * T * (4 * D * D + 2 * D * F_) + 2 * (2 * T * D * D + 2 * S * D * D) + 4 * T * T * D + 4 * T * S * D
        total += config.n_encoder_layers * enc + config.n_decoder_layers * dec + 2 * T * D * V
    return total


def matmul_peak(seconds: float = 2.0, size: int = 2048) -> float:
    """Best fp32 matmul FLOP/s of this process (same threads as the benchmarks) over ``seconds``,
    with either kernel qkv multiplies with: MKL's ``torch.mm`` and oneDNN's linear (``qkv.model.kernels``;
    on an AMD CPU MKL's AVX2 path measures about half of oneDNN's), half the time each."""
    import time

    from qkv.model import kernels

    a, b = torch.randn(size, size), torch.randn(size, size)
    products = [lambda: torch.mm(a, b)]
    if kernels.onednn_available():
        products.append(lambda: kernels.linear(a, b))  # a b^T, no gradient: oneDNN's; the same FLOPs
    best = 0.0
    with torch.no_grad():
        for product in products:
            product()  # warm-up
            end = time.perf_counter() + seconds / len(products)
            while time.perf_counter() < end:
                start = time.perf_counter()
                product()
                best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best
