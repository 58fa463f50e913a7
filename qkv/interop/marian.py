"""Hugging Face Marian (OPUS-MT) directories <-> qkv checkpoints: ``qkv import marian`` and ``qkv export --format marian``.

A Marian directory is what ``save_pretrained`` writes for a ``MarianMTModel`` and its ``MarianTokenizer``:
    config.json                              the model's config (``model_type`` "marian")
    model.safetensors or pytorch_model.bin   the weights
    source.spm, target.spm                   a SentencePiece model for each side
    vocab.json                               one vocabulary: piece -> id, for both sides
    tokenizer_config.json                    the special tokens and languages (optional)
No hub is contacted: the user supplies the directory, and nothing in it is trusted. Every value the
import reads from the JSON files is checked for its type and range, and the model the config describes
is measured on the meta device against the weight file's size before anything is allocated, as
``qkv.io.checkpoint`` does for qkv's own checkpoints. Weights are read without unpickling anything:
safetensors, or a ``pytorch_model.bin`` through ``torch.load(weights_only=True)``, which refuses a
pickle that holds more than tensors (on torch 2.6 or later only: before it, a crafted file runs code
there, CVE-2025-32434). The weights are converted by ``qkv.interop.convert.from_marian``; the tokenizer
becomes a ``qkv.data.marian_tokenizer.MarianTokenizer``, stored in the checkpoint's ``tokenizer.model``.
``transformers`` is imported only when a function here is called.
"""

from __future__ import annotations

import json
import pickle
import re
import reprlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from qkv.errors import CheckpointError, MissingPackage, QkvError
from qkv.io import checkpoint
from qkv.io.weights import check_size
from qkv.model.config import ModelConfig
from qkv.interop.convert import from_marian, marian_config, to_marian
from qkv.interop.ctranslate2 import check_export_out, write_export
from qkv.io.outputs import check_checkpoint_out
from qkv.data.marian_tokenizer import MarianTokenizer
from qkv.data.tokenizer import Tokenizer, TokenizerError

HF_CONFIG, SAFETENSORS, PYTORCH_BIN = "config.json", "model.safetensors", "pytorch_model.bin"
SPM_FILES, VOCAB, TOKENIZER_CONFIG = ("source.spm", "target.spm"), "vocab.json", "tokenizer_config.json"
# Generation settings of the original model, kept in the checkpoint and written back on export, so that
# ``generate()`` on an exported OPUS-MT model searches as the original did (not with transformers' defaults).
GENERATION_KEYS = ("bad_words_ids", "num_beams", "max_length")
SAFE_TORCH_LOAD = (2, 6)  # torch.load(weights_only=True) runs code in crafted files before 2.6 (CVE-2025-32434)
MAX_SIZE = 1 << 24  # no size or id of a real model comes near; every product of two stays inside int64


def _whole(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= MAX_SIZE


def _rate(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value < 1


# The config.json keys the import reads, each with its check. No other key reaches transformers (its
# bookkeeping, id2label, init_std ... do not change the weights' layout), so none goes unchecked.
_POSITIVE = (
    "vocab_size", "d_model", "encoder_ffn_dim", "decoder_ffn_dim", "encoder_attention_heads",
    "decoder_attention_heads", "max_position_embeddings",
)
_COUNTS = ("encoder_layers", "decoder_layers", "pad_token_id", "eos_token_id", "decoder_start_token_id")
_SWITCHES = ("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings")
CONFIG_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: (_whole(1), f"an integer from 1 to {MAX_SIZE}") for key in _POSITIVE},
    **{key: (_whole(0), f"an integer from 0 to {MAX_SIZE}") for key in _COUNTS},
    "decoder_vocab_size": (lambda v: v is None or _whole(1)(v), f"null or an integer from 1 to {MAX_SIZE}"),
    **{key: (_rate, "a number in [0, 1)") for key in ("dropout", "attention_dropout", "activation_dropout")},
    **{key: (lambda v: type(v) is bool, "true or false") for key in _SWITCHES},
    "activation_function": (lambda v: isinstance(v, str), "a string"),
}


