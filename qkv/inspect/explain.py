"""``qkv explain``: attention computed on concrete numbers, one step at a time.

Scaled dot-product attention as the tutorials teach it (section 3.2.1 of the paper):
1. alignment scores e = Q K^T (m x n); 2. scaled by 1/sqrt(d_k); 3. softmax over each row;
4. output = weights V (m x d_v); then 5. what each key *contributed* to each output, ||alpha_ij v_j||
as a share of the row (Kobayashi et al., 2020), which is not its weight: a key with a long value
adds more than its weight says, one with a short value less. With ``heads`` it also shows multi-head
attention (section 3.2.2) with seeded random projections W_i^Q, W_i^K, W_i^V and W^O, and the
contributions through W^O, ||sum_i alpha^i_j v^i_j W^O_i||, against the heads' mean weight
(what ``qkv align --method norm`` and ``qkv attend --kind norm`` read from a real model).

Every number shown comes from ``qkv.inspect.reference``, the NumPy oracle. The same inputs also go through
``qkv.model.attention.scaled_dot_product_attention`` in float32, on both its explicit path
(need_weights=True) and PyTorch's fused kernel (need_weights=False), and the largest difference from
the oracle is reported, so a learner sees that the library computes what the tutorial describes.

Shapes: m queries, n keys (= values), d_k query/key width, d_v value width, H heads, d_model the
width of the multi-head inputs (here the width of Q and K).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkv.errors import QkvError
from qkv.inspect import reference
from qkv.model.attention import scaled_dot_product_attention
from qkv.inspect.reference import AttentionSteps, MultiHeadSteps

# The tutorials' worked example: one query, two keys, two-dimensional values.
WORKED_EXAMPLE: dict[str, list[list[float]]] = {
    "q": [[1, 0, 1]],
    "k": [[1, 1, 0], [0, 1, 1]],
    "v": [[1, 0], [2, 1]],
}

MaskSpec = str | list | np.ndarray | None


@dataclass
class TorchCheck:
    """Largest absolute differences between qkv's float32 attention and the float64 oracle."""

    fused: float  # output of the fused kernel path (need_weights=False)
    explicit: float  # output and weights of the explicit path (need_weights=True)


@dataclass
class MultiHeadExplanation:
    """Multi-head attention on the same inputs: X = Q for the queries, K and V as the memory."""

    n_heads: int
    seed: int  # the projections' seed
    d_model: int  # width of Q and K, and of the output
    d_k: int  # per-head query/key width
    d_v: int  # per-head value width
    w_q: list[np.ndarray]  # each (d_model, d_k)
    w_k: list[np.ndarray]  # each (d_model, d_k)
    w_v: list[np.ndarray]  # each (width of V, d_v)
    w_o: np.ndarray  # (H * d_v, d_model)
    steps: MultiHeadSteps
    check: TorchCheck
    contributions: np.ndarray | None = None  # (m, n): ||sum_i alpha^i_j v^i_j W^O_i||, each row scaled to sum to 1


@dataclass
class Explanation:
    """Everything ``format_explanation`` prints, as numbers: inputs, the four steps, the checks."""

    q: np.ndarray  # (m, d_k)
    k: np.ndarray  # (n, d_k)
    v: np.ndarray  # (n, d_v)
    mask: np.ndarray | None  # (m, n) bool, True = may attend
    mask_spec: str | None  # how the mask was given ("causal", "1,1,0", ...), for the printout
    steps: AttentionSteps
    check: TorchCheck
    multi_head: MultiHeadExplanation | None = None
    contributions: np.ndarray | None = None  # (m, n): ||alpha_ij v_j||, each row scaled to sum to 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(m, n, d_k, d_v)."""
        return self.q.shape[0], self.k.shape[0], self.q.shape[1], self.v.shape[1]


def as_matrix(x: Any, name: str) -> np.ndarray:
    """A non-empty 2-D float64 array of finite numbers, or a ValueError naming ``name``."""
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise QkvError(f"{name} must be a matrix of numbers (a list of equally long rows)") from None
    if a.ndim != 2 or a.size == 0:
        raise QkvError(f"{name} must be a non-empty matrix (a list of rows), got shape {a.shape}")
    if not np.isfinite(a).all():
        raise QkvError(f"{name} contains a non-finite number")
    return a


