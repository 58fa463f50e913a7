"""Checkpoints: exact round trips, no pickle anywhere, clear errors for broken directories, averaging."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from qkv import checkpoint
from qkv.checkpoint import CheckpointError
from qkv.config import model_preset
from qkv.model import Transformer
from qkv.tokenizer import Tokenizer

SENTENCES = [
    "A dog runs across the green field.",
    "Ein Hund rennt über die grüne Wiese.",
    "Two children play with a red ball.",
    "Zwei Kinder spielen mit einem roten Ball.",
    "A woman is reading a book in the park.",
    "Eine Frau liest ein Buch im Park.",
] * 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.train(SENTENCES, vocab_size=80, path=tmp_path_factory.mktemp("tok") / "spm.model")


def make_model(tok: Tokenizer, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    config = model_preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id, **overrides)
    return Transformer(config).eval()


def logits(model: Transformer, tok: Tokenizer) -> torch.Tensor:
    src = torch.tensor([tok.encode("A dog runs.") + [tok.eos_id]])
    tgt = torch.tensor([[tok.bos_id] + tok.encode("Ein Hund rennt.")])
    with torch.no_grad():
        return model(src, tgt)


@pytest.fixture
def saved(tok, tmp_path) -> Path:
    return checkpoint.save(tmp_path / "ckpt", make_model(tok), tok, configs={"data": {"src_lang": "en"}})


# ---- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_first": True, "output_bias": True, "tie_output": False, "share_embeddings": False, "activation": "gelu"}],
)
def test_save_then_load_gives_identical_logits(tok, tmp_path, overrides):
    model = make_model(tok, **overrides)
    if model.generator.bias is not None:
        torch.nn.init.normal_(model.generator.bias)  # not its zero init, so the bias really round-trips
    checkpoint.save(tmp_path / "ckpt", model, tok, configs={"data": {"src_lang": "en", "tgt_lang": "de"}})
    loaded = checkpoint.load(tmp_path / "ckpt")
    assert loaded.model.config == model.config
    assert torch.equal(logits(loaded.model, tok), logits(model, tok))
    assert loaded.tokenizer.encode("Ein Hund rennt.") == tok.encode("Ein Hund rennt.")
    assert loaded.config["data"] == {"src_lang": "en", "tgt_lang": "de"}
    if model.config.tie_output:  # tied weights are stored once and come back tied
        assert loaded.model.generator.weight is loaded.model.tgt_embed.weight


def test_a_checkpoint_holds_no_pickle(saved, tiny_run):
    for directory in (saved, tiny_run / "last", tiny_run / "final"):
        suffixes = {p.suffix for p in directory.iterdir()}
        assert suffixes <= {".safetensors", ".json", ".model"}, directory
    assert (tiny_run / "last" / checkpoint.TRAINER_TENSORS).exists()  # the resumable one has training state


# ---- broken checkpoints ----------------------------------------------------------------------


class CreatesFile:
    """Unpickling this creates a file: what a malicious 'checkpoint' could do with torch.load."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_posing_as_weights_is_refused_not_unpickled(saved, tmp_path):
    payload = pickle.dumps({"weights": CreatesFile(tmp_path / "unpickled-control")})
    pickle.loads(payload)
    assert (tmp_path / "unpickled-control").exists()  # the payload is live: unpickling it runs code

    marker = tmp_path / "unpickled"
    (saved / checkpoint.WEIGHTS).write_bytes(pickle.dumps({"weights": CreatesFile(marker)}))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        checkpoint.load(saved)
    assert not marker.exists()


def test_truncated_weights_name_the_file(saved):
    weights = saved / checkpoint.WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted"):
        checkpoint.load(saved)


def test_a_newer_format_asks_for_a_newer_qkv(saved):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    (saved / checkpoint.CONFIG).write_text(json.dumps({**config, "format": 99}))
    with pytest.raises(CheckpointError, match="format 99.*newer"):
        checkpoint.load(saved)


def test_missing_or_broken_files_are_named(saved):
    (saved / checkpoint.TOKENIZER).unlink()
    with pytest.raises(CheckpointError, match="tokenizer.model is missing"):
        checkpoint.load(saved)
    (saved / checkpoint.CONFIG).write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        checkpoint.load(saved)
    (saved / checkpoint.CONFIG).unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        checkpoint.load(saved)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(saved.parent / "nowhere")


