"""The training speed-ups: the fused, chunked output projection + loss against the plain computation
(values and gradients), the allocator settings, and the trainer's flags that turn each off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.model import cpu, kernels
from qkv.model.config import ModelConfig
from qkv.train.loss import label_smoothed_loss, projected_label_smoothed_loss
from qkv.model.transformer import Transformer
from qkv.train.trainer import Trainer
from qkv.train.recipes import build_configs
from qkv.model.dropout import FastDropout, use_fast_dropout

PAD = 2

# float32: the chunked sums and the gradient computed from the softmax (not log_softmax's backward)
# round differently from the plain path; measured differences stay below 2e-6 relative.
FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}


def plain_loss(hidden, weight, bias, target, smoothing):
    """The plain computation, in the inputs' dtype: all logits, then F.cross_entropy."""
    logits = F.linear(hidden, weight, bias)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=PAD,
                           label_smoothing=smoothing, reduction="sum")


def inputs(dtype, *, bias: bool, B=3, T=11, D=8, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(PAD + 1, V, (B, T), generator=g)
    target[0, 6:], target[2, 2:] = PAD, PAD  # 6 + 11 + 2 = 19 real positions
    return hidden, weight, b, target


@pytest.mark.parametrize("dtype,tol", [(torch.float64, FLOAT64), (torch.float32, FLOAT32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 5, 0])  # 5 does not divide the 19 real positions; 0: the default (all at once here)
def test_fused_loss_and_its_gradients_equal_the_plain_computation(dtype, tol, bias, smoothing, chunk):
    hidden, weight, b, target = inputs(dtype, bias=bias)
    params = [x for x in (hidden, weight, b) if x is not None]
    expected = plain_loss(hidden, weight, b, target, smoothing)
    expected_grads = torch.autograd.grad(expected * 0.3, params)  # a scale, as the trainer's 1/tokens
    loss, n_tokens = projected_label_smoothed_loss(hidden, weight, b, target, pad_id=PAD, smoothing=smoothing, chunk=chunk)
    grads = torch.autograd.grad(loss * 0.3, params)
    assert loss.dtype == dtype and n_tokens.item() == int((target != PAD).sum()) == 19
    torch.testing.assert_close(loss, expected, **tol)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16_loss_is_the_float32_loss_to_bfloat16_rounding(bias):
    """bf16=True rounds the three products' operands and results to bfloat16 (8 bits of mantissa):
    the loss within 1e-4 and the gradients within 1% (relative norms) of float32's (measured: 2e-5, 0.3%),
    at the preset's width and vocabulary; and really in bfloat16 (not equal to float32)."""
    g = torch.Generator().manual_seed(1)
    B, T, D, V = 4, 50, 128, 8000
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(V, D, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(V, generator=g)).requires_grad_() if bias else None
    target = torch.randint(PAD + 1, V, (B, T), generator=g)
    target[1, 30:] = PAD
    params = [x for x in (hidden, weight, b) if x is not None]
    results = {}
    for bf16 in (False, True):
        loss, n_tokens = projected_label_smoothed_loss(hidden, weight, b, target, pad_id=PAD, smoothing=0.1, bf16=bf16)
        results[bf16] = (loss, torch.autograd.grad(loss, params))
    (want, want_grads), (got, got_grads) = results[False], results[True]
    assert got.dtype == torch.float32 and n_tokens.item() == 180 and got.item() != want.item()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
    for g_bf16, g_fp32 in zip(got_grads, want_grads):
        assert g_bf16.dtype == torch.float32
        assert 0 < ((g_bf16 - g_fp32).norm() / g_fp32.norm()).item() < 1e-2


def test_bf16_on_the_cpu_is_used_only_with_native_bfloat16(monkeypatch, tmp_path, dates_tsv):
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: True)
    assert trainer(tmp_path / "native", dates_tsv, bf16=True).loss_bf16
    assert not trainer(tmp_path / "default", dates_tsv).loss_bf16
    with pytest.warns(UserWarning, match="fused_loss is off"):
        assert not trainer(tmp_path / "plain", dates_tsv, bf16=True, fused_loss=False).loss_bf16
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match="no native bfloat16"):
        assert not trainer(tmp_path / "emulated", dates_tsv, bf16=True).loss_bf16


