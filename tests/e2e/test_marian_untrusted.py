"""`qkv import marian` on directories nobody vouches for: sizes bounded before anything is allocated,
every value read from the JSON files checked, pytorch_model.bin refused where torch cannot read it safely;
and an imported model's generation settings kept through fine-tuning into the Marian export.

Offline: the Marian directory is the one tests/e2e/test_marian.py builds (Multi30k for its SentencePiece models).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_marian import build_marian_dir, in_process, multi30k_lines, refused  # noqa: E402

from qkv.io import checkpoint
from qkv.interop import marian  # noqa: E402
from qkv.interop.marian import export_marian, import_marian  # noqa: E402
from qkv.train.recipes import build_configs, fine_tuning_model  # noqa: E402
from qkv.train.trainer import Trainer  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    return build_marian_dir(tmp_path_factory.mktemp("untrusted") / "opus-mt-en-de")


def edited(marian_dir: Path, where: Path, **files: dict) -> Path:
    """A copy of the Marian directory with some keys of its JSON files replaced (``config={...}``,
    ``tokenizer_config={...}``, ``generation_config={...}``)."""
    shutil.copytree(marian_dir, where)
    for name, changes in files.items():
        path = where / f"{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return where


@pytest.fixture
def nothing_allocated(monkeypatch) -> None:
    """Fail the test if the import builds transformers' model or unpickles weights (where the memory goes)."""

    def allocates(*args, **kwargs):
        raise AssertionError("the import allocated the model or read the weights before refusing")

    monkeypatch.setattr(transformers.MarianMTModel, "__init__", allocates)
    monkeypatch.setattr(torch, "load", allocates)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"encoder_ffn_dim": 2**24, "decoder_ffn_dim": 2**24},
         r"asks for 16,\d{3} MiB of weights and tables, the file holds 0\.\d MiB: refused before allocating"),
        ({"d_model": 4096, "encoder_attention_heads": 4, "decoder_attention_heads": 4}, r"asks for \d[\d,]* MiB of weights and tables"),
        ({"max_position_embeddings": 2**22}, r"asks for \d[\d,]* MiB of weights and tables"),
        ({"encoder_layers": 600, "decoder_layers": 401}, r"asks for more than 1000 layers: refused"),
        ({"encoder_ffn_dim": 2**32, "decoder_ffn_dim": 2**32},
         r"config\.json: encoder_ffn_dim must be an integer from 1 to 16777216, got 4294967296"),
    ],
)
def test_a_config_asking_for_more_than_its_weights_hold_is_refused_before_allocating(
    marian_dir, tmp_path, capsys, nothing_allocated, weights, changes, message
):
    """The issue's 2 MB directory asking for encoder_ffn_dim 2^32, and configs whose sizes pass one by one
    but together ask for gigabytes (or for more layers than MAX_LAYERS) next to a 0.2 MB weight file."""
    hf_dir = edited(marian_dir, tmp_path / "hf", config=changes)
    if weights == "pytorch_model.bin":
        from safetensors.torch import load_file

        state = load_file(hf_dir / "model.safetensors")
        (hf_dir / "model.safetensors").unlink()
        with open(hf_dir / "pytorch_model.bin", "wb") as handle:
            torch.save(state, handle)
    result = in_process(capsys, "import", "marian", hf_dir, "--out", tmp_path / "ckpt")
    refused(result, "import", "")
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "file, key, value, expected",
    [
        ("config", "encoder_layers", "2", "an integer from 0 to 16777216, got '2'"),
        ("config", "encoder_layers", [2], "an integer from 0 to 16777216, got [2]"),
        ("config", "decoder_layers", None, "an integer from 0 to 16777216, got None"),
        ("config", "d_model", -32, "an integer from 1 to 16777216, got -32"),
        ("config", "vocab_size", True, "an integer from 1 to 16777216, got True"),
        ("config", "dropout", "0.1", "a number in [0, 1), got '0.1'"),
        ("config", "attention_dropout", 1.5, "a number in [0, 1), got 1.5"),
        ("config", "scale_embedding", 1, "true or false, got 1"),
        ("config", "activation_function", ["swish"], "a string, got ['swish']"),
        ("config", "bad_words_ids", "[[526]]", "a list of non-empty lists of token ids (0 to 526), got '[[526]]'"),
        ("tokenizer_config", "additional_special_tokens", 5, "a list or an object of tokens, got 5"),
        ("tokenizer_config", "additional_special_tokens", [7], 'a string or {"content": string}, got 7'),
        ("tokenizer_config", "eos_token", 5, 'a string or {"content": string}, got 5'),
        ("tokenizer_config", "pad_token", {"content": None}, 'a string or {"content": string}, got {\'content\': None}'),
        ("tokenizer_config", "added_tokens_decoder", {"0": 3}, 'a string or {"content": string}, got 3'),
        ("tokenizer_config", "source_lang", ["en"], "a string or null, got ['en']"),
        ("tokenizer_config", "clean_up_tokenization_spaces", "yes", "true, false or null, got 'yes'"),
        ("generation_config", "max_length", 0, "an integer from 1 to 16777216, got 0"),
        ("generation_config", "bad_words_ids", [[10**6]], "a list of non-empty lists of token ids (0 to 526), got [[1000000]]"),
        ("generation_config", "bad_words_ids", [526], "a list of non-empty lists of token ids (0 to 526), got [526]"),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_one_line_naming_the_file_and_key(marian_dir, tmp_path, capsys, file, key, value, expected):
    hf_dir = edited(marian_dir, tmp_path / "hf", **{file: {key: value}})
    refused(in_process(capsys, "import", "marian", hf_dir, "--out", tmp_path / "ckpt"), "import", f"{hf_dir / file}.json: {key} must be {expected}")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "value, message",
    [
        (["<eop>\n>>fr<<"], "adds tokens qkv's Marian tokenizer does not have (<eop>\\n>>fr<<)"),
        (0, "additional_special_tokens must be a list or an object of tokens, got 0"),
        (False, "additional_special_tokens must be a list or an object of tokens, got False"),
    ],
)
def test_added_tokens_are_refused_in_one_line(marian_dir, tmp_path, capsys, value, message):
    """A token holding a line break is shown escaped; a falsy non-list is not taken for an empty list."""
    hf_dir = edited(marian_dir, tmp_path / "hf", tokenizer_config={"additional_special_tokens": value})
    refused(in_process(capsys, "import", "marian", hf_dir, "--out", tmp_path / "ckpt"), "import", message)


