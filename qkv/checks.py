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


def _random_model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_preset("tiny", src_vocab_size=40, tgt_vocab_size=40)).eval()


def _random_sources(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def check_greedy_equals_beam_of_one(model: Transformer | None = None, sources: list[list[int]] | None = None, *, seed: int = 0, bos_id: int = 2, eos_id: int = 3, pad_id: int = 0) -> CheckResult:
    """Beam search with a beam of one returns exactly the greedy output."""
    from qkv.decode import DecodeConfig, beam_search, greedy_search
    from qkv.translate import collate_sources

    model = model or _random_model(seed)
    sources = sources or _random_sources(16, seed)
    src = collate_sources(sources, pad_id=pad_id, eos_id=eos_id)
    config = DecodeConfig(beam_size=1, max_len_b=8)
    greedy = greedy_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config)
    beam = [h[0].tokens for h in beam_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config)]
    same = sum(g == b for g, b in zip(greedy, beam))
    return CheckResult("greedy equals beam of size 1", same == len(sources), f"{same}/{len(sources)} identical")


def check_batch_invariance(model: Transformer | None = None, sources: list[list[int]] | None = None, *, seed: int = 0, bos_id: int = 2, eos_id: int = 3, pad_id: int = 0, beam_size: int = 3) -> CheckResult:
    """The same sentences translated one at a time and in one padded batch give identical output."""
    from qkv.decode import DecodeConfig, search
    from qkv.translate import collate_sources

    model = model or _random_model(seed)
    sources = sources or _random_sources(32, seed)
    config = DecodeConfig(beam_size=beam_size, max_len_b=8)

    def run(batch: list[list[int]]) -> list[list[int]]:
        src = collate_sources(batch, pad_id=pad_id, eos_id=eos_id)
        return [h[0].tokens for h in search(model, src, bos_id=bos_id, eos_id=eos_id, config=config)]

    alone = [run([s])[0] for s in sources]
    together = run(sources)
    same = sum(a == b for a, b in zip(alone, together))
    return CheckResult(
        f"batch invariance (batch 1 vs {len(sources)}, beam {beam_size})", same == len(sources), f"{same}/{len(sources)} identical"
    )


MECHANISM_CHECKS = [
    check_reference_parity,
    check_masks,
    check_causality,
    check_cache,
    check_greedy_equals_beam_of_one,
    check_batch_invariance,
]


def run_checks(checks=MECHANISM_CHECKS) -> list[CheckResult]:
    return [check() for check in checks]


def checkpoint_checks(path: str) -> list[CheckResult]:
    """The decoding checks on a user's own checkpoint, with sentences from its tokenizer's vocabulary."""
    from qkv import checkpoint

    loaded = checkpoint.load(path)
    tok = loaded.tokenizer
    sentences = [
        "A man in a blue shirt is standing on a ladder.", "Two dogs play in the snow.", "A little girl is reading a book.",
        "People are walking down a busy city street at night.", "A woman plays the guitar.", "Children are swimming.",
        "A cyclist rides past a red building while a crowd watches.", "An old man sits on a bench.",
    ]
    sources = [tok.encode(s) for s in sentences]
    ids = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    return [
        check_greedy_equals_beam_of_one(loaded.model, sources, **ids),
        check_batch_invariance(loaded.model, sources, **ids, beam_size=1),
        check_batch_invariance(loaded.model, sources, **ids, beam_size=5),
    ]
