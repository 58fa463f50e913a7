"""The Transformer around the mechanism: config, positions, causality, padding, cache."""

import math

import pytest
import torch

from qkv.model.config import ConfigError, ModelConfig, model_preset
from qkv.model.transformer import Transformer, sinusoidal_table

V = 23
PAD = 0


def make_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, **overrides)
    return Transformer(config).double().eval()


def test_config_validation_and_unknown_keys():
    with pytest.raises(ConfigError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="dropout"):
        ModelConfig(dropout=1.0)
    with pytest.raises(ConfigError, match="did you mean 'n_heads'"):
        ModelConfig.from_dict({"n_head": 8})
    with pytest.raises(ConfigError, match="did you mean 'base'"):
        model_preset("bsae")
    assert ModelConfig(d_model=30, n_heads=4, d_k=5, d_v=9).head_dim_v == 9
    config = model_preset("base")
    assert (config.d_model, config.n_heads, config.d_ff, config.n_encoder_layers) == (512, 8, 2048, 6)
    assert not config.norm_first  # the paper's post-LN is the default
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_sinusoidal_table_matches_the_formula():
    table = sinusoidal_table(50, 16)
    pos, i = 7, 3
    assert table[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)
    split = sinusoidal_table(50, 16, "split")
    torch.testing.assert_close(split[:, :8], table[:, 0::2])
    torch.testing.assert_close(split[:, 8:], table[:, 1::2])


def test_positions_are_a_buffer_not_a_parameter_and_not_saved():
    model = make_model()
    assert "positions.table" not in model.state_dict()
    assert all("positions" not in name for name, _ in model.named_parameters())
    assert "positions.table" in dict(model.named_buffers())


@pytest.mark.parametrize("norm_first", [False, True])
def test_changing_a_future_target_token_leaves_earlier_logits_unchanged(norm_first):
    model = make_model(norm_first=norm_first)
    src = torch.randint(1, V, (2, 6))
    tgt = torch.randint(1, V, (2, 8))
    t = 4
    changed = tgt.clone()
    changed[:, t + 1] = (tgt[:, t + 1] % (V - 1)) + 1
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    assert torch.equal(before[:, : t + 1], after[:, : t + 1])
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :])


