"""Parity with Hugging Face's Marian: the same weights give the same logits."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkv.convert import from_marian  # noqa: E402

PAD = 5


def marian(activation="relu", scale_embedding=True, seed=0):
    torch.manual_seed(seed)
    config = transformers.MarianConfig(
        vocab_size=40,
        decoder_vocab_size=40,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        activation_function=activation,
        scale_embedding=scale_embedding,
        max_position_embeddings=64,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        eos_token_id=0,
        dropout=0.1,
    )
    model = transformers.MarianMTModel(config).eval()
    # Marian's own init (std 0.02) makes attention nearly uniform, which would hide a wrong query or
    # key projection; larger random weights give peaked attention that the comparison can see.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_positions" in name:
                continue  # the fixed sinusoidal table
            if "layer_norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.25 if param.dim() > 1 else 0.1)
        model.final_logits_bias.normal_()
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(6, 40, (3, 9), generator=g)
    src[1, 6:] = PAD
    src[2, 3:] = PAD
    tgt = torch.randint(6, 40, (3, 7), generator=g)
    tgt[:, 0] = PAD  # Marian starts decoding from the pad token
    return src, tgt


def marian_logits(model, src, tgt):
    with torch.no_grad():
        return model(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt).logits


@pytest.mark.parametrize("activation,scale", [("relu", True), ("swish", True), ("gelu", False)])
def test_imported_marian_gives_the_same_logits(activation, scale):
    hf = marian(activation, scale)
    ours = from_marian(hf)
    assert ours.config.position_layout == "split" and ours.config.output_bias
    src, tgt = batch()
    with torch.no_grad():
        logits = ours(src, tgt)
    expected = marian_logits(hf, src, tgt)
    # Padded query positions of the encoder are never read, so every decoder logit must match.
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_imported_marian_cached_decoding_matches():
    hf = marian()
    ours = from_marian(hf)
    src, tgt = batch()
    expected = marian_logits(hf, src, tgt)
    with torch.no_grad():
        memory, src_mask, _ = ours.encode(src)
        state = ours.new_state()
        steps = [ours.decode(tgt[:, t : t + 1], memory, src_mask, state=state)[0] for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "name",
    ["model.encoder.layers.1.self_attn.k_proj.weight", "model.decoder.layers.0.encoder_attn.v_proj.bias", "final_logits_bias"],
)
def test_parity_fails_when_one_marian_weight_is_perturbed(name):
    hf = marian()
    ours = from_marian(hf)
    with torch.no_grad():
        dict(hf.named_parameters(), **dict(hf.named_buffers()))[name].view(-1)[0] += 0.05
    src, tgt = batch()
    with torch.no_grad():
        diff = (ours(src, tgt) - marian_logits(hf, src, tgt)).abs().max()
    assert diff > 1e-4