@pytest.mark.skipif(not cpu.cpu_has_bf16(), reason="this CPU has no native bfloat16: oneDNN cannot make the bf16 layers' primitive")
def test_bf16_training_steps_multiply_the_linear_layers_in_bfloat16_and_nothing_else(monkeypatch, tmp_path, dates_tsv):
    """--bf16 with bf16_layers on a CPU with native bfloat16: a train step's linear layers run inside
    ``kernels.bf16_products`` (their products in bfloat16), validation's do not, and the setting
    is gone after the step; --bf16 alone (the output layer) and float32 training never enter it."""
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: True)
    seen = []
    modes = {"layers": "linear and output layers", "bf16": "output layer", "fp32": None}
    for name, flags in (("layers", {"bf16": True, "bf16_layers": True}), ("bf16", {"bf16": True}), ("fp32", {})):
        t = trainer(tmp_path / name, dates_tsv, **flags)
        assert t.linear_bf16 is (name == "layers") and t.bf16_mode == modes[name]
        layer = t.model.encoder_layers[0].self_attn.in_proj
        assert isinstance(layer, kernels.Linear)
        hook = layer.register_forward_hook(lambda *_: seen.append((name, torch.is_grad_enabled(), kernels._bf16_products)))
        t.train_step(t.batches(0)[:1])
        with torch.no_grad():
            t.model.eval()
            t.model(*t._collate(t.batches(0)[0])[:2])
        hook.remove()
        assert kernels._bf16_products is False
    assert seen == [("layers", True, True), ("layers", False, False), ("bf16", True, False), ("bf16", False, False),
                    ("fp32", True, False), ("fp32", False, False)]
    with pytest.warns(UserWarning, match="bf16_layers needs --bf16"):
        assert not trainer(tmp_path / "alone", dates_tsv, bf16_layers=True).linear_bf16


def test_padding_positions_get_no_gradient_and_change_nothing():
    hidden, weight, _, target = inputs(torch.float64, bias=False)
    loss, _ = projected_label_smoothed_loss(hidden, weight, None, target, pad_id=PAD, smoothing=0.1, chunk=3)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert (grad[target == PAD] == 0).all() and (grad[target != PAD] != 0).any()
    changed = hidden.detach().clone()
    changed[target == PAD] = 1e3
    assert projected_label_smoothed_loss(changed, weight, None, target, pad_id=PAD, smoothing=0.1, chunk=3)[0].item() == loss.item()


def test_without_gradients_it_computes_the_same_loss():
    hidden, weight, b, target = inputs(torch.float64, bias=True)
    with torch.no_grad():
        loss, _ = projected_label_smoothed_loss(hidden, weight, b, target, pad_id=PAD, smoothing=0.1, chunk=4)
        plain, _ = label_smoothed_loss(F.linear(hidden, weight, b).double(), target, pad_id=PAD, smoothing=0.1)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, plain.double(), **FLOAT32)  # label_smoothed_loss computes in float32


@pytest.mark.parametrize("tie_output,output_bias", [(True, False), (False, False), (True, True), (False, True)])
def test_through_the_model_every_weight_gets_the_plain_gradient(tie_output, output_bias):
    """A whole Transformer in float64: the decoder's hidden states, the tied (or untied) projection
    and its bias, and every weight behind them get the gradient of the plain logits + loss."""
    config = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2, dropout=0.0,
                         src_vocab_size=41, tgt_vocab_size=41, pad_id=PAD, norm_first=True,
                         tie_output=tie_output, output_bias=output_bias)
    torch.manual_seed(0)
    model = Transformer(config).double()
    if output_bias:
        torch.nn.init.normal_(model.generator.bias)
    src, tgt = torch.randint(3, 41, (3, 9)), torch.randint(3, 41, (3, 8))
    src[1, 6:], tgt[2, 5:] = PAD, PAD
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]

    logits = model(src, tgt_in)
    expected = F.cross_entropy(logits.reshape(-1, 41), tgt_out.reshape(-1), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    hidden = model(src, tgt_in, project=False)
    assert hidden.shape == (3, 7, 16)
    hidden.retain_grad()
    gen = model.generator
    loss, _ = projected_label_smoothed_loss(hidden, gen.weight, gen.bias, tgt_out, pad_id=PAD, smoothing=0.1, chunk=4)
    loss.backward()
    torch.testing.assert_close(loss, expected, **FLOAT64)
    torch.testing.assert_close(F.linear(hidden, gen.weight, gen.bias), logits, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], **FLOAT64, msg=lambda m, name=name: f"{name}: {m}")


# ---- the trainer's flags -----------------------------------------------------------------------