def _transformers():
    from qkv.model.quantize import quiet_loggers

    try:
        with quiet_loggers():  # transformers' Marian model imports torchao when it is installed: its import-time notices, kept quiet
            import transformers

            transformers.MarianMTModel  # noqa: B018 (resolved here, the one import that reaches torchao)
    except ImportError:
        raise MissingPackage("Marian import and export need the transformers package: pip install transformers (in qkv's clone: pip install -e '.[marian]')") from None
    return transformers


@contextmanager
def _quiet() -> Iterator[None]:
    """Without transformers' progress bars and its advice to install sacremoses (which MarianTokenizer
    uses only in a ``normalize`` method that tokenizing never calls)."""
    logging = _transformers().utils.logging
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
            yield
    finally:
        if bars:
            logging.enable_progress_bar()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise QkvError(f"{path} is not valid JSON ({type(error).__name__}: {str(error)[:200]})") from None


def _wrong(path: Path, key: str, expected: str, value: Any) -> CheckpointError:
    return CheckpointError(f"{path}: {key} must be {expected}, got {reprlib.repr(value)}")


def _token(value: Any, path: Path, key: str) -> str:
    """A special token from tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str):
        raise _wrong(path, key, 'a string or {"content": string}', value)
    return content


def _model_settings(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The values of ``CONFIG_KEYS`` in config.json, each checked (absent ones keep MarianConfig's defaults)."""
    for key, (valid, expected) in CONFIG_KEYS.items():
        if key in config and not valid(config[key]):
            raise _wrong(path, key, expected, config[key])
    return {key: config[key] for key in CONFIG_KEYS if key in config}


def _check_size(model_config: ModelConfig, weights: Path) -> None:
    """``qkv.io.weights.check_size`` for an imported model, measured on qkv's model (transformers'
    model and the conversion hold a few times as much)."""
    check_size(model_config, weights, what="its config.json")


