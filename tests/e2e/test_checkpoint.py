"""Checkpoints: exact round trips, no pickle anywhere, clear errors for broken directories, averaging."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.io import checkpoint, manifest
from qkv.io.checkpoint import CheckpointError
from qkv.model.config import model_preset
from qkv.model.transformer import Transformer
from qkv.data.tokenizer import Tokenizer

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


def rewrite(directory: Path, name: str, data: bytes | str) -> None:
    """Replace one file and write a manifest that agrees: a checkpoint damaged or crafted by someone
    who also updated the checksums, so that the checks after verification are reached."""
    path = directory / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    manifest.write(directory)


def test_truncated_weights_name_the_file(saved):
    weights = saved / checkpoint.WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted"):
        checkpoint.load(saved)


def test_a_newer_format_asks_for_a_newer_qkv(saved):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    rewrite(saved, checkpoint.CONFIG, json.dumps({**config, "format": 99}))
    with pytest.raises(CheckpointError, match="format 99.*newer"):
        checkpoint.load(saved)


def test_missing_or_broken_files_are_named(saved):
    (saved / checkpoint.TOKENIZER).unlink()
    with pytest.raises(CheckpointError, match="tokenizer.model is missing"):
        checkpoint.load(saved)
    tokenizer = saved.parent / "tokenizer.model"
    tokenizer.write_bytes(b"")
    rewrite(saved, checkpoint.CONFIG, "{not json")  # the manifest now lists no tokenizer
    with pytest.raises(CheckpointError, match="does not list tokenizer.model"):
        checkpoint.load(saved)
    rewrite(saved, checkpoint.TOKENIZER, b"")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        checkpoint.load(saved)
    rewrite(saved, checkpoint.CONFIG, json.dumps({"format": checkpoint.FORMAT_VERSION}))
    with pytest.raises(CheckpointError, match='config.json has no "model" section'):
        checkpoint.load(saved)
    (saved / checkpoint.CONFIG).unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        checkpoint.load(saved)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(saved.parent / "nowhere")


def test_weights_that_do_not_match_the_config_are_refused(tok, saved):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    config["model"]["d_ff"] = 128
    rewrite(saved, checkpoint.CONFIG, json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model.safetensors does not match its config: .* is \[64\], the config makes it \[128\]"):
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


def crash_between_the_renames(tok, saved, monkeypatch) -> None:
    """Save over ``saved`` and die after it was moved aside to NAME.old, before NAME.tmp took its place."""
    real_replace = os.replace

    def killed_on_the_second_rename(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError(errno.EIO, "killed")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", killed_on_the_second_rename)
    with pytest.raises(OSError, match="killed"):
        checkpoint.save(saved, make_model(tok, seed=5), tok)
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    assert not saved.exists() and saved.with_name(saved.name + ".old").is_dir()


def test_a_crash_between_the_renames_leaves_the_old_checkpoint_usable(tok, saved, monkeypatch):
    expected = logits(checkpoint.load(saved).model, tok)
    crash_between_the_renames(tok, saved, monkeypatch)
    with pytest.warns(checkpoint.CheckpointWarning, match="the copy an interrupted save left"):  # never silently
        loaded = checkpoint.load(saved)
    torch.testing.assert_close(logits(loaded.model, tok), expected, rtol=0, atol=0)


def test_a_users_backup_named_old_is_never_loaded_deleted_or_replaced(tok, saved, tmp_path):
    backup = saved.with_name(saved.name + ".old")
    saved.rename(backup)  # the user's own `mv ckpt ckpt.old`
    before = {p.name: p.read_bytes() for p in backup.iterdir()}
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(saved)  # not taken for ckpt
    checkpoint.save(saved, make_model(tok, seed=3), tok)  # a new ckpt beside it
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == before
    with pytest.raises(CheckpointError, match=r"ckpt\.old is in the way and qkv did not write it"):
        checkpoint.save(saved, make_model(tok, seed=4), tok)  # replacing ckpt would need ckpt.old: refused
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == before
    checkpoint.verify(saved)  # and ckpt itself is still whole


def test_a_users_directory_named_tmp_is_never_deleted(tok, tmp_path):
    mine = tmp_path / "avg.tmp"
    shutil.copytree(checkpoint.save(tmp_path / "elsewhere", make_model(tok), tok), mine)  # a whole checkpoint the user keeps there
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    with pytest.raises(CheckpointError, match=r"avg\.tmp is in the way and qkv did not write it"):
        checkpoint.save(tmp_path / "avg", make_model(tok), tok)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    assert not (tmp_path / "avg").exists()


# ---- checkpoints from someone else: verify first, parse after, names confined ----------------


def test_a_checkpoint_without_a_valid_manifest_is_refused(saved):
    manifest = saved / checkpoint.MANIFEST
    original = manifest.read_text()
    for broken, message in [
        (json.dumps({"format": 1, "files": []}), "not a valid manifest"),
        (json.dumps({"format": 1, "files": {}}), "does not list model.safetensors, config.json, tokenizer.model"),
        ('{"format": 1}', "not a valid manifest"),
    ]:
        manifest.write_text(broken)
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load(saved)
    manifest.unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json, so its files cannot be verified"):
        checkpoint.load(saved)
    manifest.write_text(original)
    checkpoint.load(saved)  # whole again


@pytest.mark.parametrize("name", ["/dev/zero", "../outside.txt", "sub/model.safetensors", "notes.txt"])
def test_manifest_names_are_confined_to_the_checkpoint_files(saved, name):
    (saved.parent / "outside.txt").write_text("a secret of 27 bytes length")
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    manifest["files"][name] = {"bytes": 0, "sha256": "0" * 64}
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lists files a checkpoint does not hold") as error:
        checkpoint.load(saved)  # /dev/zero would hang a reader; ../ would leak another file's size
    assert "27" not in str(error.value).replace(str(saved), "")  # the size, not a number in the temporary path (pytest-27)


def test_symlinks_and_special_files_in_a_checkpoint_are_refused(saved, tmp_path):
    elsewhere = tmp_path / "elsewhere.model"
    shutil.copyfile(saved / checkpoint.TOKENIZER, elsewhere)
    (saved / checkpoint.TOKENIZER).unlink()
    (saved / checkpoint.TOKENIZER).symlink_to(elsewhere)  # same bytes, so the checksum alone would pass
    with pytest.raises(CheckpointError, match="tokenizer.model is not a regular file"):
        checkpoint.load(saved)


def test_files_are_verified_before_any_is_parsed(saved, monkeypatch):
    parsed = []
    real = checkpoint.load_tokenizer  # what checkpoint.load calls to parse tokenizer.model
    monkeypatch.setattr(checkpoint, "load_tokenizer", lambda path: parsed.append(path) or real(path))
    checkpoint.load(saved)
    assert parsed == [saved / checkpoint.TOKENIZER]  # the patch sees the parse of a good checkpoint
    parsed.clear()
    tokenizer = saved / checkpoint.TOKENIZER
    data = bytearray(tokenizer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum can tell
    tokenizer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tokenizer.model fails its SHA-256 check"):
        checkpoint.load(saved)
    assert parsed == []  # SentencePiece's C++ parser never saw the damaged file


def test_a_config_asking_for_a_huge_model_is_refused_before_allocating(saved):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    config["model"].update(src_vocab_size=10**9, tgt_vocab_size=10**9)  # 128 GB of embeddings in float32
    rewrite(saved, checkpoint.CONFIG, json.dumps(config))
    with pytest.raises(CheckpointError, match=r"does not match its config: .*the config makes it \[1000000000, 32\]"):
        checkpoint.load(saved)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_len": 10**9}, r"asks for [\d,]+ MiB of weights and tables, the file holds [\d.]+ MiB: refused before allocating"),
        ({"n_encoder_layers": 400}, r"lacks 4776 weights its config needs \(encoder_layers\.2\.self_attn\.in_proj\.weight, .* and 4773 more\)"),
        ({"n_encoder_layers": 10**6}, "asks for more than 1000 layers"),
    ],
)
def test_a_config_asking_for_much_more_memory_than_its_weights_is_refused(saved, change, message):
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    config["model"].update(change)  # the positional table is not stored, and missing layers are not either
    rewrite(saved, checkpoint.CONFIG, json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(saved)


def test_averaging_verifies_and_requires_the_same_model(tok, tmp_path):
    a = checkpoint.save(tmp_path / "a", make_model(tok, seed=1), tok)
    b = checkpoint.save(tmp_path / "b", make_model(tok, seed=2), tok)
    wider = checkpoint.save(tmp_path / "wider", make_model(tok, seed=3, d_ff=128), tok)
    with pytest.raises(CheckpointError, match="another model config"):
        checkpoint.average([a, wider])
    weights = b / checkpoint.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"b/model\.safetensors fails its SHA-256 check"):
        checkpoint.average([a, b])


def test_saving_an_averaged_state_requires_every_weight(tok, tmp_path):
    model = make_model(tok)
    state = {name: value for name, value in model.state_dict().items() if "decoder_layers.1." not in name}
    with pytest.raises(CheckpointError, match=r"does not match the model: missing decoder_layers\.1\.\S+, .* and \d+ more; unexpected none"):
        checkpoint.save(tmp_path / "avg", model, tok, state_dict=state)
    assert not (tmp_path / "avg").exists() and not (tmp_path / "avg.tmp").exists()


def test_steps_sort_by_number_not_as_text(tmp_path):
    for step in (999_999, 1_000_000, 5):
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / "step-notes").mkdir()
    assert [d.name for d in checkpoint.step_dirs(tmp_path)] == ["step-5", "step-999999", "step-1000000"]


# ---- writing: never over a user's directory, never a window with nothing loadable ------------


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tok, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(CheckpointError, match="not a qkv checkpoint"):
        checkpoint.save(mine, make_model(tok), tok)
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_save_after_a_crash_between_the_renames_keeps_the_old_copy_until_the_new_is_in_place(tok, saved, monkeypatch):
    expected = logits(checkpoint.load(saved).model, tok)
    crash_between_the_renames(tok, saved, monkeypatch)
    crash_between_the_renames(tok, saved, monkeypatch)  # and again, before the new copy was in place
    # the only whole copy survived the failed saves and still loads
    with pytest.warns(checkpoint.CheckpointWarning):
        torch.testing.assert_close(logits(checkpoint.load(saved).model, tok), expected, rtol=0, atol=0)
    second = make_model(tok, seed=6)
    checkpoint.save(saved, second, tok)  # and the next save completes and cleans up
    assert torch.equal(logits(checkpoint.load(saved).model, tok), logits(second, tok))
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]
    assert checkpoint.MARKER not in {p.name for p in saved.iterdir()}


def test_a_full_disk_leaves_the_previous_checkpoint_whole(tok, saved, monkeypatch):
    expected = logits(checkpoint.load(saved).model, tok)

    def disk_full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Tokenizer, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(saved, make_model(tok, seed=7), tok)
    monkeypatch.undo()
    assert sorted(p.name for p in saved.parent.iterdir()) == ["ckpt"]  # no NAME.tmp left to fill the disk
    torch.testing.assert_close(logits(checkpoint.load(saved).model, tok), expected, rtol=0, atol=0)


def test_a_second_writer_waits_for_the_lock_and_is_refused_after_the_timeout(tok, saved, monkeypatch):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(30)", str(saved.parent)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setattr(checkpoint, "LOCK_TIMEOUT", 0.5)
        with pytest.raises(CheckpointError, match="another process has been writing a checkpoint"):
            checkpoint.save(saved, make_model(tok, seed=8), tok)
    finally:
        holder.kill()
        holder.wait()
    checkpoint.save(saved, make_model(tok, seed=8), tok)  # free again


@pytest.mark.parametrize("name", [checkpoint.TRAINER_JSON, checkpoint.TRAINER_TENSORS])
def test_training_state_left_out_of_the_manifest_is_refused_not_parsed(tok, tmp_path, name):
    run = checkpoint.save(tmp_path / "last", make_model(tok), tok, trainer={"step": 7, "epoch": 0, "position": 0},
                          optimizer=torch.optim.Adam(make_model(tok).parameters()))
    manifest = json.loads((run / checkpoint.MANIFEST).read_text())
    del manifest["files"][name]  # the file stays, unverifiable: an edited step count would be accepted
    (run / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    state = json.loads((run / checkpoint.TRAINER_JSON).read_text())
    (run / checkpoint.TRAINER_JSON).write_text(json.dumps({**state, "step": 700}))
    with pytest.raises(CheckpointError, match=f"{name} is not in the checkpoint's manifest"):
        checkpoint.load_trainer(run)
