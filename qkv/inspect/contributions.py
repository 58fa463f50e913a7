"""What each input actually contributed: attention weights, value-norm contributions and ALTI+.

Dimension legend used in shape comments:
    B batch, S source length (EOS included), T target length (BOS + target), D d_model, H heads,
    d_v value size per head, m queries and n keys of one attention block, K parts of a block's output.

An attention weight alpha_ij says how much of query i's softmax goes to key j. What reaches the output
is alpha_ij f(x_j), with f(x) = (x W_V + b_V) W_O: a key with a large weight but a small transformed
value contributes little (Kobayashi et al., 2020). Three readings, from one teacher-forced pass of the
model that translates (its own modules, weights and masks; the walk below calls its layers):

- ``weights``: alpha per decoder layer and head, what ``decode_hidden`` returns;
- ``norms``: ||sum_h alpha^h_ij f^h(x_j)||, the norm of what source token j adds to target position i
  in a layer's cross-attention (Kobayashi et al.'s norm, heads summed: the block's real output mixes
  them); ``head_norms`` the same for each head alone, alpha^h_ij ||f^h(x_j)||;
- ALTI (Ferrando et al., 2022, "Measuring the Mixing of Contextual Information in the Transformer"):
  each attention block's output y_i, residual and layer norm included, is written exactly as one
  vector per input plus a bias vector (``decompose``); input k's share is how close its vector is
  to y_i, max(0, ||y_i||_1 - ||y_i - v_ik||_1), normalised over k. The feed-forward network and the
  layer norm after it work on each position alone and move nothing between tokens, so the shares
  of the attention blocks are rolled out (matrix products) through the encoder, and through the
  decoder with ALTI+'s split (Ferrando et al., 2022, "Towards Opening the Black Box of Neural
  Machine Translation"): every decoder position's output is shared between the source tokens and
  the target prefix (``alti``, rows summing to 1), and ``source_share`` is the source's part.

Where to read them for word alignment: the literature reads cross-attention where a target word is
the decoder's *input* (``row="input"``, Shift-Att, Chen et al., 2020), not where it is predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.errors import QkvError
from qkv.model.attention import MultiHeadAttention
from qkv.model.transformer import Sublayer, Transformer


@dataclass
class Block:
    """One attention block (attention, residual and layer norm) written as a sum.

    ``parts`` (B, m, K, D): one vector per input: the n keys (for self-attention the residual is
    added to the query's own key), then, in cross-attention, the residual (K = n + 1);
    ``bias`` (B, m, D): what comes from no input (the output bias, and the layer norm's shift and
    centring of it); ``parts.sum(2) + bias`` equals ``output`` (B, m, D), the block's real output.
    ``weights`` (B, H, m, n) are the block's attention weights and ``mixed`` (B, m, n, D) the vectors
    sum_h alpha^h_ij f^h(x_j) (no residual, no layer norm), ``head_norms`` (B, H, m, n) their per-head norms.
    """

    parts: Tensor
    bias: Tensor
    output: Tensor
    weights: Tensor
    mixed: Tensor
    head_norms: Tensor


def decompose(
    sublayer: Sublayer, attention: MultiHeadAttention, x: Tensor, memory: Tensor | None = None, *,
    key_mask: Tensor | None = None, causal: bool = False, norms: bool = True,
) -> Block:
    """Run one attention block of the model and write its output as a sum of one vector per input.

    x: (B, m, D) the block's input (the residual stream); memory: (B, n, D) for cross-attention, None
    for self-attention; key_mask: (B, n) True for real keys. The output and weights are the real
    module's (``sublayer`` calling ``attention``), computed once; the parts are built from the same
    weights, so in float64 they sum back to the output to rounding. With ``norms`` False, ``head_norms``
    is left empty and ``mixed`` of a self-attention block holds its parts (the residual added in place,
    no copy): what ALTI alone needs (``contributions(norms=False)``).
    """
    if attention.training or sublayer.training:
        raise QkvError("contributions are read from a model in eval mode (dropout off): call model.eval()")
    output, weights = sublayer(
        x, lambda h: attention(h, memory, key_mask=key_mask, causal=causal, need_weights=True)
    )  # (B, m, D), (B, H, m, n)
    query = sublayer.norm(x) if sublayer.norm_first else x
    keys = query if memory is None else memory  # pre-LN: self-attention's keys are the normed input too
    B, n, D = keys.shape
    H, d_k, d_v = attention.n_heads, attention.d_k, attention.d_v
    W, b = attention.in_proj.weight, attention.in_proj.bias
    v = F.linear(keys, W[2 * H * d_k :], None if b is None else b[2 * H * d_k :])  # (B, n, H*d_v)
    v = v.view(B, n, H, d_v).transpose(1, 2)  # (B, n, H*d_v) -> (B, H, n, d_v)
    W_o = attention.out_proj.weight.view(D, H, d_v).permute(1, 2, 0)  # (D, H*d_v) -> (H, d_v, D)
    f = torch.einsum("bhnv,hvd->bhnd", v, W_o)  # (B, H, n, D): f^h(x_j), head h's share of W^O
    weights = weights.to(f.dtype)
    mixed = torch.einsum("bhmn,bhnd->bmnd", weights, f)  # (B, m, n, D): sum_h alpha^h_ij f^h(x_j)
    head_norms = weights * f.norm(dim=-1)[:, :, None, :] if norms else weights.new_zeros(0)  # (B, H, m, n): alpha >= 0
    b_o = attention.out_proj.bias
    b_o = torch.zeros(D, dtype=f.dtype, device=f.device) if b_o is None else b_o
    if memory is None:  # self-attention: the residual x_i belongs to key i
        if mixed.size(1) != mixed.size(2):
            raise QkvError("self-attention with a cache has no decomposition: run the whole sequence")
        parts = mixed.clone() if norms else mixed  # (B, m, m, D); without norms nothing else reads mixed: no copy
        parts.diagonal(dim1=1, dim2=2).add_(x.to(parts.dtype).transpose(1, 2))  # x_i on the diagonal: (B, D, m) view
    else:
        parts = torch.cat([mixed, x[:, :, None, :]], dim=2)  # (B, m, n + 1, D): the residual last
    bias = b_o.expand_as(x)
    if not sublayer.norm_first:  # post-LN: LayerNorm(sum), and centring is linear; one sigma per position
        norm = sublayer.norm
        total = parts.sum(dim=2) + bias  # (B, m, D): the layer norm's input, x + attention(x)
        sigma = (total.var(dim=-1, unbiased=False, keepdim=True) + norm.eps).sqrt()  # (B, m, 1)
        gamma = norm.weight if norm.weight is not None else 1.0
        beta = norm.bias if norm.bias is not None else 0.0
        parts = gamma * (parts - parts.mean(dim=-1, keepdim=True)) / sigma[:, :, None]
        bias = gamma * (bias - bias.mean(dim=-1, keepdim=True)) / sigma + beta
    return Block(parts, bias, output, weights, mixed, head_norms)


def alti_shares(parts: Tensor) -> Tensor:
    """(B, m, K, D) -> (B, m, K): ALTI's share of each part in the output it sums to (bias left out,
    as in the method's code): max(0, ||y||_1 - ||y - part||_1), normalised over the K parts."""
    B, m, K, D = parts.shape
    y = parts.sum(dim=2).reshape(B * m, 1, D)
    distance = torch.cdist(y, parts.reshape(B * m, K, D), p=1)  # (B*m, 1, K): ||y - part||_1, one pass, no copies
    norm = torch.cdist(y, y.new_zeros(1, 1, D).expand(B * m, 1, D), p=1)  # (B*m, 1, 1): ||y||_1, summed alike
    score = (norm - distance).clamp(min=0).view(B, m, K)  # a zero part (padding) scores exactly 0
    return score / score.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(score.dtype).tiny)