def torch_version() -> tuple[int, int]:
    """The running torch's (major, minor); (0, 0) when its version string cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return (int(match[1]), int(match[2])) if match else (0, 0)


def weights_file(hf_dir: Path) -> Path:
    """model.safetensors, else pytorch_model.bin, which only a torch that reads it safely may open."""
    if (hf_dir / SAFETENSORS).is_file():
        return hf_dir / SAFETENSORS
    if torch_version() < SAFE_TORCH_LOAD:
        raise CheckpointError(
            f"{hf_dir / PYTORCH_BIN} is refused: torch {torch.__version__} can run code hidden in such a file "
            f"(CVE-2025-32434); convert it to {SAFETENSORS}, or upgrade torch to 2.6 or later"
        )
    return hf_dir / PYTORCH_BIN


def _check_directory(hf_dir: Path) -> dict[str, Any]:
    """The parsed config.json of a Marian directory, after checking that it holds every file needed."""
    if not hf_dir.is_dir():
        raise QkvError(f"{hf_dir} is not a directory (give the directory save_pretrained wrote)")
    if not (hf_dir / HF_CONFIG).is_file():
        raise QkvError(f"{hf_dir} is not a Hugging Face model directory: it has no {HF_CONFIG}")
    config = _read_json(hf_dir / HF_CONFIG)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "marian":
        raise QkvError(f"{hf_dir} is not a Marian model: its {HF_CONFIG} says model_type {model_type!r}, not 'marian'")
    missing = [name for name in (*SPM_FILES, VOCAB) if not (hf_dir / name).is_file()]
    if missing:
        raise QkvError(f"{hf_dir} has no {', '.join(missing)}: save the model's MarianTokenizer into it too (tokenizer.save_pretrained)")
    if (hf_dir / "target_vocab.json").exists():
        raise QkvError(f"{hf_dir} has separate source and target vocabularies (target_vocab.json): qkv supports one shared vocab.json")
    if not (hf_dir / SAFETENSORS).is_file() and not (hf_dir / PYTORCH_BIN).is_file():
        sharded = " (sharded weights are not supported)" if any(hf_dir.glob("*.index.json")) else ""
        raise QkvError(f"{hf_dir} has no {SAFETENSORS} or {PYTORCH_BIN}{sharded}")
    return config


def read_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The state dict of a Marian directory: model.safetensors, else pytorch_model.bin as plain tensors only."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = weights_file(hf_dir)
    if path.name == SAFETENSORS:
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise QkvError(f"{path} cannot be read as safetensors ({error})") from None
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise QkvError(
            f"{path} holds more than tensors (its pickle would run code), so it was not loaded: "
            f"use the model's {SAFETENSORS} instead (OPUS-MT models publish one)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise QkvError(f"{path} cannot be read as PyTorch weights ({str(error).splitlines()[0]})") from None
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise QkvError(f"{path} is not a state dict (names -> tensors)")
    return weights


def _marian_model(hf_config: Any, weights: dict[str, torch.Tensor], where: Path) -> Any:
    """A ``MarianMTModel`` holding ``weights``: every parameter loaded, or tied to one that was."""
    model = _transformers().MarianMTModel(hf_config).eval()
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # a shape that is not the config's
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise CheckpointError(f"{where} does not match its config.json: {lines[-1] if lines else error}") from None
    state = model.state_dict()
    loaded = {t.data_ptr() for name, t in state.items() if name in weights}
    positions = "embed_positions"  # the sinusoidal tables, which the model computes itself
    missing = [n for n in missing if positions not in n and state[n].data_ptr() not in loaded]
    unexpected = [n for n in unexpected if positions not in n]
    if missing or unexpected:
        raise QkvError(f"{where} does not match its config.json: missing {missing[:3]}; unexpected {unexpected[:3]}")
    return model


def _check_positions(weights: dict[str, torch.Tensor], table: torch.Tensor, where: Path) -> None:
    """Positional tables stored with the weights (older files have them) must be the sinusoids qkv computes
    (``table``: (max_len, d_model), split layout); qkv has no learned positions to put anything else in."""
    for name, stored in weights.items():
        if "embed_positions" in name and (stored.shape != table.shape or not torch.allclose(stored.float(), table, atol=1e-4)):
            raise QkvError(f"{where}: {name} is not Marian's sinusoidal table, which is all qkv can represent")


def read_tokenizer(hf_dir: Path, hf_config: Any) -> MarianTokenizer:
    """The qkv ``MarianTokenizer`` of a Marian directory, checked against the model's config."""
    path = hf_dir / TOKENIZER_CONFIG
    settings = _read_json(path) if path.is_file() else {}
    if not isinstance(settings, dict):
        raise QkvError(f"{path} is not a JSON object")
    for key in ("separate_vocabs", "clean_up_tokenization_spaces"):
        if settings.get(key) is not None and type(settings[key]) is not bool:
            raise _wrong(path, key, "true, false or null", settings[key])
    for key in ("source_lang", "target_lang"):
        if settings.get(key) is not None and not isinstance(settings[key], str):
            raise _wrong(path, key, "a string or null", settings[key])
    if settings.get("separate_vocabs"):
        raise QkvError(f"{hf_dir} has separate source and target vocabularies: qkv supports one shared vocab.json")
    defaults = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    special = [_token(settings.get(key, default), path, key) for key, default in defaults.items()]
    added: list[str] = []
    for key in ("added_tokens_decoder", "additional_special_tokens"):
        tokens = [] if settings.get(key) is None else settings[key]
        if isinstance(tokens, dict):  # added_tokens_decoder: id -> token
            tokens = list(tokens.values())
        if not isinstance(tokens, list):
            raise _wrong(path, key, "a list or an object of tokens", tokens)
        added += [_token(token, path, key) for token in tokens]
    extra = sorted({t for t in added if t not in special})
    if extra:  # transformers would give them ids of their own and split sentences at them
        shown = ", ".join(repr(t)[1:-1] for t in extra[:3])  # escaped: a token may hold a line break
        raise QkvError(f"{path} adds tokens qkv's Marian tokenizer does not have ({shown})")
    try:
        tokenizer = MarianTokenizer(
            source_spm=(hf_dir / SPM_FILES[0]).read_bytes(), target_spm=(hf_dir / SPM_FILES[1]).read_bytes(),
            vocab=_read_json(hf_dir / VOCAB), decoder_start_id=hf_config.decoder_start_token_id,
            eos=special[0], unk=special[1], pad=special[2], source_lang=settings.get("source_lang"),
            target_lang=settings.get("target_lang"),
            clean_up_tokenization_spaces=bool(settings.get("clean_up_tokenization_spaces")), name=str(hf_dir),
        )
    except TokenizerError as error:
        raise QkvError(str(error)) from None
    expected = {"vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_id, "eos_token_id": tokenizer.eos_id}
    for key, value in expected.items():
        if getattr(hf_config, key) != value:
            raise QkvError(f"{hf_dir}: config.json has {key} {getattr(hf_config, key)}, the tokenizer files make it {value}")
    return tokenizer


def _generation(hf_dir: Path, config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The original generation settings (generation_config.json over config.json; null is unset), checked,
    for the export."""
    path = hf_dir / "generation_config.json"
    generation = _read_json(path) if path.is_file() else {}
    if not isinstance(generation, dict):
        raise QkvError(f"{path} is not a JSON object")
    kept = {}
    for key in GENERATION_KEYS:
        found = [(where, s[key]) for where, s in ((path, generation), (hf_dir / HF_CONFIG, config)) if s.get(key) is not None]
        if not found:
            continue
        where, value = found[0]
        if key == "bad_words_ids":
            valid = isinstance(value, list) and all(
                isinstance(ids, list) and ids and all(type(i) is int and 0 <= i < vocab_size for i in ids) for ids in value
            )
            if not valid:
                raise _wrong(where, key, f"a list of non-empty lists of token ids (0 to {vocab_size - 1})", value)
        elif not _whole(1)(value):
            raise _wrong(where, key, f"an integer from 1 to {MAX_SIZE}", value)
        kept[key] = value
    return kept


def import_marian(hf_dir: str | Path, out: str | Path, *, force: bool = False) -> checkpoint.Checkpoint:
    """Convert a local Marian directory into the qkv checkpoint ``out``; returns it, loaded.

    ``out`` must be new; with ``force`` it may be a qkv checkpoint, which is replaced (never another directory).
    """
    hf_dir, out = Path(hf_dir), Path(out)
    check_checkpoint_out(out, force=force)
    config = _check_directory(hf_dir)
    hf_config = _transformers().MarianConfig.from_dict(_model_settings(config, hf_dir / HF_CONFIG))
    tokenizer = read_tokenizer(hf_dir, hf_config)  # its files are read whole, so its memory is theirs
    try:
        model_config = marian_config(hf_config)
    except ValueError as error:  # values that do not go together (d_model and the heads, activations, ...)
        raise CheckpointError(f"{hf_dir / HF_CONFIG}: {error}") from None
    _check_size(model_config, weights_file(hf_dir))
    generation = _generation(hf_dir, config, hf_config.vocab_size)
    weights = read_weights(hf_dir)
    model = from_marian(_marian_model(hf_config, weights, hf_dir))
    _check_positions(weights, model.positions.table.float(), hf_dir)
    languages = {"src_lang": tokenizer.source_lang, "tgt_lang": tokenizer.target_lang}
    configs = {
        "marian": {"source": str(hf_dir.resolve()), "generation": generation},
        # evaluate and export default to Multi30k in these languages, as for a checkpoint qkv trained
        "data": {k: v for k, v in languages.items() if v},
    }
    checkpoint.save(out, model, tokenizer, configs=configs)
    return checkpoint.load(out)


def marian_tokenizer(tokenizer: Tokenizer | MarianTokenizer) -> MarianTokenizer:
    """``tokenizer`` as a Marian tokenizer. qkv's joint SentencePiece model becomes both sides' model,
    its pieces in id order the vocabulary, so ``transformers.MarianTokenizer`` gives the same ids
    (except for text holding a special token's string, e.g. "</s>", which transformers reads as that token)."""
    if isinstance(tokenizer, MarianTokenizer):
        return tokenizer
    pieces = tokenizer.pieces(range(tokenizer.vocab_size))
    eos, unk, pad = tokenizer.pieces([tokenizer.eos_id, tokenizer.unk_id, tokenizer.pad_id])
    return MarianTokenizer(
        source_spm=tokenizer.model_proto, target_spm=tokenizer.model_proto, vocab={p: i for i, p in enumerate(pieces)},
        decoder_start_id=tokenizer.bos_id, eos=eos, unk=unk, pad=pad, name=tokenizer.name,
    )


def export_marian(checkpoint_dir: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the checkpoint as a Hugging Face Marian directory that ``MarianMTModel.from_pretrained`` and
    ``MarianTokenizer.from_pretrained`` load. Post-LN models only (Marian's architecture); ``out`` as
    for ``export_ctranslate2``: new or empty, or with ``force`` an earlier export."""
    _transformers()  # before any work: a clear error without it
    out = check_export_out(out, force=force)
    loaded = checkpoint.load(checkpoint_dir)
    if loaded.model.config.norm_first:
        raise QkvError("this model is pre-LN (norm_first); Marian is post-LN, so it cannot hold it")
    tokenizer = marian_tokenizer(loaded.tokenizer)
    if tokenizer.vocab_size != loaded.model.config.src_vocab_size:
        raise QkvError(f"the tokenizer has {tokenizer.vocab_size} pieces, the model {loaded.model.config.src_vocab_size} embeddings")
    hf = to_marian(loaded.model, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    for key, value in loaded.config.get("marian", {}).get("generation", {}).items():
        setattr(hf.generation_config, key, value)

    def fill(tmp: Path) -> None:
        with _quiet():
            _write_marian(tmp, hf, tokenizer)

    return write_export(out, loaded.path, fill)


def _write_marian(tmp: Path, hf: Any, tokenizer: MarianTokenizer) -> None:
    hf.save_pretrained(tmp)
    for name, data in zip(SPM_FILES, (tokenizer.source_spm, tokenizer.target_spm)):
        (tmp / name).write_bytes(data)
    (tmp / VOCAB).write_text(json.dumps(tokenizer.vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    special = {f"{role}_token": token for role, token in tokenizer.special.items()}
    hf_tokenizer = _transformers().MarianTokenizer(
        str(tmp / SPM_FILES[0]), str(tmp / SPM_FILES[1]), str(tmp / VOCAB), source_lang=tokenizer.source_lang,
        target_lang=tokenizer.target_lang, clean_up_tokenization_spaces=tokenizer.clean_up_tokenization_spaces, **special,
    )
    hf_tokenizer.save_pretrained(tmp)  # tokenizer_config.json in this transformers version's format


def check_export(checkpoint_dir: str | Path, marian_dir: str | Path, sources: list[str]) -> tuple[int, int, float]:
    """Compare an export with its checkpoint on the first 64 non-empty ``sources``: their number, on how many
    ``transformers.MarianTokenizer`` (loaded from ``marian_dir``) gives the same ids as qkv's tokenizer, and
    the largest absolute difference between the logits of ``MarianMTModel.from_pretrained(marian_dir)``
    and qkv's model, teacher-forced with each sentence's target-side ids as its target."""
    transformers = _transformers()
    loaded = checkpoint.load(checkpoint_dir)
    tok, model = loaded.tokenizer, loaded.model
    with _quiet():
        hf_tok = transformers.MarianTokenizer.from_pretrained(str(marian_dir))
        hf = transformers.MarianMTModel.from_pretrained(str(marian_dir)).eval()
    sources = [s for s in sources if s.strip()][:64]  # the logits of 64 sentences say enough
    src_ids = [tok.encode(s) + [tok.eos_id] for s in sources]
    same = sum(hf_tok(s)["input_ids"] == ids for s, ids in zip(sources, src_ids))
    limit, worst = model.config.max_len - 1, 0.0
    with torch.no_grad():
        for source, src in zip(sources, src_ids):
            src_t = torch.tensor([src[:-1][:limit] + [tok.eos_id]])
            tgt_t = torch.tensor([[tok.bos_id, *tok.encode_target(source)[: limit - 1]]])
            theirs = hf(input_ids=src_t, decoder_input_ids=tgt_t).logits
            worst = max(worst, float((model(src_t, tgt_t) - theirs).abs().max()))
    return len(sources), same, worst