def make_mask(spec: MaskSpec, m: int, n: int) -> np.ndarray | None:
    """A (m, n) bool mask (True = may attend) from a user's description, or None for no mask.

    spec: None or "none"; "causal" (query i sees keys up to its own position, queries aligned with
    the last m keys as in qkv.model.attention.causal_mask); a keep pattern over the n keys as "1,1,0";
    a JSON string; or a nested list / array of 0/1 or booleans, shaped (n,) or (m, n).
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() == "none":
            return None
        if text.lower() == "causal":
            return np.tril(np.ones((m, n), dtype=bool), k=n - m)
        if text.startswith("["):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as error:
                raise QkvError(f"mask {text!r} is not valid JSON: {error.msg}") from None
        else:
            try:
                spec = [int(part) for part in text.split(",")]
            except ValueError:
                raise QkvError(
                    f"mask {text!r} not understood: use 'causal', a keep pattern like 1,1,0, or a JSON matrix"
                ) from None
    try:
        a = np.asarray(spec)
    except ValueError:
        raise QkvError("mask rows must all have the same length") from None
    if a.dtype == object or not (a.dtype == bool or np.isin(a, (0, 1)).all()):
        raise QkvError("mask entries must be 0/1 or true/false (1 = may attend)")
    a = a.astype(bool)
    if a.shape == (n,):
        return np.broadcast_to(a, (m, n)).copy()  # the same keys hidden from every query
    if a.shape == (m, n):
        return a
    raise QkvError(f"mask has shape {a.shape}; it must be ({n},) over the keys or ({m}, {n}) for m x n")


def random_inputs(*, m: int, n: int, d_k: int, d_v: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded Q (m, d_k), K (n, d_k), V (n, d_v), rounded to one decimal so they print exactly."""
    for name, size in (("m", m), ("n", n), ("d_k", d_k), ("d_v", d_v)):
        if size < 1:
            raise QkvError(f"{name} must be at least 1, got {size}")
    if seed < 0:
        raise QkvError(f"seed must be non-negative, got {seed}")
    rng = np.random.default_rng([seed, 0])
    q, k, v = (np.round(rng.standard_normal(shape), 1) for shape in ((m, d_k), (n, d_k), (n, d_v)))
    return q, k, v


def load_inputs(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, MaskSpec]:
    """Read {"q": [[...]], "k": [[...]], "v": [[...]], "mask": optional} from a JSON file."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise QkvError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise QkvError(f'{path}: expected an object like {{"q": [[...]], "k": [[...]], "v": [[...]]}}')
    missing = [key for key in ("q", "k", "v") if key not in data]
    unknown = sorted(set(data) - {"q", "k", "v", "mask"})
    if missing:
        raise QkvError(f"{path}: missing {', '.join(repr(k) for k in missing)}")
    if unknown:
        raise QkvError(f"{path}: unknown key(s) {', '.join(repr(k) for k in unknown)}; expected q, k, v, mask")
    return data["q"], data["k"], data["v"], data.get("mask")


def random_projections(
    *, n_heads: int, d_model: int, d_value_in: int, d_k: int, d_v: int, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Seeded W_i^Q, W_i^K (d_model x d_k), W_i^V (d_value_in x d_v) per head, and W^O (H d_v x d_model).

    Entries are N(0, 1/fan_in) (so projections keep the inputs' scale), rounded to two decimals
    so the printed matrices are the ones used.
    """
    rng = np.random.default_rng([seed, 1])  # a stream apart from random_inputs' for the same seed

    def draw(rows: int, cols: int) -> np.ndarray:
        return np.round(rng.standard_normal((rows, cols)) / math.sqrt(rows), 2)

    w_q = [draw(d_model, d_k) for _ in range(n_heads)]
    w_k = [draw(d_model, d_k) for _ in range(n_heads)]
    w_v = [draw(d_value_in, d_v) for _ in range(n_heads)]
    return w_q, w_k, w_v, draw(n_heads * d_v, d_model)


