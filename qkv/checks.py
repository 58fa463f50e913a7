"""Self-checks of the mechanism a user can run on their own install (``qkv doctor``).

Each check returns a ``CheckResult`` with the number it measured, so the command prints evidence,
not just "ok".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qkv import reference
from qkv.attention import scaled_dot_product_attention
from qkv.config import model_preset
from qkv.model import Transformer


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str


def check_reference_parity(seed: int = 0) -> CheckResult:
    """Explicit and fused attention equal the NumPy reference on rectangular inputs (m != n, d_k != d_v)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, 6, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    expected = reference.attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy()).output
    explicit, _ = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
    fused, _ = scaled_dot_product_attention(q, k, v, mask=mask)
    diff = max(np.abs(explicit.numpy() - expected).max(), np.abs(fused.numpy() - expected).max())
    return CheckResult("attention equals the NumPy reference", diff < 1e-5, f"max |diff| = {diff:.2e}")


def check_masks(seed: int = 0) -> CheckResult:
    """Masked keys get exactly zero weight, and a fully masked query gives zeros, not NaN."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False  # padding keys
    mask[3] = False  # a query that sees nothing
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask, need_weights=True)
    leaked = weights[~mask].abs().max().item()
    finite = bool(torch.isfinite(out).all())
    passed = leaked == 0.0 and finite and out[3].abs().max().item() == 0.0
    return CheckResult("masked keys get zero weight", passed, f"max masked weight = {leaked}, finite = {finite}")


def check_causality(seed: int = 0) -> CheckResult:
    """Changing a future target token leaves the logits of earlier positions unchanged."""
    torch.manual_seed(seed)
    model = Transformer(model_preset("tiny", src_vocab_size=16, tgt_vocab_size=16)).eval()
    src = torch.randint(1, 16, (1, 5))
    tgt = torch.randint(1, 16, (1, 6))
    changed = tgt.clone()
    changed[0, 4] = (tgt[0, 4] % 15) + 1
    with torch.no_grad():
        diff = (model(src, tgt)[:, :4] - model(src, changed)[:, :4]).abs().max().item()
    return CheckResult("decoder cannot see the future", diff == 0.0, f"max |logit change| before t = {diff:.2e}")


def check_cache(seed: int = 0) -> CheckResult:
    """Incremental decoding with the key/value cache equals the full forward pass."""
    torch.manual_seed(seed)
    model = Transformer(model_preset("tiny", src_vocab_size=16, tgt_vocab_size=16)).eval()
    src, tgt = torch.randint(1, 16, (2, 7)), torch.randint(1, 16, (2, 5))
    with torch.no_grad():
        full = model(src, tgt)
        memory, src_mask, _ = model.encode(src)
        state = model.new_state()
        steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, state=state)[0] for t in range(tgt.size(1))]
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    return CheckResult("cached decoding equals full decoding", diff < 1e-4, f"max |diff| = {diff:.2e}")


MECHANISM_CHECKS = [check_reference_parity, check_masks, check_causality, check_cache]


def run_checks(checks=MECHANISM_CHECKS) -> list[CheckResult]:
    return [check() for check in checks]