def test_changing_padded_source_tokens_changes_nothing():
    # Untied, so the padding row of the source embedding is not also an output-projection row.
    model = make_model(share_embeddings=False, tie_output=False)
    src = torch.randint(1, V, (2, 7))
    src[0, 4:] = PAD
    tgt = torch.randint(1, V, (2, 5))
    with torch.no_grad():
        reference = model(src, tgt)
        # Replace the padding embedding itself: padded keys must not matter at all.
        model.src_embed.weight[PAD].normal_()
        after_pad_change = model(src, tgt)
    torch.testing.assert_close(after_pad_change[0], reference[0], atol=1e-12, rtol=0)
    # A shorter batch (no padding) gives the same result for the padded sentence.
    with torch.no_grad():
        alone = model(src[:1, :4], tgt[:1])
    torch.testing.assert_close(alone[0], reference[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("norm_first,learned", [(False, False), (True, False), (True, True)])
def test_incremental_decoding_with_cache_equals_full_forward(norm_first, learned):
    model = make_model(norm_first=norm_first, learned_positions=learned)
    src = torch.randint(1, V, (3, 6))
    src[1, 3:] = PAD
    tgt = torch.randint(1, V, (3, 7))
    with torch.no_grad():
        full = model(src, tgt)
        memory, src_mask, _ = model.encode(src)
        state = model.new_state()
        for t in range(tgt.size(1)):
            logits, _ = model.decode(tgt[:, t : t + 1], memory, src_mask, state=state)
            torch.testing.assert_close(logits[:, 0], full[:, t], atol=1e-10, rtol=0)
    assert state.position == tgt.size(1)


def test_state_reorder_selects_batch_rows():
    model = make_model()
    src = torch.randint(1, V, (3, 5))
    tgt = torch.randint(1, V, (3, 4))
    with torch.no_grad():
        memory, src_mask, _ = model.encode(src)
        state = model.new_state()
        model.decode(tgt[:, :3], memory, src_mask, state=state)
        index = torch.tensor([2, 0])
        state.reorder(index)
        step, _ = model.decode(tgt[index, 3:], memory[index], src_mask[index], state=state)
        full = model(src[index], tgt[index])
    torch.testing.assert_close(step[:, 0], full[:, 3], atol=1e-10, rtol=0)


def test_attention_weights_are_returned_per_layer_and_kind():
    model = make_model()
    src = torch.randint(1, V, (2, 6))
    src[1, 4:] = PAD
    tgt = torch.randint(1, V, (2, 5))
    with torch.no_grad():
        memory, src_mask, enc = model.encode(src, need_weights=True)
        _, weights = model.decode(tgt, memory, src_mask, need_weights=True)
    H = model.config.n_heads
    assert [w.shape for w in enc] == [(2, H, 6, 6)] * 2
    assert [w.shape for w in weights.cross] == [(2, H, 5, 6)] * 2
    assert all((w[1, :, :, 4:] == 0).all() for w in weights.cross)  # padded source keys
    assert all((w.triu(diagonal=1) == 0).all() for w in weights.decoder_self)  # future positions


def test_shared_and_tied_embeddings():
    model = make_model()
    assert model.tgt_embed is model.src_embed
    assert model.generator.weight is model.src_embed.weight
    untied = make_model(share_embeddings=False, tie_output=False)
    assert untied.tgt_embed is not untied.src_embed
    assert untied.generator.weight is not untied.tgt_embed.weight


def test_d_k_different_from_d_v_model_runs_and_trains():
    model = make_model(d_k=6, d_v=10)
    model.train()
    src, tgt = torch.randint(1, V, (2, 5)), torch.randint(1, V, (2, 4))
    loss = model(src, tgt).logsumexp(-1).mean()
    loss.backward()
    assert model.encoder_layers[0].self_attn.in_proj.weight.shape == (2 * (6 + 6 + 10), 32)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_module_has_no_device_argument_and_moves_with_to():
    model = make_model().float()
    assert model.positions.table.dtype == torch.float32
    assert model.positions.table.device == model.src_embed.weight.device


def test_learned_positions_are_a_trained_saved_parameter(tmp_path):
    from qkv.io import checkpoint
    from qkv.interop.convert import to_huggingface
    from qkv.data.tokenizer import Tokenizer

    model = make_model(learned_positions=True).float().train()
    table = model.positions.table
    assert isinstance(table, torch.nn.Parameter) and table.shape == (model.config.max_len, model.config.d_model)
    src, tgt = torch.randint(1, V, (2, 5)), torch.randint(1, V, (2, 4))
    model(src, tgt).sum().backward()
    assert table.grad[:4].abs().sum() > 0 and table.grad[5:].abs().sum() == 0  # the positions used, only
    # moving position 0 changes the output: the table is read
    with torch.no_grad():
        before = model.eval()(src, tgt)
        table[0] += 1.0
        assert not torch.allclose(before, model(src, tgt))
    sentences = ["a b c d e f g h", "b c d e f g h a"] * 10
    tok = Tokenizer.train(sentences, vocab_size=V, path=tmp_path / "spm.model")
    saved = checkpoint.save(tmp_path / "ckpt", model, tok, configs={})
    loaded = checkpoint.load(saved).model
    torch.testing.assert_close(loaded.positions.table, table.detach())
    with pytest.raises(ValueError, match="learned its positions"):
        to_huggingface(model, bos_id=1, eos_id=2)


def test_activation_dropout_drops_the_feed_forward_activations_in_training_only():
    from qkv.model.dropout import use_fast_dropout
    from qkv.model.transformer import FeedForward

    with pytest.raises(ConfigError, match="activation_dropout must be in"):
        ModelConfig(activation_dropout=1.0)
    torch.manual_seed(0)
    ff = FeedForward(8, 64, "relu", dropout=0.5)
    seen = []
    ff.linear2.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(4, 5, 8)
    relu = torch.relu(ff.linear1(x)).detach()
    ff.train()(x)
    kept = seen[-1] != 0
    assert torch.equal(seen[-1][kept], 2 * relu[kept])  # the kept activations scaled by 1 / (1 - p)
    alive = relu > 0
    dropped = (~kept & alive).sum() / alive.sum()
    assert 0.3 < dropped < 0.7  # about half of the 640 non-zero activations, here and not elsewhere
    ff.eval()(x)
    assert torch.equal(seen[-1], relu)
    assert isinstance(FeedForward(8, 64).dropout, torch.nn.Identity)  # 0: no operation at all
    # the model builds it from the config, and fast_dropout replaces it like every other dropout
    model = Transformer(model_preset("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, activation_dropout=0.1))
    layers = [*model.encoder_layers, *model.decoder_layers]
    assert all(layer.feed_forward.dropout.p == 0.1 for layer in layers)
    assert use_fast_dropout(model) == sum(1 for m in model.modules() if type(m).__name__ == "FastDropout")
    assert all(type(layer.feed_forward.dropout).__name__ == "FastDropout" for layer in layers)


def test_word_dropout_drops_whole_source_embeddings_in_training_only():
    with pytest.raises(ConfigError, match="word_dropout must be in"):
        ModelConfig(word_dropout=1.0)
    model = make_model(word_dropout=0.5)  # tiny: dropout 0, so the embedding layer's output is the embeddings plus positions
    src = torch.randint(1, V, (8, 40))
    plain = model._embed(model.src_embed, src)  # (B, S, D)
    positions = model.positions(torch.zeros_like(plain))
    model.train()
    torch.manual_seed(1)
    dropped_out = model._embed(model.src_embed, src, word_dropout=0.5)
    dropped = (dropped_out - positions).abs().amax(-1) == 0  # (B, S): the whole vector, or nothing of it
    kept = ~dropped
    torch.testing.assert_close(dropped_out[kept] - positions[kept], 2 * (plain[kept] - positions[kept]))  # scaled by 1 / (1 - p)
    assert 0.35 < dropped.double().mean() < 0.65  # about half of the 320 tokens
    torch.manual_seed(1)
    memory, _, _ = model.encode(src)  # the encoder drops them (the decoder's tokens never)
    assert not torch.allclose(memory, make_model().train().encode(src)[0])
    model.eval()
    torch.testing.assert_close(model.encode(src)[0], make_model().encode(src)[0], rtol=0, atol=0)  # never in translation
    torch.testing.assert_close(model._embed(model.tgt_embed, src), plain)


def test_fine_tuning_may_change_the_three_dropouts_and_nothing_else():
    from qkv.train.recipes import fine_tuning_model

    parent = model_preset("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD)
    child = fine_tuning_model(parent, {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.2})
    assert (child.dropout, child.attention_dropout, child.activation_dropout, child.d_model) == (0.1, 0.1, 0.2, parent.d_model)
    with pytest.raises(ConfigError, match="--model d_ff cannot change"):
        fine_tuning_model(parent, {"activation_dropout": 0.2, "d_ff": 128})
