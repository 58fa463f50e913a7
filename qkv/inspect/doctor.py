"""Self-checks of the mechanism a user can run on their own install (``qkv doctor``).

Each check returns a ``CheckResult`` with the number it measured, so the command prints evidence,
not just "ok".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from qkv.inspect import reference
from qkv.model.attention import scaled_dot_product_attention
from qkv.model.config import model_preset
from qkv.model.transformer import Transformer


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
    from qkv.infer.search import DecodeConfig, beam_search, greedy_search
    from qkv.infer.translator import collate_sources

    model = model or _random_model(seed)
    sources = sources or _random_sources(16, seed)
    src = collate_sources(sources, pad_id=pad_id, eos_id=eos_id).to(model.device)
    config = DecodeConfig(beam_size=1, max_len_b=8)
    greedy = greedy_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config)
    beam = [h[0].tokens for h in beam_search(model, src, bos_id=bos_id, eos_id=eos_id, config=config)]
    same = sum(g == b for g, b in zip(greedy, beam))
    return CheckResult("greedy equals beam of size 1", same == len(sources), f"{same}/{len(sources)} identical")


def check_batch_invariance(model: Transformer | None = None, sources: list[list[int]] | None = None, *, seed: int = 0, bos_id: int = 2, eos_id: int = 3, pad_id: int = 0, beam_size: int = 3) -> CheckResult:
    """The same sentences translated one at a time and in one padded batch give identical output."""
    from qkv.infer.search import DecodeConfig, search
    from qkv.infer.translator import collate_sources

    model = model or _random_model(seed)
    sources = sources or _random_sources(32, seed)
    config = DecodeConfig(beam_size=beam_size, max_len_b=8)

    def run(batch: list[list[int]]) -> list[list[int]]:
        src = collate_sources(batch, pad_id=pad_id, eos_id=eos_id).to(model.device)
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


def checkpoint_checks(path: str, device: str | torch.device = "cpu") -> list[CheckResult]:
    """The decoding checks on a user's own checkpoint, with sentences from its tokenizer's vocabulary,
    on ``device``."""
    from qkv.io import checkpoint

    loaded = checkpoint.load(path, device=device)
    tok = loaded.tokenizer
    sentences = [
        "A man in a blue shirt is standing on a ladder.", "Two dogs play in the snow.", "A little girl is reading a book.",
        "People are walking down a busy city street at night.", "A woman plays the guitar.", "Children are swimming.",
        "A cyclist rides past a red building while a crowd watches.", "An old man sits on a bench.",
    ]
    # 32 sentences of varied lengths, so that batch invariance compares batch size 1 with 32.
    sentences = (
        sentences + [s.lower() for s in sentences] + [" ".join(s.split()[: len(s.split()) // 2]) for s in sentences]
        + [f"Yesterday, {s[0].lower()}{s[1:]}" for s in sentences]
    )
    sources = [tok.encode(s) for s in sentences]
    ids = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    return [
        check_greedy_equals_beam_of_one(loaded.model, sources, **ids),
        check_batch_invariance(loaded.model, sources, **ids, beam_size=1),
        check_batch_invariance(loaded.model, sources, **ids, beam_size=5),
    ]


def check_resume_exactness(workdir: str | None = None, *, steps: int = 60, seed: int = 0) -> CheckResult:
    """Kill a real training process with SIGKILL at a random step, resume it, and compare the result
    bitwise with an uninterrupted run of the same seed: weights and optimizer moments.

    Both runs train the "tiny" preset (with dropout, so the RNG states matter) on generated dates,
    one thread each, through ``python -m qkv train`` exactly as a user runs it.
    """
    import random
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    from qkv.data.tasks import date_pairs

    name = "resume after SIGKILL is bitwise exact"
    with tempfile.TemporaryDirectory(prefix="qkv-resume-", dir=workdir) as tmp:
        root = Path(tmp)
        data = root / "dates.tsv"
        data.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(400, seed=seed)), encoding="utf-8")
        eval_every = 10
        base = [
            sys.executable, "-m", "qkv", "train", "--preset", "tiny", "--train-src", str(data), "--max-steps", str(steps),
            "--seed", str(seed), "--no-progress", "--model", "dropout=0.1", "--data", "vocab_size=120",
            "--train", f"eval_every={eval_every}", "threads=1", "keep_last=2", "average_last=1",
        ]

        def launch(args: list[str], log: str) -> subprocess.Popen:
            with open(root / log, "w") as stderr:  # the child keeps its own copy of the handle
                return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, env=_one_thread_env())

        def saved_step(run: Path) -> int:
            try:
                return json.loads((run / "last" / "trainer.json").read_text())["step"]
            except (OSError, ValueError, KeyError):
                return 0

        whole, killed = root / "whole", root / "killed"
        if launch([*base, "--out", str(whole)], "whole.log").wait() != 0:
            return CheckResult(name, False, f"the uninterrupted run failed: {(root / 'whole.log').read_text()[-500:]}")
        # Kill once a random checkpoint (at least two before the last) is on disk, a random moment after it.
        kill_after = random.Random().randrange(eval_every, max(steps - eval_every, eval_every + 1), eval_every)
        process = launch([*base, "--out", str(killed)], "killed.log")
        while saved_step(killed) < kill_after and process.poll() is None:
            time.sleep(0.01)
        time.sleep(random.Random().uniform(0.0, 0.2))
        if process.poll() is not None:
            return CheckResult(name, False, "the run finished before it could be killed; use more steps")
        process.send_signal(signal.SIGKILL)
        process.wait()
        resumed_from = saved_step(killed)
        if not 0 < resumed_from < steps:  # killed before its first checkpoint, or after its last: nothing to resume
            return CheckResult(name, False, f"the kill came at saved step {resumed_from} of {steps}: nothing was resumed; use more steps")
        resume = [sys.executable, "-m", "qkv", "train", "--resume", str(killed), "--no-progress"]
        if launch(resume, "resumed.log").wait() != 0:
            return CheckResult(name, False, f"the resumed run failed: {(root / 'resumed.log').read_text()[-500:]}")
        diffs, compared = [], 0
        for file in ("model.safetensors", "trainer.safetensors"):
            a, b = load_file(str(whole / "last" / file)), load_file(str(killed / "last" / file))
            if a.keys() != b.keys():
                return CheckResult(name, False, f"{file}: different tensors saved")
            for key in a:
                if key.startswith("rng."):
                    continue
                compared += 1
                diffs.append(0.0 if torch.equal(a[key], b[key]) else (a[key].double() - b[key].double()).abs().max().item())
        worst = max(diffs)
        detail = (
            f"killed at step >= {kill_after}, resumed from step {resumed_from}, trained to {steps}: "
            f"{compared} tensors (weights, Adam moments), max |diff| = {worst:.1e}"
        )
        return CheckResult(name, worst == 0.0 and saved_step(killed) == steps, detail)


def _one_thread_env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