def test_weights_that_do_not_match_the_config_are_refused(tok, saved):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    config["model"]["d_ff"] = 128
    (saved / checkpoint.CONFIG).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        checkpoint.load(saved)


# ---- averaging and resolving -----------------------------------------------------------------


def test_average_is_the_mean_of_the_weights(tok, tmp_path):
    a, b = make_model(tok, seed=1), make_model(tok, seed=2)
    dirs = [checkpoint.save(tmp_path / "a", a, tok), checkpoint.save(tmp_path / "b", b, tok)]
    mean = checkpoint.average(dirs)
    sa, sb = a.state_dict(), b.state_dict()
    # every distinct parameter once (the tied embedding/projection under one of its names)
    assert set(mean) <= set(sa) and len(mean) == len(list(a.parameters()))
    for name, value in mean.items():
        torch.testing.assert_close(value, (sa[name] + sb[name]) / 2)
    # written as a checkpoint, the mean loads into a model that holds it (tied weights included)
    checkpoint.save(tmp_path / "mean", a, tok, state_dict=mean)
    loaded = checkpoint.load(tmp_path / "mean").model.state_dict()
    for name in sa:
        torch.testing.assert_close(loaded[name], (sa[name] + sb[name]) / 2)
    with pytest.raises(CheckpointError, match="no checkpoints"):
        checkpoint.average([])


def test_resolve_prefers_final_then_best_then_last(saved, tmp_path):
    run = tmp_path / "run"
    for name in ("last", "best", "final"):
        shutil.copytree(saved, run / name)
    assert checkpoint.resolve(run) == run / "final"
    assert checkpoint.resolve(run / "last") == run / "last"  # a checkpoint directory is itself
    shutil.rmtree(run / "final")
    assert checkpoint.resolve(run) == run / "best"
    shutil.rmtree(run / "best")
    assert checkpoint.resolve(run) == run / "last"
    shutil.rmtree(run / "last")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoint.resolve(run)


def test_saving_over_a_checkpoint_replaces_it_whole(tok, tmp_path):
    checkpoint.save(tmp_path / "ckpt", make_model(tok, seed=1), tok, trainer={"step": 1})
    assert (tmp_path / "ckpt" / checkpoint.TRAINER_JSON).exists()
    second = make_model(tok, seed=2)
    checkpoint.save(tmp_path / "ckpt", second, tok)
    assert not (tmp_path / "ckpt" / checkpoint.TRAINER_JSON).exists()  # nothing left from the first
    assert torch.equal(logits(checkpoint.load(tmp_path / "ckpt").model, tok), logits(second, tok))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp or .old left behind


# ---- manifest and crash safety ---------------------------------------------------------------


def test_the_manifest_records_every_file_with_its_checksum(saved):
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    files = {p.name for p in saved.iterdir()} - {checkpoint.MANIFEST}
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (saved / name).stat().st_size
        assert entry["sha256"] == checkpoint.sha256(saved / name)


def test_a_flipped_bit_fails_the_checksum_and_names_the_other_checkpoints(tok, tmp_path):
    run = tmp_path / "run"
    for name in ("best", "last"):
        checkpoint.save(run / name, make_model(tok), tok)
    weights = run / "last" / checkpoint.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # inside a weight: still valid safetensors, silently wrong numbers
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last/model\.safetensors fails its SHA-256 check.*other checkpoints.*best"):
        checkpoint.load(run / "last")
    checkpoint.load(run / "best")  # the good one still loads


def test_a_changed_size_is_caught_by_the_manifest(saved):
    config = saved / checkpoint.CONFIG
    config.write_text(config.read_text() + "\n\n")  # still valid JSON with the same content, but not what was saved
    with pytest.raises(CheckpointError, match=r"config\.json is \d+ bytes, its manifest says \d+"):
        checkpoint.load(saved)


def test_a_crash_between_the_renames_leaves_the_old_checkpoint_usable(tok, saved):
    expected = logits(checkpoint.load(saved).model, tok)
    saved.rename(saved.with_name(saved.name + ".old"))  # as if killed after moving the old one aside
    torch.testing.assert_close(logits(checkpoint.load(saved).model, tok), expected, rtol=0, atol=0)