def _torch_check(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    ref_weights: np.ndarray,
    ref_output: np.ndarray,
    projections: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], np.ndarray] | None = None,
) -> TorchCheck:
    """Run the inputs through qkv.model.attention in float32 on both paths; compare with the oracle.

    ref_weights: (H, m, n) per-head weights; ref_output: (m, d_v) single-head or (m, d_model)
    multi-head. With ``projections`` the whole multi-head computation is redone in torch.
    """

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=torch.float32)

    if projections is None:
        qh, kh, vh = t(q)[None], t(k)[None], t(v)[None]  # (1, L, d): a single head
    else:
        w_q, w_k, w_v, _ = projections
        qh = torch.stack([t(q) @ t(w) for w in w_q])  # (H, m, d_k)
        kh = torch.stack([t(k) @ t(w) for w in w_k])  # (H, n, d_k)
        vh = torch.stack([t(v) @ t(w) for w in w_v])  # (H, n, d_v)
    torch_mask = None if mask is None else torch.as_tensor(mask)  # (m, n), broadcast over heads
    m = qh.size(1)
    diffs = {}
    for need_weights in (False, True):
        with torch.no_grad():
            out, weights = scaled_dot_product_attention(qh, kh, vh, mask=torch_mask, need_weights=need_weights,
                                                        fused=not need_weights)
        out = out.transpose(0, 1).reshape(m, -1)  # (H, m, d_v) -> (m, H*d_v): heads side by side
        if projections is not None:
            out = out @ t(projections[3])  # concat W^O: (m, d_model)
        diff = float(np.abs(out.double().numpy() - ref_output).max())
        if weights is not None:
            diff = max(diff, float(np.abs(weights.double().numpy() - ref_weights).max()))
        diffs[need_weights] = diff
    return TorchCheck(fused=diffs[False], explicit=diffs[True])


def explain(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: MaskSpec = None,
    heads: int | None = None,
    head_d_k: int | None = None,
    head_d_v: int | None = None,
    seed: int = 0,
) -> Explanation:
    """Compute every step of attention(Q, K, V) with the NumPy oracle, and check qkv.model.attention against it.

    q: (m, d_k), k: (n, d_k), v: (n, d_v), as nested lists or arrays; mask: see ``make_mask``.
    With ``heads`` = H, also multi-head attention with X = Q (d_model = d_k) for the queries and
    K, V as the memory; per-head sizes default to ceil(d_model / H) as in the paper's d_model / h.
    Projections are drawn from ``seed``.
    """
    q, k, v = as_matrix(q, "Q"), as_matrix(k, "K"), as_matrix(v, "V")
    (m, d_k), (n, d_k_keys), (n_values, d_v) = q.shape, k.shape, v.shape
    if d_k_keys != d_k:
        raise QkvError(
            f"Q is {m} x {d_k} but K is {n} x {d_k_keys}: queries and keys must have the same width d_k"
        )
    if n_values != n:
        raise QkvError(f"K has {n} rows but V has {n_values}: every key needs exactly one value row")
    mask_spec = mask if isinstance(mask, str) else (None if mask is None else "given")
    mask = make_mask(mask, m, n)
    steps = reference.attention(q, k, v, mask)
    check = _torch_check(q, k, v, mask, steps.weights[None], steps.output)
    expl = Explanation(q=q, k=k, v=v, mask=mask, mask_spec=mask_spec, steps=steps, check=check,
                       contributions=shares(steps.weights[:, :, None] * v[None]))
    if heads is None:
        return expl
    if heads < 1:
        raise QkvError(f"heads must be at least 1, got {heads}")
    if seed < 0:
        raise QkvError(f"seed must be non-negative, got {seed}")
    d_model = d_k
    dk_head = head_d_k if head_d_k is not None else math.ceil(d_model / heads)
    dv_head = head_d_v if head_d_v is not None else dk_head
    if dk_head < 1 or dv_head < 1:
        raise QkvError(f"per-head sizes must be at least 1, got d_k={dk_head}, d_v={dv_head}")
    projections = random_projections(
        n_heads=heads, d_model=d_model, d_value_in=d_v, d_k=dk_head, d_v=dv_head, seed=seed
    )
    multi = reference.multi_head_attention(q, k, v, *projections, mask=mask)
    ref_weights = np.stack([head.weights for head in multi.heads])  # (H, m, n)
    multi_check = _torch_check(q, k, v, mask, ref_weights, multi.output, projections)
    expl.multi_head = MultiHeadExplanation(
        n_heads=heads,
        seed=seed,
        d_model=d_model,
        d_k=dk_head,
        d_v=dv_head,
        w_q=projections[0],
        w_k=projections[1],
        w_v=projections[2],
        w_o=projections[3],
        steps=multi,
        check=multi_check,
    )
    w_o = projections[3].reshape(heads, dv_head, d_model)  # (H * d_v, d_model) -> (H, d_v, d_model): W^O_i
    f = np.einsum("hnv,hvd->hnd", np.stack(multi.v_heads), w_o)  # (H, n, d_model): v^i_j W^O_i
    expl.multi_head.contributions = shares(np.einsum("hmn,hnd->mnd", ref_weights, f))  # (m, n, d_model) -> (m, n)
    return expl