@dataclass
class Contributions:
    """One teacher-forced pass's readings, per decoder layer (lists of length n_decoder_layers).

    weights (B, H, T, S) cross-attention weights; head_norms (B, H, T, S) alpha^h_ij ||f^h(x_j)||;
    norms (B, T, S) ||sum_h alpha^h_ij f^h(x_j)||; alti (B, T, S + T): after each decoder layer, the
    share of every source token (first S columns) and target input position (last T) in each target
    position's representation, rows summing to 1; encoder_alti (B, S, S) the same through the encoder
    (memory rows over source tokens). Row t of the target is the decoder position whose input is
    token t of BOS + target and which predicts token t of target + EOS.
    """

    weights: list[Tensor]
    head_norms: list[Tensor]
    norms: list[Tensor]
    alti: list[Tensor]
    encoder_alti: Tensor
    memory: Tensor
    hidden: Tensor

    @property
    def source_share(self) -> Tensor:
        """(B, T): how much of each prediction comes from the source (ALTI+, after the last layer)."""
        S = self.encoder_alti.size(-1)
        return self.alti[-1][..., :S].sum(-1)


@torch.inference_mode()
def contributions(model: Transformer, src: Tensor, tgt_in: Tensor, *, alti: bool = True, norms: bool = True) -> Contributions:
    """Every reading for a padded batch: src (B, S) ids ending in EOS, tgt_in (B, T) = BOS + target.

    Runs the model's own layers one block at a time, in the model's dtype (float64 for the exactness
    tests: ``model.double()``); ``hidden`` (B, T, D) and ``memory`` (B, S, D) are the decoder's and
    encoder's real outputs, as ``encode`` and ``decode_hidden`` give them. With ``alti`` False only
    the cross-attention blocks are decomposed (weights, head norms and norms; ``alti`` and
    ``encoder_alti`` stay empty): what ``qkv align --method norm`` reads, without ALTI's rollout. With
    ``norms`` False, ALTI without the value norms (``head_norms`` and ``norms`` stay empty lists): what
    the trust pass reads, for less work.
    """
    if model.training:
        raise QkvError("contributions are read from a model in eval mode (dropout off): call model.eval()")
    if not torch.is_floating_point(model.src_embed.weight) or not isinstance(model.generator.weight, Tensor):
        raise QkvError("contributions need the model's floating-point weights (not an --int8 copy)")
    src_mask = src != model.config.pad_id  # (B, S)
    B, S = src.shape
    T = tgt_in.size(1)
    if not alti:
        return _cross_only(model, src, tgt_in)
    x = model._embed(model.src_embed, src)  # (B, S, D)
    rollout = torch.eye(S, dtype=x.dtype, device=x.device).expand(B, S, S)  # (B, S, S)
    for layer in model.encoder_layers:
        block = decompose(layer.attn_sublayer, layer.self_attn, x, key_mask=src_mask, norms=False)
        rollout = alti_shares(block.parts) @ rollout  # (B, S, S) @ (B, S, S)
        x, _ = layer.ff_sublayer(block.output, lambda h, layer=layer: (layer.feed_forward(h), None))
    memory = model.encoder_norm(x)  # (B, S, D)
    encoder_alti = rollout
    from_source = torch.cat([rollout, rollout.new_zeros(B, S, T)], dim=-1)  # (B, S, S + T)
    alti = torch.cat([rollout.new_zeros(B, T, S), torch.eye(T, dtype=x.dtype, device=x.device).expand(B, T, T)], dim=-1)
    y = model._embed(model.tgt_embed, tgt_in)  # (B, T, D)
    weights, head_norms, value_norms, altis = [], [], [], []
    for layer in model.decoder_layers:
        block = decompose(layer.self_sublayer, layer.self_attn, y, causal=True, norms=False)
        alti = alti_shares(block.parts) @ alti  # (B, T, T) @ (B, T, S + T)
        cross = decompose(layer.cross_sublayer, layer.cross_attn, block.output, memory, key_mask=src_mask, norms=norms)
        shares = alti_shares(cross.parts)  # (B, T, S + 1): the source tokens, then the residual
        alti = shares[..., :S] @ from_source + shares[..., S:] * alti  # (B, T, S + T)
        y, _ = layer.ff_sublayer(cross.output, lambda h, layer=layer: (layer.feed_forward(h), None))
        weights.append(cross.weights)
        if norms:
            head_norms.append(cross.head_norms)
            value_norms.append(cross.mixed.norm(dim=-1))  # (B, T, S)
        altis.append(alti)
    return Contributions(weights, head_norms, value_norms, altis, encoder_alti, memory, model.decoder_norm(y))


