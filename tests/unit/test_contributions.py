"""Contributions (qkv.inspect.contributions): every attention block's decomposition sums back to the
block's real output, on every layer kind, and the readings mean what they say."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect.contributions import alti_shares, contributions, decompose, reading
from qkv.model.config import ModelConfig
from qkv.model.transformer import Transformer

KINDS = {
    "post-LN, sinusoidal": {},
    "pre-LN, learned positions": {"norm_first": True, "learned_positions": True},
    "post-LN, d_k != d_v, no output bias": {"d_k": 6, "d_v": 10, "output_bias": False},
    "pre-LN, gelu, split sinusoids": {"norm_first": True, "activation": "gelu", "position_layout": "split"},
}


def model_of(kind: str) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2,
                         n_decoder_layers=3, dropout=0.0, max_len=32, **KINDS[kind])
    model = Transformer(config).double().eval()
    with torch.no_grad():  # layer norms away from their initial 1 and 0, so a missing gamma or beta shows
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def batch(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, pad, pad]])  # (B, S), EOS = 2, padded
    tgt = torch.tensor([[1, 11, 12, 13], [1, 14, pad, pad]])  # (B, T), BOS = 1
    return src, tgt


@pytest.mark.parametrize("kind", KINDS)
def test_every_block_sums_back_to_its_real_output(kind):
    model = model_of(kind)
    src, tgt = batch(model.config.pad_id)
    src_mask = src != model.config.pad_id
    x = model._embed(model.src_embed, src)
    for layer in model.encoder_layers:
        block = decompose(layer.attn_sublayer, layer.self_attn, x, key_mask=src_mask)
        real, _ = layer(x, src_mask)  # the model's own layer, for the next block's input
        torch.testing.assert_close(block.parts.sum(2) + block.bias, block.output, atol=1e-10, rtol=0)
        x = real
    memory, _, _ = model.encode(src)
    y = model._embed(model.tgt_embed, tgt)
    for layer in model.decoder_layers:
        self_block = decompose(layer.self_sublayer, layer.self_attn, y, causal=True)
        torch.testing.assert_close(self_block.parts.sum(2) + self_block.bias, self_block.output, atol=1e-10, rtol=0)
        cross = decompose(layer.cross_sublayer, layer.cross_attn, self_block.output, memory, key_mask=src_mask)
        torch.testing.assert_close(cross.parts.sum(2) + cross.bias, cross.output, atol=1e-10, rtol=0)
        y, _, _ = layer(y, memory, src_mask)
    found = contributions(model, src, tgt)
    hidden, _ = model.decode_hidden(tgt, memory, src_mask)
    torch.testing.assert_close(found.memory, memory, atol=1e-12, rtol=0)  # the walk is the model's own pass
    torch.testing.assert_close(found.hidden, hidden, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["post-LN, sinusoidal", "pre-LN, learned positions"])
def test_a_wrong_decomposition_does_not_sum_back(kind):
    """The check above can fail: leaving out the residual or the layer norm's shift breaks the sum."""
    model = model_of(kind)
    src, _ = batch(model.config.pad_id)
    layer = model.encoder_layers[0]
    block = decompose(layer.attn_sublayer, layer.self_attn, model._embed(model.src_embed, src), key_mask=src != 0)
    assert (block.mixed.sum(2) + block.bias - block.output).abs().max() > 1e-3  # without the residual


@pytest.mark.parametrize("kind", KINDS)
def test_shares_are_distributions_and_padding_and_the_future_get_none(kind):
    model = model_of(kind)
    src, tgt = batch(model.config.pad_id)
    found = contributions(model, src, tgt)
    S, T = src.size(1), tgt.size(1)
    for alti in [found.encoder_alti, *found.alti]:
        torch.testing.assert_close(alti.sum(-1), torch.ones(alti.shape[:-1], dtype=alti.dtype))
        assert (alti >= 0).all()
    assert found.encoder_alti[1, :3, 3:].abs().max() == 0  # padded source tokens contribute nothing to real ones
    for alti in found.alti:
        assert alti[1, :, 3:S].abs().max() == 0
        future = torch.ones(T, T, dtype=torch.bool).triu(1)  # target position t never uses a later input
        assert alti[0, :, S:][future].abs().max() == 0
        assert found.norms[0][1, :, 3:].abs().max() == 0
    assert ((found.source_share > 0) & (found.source_share < 1)).all()


def test_value_norms_are_the_norms_of_what_each_key_adds():
    """Kobayashi et al.'s reading by hand for one head, query and key: alpha * ||(x W_V + b_V) W_O^h||."""
    model = model_of("post-LN, sinusoidal")
    src, tgt = batch(model.config.pad_id)
    found = contributions(model, src, tgt)
    attn, H, d = model.decoder_layers[1].cross_attn, 4, 8
    with torch.inference_mode():
        check_head_norm(found, attn, H, d)
    assert reading(found, "norm", 1).shape == reading(found, "attention", 1).shape == reading(found, "alti", 1).shape


def check_head_norm(found, attn, H: int, d: int) -> None:
    v_rows = attn.in_proj.weight[2 * H * d :][d : 2 * d], attn.in_proj.bias[2 * H * d :][d : 2 * d]  # head 1
    value = found.memory[0, 2] @ v_rows[0].T + v_rows[1]  # (d_v,)
    f = attn.out_proj.weight[:, d : 2 * d] @ value  # (D,)
    alpha = found.weights[1][0, 1, 2, 2]
    torch.testing.assert_close(found.head_norms[1][0, 1, 2, 2], alpha * f.norm())


def test_alti_shares_on_hand_made_vectors():
    parts = torch.tensor([[[[1.0, 0.0], [0.0, 0.0], [3.0, 0.0]]]])  # (1, 1, 3, 2): y = (4, 0)
    shares = alti_shares(parts)[0, 0]
    # ||y||_1 = 4; distances 3, 4, 1 -> scores 1, 0, 3 -> shares 1/4, 0, 3/4
    torch.testing.assert_close(shares, torch.tensor([0.25, 0.0, 0.75]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_cross_only_pass_reads_what_the_full_pass_reads(kind):
    """contributions(alti=False), what `qkv align --method norm` runs: the model's own passes with only the
    cross blocks decomposed give the full pass's weights, head norms, norms and outputs, and no ALTI."""
    model = model_of(kind)
    src, tgt = batch(model.config.pad_id)
    full, light = contributions(model, src, tgt), contributions(model, src, tgt, alti=False)
    for name in ("weights", "head_norms", "norms"):
        for a, b in zip(getattr(full, name), getattr(light, name), strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    torch.testing.assert_close(full.hidden, light.hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(full.memory, light.memory, atol=1e-10, rtol=0)
    assert light.alti == [] and light.encoder_alti.numel() == 0