def shares(vectors: np.ndarray) -> np.ndarray:
    """(m, n, d) vectors that sum to each output row -> (m, n) their norms, each row scaled to sum to 1
    (a row with no contribution stays 0)."""
    norms = np.linalg.norm(vectors, axis=-1)
    total = norms.sum(axis=1, keepdims=True)
    return np.divide(norms, total, out=np.zeros_like(norms), where=total > 0)


def _weight_is_not_contribution(weights: np.ndarray, contributions: np.ndarray, precision: int, *,
                                because: str = "its value's length") -> list[str]:
    """The key whose weight and contribution differ most, in words."""
    i, j = np.unravel_index(np.argmax(np.abs(weights - contributions)), weights.shape)
    w, c = weights[i, j], contributions[i, j]
    if abs(w - c) < 10 ** -precision:
        return ["   here every contribution equals its weight"]
    more = "more" if c > w else "less"
    return [f"   q{i + 1} gives k{j + 1} weight {_num(w, precision)} but k{j + 1} adds {_num(c, precision)} of what "
            f"q{i + 1} gets: {more} than its weight, because of {because}. A weight says where a query "
            "looked; a contribution, what each key added."]


# ---------------------------------------------------------------- printing


def _num(x: float, precision: int) -> str:
    if np.isneginf(x):
        return "-inf"
    text = f"{x:.{precision}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.0000"


def _matrix(
    title: str,
    a: np.ndarray,
    *,
    precision: int,
    row_name: str,
    col_names: list[str] | None = None,
    exact_zero: np.ndarray | None = None,
    row_sums: bool = False,
    indent: str = "",
) -> list[str]:
    """A titled matrix, one labelled row per line; ``exact_zero`` marks entries printed as a bare 0."""
    cells = [[_num(x, precision) for x in row] for row in a]
    if exact_zero is not None:
        cells = [["0" if z else c for c, z in zip(row, zrow)] for row, zrow in zip(cells, exact_zero)]
    header = list(col_names) if col_names else None
    if row_sums:
        for row, values in zip(cells, a):
            row.append(_num(values.sum(), precision))
        if header is not None:
            header.append("row sum")
    columns = list(zip(*cells, *([header] if header else [])))
    widths = [max(len(s) for s in col) for col in columns]
    labels = [f"{row_name}{i + 1}" for i in range(len(cells))]
    label_width = max(len(s) for s in labels)

    def line(label: str, row: list[str]) -> str:
        seps = ["  "] * len(row)
        if row_sums:
            seps[-1] = "   | "  # the sum column is not part of the matrix
        return f"{indent}  {label:>{label_width}}" + "".join(s + c.rjust(w) for s, c, w in zip(seps, row, widths))

    lines = [f"{indent}{title}"]
    if header:
        lines.append(line("", header))
    lines += [line(label, row) for label, row in zip(labels, cells)]
    return lines


