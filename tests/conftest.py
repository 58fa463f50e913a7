"""Shared test fixtures: where Multi30k lives, one tiny training run reused by several test files, and
a small corpus of date pairs to train on.

Multi30k is read from ``$QKV_DATA`` when it is set, else from ``../shared/data/multi30k`` beside the
repository when that exists, else from qkv's own download cache (``~/.cache/qkv/multi30k``), which the
first test that needs it fills, as ``qkv train`` would. Tests that need Multi30k fail when it is missing
and cannot be downloaded, so that a CI without the data cannot pass by skipping them; set
QKV_ALLOW_MISSING_DATA=1 to skip them instead (a machine without the data).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

# `make test` runs two pytest-xdist workers: each, and every command it starts, computes on one thread,
# so that two workers share two cores instead of four threads spinning against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    import sys

    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:  # imported before this file: too late for the variable
        sys.modules["torch"].set_num_threads(1)


SHARED_MULTI30K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"


def multi30k_location(env: str | None, shared: Path) -> tuple[Path, bool]:
    """Where the tests read Multi30k, and whether it is qkv's download cache (filled on first use):
    ``env`` ($QKV_DATA, the variable qkv itself reads), else ``shared`` when it exists, else the cache."""
    if env:
        return Path(env), False
    if shared.is_dir():
        return shared, False
    from qkv.data.corpus import multi30k_dir

    return multi30k_dir(None), True


MULTI30K, MULTI30K_IS_CACHE = multi30k_location(os.environ.get("QKV_DATA"), SHARED_MULTI30K)


@functools.cache
def _download_into_the_cache() -> str:
    """Fill the cache with the files not there yet, once a session; what went wrong, or ''."""
    from qkv.data.corpus import download_multi30k
    from qkv.errors import DataError

    try:
        download_multi30k(MULTI30K)
    except DataError as error:
        return f"Multi30k not found at {MULTI30K}, and {error}"
    return ""


def require_multi30k() -> Path:
    """MULTI30K, downloaded first when it is the cache; a failure when it is missing (a skip with
    QKV_ALLOW_MISSING_DATA=1)."""
    message = _download_into_the_cache() if MULTI30K_IS_CACHE else ""
    if message or not MULTI30K.is_dir():
        message = message or f"Multi30k not found at {MULTI30K}"
        if os.environ.get("QKV_ALLOW_MISSING_DATA") == "1":
            pytest.skip(message)
        pytest.fail(f"{message} (set QKV_ALLOW_MISSING_DATA=1 to skip the tests that need it)", pytrace=False)
    return MULTI30K


@pytest.fixture
def multi30k() -> Path:
    return require_multi30k()


needs_multi30k = pytest.mark.usefixtures("multi30k")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run directory of the "tiny" preset trained for 60 steps (a few seconds): step-000050,
    step-000060, last/, best/, final/ (the average of the two step checkpoints) and the tokenizer."""
    require_multi30k()
    from qkv.train.trainer import Trainer
    from qkv.train.recipes import build_configs

    model, train, data = build_configs(
        "tiny", model={}, train={"max_steps": 60}, data={"data_dir": str(MULTI30K), "valid_limit": 20}
    )
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    Trainer(run_dir, model, train, data).run(progress=False)
    return run_dir


@pytest.fixture(scope="session")
def dates_tsv(tmp_path_factory) -> Path:
    """300 date pairs (``qkv.data.tasks.date_pairs``, seed 3) in a TSV file: a corpus that trains in seconds."""
    from qkv.data.tasks import date_pairs

    path = tmp_path_factory.mktemp("dates") / "dates.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in date_pairs(300, seed=3)), encoding="utf-8")
    return path


def require_marks(directory: Path) -> None:
    """Skip where ``directory``'s file system keeps no extended attributes: there qkv cannot mark its
    outputs, so ``--force`` replaces none (``qkv.io.outputs.written_by_qkv``), which other tests check."""
    probe = directory / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.qkv.probe", b"1")
    except (OSError, AttributeError):  # AttributeError: not Linux
        pytest.skip(f"{directory}'s file system keeps no extended attributes: qkv's outputs cannot be marked there")
    finally:
        probe.unlink()


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes): what a test compares before and after a
    command that must leave the directory as it was."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


RANDOM_MODEL_SENTENCES = ["A dog runs across the green field.", "Ein Hund rennt über die grüne Wiese.",
                          "Two children play with a red ball.", "Zwei Kinder spielen mit einem roten Ball."] * 8


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory) -> Path:
    """A random tiny model with a real 60-piece tokenizer, saved as a checkpoint: it translates and
    scores (nonsense) in milliseconds, for tests of the commands around a model."""
    import torch

    from qkv.io import checkpoint
    from qkv.model.config import model_preset
    from qkv.model.transformer import Transformer
    from qkv.data.tokenizer import Tokenizer

    where = tmp_path_factory.mktemp("random-model")
    tok = Tokenizer.train(RANDOM_MODEL_SENTENCES, vocab_size=60, path=where / "spm.model")
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    return checkpoint.save(where / "model", Transformer(config), tok, configs={"data": {"src_lang": "en", "tgt_lang": "de"}})


def assert_blocks_sum_back(model, src, tgt_in, atol: float = 1e-10) -> None:
    """Every attention block of ``model`` (float64, eval) written by qkv.inspect.contributions.decompose
    sums back to the block's real output, through the encoder and the decoder; and the contributions'
    walk ends at the model's own encoder and decoder outputs. src (B, S), tgt_in (B, T)."""
    import torch

    from qkv.inspect.contributions import contributions, decompose

    src_mask = src != model.config.pad_id
    x = model._embed(model.src_embed, src)
    for layer in model.encoder_layers:
        block = decompose(layer.attn_sublayer, layer.self_attn, x, key_mask=src_mask)
        torch.testing.assert_close(block.parts.sum(2) + block.bias, block.output, atol=atol, rtol=0)
        x, _ = layer(x, src_mask)
    memory, _, _ = model.encode(src)
    y = model._embed(model.tgt_embed, tgt_in)
    for layer in model.decoder_layers:
        block = decompose(layer.self_sublayer, layer.self_attn, y, causal=True)
        cross = decompose(layer.cross_sublayer, layer.cross_attn, block.output, memory, key_mask=src_mask)
        for b in (block, cross):
            torch.testing.assert_close(b.parts.sum(2) + b.bias, b.output, atol=atol, rtol=0)
        y, _, _ = layer(y, memory, src_mask)
    found = contributions(model, src, tgt_in)
    torch.testing.assert_close(found.memory, memory, atol=atol, rtol=0)
    torch.testing.assert_close(found.hidden, model.decode_hidden(tgt_in, memory, src_mask)[0], atol=atol, rtol=0)


# The page's tests drive Debian's Chromium (tests/e2e/test_server.py, test_documents.py).
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1280,1000",
]


@pytest.fixture
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): apt-get install -y chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    yield driver
    driver.quit()
