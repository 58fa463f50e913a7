import json
import math

import numpy as np
import pytest
import torch

from qkv.inspect import reference
from qkv.model.attention import MultiHeadAttention
from qkv.cli.main import main
from qkv.inspect.explain import WORKED_EXAMPLE, _torch_check, explain, format_explanation, make_mask, random_inputs


def printed_block(text: str, header_start: str) -> np.ndarray:
    """The matrix printed under the first line starting with ``header_start`` (sum column dropped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(header_start))
    rows = []
    for line in lines[start + 1 :]:
        tokens = line.split()
        labelled = len(tokens) > 1 and tokens[0][0] in "qkvr" and tokens[0][1:].isdigit()
        is_row = labelled and tokens[1][0] in "-.0123456789"  # not the line of column labels
        if not is_row:
            if rows:
                break
            continue  # the column labels
        values = tokens[1:tokens.index("|")] if "|" in tokens else tokens[1:]
        rows.append([float(x) for x in values])
    return np.array(rows)


def softmax_by_hand(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(q.shape[1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return weights, weights @ v


def test_worked_example_by_hand():
    expl = explain(**WORKED_EXAMPLE)
    s = expl.steps
    np.testing.assert_allclose(s.scores, [[1, 1]])
    # d_k = 3 (Q has three columns), so the scale is 1/sqrt(3), not 1/sqrt(2).
    np.testing.assert_allclose(s.scaled, [[1 / math.sqrt(3), 1 / math.sqrt(3)]])
    np.testing.assert_allclose(s.weights, [[0.5, 0.5]])
    np.testing.assert_allclose(s.output, [[1.5, 0.5]])
    text = format_explanation(expl)
    np.testing.assert_allclose(printed_block(text, "1. alignment scores"), [[1.0, 1.0]])
    np.testing.assert_allclose(printed_block(text, "2. scaled scores"), [[0.5774, 0.5774]])
    np.testing.assert_allclose(printed_block(text, "3. softmax"), [[0.5, 0.5]])
    np.testing.assert_allclose(printed_block(text, "4. output"), [[1.5, 0.5]])
    assert "|  1.0000" in text  # the row sum


def test_random_rectangular_inputs_match_the_reference():
    q, k, v = random_inputs(m=3, n=5, d_k=4, d_v=2, seed=7)
    assert (q.shape, k.shape, v.shape) == ((3, 4), (5, 4), (5, 2))
    expl = explain(q, k, v)
    weights, output = softmax_by_hand(q, k, v)
    np.testing.assert_allclose(expl.steps.scores, q @ k.T)
    np.testing.assert_allclose(expl.steps.weights, weights)
    np.testing.assert_allclose(expl.steps.output, output)
    ref = reference.attention(q, k, v)
    text = format_explanation(expl, precision=6)
    for header, expected in [
        ("1. alignment scores", ref.scores),
        ("2. scaled scores", ref.scaled),
        ("3. softmax", ref.weights),
        ("4. output", ref.output),
    ]:
        np.testing.assert_allclose(printed_block(text, header), expected, atol=6e-7)
    assert "(m x n = 3 x 5)" in text and "(m x d_v = 3 x 2)" in text


@pytest.mark.parametrize("mask", [None, "causal", "1,0,1,1,0"])
def test_fused_and_explicit_torch_paths_agree_with_the_reference(mask):
    q, k, v = random_inputs(m=4, n=5, d_k=3, d_v=6, seed=1)
    expl = explain(q, k, v, mask=mask)
    assert expl.check.fused < 1e-5 and expl.check.explicit < 1e-5
    text = format_explanation(expl)
    assert f"fused kernel vs step-by-step: max |diff| = {expl.check.fused:.1e}" in text


def test_torch_check_can_fail():
    q, k, v = random_inputs(m=2, n=3, d_k=4, d_v=2, seed=0)
    ref = reference.attention(q, k, v)
    check = _torch_check(q, k, v, None, ref.weights[None], ref.output + 0.25)
    assert check.fused == pytest.approx(0.25, abs=1e-5) and check.explicit == pytest.approx(0.25, abs=1e-5)


def test_mask_gives_masked_keys_exactly_zero_weight():
    q, k, v = random_inputs(m=3, n=4, d_k=4, d_v=2, seed=3)
    expl = explain(q, k, v, mask="1,1,0,1")
    assert np.all(expl.steps.weights[:, 2] == 0.0)
    assert np.all(np.isneginf(expl.steps.scaled[:, 2]))
    np.testing.assert_allclose(expl.steps.weights.sum(axis=1), 1.0)
    weights, output = softmax_by_hand(q, k, v, expl.mask)
    np.testing.assert_allclose(expl.steps.output, output)
    text = format_explanation(expl)
    assert "-inf" in text and "masked keys get weight exactly 0" in text
    assert printed_block(text, "2. scaled scores").shape == (3, 4)


def test_causal_mask_and_fully_masked_row():
    q, k, v = random_inputs(m=3, n=3, d_k=2, d_v=2, seed=0)
    expl = explain(q, k, v, mask="causal")
    assert np.all(expl.steps.weights[np.triu_indices(3, 1)] == 0.0)
    expl = explain(q, k, v, mask=[[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert np.all(expl.steps.weights[1] == 0.0) and np.all(expl.steps.output[1] == 0.0)
    assert np.isfinite(expl.steps.output).all() and expl.check.fused < 1e-5 and expl.check.explicit < 1e-5
    assert "not NaN" in format_explanation(expl)


def test_causal_mask_with_more_keys_than_queries_aligns_queries_with_the_last_keys():
    np.testing.assert_array_equal(make_mask("causal", 2, 3), [[1, 1, 0], [1, 1, 1]])


def test_multi_head_equals_reference_and_torch_module():
    rng = np.random.default_rng(0)
    x, memory = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    expl = explain(x, memory, memory, heads=2, mask="1,1,1,0,1", seed=5)
    mh = expl.multi_head
    assert (mh.d_model, mh.d_k, mh.d_v) == (4, 2, 2)
    assert mh.check.fused < 1e-5 and mh.check.explicit < 1e-5
    ref = reference.multi_head_attention(x, memory, memory, mh.w_q, mh.w_k, mh.w_v, mh.w_o, mask=expl.mask)
    np.testing.assert_allclose(mh.steps.output, ref.output)

    module = MultiHeadAttention(4, 2, bias=False)
    t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    with torch.no_grad():
        module.in_proj.weight.copy_(torch.cat([t(w.T) for w in mh.w_q + mh.w_k + mh.w_v]))  # (out, in) rows
        module.out_proj.weight.copy_(t(mh.w_o.T))
        out, _ = module(t(x)[None], t(memory)[None], key_mask=t(expl.mask[0]).bool()[None])
    np.testing.assert_allclose(out[0].numpy(), mh.steps.output, atol=1e-5)


def test_multi_head_on_the_worked_example_with_rectangular_heads():
    expl = explain(**WORKED_EXAMPLE, heads=3, head_d_k=2, head_d_v=1, seed=2)
    mh = expl.multi_head
    assert [w.shape for w in mh.w_q] == [(3, 2)] * 3 and [w.shape for w in mh.w_v] == [(2, 1)] * 3
    assert mh.w_o.shape == (3, 3) and mh.steps.concat.shape == (1, 3) and mh.steps.output.shape == (1, 3)
    assert mh.check.fused < 1e-5 and mh.check.explicit < 1e-5
    text = format_explanation(expl)
    np.testing.assert_allclose(printed_block(text, "multi-head output"), mh.steps.output, atol=5e-5)
    # the projections are seeded: the same seed gives the same numbers, another seed others
    sizes = dict(heads=3, head_d_k=2, head_d_v=1)
    assert np.array_equal(explain(**WORKED_EXAMPLE, **sizes, seed=2).multi_head.w_o, mh.w_o)
    assert not np.array_equal(explain(**WORKED_EXAMPLE, **sizes, seed=3).multi_head.w_o, mh.w_o)


@pytest.mark.parametrize(
    "q, k, v, mask, message",
    [
        ([[1, 0, 1]], [[1, 1], [0, 1]], [[1], [2]], None, "same width d_k"),
        ([[1, 0]], [[1, 1], [0, 1]], [[1]], None, "exactly one value row"),
        ([[1, 0], [1]], [[1, 1]], [[1]], None, "equally long rows"),
        ([1, 0], [[1, 1]], [[1]], None, "non-empty matrix"),
        ([[1, 0]], [[1, 1]], [[1]], "1,0", "must be (1,) over the keys"),
        ([[1, 0]], [[1, 1]], [[1]], "2", "0/1"),
        ([[1, 0]], [[1, 1]], [[1]], "diagonal", "not understood"),
    ],
)
def test_bad_inputs_raise_clear_errors(q, k, v, mask, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        explain(q, k, v, mask=mask)


def test_cli_default_prints_steps_and_numbers(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    for header in [
        "1. alignment scores  e = Q K^T   (m x n = 1 x 2)",
        "2. scaled scores  e / sqrt(d_k) = e / sqrt(3)",
        "3. softmax of each row",
        "4. output  alpha V",
    ]:
        assert header in out
    assert "0.5774" in out and "1.5000" in out
    np.testing.assert_allclose(printed_block(out, "4. output"), [[1.5, 0.5]])
    diff = float(out.split("fused kernel vs step-by-step: max |diff| = ")[1].split()[0])
    assert diff < 1e-5


def test_cli_heads_random_and_json(capsys, tmp_path):
    assert main(["explain", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "head 2" in out and "W^O   (H*d_v x d_model = 4 x 3)" in out and "multi-head output" in out

    assert main(["explain", "--random", "--seed", "4", "--m", "2", "--n", "5", "--d-k", "3", "--d-v", "4"]) == 0
    out = capsys.readouterr().out
    q, k, v = random_inputs(m=2, n=5, d_k=3, d_v=4, seed=4)
    np.testing.assert_allclose(printed_block(out, "4. output"), reference.attention(q, k, v).output, atol=5e-5)

    path = tmp_path / "inputs.json"
    path.write_text(json.dumps({"q": [[1, 0]], "k": [[1, 0], [0, 1], [1, 1]], "v": [[1], [2], [3]], "mask": [1, 0, 1]}))
    assert main(["explain", "--json", str(path)]) == 0
    weights = printed_block(capsys.readouterr().out, "3. softmax")
    assert weights[0, 1] == 0.0 and weights[0, 0] == pytest.approx(0.5, abs=1e-4)
    assert main(["explain", "--json", str(path), "--mask", "none"]) == 0  # the command line overrides the file
    assert printed_block(capsys.readouterr().out, "3. softmax")[0, 1] > 0


@pytest.mark.parametrize(
    "args, content, message",
    [
        (["--json", "{f}"], '{"q": [[1, 0, 1]], "k": [[1, 1], [0, 1]], "v": [[1], [2]]}', "same width d_k"),
        (["--json", "{f}"], '{"q": [[1, 0]], "k": [[1, 1]]', "not valid JSON"),
        (["--json", "{f}"], '{"q": [[1]], "k": [[1]], "v": [[1]], "values": 1}', "unknown key"),
        (["--json", "{f}"], '{"q": [[1]], "k": [[1]]}', "missing 'v'"),
        (["--json", "{f}"], '[[1]]', "expected an object"),
        (["--mask", "1,0,1"], None, "mask has shape"),
        (["--d-k", "3"], None, "add --random"),
        (["--heads", "0"], None, "heads must be at least 1"),
        (["--random", "--m", "0"], None, "m must be at least 1"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, tmp_path, args, content, message):
    path = tmp_path / "in.json"
    if content is not None:
        path.write_text(content)
    assert main(["explain", *[a.replace("{f}", str(path)) for a in args]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv explain: error:") and message in err and err.count("\n") == 1


def test_cli_missing_file_exits_2(capsys, tmp_path):
    assert main(["explain", "--json", str(tmp_path / "nope.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_a_weight_is_not_a_contribution_on_the_worked_example():
    """Both keys get weight 0.5, but v2 is sqrt(5) times as long as v1: k1 adds 1 / (1 + sqrt 5) of the
    output, k2 the rest. The printout shows the contributions and says so in words."""
    expl = explain(**WORKED_EXAMPLE)
    np.testing.assert_allclose(expl.contributions, [[1 / (1 + math.sqrt(5)), math.sqrt(5) / (1 + math.sqrt(5))]])
    text = format_explanation(expl)
    np.testing.assert_allclose(printed_block(text, "5. contributions"), [[0.3090, 0.6910]])
    assert "q1 gives k1 weight 0.5000 but k1 adds 0.3090 of what q1 gets: less than its weight" in text
    equal = format_explanation(explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]))
    assert "here every contribution equals its weight" in equal  # values of one length: nothing to explain


def test_multi_head_contributions_are_those_qkv_inspect_contributions_reads_from_the_module():
    """The multi-head contributions are the norms of sum_i alpha^i_j v^i_j W^O_i: what
    qkv.inspect.contributions.decompose computes on a real attention module with the same projections."""
    from qkv.inspect.contributions import decompose
    from qkv.model.transformer import Sublayer

    rng = np.random.default_rng(1)
    x, memory = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    expl = explain(x, memory, memory, heads=2, mask="1,1,1,0,1", seed=3)
    mh = expl.multi_head
    module = MultiHeadAttention(4, 2, bias=False).double().eval()
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    with torch.no_grad():
        module.in_proj.weight.copy_(torch.cat([t(w.T) for w in mh.w_q + mh.w_k + mh.w_v]))
        module.out_proj.weight.copy_(t(mh.w_o.T))
    sublayer = Sublayer(4, 0.0, norm_first=False, eps=1e-5).double().eval()
    with torch.no_grad():
        block = decompose(sublayer, module, t(x)[None], t(memory)[None], key_mask=t(expl.mask[0]).bool()[None])
    norms = block.mixed[0].norm(dim=-1)  # (m, n)
    np.testing.assert_allclose(mh.contributions, (norms / norms.sum(-1, keepdim=True)).numpy(), atol=1e-12)
    assert mh.contributions[:, 3].max() == 0  # the masked key adds nothing
    text = format_explanation(expl)
    np.testing.assert_allclose(printed_block(text, "multi-head: contributions"), mh.contributions, atol=1e-4)