def _steps_lines(
    s: AttentionSteps,
    mask: np.ndarray | None,
    *,
    names: tuple[str, str, str],
    d_k: int,
    precision: int,
    indent: str = "",
) -> list[str]:
    """The four steps for one head; ``names`` are the printed names of the query, key, value matrices."""
    qn, kn, vn = names
    (m, n), d_v = s.scores.shape, s.output.shape[1]
    keys = [f"k{j + 1}" for j in range(n)]
    p = dict(precision=precision, row_name="q", indent=indent)
    lines = _matrix(f"1. alignment scores  e = {qn} {kn}^T   (m x n = {m} x {n})", s.scores, col_names=keys, **p)
    scale = f"e / sqrt(d_k) = e / sqrt({d_k}) = e * {_num(1 / math.sqrt(d_k), precision)}"
    masked = "   masked keys -> -inf" if mask is not None else ""
    lines += [""] + _matrix(f"2. scaled scores  {scale}   (m x n = {m} x {n}){masked}", s.scaled, col_names=keys, **p)
    zero = None if mask is None else ~mask
    lines += [""] + _matrix(
        f"3. softmax of each row  alpha = softmax(e / sqrt(d_k))   (m x n = {m} x {n})",
        s.weights,
        col_names=keys,
        exact_zero=zero,
        row_sums=True,
        **p,
    )
    if mask is not None:
        lines.append(f"{indent}   masked keys get weight exactly 0")
        if not mask.any(axis=1).all():
            lines.append(f"{indent}   a query with no visible key gets all-zero weights and output, not NaN")
    lines += [""] + _matrix(
        f"4. output  alpha {vn} = weighted sum of the value rows   (m x d_v = {m} x {d_v})", s.output, **p
    )
    if n <= 6 and m <= 6:  # spell out the weighted sums while they fit on a line
        for i, row in enumerate(s.weights):
            visible = np.ones(n, dtype=bool) if mask is None else mask[i]
            terms = " + ".join(
                f"{_num(w, precision) if ok else '0'} v{j + 1}" for j, (w, ok) in enumerate(zip(row, visible))
            )
            lines.append(f"{indent}   out{i + 1} = {terms}")
    return lines


def _inputs_lines(expl: Explanation, precision: int) -> list[str]:
    m, n, d_k, d_v = expl.shape
    p = dict(precision=precision)
    lines = _matrix(f"Q  queries   (m x d_k = {m} x {d_k})", expl.q, row_name="q", **p)
    lines += [""] + _matrix(f"K  keys   (n x d_k = {n} x {d_k})", expl.k, row_name="k", **p)
    lines += [""] + _matrix(f"V  values   (n x d_v = {n} x {d_v})", expl.v, row_name="v", **p)
    if expl.mask is not None:
        source = f", from {expl.mask_spec}" if expl.mask_spec and expl.mask_spec != "given" else ""
        lines += [""] + _matrix(
            f"mask   (m x n = {m} x {n}; 1 = may attend, 0 = hidden{source})",
            expl.mask.astype(float),
            precision=0,
            row_name="q",
            col_names=[f"k{j + 1}" for j in range(n)],
        )
    return lines


def _listed(pattern: str, count: int, sep: str) -> str:
    """'head_1, head_2' for a few items, 'head_1, ..., head_8' for many."""
    names = [pattern.format(i + 1) for i in range(count)]
    return sep.join(names) if count <= 3 else f"{names[0]}{sep}...{sep}{names[-1]}"