def test_weights_of_other_shapes_than_the_config_says_are_one_line(marian_dir, tmp_path, capsys):
    """A config asking for less than the file holds passes the size check; the shapes then differ."""
    hf_dir = edited(marian_dir, tmp_path / "hf", config={"encoder_ffn_dim": 32, "decoder_ffn_dim": 32})
    refused(in_process(capsys, "import", "marian", hf_dir, "--out", tmp_path / "ckpt"), "import",
            "does not match its config.json: size mismatch for model.")  # fmt: skip


SCALARS = st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=6)
# Scalars as often as containers (st.recursive draws mostly lists and objects).
JSON = (
    SCALARS | st.lists(SCALARS, max_size=3) | st.dictionaries(st.text(max_size=4), SCALARS, max_size=2)
    | st.lists(st.lists(SCALARS, max_size=2), max_size=2)
)
# The keys the import may read that a saved model's files leave out; of config.json and tokenizer_config.json
# every key they hold is tried too (generation_config.json's others are transformers' alone).
MORE_KEYS = {
    "config": list(marian.GENERATION_KEYS),
    "tokenizer_config": ["unk_token", "additional_special_tokens", "clean_up_tokenization_spaces"],
    "generation_config": list(marian.GENERATION_KEYS),
}


@pytest.mark.parametrize("file", sorted(MORE_KEYS))
def test_any_value_for_any_key_imports_or_is_refused_in_one_line(marian_dir, file):
    """Whatever JSON value a key of config.json or tokenizer_config.json (or a generation setting) holds,
    the import succeeds or raises a ValueError with a one-line message: never another exception (a
    TypeError from transformers, an allocator's failure)."""
    saved = json.loads((marian_dir / f"{file}.json").read_text()) if file != "generation_config" else {}
    keys = sorted({*saved, *MORE_KEYS[file]})

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(key=st.sampled_from(keys), value=JSON)
    def imports_or_refuses(key, value):
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = edited(marian_dir, Path(tmp) / "hf", **{file: {key: value}})
            try:
                import_marian(hf_dir, Path(tmp) / "ckpt")
            except ValueError as error:
                assert "\n" not in str(error) and str(error), repr(error)

    imports_or_refuses()


