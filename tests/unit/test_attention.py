"""The mechanism: scaled dot-product attention and multi-head attention."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv.inspect import reference
from qkv.model.attention import KVCache, MultiHeadAttention, causal_mask, scaled_dot_product_attention

# The tutorials' worked example: one query, two keys, two-dimensional values.
Q = [[1.0, 0.0, 1.0]]
K = [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
V = [[1.0, 0.0], [2.0, 1.0]]


def test_worked_example_by_hand():
    steps = reference.attention(np.array(Q), np.array(K), np.array(V))
    # q.k1 = 1 and q.k2 = 1; scaled by 1/sqrt(3); equal scores give weights 1/2 each.
    np.testing.assert_allclose(steps.scores, [[1.0, 1.0]])
    np.testing.assert_allclose(steps.scaled, [[1 / math.sqrt(3), 1 / math.sqrt(3)]])
    np.testing.assert_allclose(steps.weights, [[0.5, 0.5]])
    np.testing.assert_allclose(steps.output, [[1.5, 0.5]])
    for need_weights in (False, True):
        out, _ = scaled_dot_product_attention(
            torch.tensor(Q, dtype=torch.float64),
            torch.tensor(K, dtype=torch.float64),
            torch.tensor(V, dtype=torch.float64),
            need_weights=need_weights,
        )
        np.testing.assert_allclose(out.numpy(), [[1.5, 0.5]], atol=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("m,n,d_k,d_v", [(3, 5, 4, 6), (7, 2, 8, 3), (1, 1, 2, 2)])
def test_equals_numpy_reference_rectangular(need_weights, m, n, d_k, d_v):
    g = torch.Generator().manual_seed(m * 100 + n)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in [(m, d_k), (n, d_k), (n, d_v)])
    mask = torch.rand(m, n, generator=g) > 0.4
    mask[:, 0] = True
    steps = reference.attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy())
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=need_weights)
    assert out.shape == (m, d_v)
    np.testing.assert_allclose(out.numpy(), steps.output, atol=1e-10)
    if need_weights:
        np.testing.assert_allclose(weights.numpy(), steps.weights, atol=1e-12)


def test_equals_pytorch_fused_kernel_with_batch_and_heads():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False  # padding keys of the second sequence
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    assert weights.shape == (2, 3, 5, 9)


def _count_fused_calls(monkeypatch) -> list[int]:
    calls = [0]
    fused = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def test_short_inputs_take_the_explicit_steps_and_agree_with_the_fused_kernel(monkeypatch):
    """A decoding step's shapes (no gradient, m * n up to SHORT_ATTENTION) and a training batch of
    short sentences (with gradients, up to SHORT_TRAINING_ATTENTION) skip the fused kernel; longer
    inputs keep it; both give the same output and gradients to fp32 rounding, padding and empty rows included."""
    calls = _count_fused_calls(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(6, 4, 5, 32, generator=g), torch.randn(6, 4, 17, 32, generator=g), torch.randn(6, 4, 17, 32, generator=g)
    mask = torch.ones(6, 1, 1, 17, dtype=torch.bool)
    mask[1, ..., 9:] = False
    mask[2] = False  # a row with no key: zeros either way
    with torch.no_grad():
        explicit, weights = scaled_dot_product_attention(q, k, v, mask=mask)
        assert calls[0] == 0 and weights is None
        fused, _ = scaled_dot_product_attention(q, k, v, mask=mask, fused=True)
        assert calls[0] == 1
        long_q, long_k = torch.randn(1, 1, 200, 8, generator=g), torch.randn(1, 1, 200, 8, generator=g)
        scaled_dot_product_attention(long_q, long_k, long_k)  # m * n = 40,000 > SHORT_ATTENTION
        assert calls[0] == 2
    torch.testing.assert_close(explicit, fused, atol=1e-6, rtol=1e-5)
    assert (explicit[2] == 0).all()
    # with gradients: m * n = 85 is short for training too; 64 x 65 = 4,160 is not
    qe, ke, ve = (x.clone().requires_grad_() for x in (q, k, v))
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    out_e, _ = scaled_dot_product_attention(qe, ke, ve, mask=mask, causal=True)
    assert calls[0] == 2
    out_f, _ = scaled_dot_product_attention(qf, kf, vf, mask=mask, causal=True, fused=True)
    assert calls[0] == 3
    torch.testing.assert_close(out_e, out_f, atol=1e-6, rtol=1e-5)
    grad = torch.randn(out_e.shape, generator=g)
    out_e.backward(grad)
    out_f.backward(grad)
    for a, b in ((qe, qf), (ke, kf), (ve, vf)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    q64, k65 = torch.randn(1, 1, 64, 8, generator=g, requires_grad=True), torch.randn(1, 1, 65, 8, generator=g)
    scaled_dot_product_attention(q64, k65, k65)  # 4,160 > SHORT_TRAINING_ATTENTION: the fused kernel
    assert calls[0] == 4
    scaled_dot_product_attention(q64, k65[:, :, :64], k65[:, :, :64])  # 4,096: the explicit steps
    assert calls[0] == 4
    with pytest.raises(ValueError, match="no weights"):
        scaled_dot_product_attention(q, k, v, need_weights=True, fused=True)


def test_rows_sum_to_one_and_masked_keys_get_exactly_zero():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(4, 6, generator=g), torch.randn(7, 6, generator=g), torch.randn(7, 3, generator=g)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[:, 5:] = False
    # Large scores on the masked keys: a small-constant fill would still leak weight to them.
    k[5:] = q.sum(0) * 100
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))
    assert (weights[:, 5:] == 0).all()


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_row_gives_zeros_not_nan_in_output_and_gradient(need_weights):
    q = torch.randn(3, 4, requires_grad=True)
    k = torch.randn(5, 4, requires_grad=True)
    v = torch.randn(5, 2, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # query 1 sees nothing
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=need_weights)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    if need_weights:
        assert (weights[1] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[1] == 0).all()


def test_causal_mask_hides_the_future():
    assert causal_mask(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # With a cache (n > m) the queries are the last m positions.
    assert causal_mask(1, 4).tolist() == [[True, True, True, True]]
    q, k, v = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 2)
    _, weights = scaled_dot_product_attention(q, k, v, causal=True, need_weights=True)
    assert (weights.triu(diagonal=1) == 0).all()
    fused, _ = scaled_dot_product_attention(q, k, v, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(fused, expected)


def test_gradcheck_both_paths():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 3, 5, generator=g) > 0.3
    mask[0, 1] = False
    for need_weights in (False, True):
        fn = lambda q, k, v: scaled_dot_product_attention(q, k, v, mask=mask, need_weights=need_weights)[0]  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v))


def _copy_into_torch_mha(ours: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    theirs = torch.nn.MultiheadAttention(ours.d_model, ours.n_heads, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.in_proj.weight)
        theirs.in_proj_bias.copy_(ours.in_proj.bias)
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    return theirs.eval()


def _mha(d_model=16, n_heads=4, **kw) -> MultiHeadAttention:
    torch.manual_seed(4)
    mha = MultiHeadAttention(d_model, n_heads, **kw).double().eval()
    with torch.no_grad():  # non-zero biases so the test would notice a misplaced one
        mha.in_proj.bias.normal_()
        mha.out_proj.bias.normal_()
    return mha


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_equals_torch_self_attention_with_padding(need_weights):
    ours = _mha()
    theirs = _copy_into_torch_mha(ours)
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    key_mask = torch.ones(3, 6, dtype=torch.bool)
    key_mask[1, 4:] = False
    key_mask[2, 2:] = False
    out, weights = ours(x, key_mask=key_mask, need_weights=need_weights)
    expected, expected_w = theirs(x, x, x, key_padding_mask=~key_mask, average_attn_weights=False)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    if need_weights:
        torch.testing.assert_close(weights, expected_w, atol=1e-12, rtol=0)


def test_mha_equals_torch_cross_attention_with_padding():
    ours = _mha()
    theirs = _copy_into_torch_mha(ours)
    x = torch.randn(2, 3, 16, dtype=torch.float64)  # decoder states, m = 3
    memory = torch.randn(2, 7, 16, dtype=torch.float64)  # encoder output, n = 7
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[0, 5:] = False
    out, _ = ours(x, memory, key_mask=key_mask)
    expected, _ = theirs(x, memory, memory, key_padding_mask=~key_mask)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_mha_parity_fails_when_one_weight_is_perturbed():
    ours = _mha()
    theirs = _copy_into_torch_mha(ours)
    with torch.no_grad():
        theirs.in_proj_weight[20, 3] += 1e-3  # one key-projection weight
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out, _ = ours(x)
    expected, _ = theirs(x, x, x)
    assert (out - expected).abs().max() > 1e-6


def test_mha_with_d_k_different_from_d_v_equals_reference():
    ours = _mha(d_model=12, n_heads=3, d_k=5, d_v=7)
    x = torch.randn(1, 4, 12, dtype=torch.float64)
    memory = torch.randn(1, 6, 12, dtype=torch.float64)
    out, weights = ours(x, memory, need_weights=True)
    assert out.shape == (1, 4, 12) and weights.shape == (1, 3, 4, 6)
    W, b = ours.in_proj.weight.detach().numpy(), ours.in_proj.bias.detach().numpy()
    H, dk, dv = 3, 5, 7
    wq, wk, wv = W[: H * dk], W[H * dk : 2 * H * dk], W[2 * H * dk :]
    bq, bk, bv = b[: H * dk], b[H * dk : 2 * H * dk], b[2 * H * dk :]
    steps = reference.multi_head_attention(
        x[0].numpy(),
        memory[0].numpy(),
        memory[0].numpy(),
        w_q=[wq[i * dk : (i + 1) * dk].T for i in range(H)],
        w_k=[wk[i * dk : (i + 1) * dk].T for i in range(H)],
        w_v=[wv[i * dv : (i + 1) * dv].T for i in range(H)],
        w_o=ours.out_proj.weight.detach().numpy().T,
        b_q=[bq[i * dk : (i + 1) * dk] for i in range(H)],
        b_k=[bk[i * dk : (i + 1) * dk] for i in range(H)],
        b_v=[bv[i * dv : (i + 1) * dv] for i in range(H)],
        b_o=ours.out_proj.bias.detach().numpy(),
    )
    np.testing.assert_allclose(out[0].detach().numpy(), steps.output, atol=1e-10)
    for i in range(H):
        np.testing.assert_allclose(weights[0, i].detach().numpy(), steps.heads[i].weights, atol=1e-12)


def test_self_attention_cache_grows_one_position_a_step():
    mha = _mha()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    full, _ = mha(x, causal=True)
    cache = KVCache(capacity=2)  # grows twice on the way
    steps = []
    for t in range(5):
        out, _ = mha(x[:, t : t + 1], causal=True, cache=cache)
        assert cache.k.shape == (2, 4, t + 1, 4)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)


def test_cache_reorder_keeps_the_chosen_rows_and_appending_goes_on():
    """Beam search reorders the cache every step (rows repeated, dropped, permuted) and keeps appending."""
    cache = KVCache(capacity=3)
    k = torch.arange(2 * 1 * 2 * 2, dtype=torch.float64).view(2, 1, 2, 2)  # (N=2, H=1, m=2, d=2)
    cache.append(k, -k)
    cache.reorder(torch.tensor([1, 1, 0]))  # three rows now
    assert cache.k.shape == (3, 1, 2, 2)
    torch.testing.assert_close(cache.k, k[[1, 1, 0]])
    new = torch.full((3, 1, 2, 2), 7.0, dtype=torch.float64)
    keys, values = cache.append(new, -new)  # overflows the capacity of 3: the buffers grow
    torch.testing.assert_close(keys, torch.cat([k[[1, 1, 0]], new], dim=2))
    torch.testing.assert_close(values, -keys)
    cache.reorder(torch.tensor([2]))
    torch.testing.assert_close(cache.v, -torch.cat([k[[0]], new[:1]], dim=2))


def test_cross_attention_cache_projects_memory_once():
    mha = _mha()
    memory = torch.randn(2, 7, 16, dtype=torch.float64)
    cache = KVCache()
    mha(torch.randn(2, 1, 16, dtype=torch.float64), memory, cache=cache)
    k_first = cache.k
    # A different memory on the next step is ignored: the cached projection is reused.
    x = torch.randn(2, 1, 16, dtype=torch.float64)
    out, _ = mha(x, torch.zeros_like(memory), cache=cache)
    assert cache.k.data_ptr() == k_first.data_ptr()
    expected, _ = mha(x, memory)
    torch.testing.assert_close(out, expected)


def test_attention_dropout_in_the_explicit_steps_is_the_modules_own_and_fast_dropout_replaces_it():
    from qkv.model.dropout import FastDropout, use_fast_dropout

    calls = []

    class Recording(torch.nn.Dropout):
        def forward(self, x):
            calls.append(tuple(x.shape))
            return super().forward(x)

    torch.manual_seed(0)
    att = MultiHeadAttention(16, 2, dropout=0.25)
    assert type(att.dropout) is torch.nn.Dropout and att.dropout.p == 0.25
    att.dropout = Recording(0.25)
    x = torch.randn(3, 5, 16, requires_grad=True)
    out, _ = att(x, key_mask=torch.ones(3, 5, dtype=torch.bool))  # 5 x 5 per head: the explicit steps
    assert calls == [(3, 2, 5, 5)]  # the attention weights, dropped by the module
    # with nn.Dropout's draws, the same numbers as F.dropout on the weights (the path before the module)
    plain = MultiHeadAttention(16, 2, dropout=0.25)
    plain.load_state_dict(att.state_dict())
    torch.manual_seed(1)
    a, _ = att(x)
    torch.manual_seed(1)
    b, _ = plain(x)
    torch.manual_seed(1)
    q, k, v = plain.in_proj(x).split(16, dim=-1)
    split = lambda t: t.view(3, 5, 2, 8).transpose(1, 2)  # noqa: E731
    weights = (split(q) @ split(k).transpose(-2, -1) / math.sqrt(8)).softmax(-1)
    by_hand = plain.out_proj((F.dropout(weights, p=0.25) @ split(v)).transpose(1, 2).reshape(3, 5, 16))
    assert torch.equal(a, b) and torch.allclose(b, by_hand, atol=1e-6)
    att.eval()(x)
    assert len(calls) == 2  # the two training calls above; eval drops nothing and calls nothing
    replaced = MultiHeadAttention(16, 2, dropout=0.25)
    assert use_fast_dropout(replaced) == 1 and isinstance(replaced.dropout, FastDropout) and replaced.dropout.p == 0.25
