"""Parity with Hugging Face's Marian (and Pegasus) in both directions: the same weights give the same logits."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkv.model.config import ModelConfig  # noqa: E402
from qkv.interop.convert import from_marian, to_marian, to_pegasus, with_position_layout  # noqa: E402
from qkv.infer.search import DecodeConfig, greedy_search  # noqa: E402
from qkv.model.transformer import Transformer  # noqa: E402

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


# ---- qkv -> Hugging Face ------------------------------------------------------------------------

BOS, EOS = 2, 3


def qkv_model(seed=0, **overrides):
    torch.manual_seed(seed)
    config = ModelConfig(
        src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2,
        n_decoder_layers=2, dropout=0.0, max_len=64, pad_id=PAD, output_bias=True, **overrides,
    )
    model = Transformer(config).eval()
    with torch.no_grad():  # large weights: peaked attention, so a wrong projection shows in the logits
        for param in model.parameters():
            param.normal_(0, 0.25 if param.dim() > 1 else 0.1)
    return model


def qkv_batch():
    src, tgt = batch()
    tgt[:, 0] = BOS  # qkv starts the target with BOS; the export makes it Marian's decoder start
    return src, tgt


def test_position_layout_change_is_exact():
    model = qkv_model(activation="gelu", norm_first=True)
    split = with_position_layout(model, "split")
    assert split.config.position_layout == "split"
    src, tgt = qkv_batch()
    with torch.no_grad():
        expected = model(src, tgt)
        torch.testing.assert_close(split(src, tgt), expected, atol=1e-5, rtol=0)
        back = with_position_layout(split, "interleaved")
        torch.testing.assert_close(back(src, tgt), expected, atol=1e-5, rtol=0)
        # Changing only the flag, without moving the weights, is a different model.
        relabelled = Transformer(model.config.replace(position_layout="split")).eval()
        relabelled.load_state_dict(model.state_dict())
        assert (relabelled(src, tgt) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("overrides", [dict(activation="silu"), dict(activation="relu", share_embeddings=False, position_layout="split",
                                                                    activation_dropout=0.1, attention_dropout=0.2)])
def test_to_marian_round_trip(overrides):
    ours = qkv_model(**overrides)
    hf = to_marian(ours, bos_id=BOS, eos_id=EOS)
    assert isinstance(hf, transformers.MarianMTModel)
    src, tgt = qkv_batch()
    with torch.no_grad():
        expected = ours(src, tgt)
        torch.testing.assert_close(marian_logits(hf, src, tgt), expected, atol=1e-5, rtol=0)
        back = from_marian(hf)  # qkv -> Marian -> qkv: split positions, the same function
        torch.testing.assert_close(back(src, tgt), expected, atol=1e-5, rtol=0)
    # the regularization travels both ways too (it acts in training only)
    assert (hf.config.activation_dropout, hf.config.attention_dropout) == (ours.config.activation_dropout, ours.config.attention_dropout)
    assert (back.config.activation_dropout, back.config.attention_dropout) == (ours.config.activation_dropout, ours.config.attention_dropout)


def test_marian_generate_matches_qkv_greedy():
    ours = qkv_model(activation="silu")
    with torch.no_grad():
        ours.generator.bias[EOS] = 1.0  # some outputs end before the length limit
    hf = to_marian(ours, bos_id=BOS, eos_id=EOS)
    src, _ = qkv_batch()
    src = src[:1, :6]  # one unpadded sentence: generate's max_new_tokens is per batch
    config = DecodeConfig(beam_size=1)
    expected = greedy_search(ours, src, bos_id=BOS, eos_id=EOS, config=config)[0]
    limit = int(config.max_len_a * src.size(1) + config.max_len_b)
    with torch.no_grad():
        out = hf.generate(input_ids=src, attention_mask=torch.ones_like(src), max_new_tokens=limit, num_beams=1, do_sample=False)
    tokens = out[0, 1:].tolist()  # without the decoder start (BOS)
    assert tokens[: len(expected)] == expected
    assert tokens[len(expected) :] in ([], [EOS])


def test_to_pegasus_for_pre_ln():
    ours = qkv_model(norm_first=True, activation="gelu")
    with pytest.raises(ValueError, match="pre-LN"):
        to_marian(ours, bos_id=BOS, eos_id=EOS)
    hf = to_pegasus(ours, bos_id=BOS, eos_id=EOS)
    src, tgt = qkv_batch()
    with torch.no_grad():
        torch.testing.assert_close(marian_logits(hf, src, tgt), ours(src, tgt), atol=1e-5, rtol=0)
