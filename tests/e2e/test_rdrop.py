"""R-Drop (``--train rdrop=ALPHA``): the objective against a plain computation of its formula, and a
training step with it against the plain step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.model import cpu, kernels
from qkv.model.config import ConfigError
from qkv.train.loss import rdrop_loss
from qkv.train.recipes import build_configs
from qkv.train.trainer import Trainer
from test_speed import trainer

PAD = 2


def inputs(*, B=3, T=9, D=8, V=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2 * B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    target = torch.randint(PAD + 1, V, (B, T), generator=g)
    target[0, 4:], target[2, 1:] = PAD, PAD  # 4 + 9 + 1 = 14 real positions
    return hidden, (lambda x: F.linear(x, weight, bias)), target


def by_the_formula(hidden, project, target, smoothing, alpha):
    """Each pass's cross-entropy by F.cross_entropy, and both KL divergences by F.kl_div, at the real positions."""
    B, V = target.size(0), project(hidden[:1, :1]).size(-1)
    ce, kl = [], 0
    logits = [project(hidden[i * B : (i + 1) * B]).reshape(-1, V) for i in range(2)]
    logp = [F.log_softmax(x, -1) for x in logits]
    real = target.reshape(-1) != PAD
    for i in range(2):
        ce.append(F.cross_entropy(logits[i], target.reshape(-1), ignore_index=PAD, label_smoothing=smoothing, reduction="sum"))
        # F.kl_div(input, target) = KL(target || input), input and target as log-probabilities
        kl = kl + F.kl_div(logp[1 - i][real], logp[i][real], reduction="sum", log_target=True)
    return (ce[0] + ce[1]) / 2 + alpha / 4 * kl, (ce[0] + ce[1]) / 2, kl


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("alpha", [0.0, 5.0])
def test_the_objective_and_its_gradient_are_the_formulas(smoothing, alpha):
    hidden, project, target = inputs()
    objective, ce, count = rdrop_loss(hidden, project, target, pad_id=PAD, smoothing=smoothing, alpha=alpha)
    expected, expected_ce, kl = by_the_formula(hidden, project, target, smoothing, alpha)
    assert count.item() == 14 and kl.item() > 0.1  # two different passes: the KL term is not nothing
    torch.testing.assert_close(objective, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ce, expected_ce.detach(), rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(objective, hidden)
    (expected_grad,) = torch.autograd.grad(expected, hidden)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert (grad[:3][target == PAD] == 0).all() and (grad[3:][target == PAD] == 0).all()


def test_two_equal_passes_cost_nothing_more_than_one():
    hidden, project, target = inputs()
    same = torch.cat([hidden[:3], hidden[:3]]).detach().requires_grad_()
    objective, ce, _ = rdrop_loss(same, project, target, pad_id=PAD, smoothing=0.1, alpha=5.0)
    one_pass = F.cross_entropy(project(same[:3]).reshape(-1, 29), target.reshape(-1), ignore_index=PAD,
                               label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(objective, one_pass, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ce, one_pass.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="two passes"):
        rdrop_loss(hidden[:3], project, target, pad_id=PAD, smoothing=0.1, alpha=5.0)


# ---- in the trainer ----------------------------------------------------------------------------


def first_steps(t: Trainer, n: int = 5) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of n updates and the first update's gradients. (Not the weights after them: Adam
    divides by sqrt(v), so a weight whose gradient is near 0 moves by about lr on rounding alone.)"""
    batches, losses, grads = t.batches(0), [], None
    for i in range(n):
        losses.append(t.train_step([batches[i]])[0])
        t.step += 1
        grads = grads or {name: p.grad.clone() for name, p in t.model.named_parameters()}
    return losses, grads


def test_without_dropout_an_r_drop_step_is_the_plain_step(tmp_path, dates_tsv):
    """No dropout: the two passes are one and the same, the KL term and its gradient are 0, and what
    is left is the plain loss: the plain path's gradients, and its losses over five updates."""
    plain = trainer(tmp_path / "plain", dates_tsv, dropout=0.0, fused_loss=False)
    rdrop = trainer(tmp_path / "rdrop", dates_tsv, dropout=0.0, rdrop=5.0)
    assert not rdrop.fused_loss
    (plain_losses, plain_grads), (losses, grads) = first_steps(plain), first_steps(rdrop)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    for name, value in plain_grads.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-7)


def test_with_dropout_the_kl_term_changes_the_update(tmp_path, dates_tsv):
    """With dropout the passes differ: alpha 5 and an alpha too small to count (rdrop=0 would be one
    pass, with other masks) draw the same masks under the same seed and report the same
    cross-entropy on the first update, yet the gradients differ by the KL term's."""
    grads = {}
    for alpha in (1e-12, 5.0):
        t = trainer(tmp_path / f"a{alpha}", dates_tsv, dropout=0.3, rdrop=alpha)
        torch.manual_seed(7)
        loss, _, applied = t.train_step([t.batches(0)[0]])
        assert applied
        grads[alpha] = (loss, torch.cat([p.grad.reshape(-1) for p in t.model.parameters() if p.grad is not None]))
    assert grads[1e-12][0] == pytest.approx(grads[5.0][0], rel=1e-6)
    difference = (grads[5.0][1] - grads[1e-12][1]).norm() / grads[1e-12][1].norm()
    assert difference > 1e-3


@pytest.mark.skipif(not cpu.cpu_has_bf16(), reason="this CPU has no native bfloat16: oneDNN cannot make the bf16 layers' primitive")
def test_with_bf16_the_output_layer_multiplies_in_bfloat16_only_with_bf16_layers(monkeypatch, tmp_path, dates_tsv):
    """R-Drop's loss is not the fused one: --bf16 alone cannot put its output layer in bfloat16 (a
    warning, float32 throughout); with bf16_layers the output layer is one of the linear layers a
    train step multiplies in bfloat16."""
    monkeypatch.setattr(cpu, "cpu_has_bf16", lambda: True)
    with pytest.warns(UserWarning, match="needs bf16_layers=true"):
        alone = trainer(tmp_path / "alone", dates_tsv, dropout=0.1, rdrop=5.0, bf16=True)
    assert (alone.loss_bf16, alone.linear_bf16, alone.bf16_mode) == (False, False, None)
    t = trainer(tmp_path / "layers", dates_tsv, dropout=0.1, rdrop=5.0, bf16=True, bf16_layers=True)
    assert (t.loss_bf16, t.linear_bf16, t.bf16_mode) == (False, True, "linear and output layers")
    seen = []
    hook = t.model.generator.register_forward_hook(lambda *_: seen.append(kernels._bf16_products))
    t.train_step([t.batches(0)[0]])
    hook.remove()
    assert seen == [True]


def test_a_negative_alpha_is_refused():
    with pytest.raises(ConfigError, match="rdrop must be >= 0"):
        build_configs("tiny", model={}, train={"rdrop": -1.0}, data={})