def trainer(run_dir: Path, data: Path, *, dropout: float = 0.0, **train) -> Trainer:
    model, train_cfg, data_cfg = build_configs(
        "tiny", model={"dropout": dropout}, train={"threads": 1, **train}, data={"corpus": "files", "train_src": str(data), "vocab_size": 120}
    )
    return Trainer(run_dir, model, train_cfg, data_cfg)


def test_the_speed_ups_are_on_by_default_and_each_can_be_turned_off():
    _, train, _ = build_configs("multi30k", model={}, train={}, data={})
    assert (train.fused_loss, train.tune_allocator, train.adam, train.fast_dropout) == (True, True, "fused", True)
    with pytest.raises(ValueError, match="adam must be"):
        build_configs("multi30k", model={}, train={"adam": "sgd"}, data={})


def test_the_fast_path_trains_as_the_plain_path_does_to_float_tolerance(tmp_path, dates_tsv):
    """With dropout: the first update's gradients, then ten updates' losses, equal with every speed-up
    on and with all off. (Not the weights after ten updates: Adam divides by sqrt(v), so a parameter
    whose gradient is near 0 moves by about +-lr on rounding noise alone, whichever path made it.)"""
    runs = {}
    for name, flags in [("plain", {"fused_loss": False, "adam": "for", "tune_allocator": False}), ("fast", {})]:
        t = trainer(tmp_path / name, dates_tsv, dropout=0.1, **flags)
        assert t.fused_loss == (name == "fast")
        assert bool(t.optimizer.defaults["fused"]) == (name == "fast")
        batches = t.batches(0) + t.batches(1)
        losses, grads = [], None
        for i in range(10):
            losses.append(t.train_step([batches[i]])[0])
            t.step += 1
            grads = grads or {n: p.grad.clone() for n, p in t.model.named_parameters()}
        runs[name] = (losses, grads)
    torch.testing.assert_close(torch.tensor(runs["fast"][0]), torch.tensor(runs["plain"][0]), rtol=1e-5, atol=0)
    for key, value in runs["plain"][1].items():
        torch.testing.assert_close(runs["fast"][1][key], value, rtol=1e-4, atol=1e-7)


def test_the_trainer_tunes_the_allocator_unless_told_not_to(monkeypatch, tmp_path, dates_tsv):
    calls = []
    monkeypatch.setattr(cpu, "tune_allocator", lambda: calls.append(1) or True)
    trainer(tmp_path / "off", dates_tsv, tune_allocator=False)
    assert calls == []
    trainer(tmp_path / "on", dates_tsv)
    assert calls == [1]


# ---- fast dropout ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [16, 32])
def test_fast_dropout_keeps_each_element_with_probability_1_minus_p_and_scales_it(bits):
    torch.manual_seed(0)
    x = torch.full((1000, 1000), 2.0, requires_grad=True)
    d = FastDropout(0.3, bits)
    assert d.bits == bits
    y = d(x)
    dropped = (y == 0).double().mean().item()
    assert abs(dropped - 0.3) < 5 * (0.3 * 0.7 / 1e6) ** 0.5  # five standard deviations of a binomial mean
    assert torch.equal(y[y != 0], torch.full_like(y[y != 0], 2.0 / 0.7))
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, (y != 0) / 0.7)  # the gradient goes through the same mask, scaled alike
    # the parts of each 64-bit draw are independent: neighbours are dropped together p^2 of the time
    pairs = (y.detach().reshape(-1, 2) == 0).all(1).double().mean().item()
    assert abs(pairs - 0.09) < 5 * (0.09 * 0.91 / 5e5) ** 0.5
    fours = (y.detach().reshape(-1, 4) == 0).all(1).double().mean().item()  # all four sixteenths of a draw: p^4
    assert abs(fours - 0.3**4) < 5 * (0.3**4 * (1 - 0.3**4) / 2.5e5) ** 0.5


def test_fast_dropout_draws_a_quarter_of_a_64_bit_number_per_element_at_16_bits(monkeypatch):
    """16 bits: 64 bits per four elements; 32: per two; the threshold p to 2^-bits; a p below 2^-8 takes 32 bits."""
    sizes = []
    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: sizes.append(a[2][0]) or real(*a, **k))
    x = torch.ones(1001)
    FastDropout(0.3)(x), FastDropout(0.3, 32)(x), FastDropout(0.001)(x)
    assert sizes == [251, 501, 501]  # ceil(1001 / 4), ceil(1001 / 2), and 32 bits for p = 0.001
    assert FastDropout(0.001).bits == 32 and FastDropout(1 - 2**-9).bits == 32 and FastDropout(2**-8).bits == 16
    # the threshold: with every draw the 16-bit value -2^15 + k, elements with k < round(p * 2^16) are dropped
    k = torch.arange(2**16, dtype=torch.int64)
    values = (k - 2**15).to(torch.int16)  # 65,536 elements, each 16-bit value once
    monkeypatch.setattr(torch, "randint", lambda *a, **kw: values.view(torch.int64))
    y = FastDropout(0.3)(torch.ones(2**16))
    assert int((y == 0).sum()) == round(0.3 * 2**16) and bool((y[k < round(0.3 * 2**16)] == 0).all())
    with pytest.raises(ValueError, match="bits must be 16 or 32"):
        FastDropout(0.3, 8)