def test_pyproject_asks_for_a_torch_that_loads_pytorch_model_bin_safely():
    tomllib = pytest.importorskip("tomllib")
    dependencies = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    bounds = [re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)(\.\d+)?", d.strip()) for d in dependencies if re.match(r"torch\b", d)]
    assert len(bounds) == 1 and bounds[0], dependencies
    assert (int(bounds[0][1]), int(bounds[0][2])) >= marian.SAFE_TORCH_LOAD == (2, 6)


def test_pytorch_model_bin_is_refused_on_a_torch_older_than_2_6(marian_dir, tmp_path, capsys, monkeypatch):
    """On torch < 2.6 weights_only=True does not stop a crafted file running code (CVE-2025-32434): the
    import never calls torch.load there; model.safetensors still imports."""
    bin_dir = tmp_path / "bin"
    shutil.copytree(marian_dir, bin_dir)
    model = transformers.MarianMTModel.from_pretrained(bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    assert in_process(capsys, "import", "marian", bin_dir, "--out", tmp_path / "now").returncode == 0  # on this torch
    calls = []
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(args))
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    assert marian.torch_version() == (2, 5)
    refused(in_process(capsys, "import", "marian", bin_dir, "--out", tmp_path / "old"), "import",
            "pytorch_model.bin is refused: torch 2.5.1 can run code hidden in such a file (CVE-2025-32434); "
            "convert it to model.safetensors, or upgrade torch to 2.6 or later")  # fmt: skip
    assert calls == [] and not (tmp_path / "old").exists()
    assert in_process(capsys, "import", "marian", marian_dir, "--out", tmp_path / "safetensors").returncode == 0


def test_a_fine_tuned_imported_model_exports_with_the_original_generation_settings(marian_dir, tmp_path):
    """The settings the import keeps (bad_words_ids, num_beams, max_length) survive `train --init-from`,
    and a resumed run of it, into `export --format marian`."""
    generation = json.loads((marian_dir / "generation_config.json").read_text())
    hf_dir = edited(marian_dir, tmp_path / "hf", generation_config={"bad_words_ids": [[generation["pad_token_id"]]], "num_beams": 3})
    imported = import_marian(hf_dir, tmp_path / "imported")
    kept = imported.config["marian"]["generation"]
    assert kept == {"bad_words_ids": [[generation["pad_token_id"]]], "num_beams": 3, "max_length": 64}
    pairs = zip(multi30k_lines("train", "en", 40, start=1000), multi30k_lines("train", "de", 40, start=1000))
    (tmp_path / "mine.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    train = {"threads": 1, "max_steps": 2, "eval_every": 2, "average_last": 1, "keep_last": 1, "tune_length_penalty": False}
    _, train_cfg, data_cfg = build_configs("tiny", model={}, train=train, data={"corpus": "files", "train_src": str(tmp_path / "mine.tsv")})
    run = tmp_path / "run"
    Trainer(run, fine_tuning_model(imported.model.config, {}), train_cfg, data_cfg, init_from=imported).run(progress=False)
    Trainer.resume(run, max_steps=4).run(progress=False)
    assert checkpoint.read_config(run / "final")["marian"]["generation"] == kept
    for name in ("final", "last"):
        export_marian(run / name, tmp_path / f"export-{name}")
        exported = transformers.GenerationConfig.from_pretrained(tmp_path / f"export-{name}")
        assert {key: getattr(exported, key) for key in kept} == kept