def _multi_head_lines(expl: Explanation, mh: MultiHeadExplanation, precision: int) -> list[str]:
    m, n, _, d_v_in = expl.shape
    H, D, dk, dv = mh.n_heads, mh.d_model, mh.d_k, mh.d_v
    p = dict(precision=precision)
    heads = _listed("head_{}", H, ", ")
    lines = [
        f"Multi-head attention, H = {H} heads:  MultiHead(Q, K, V) = concat({heads}) W^O,",
        "    head_i = attention(Q W_i^Q, K W_i^K, V W_i^V)",
        f"Q is the queries' input X (m x d_model = {m} x {D}); K ({n} x {D}) and V ({n} x {d_v_in})",
        "are the memory that the keys and values are projected from. Each head has its own projections",
        f"(random, seed {mh.seed}) to d_k = {dk} and d_v = {dv}. Side by side, W^Q = [{_listed('W_{}^Q', H, ' | ')}]",
        f"is {D} x {H * dk}: Q W^Q ({m} x {H * dk}) split column-wise gives {_listed('Q_{}', H, ', ')};"
        " the same for K and V.",
    ]
    steps = mh.steps
    for i, head in enumerate(steps.heads):
        h = i + 1
        blocks = [
            (f"W_{h}^Q   (d_model x d_k = {D} x {dk})", mh.w_q[i], "r"),
            (f"W_{h}^K   (d_model x d_k = {D} x {dk})", mh.w_k[i], "r"),
            (f"W_{h}^V   (width of V x d_v = {d_v_in} x {dv})", mh.w_v[i], "r"),
            (f"Q_{h} = Q W_{h}^Q   (m x d_k = {m} x {dk})", steps.q_heads[i], "q"),
            (f"K_{h} = K W_{h}^K   (n x d_k = {n} x {dk})", steps.k_heads[i], "k"),
            (f"V_{h} = V W_{h}^V   (n x d_v = {n} x {dv})", steps.v_heads[i], "v"),
        ]
        lines += ["", f"head {h}"]
        for title, a, row_name in blocks:
            lines += _matrix(title, a, row_name=row_name, indent="    ", **p)
        names = (f"Q_{h}", f"K_{h}", f"V_{h}")
        lines += [""] + _steps_lines(head, expl.mask, names=names, d_k=dk, precision=precision, indent="    ")
    lines += [""] + _matrix(
        f"concat({heads})   (m x H*d_v = {m} x {H * dv})", mh.steps.concat, row_name="q", **p
    )
    lines += _matrix(f"W^O   (H*d_v x d_model = {H * dv} x {D})", mh.w_o, row_name="r", **p)
    lines += _matrix(
        f"multi-head output = concat W^O   (m x d_model = {m} x {D})", mh.steps.output, row_name="q", **p
    )
    lines += [
        "",
        f"multi-head, fused kernel vs step-by-step: max |diff| = {mh.check.fused:.1e}",
        f"multi-head, explicit path (need_weights=True) vs step-by-step: max |diff| = {mh.check.explicit:.1e}",
        "(the heads stacked into one (H, m, d) batch through qkv.model.attention in float32, then W^O)",
    ]
    return lines


def format_explanation(expl: Explanation, precision: int = 4) -> str:
    """The explanation as text: inputs, the four steps with shapes, the torch checks, multi-head if any."""
    if not 0 <= precision <= 12:
        raise QkvError(f"precision must be between 0 and 12 digits, got {precision}")
    lines = ["Scaled dot-product attention:  attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V", ""]
    lines += _inputs_lines(expl, precision) + [""]
    lines += _steps_lines(expl.steps, expl.mask, names=("Q", "K", "V"), d_k=expl.shape[2], precision=precision)
    keys = [f"k{j + 1}" for j in range(expl.shape[1])]
    lines += [""] + _matrix(
        "5. contributions  ||alpha_ij v_j||, each row scaled to sum to 1: what each key added to each output",
        expl.contributions, row_name="q", col_names=keys, precision=precision,
    )
    lines += _weight_is_not_contribution(expl.steps.weights, expl.contributions, precision)
    lines += [
        "",
        f"fused kernel vs step-by-step: max |diff| = {expl.check.fused:.1e}",
        f"explicit path (need_weights=True) vs step-by-step: max |diff| = {expl.check.explicit:.1e}",
        "(qkv.model.attention.scaled_dot_product_attention in float32 against the float64 NumPy steps above)",
    ]
    if expl.multi_head is not None:
        lines += ["", ""] + _multi_head_lines(expl, expl.multi_head, precision)
        mh = expl.multi_head
        mean = np.mean([head.weights for head in mh.steps.heads], axis=0)  # (m, n)
        lines += [""] + _matrix("multi-head: the heads' mean weight   (m x n)", mean, row_name="q", col_names=keys,
                                precision=precision)
        lines += _matrix("multi-head: contributions  ||sum_i alpha^i_j v^i_j W^O_i||, rows scaled to 1   (m x n)",
                         mh.contributions, row_name="q", col_names=keys, precision=precision)
        lines += _weight_is_not_contribution(mean, mh.contributions, precision,
                                             because="the length and direction of its values through W^O in each head")
    return "\n".join(lines)