def test_fast_dropout_follows_the_seed_and_is_the_identity_in_eval_mode():
    x = torch.randn(7, 13)
    d = FastDropout(0.5)
    torch.manual_seed(3)
    a = d(x)
    torch.manual_seed(3)
    assert torch.equal(d(x), a) and not torch.equal(a, x)
    d.eval()
    assert d(x) is x


def test_use_fast_dropout_replaces_every_dropout_and_leaves_the_weights():
    config = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, dropout=0.1,
                         src_vocab_size=41, tgt_vocab_size=41, pad_id=PAD)
    model = Transformer(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rates = {name: m.p for name, m in model.named_modules() if type(m) is torch.nn.Dropout}
    assert sorted(set(rates.values())) == [0.0, 0.1]  # residual dropout 0.1, attention dropout 0
    assert use_fast_dropout(model) == len(rates)
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert {name: m.p for name, m in model.named_modules() if isinstance(m, FastDropout)} == rates  # each its own p
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_run_with_fast_dropout_resumes_bitwise_exactly(tmp_path, dates_tsv):
    whole = trainer(tmp_path / "whole", dates_tsv, dropout=0.1, fast_dropout=True, max_steps=10, eval_every=5)
    assert any(isinstance(m, FastDropout) for m in whole.model.modules())
    whole.run(progress=False)
    trainer(tmp_path / "half", dates_tsv, dropout=0.1, fast_dropout=True, max_steps=5, eval_every=5).run(progress=False)
    resumed = Trainer.resume(tmp_path / "half", max_steps=10)
    assert any(isinstance(m, FastDropout) for m in resumed.model.modules())
    assert resumed.optimizer.param_groups[0]["fused"] is True
    resumed.run(progress=False)
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_runs_adam_with_the_kernel_asked_for(tmp_path, dates_tsv):
    trainer(tmp_path / "run", dates_tsv, max_steps=2, eval_every=2).run(progress=False)
    for kind in ("for", "foreach", "fused"):
        group = Trainer.resume(tmp_path / "run", adam=kind).optimizer.param_groups[0]
        assert (group["fused"], group["foreach"]) == (kind == "fused", kind == "foreach")


# ---- no hidden process-wide settings -------------------------------------------------------------


def test_a_translator_leaves_the_allocator_alone_and_the_command_line_tunes_it(monkeypatch, random_checkpoint, tmp_path, capsys):
    from qkv.cli.main import main
    from qkv.infer.translator import Translator
    from qkv.io import checkpoint

    calls = []  # every tune_allocator, however imported, goes through cpu._mallopt
    monkeypatch.setattr(cpu, "_mallopt", lambda settings: calls.append(settings) or True)
    loaded = checkpoint.load(random_checkpoint)
    Translator(loaded.model, loaded.tokenizer).translate(["A dog runs."])
    assert calls == []  # making and using a Translator changes nothing process-wide
    source = tmp_path / "in.en"
    source.write_text("A dog runs.\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", str(random_checkpoint), "--beam", "1", "-i", str(source), "-o", str(tmp_path / "out")]) == 0
    assert len(calls) == 1  # the command opts in, once


def test_the_servers_batcher_takes_its_hook_off_the_model_when_it_closes(random_checkpoint):
    import asyncio

    from qkv.io import checkpoint
    from qkv.serve.batcher import Batcher

    model = checkpoint.load(random_checkpoint).model
    batcher = Batcher(model, checkpoint.load(random_checkpoint).tokenizer, max_batch_sentences=8, max_batch_tokens=512,
                      max_batch_work=1000, max_wait_ms=1, max_queue=4, max_queue_work=1000)
    assert len(model.generator._forward_pre_hooks) == 1
    asyncio.run(batcher.close())
    assert len(model.generator._forward_pre_hooks) == 0  # the model is the caller's again