def _cross_only(model: Transformer, src: Tensor, tgt_in: Tensor) -> Contributions:
    """``contributions(alti=False)``: the model's own passes, with only the cross blocks decomposed."""
    memory, src_mask, _ = model.encode(src)  # (B, S, D), (B, S)
    y = model._embed(model.tgt_embed, tgt_in)  # (B, T, D)
    weights, head_norms, norms = [], [], []
    for layer in model.decoder_layers:
        y, _ = layer.self_sublayer(y, lambda h, layer=layer: layer.self_attn(h, causal=True))
        cross = decompose(layer.cross_sublayer, layer.cross_attn, y, memory, key_mask=src_mask)
        y, _ = layer.ff_sublayer(cross.output, lambda h, layer=layer: (layer.feed_forward(h), None))
        weights.append(cross.weights)
        head_norms.append(cross.head_norms)
        norms.append(cross.mixed.norm(dim=-1))  # (B, T, S)
    return Contributions(weights, head_norms, norms, [], memory.new_zeros(0), memory, model.decoder_norm(y))


def reading(found: Contributions, method: str, layer: int) -> Tensor:
    """(B, T, S): the source scores of ``method`` at decoder ``layer`` (a Python index):
    ``attention`` the head-mean weights, ``norm`` the value norms, ``alti`` ALTI+'s source columns."""
    if method == "attention":
        return found.weights[layer].mean(dim=1)
    if method == "norm":
        return found.norms[layer]
    if method == "alti":
        S = found.encoder_alti.size(-1)
        return found.alti[layer][..., :S]
    raise QkvError(f"unknown contribution method {method!r}: attention, norm or alti")
