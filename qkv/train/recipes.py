"""Training recipes: the data and training configs, the named presets that combine them with a model,
and the corpora a data config names.

Typed, frozen dataclasses validated in ``__post_init__``; ``build_configs`` applies a user's overrides
to a preset and rejects unknown keys with a "did you mean".
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qkv.model.config import ConfigError, ModelConfig, did_you_mean, check_types, config_from_dict, model_preset
from qkv.data.corpus import ParallelCorpus, held_out, language_of, load_multi30k, read_parallel, read_tsv


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel text comes from and how it is tokenized."""

    # Where the pairs come from: "multi30k" (downloaded, or data_dir), "files" (train_src and train_tgt, or one
    # TSV) or "prepared" (data_dir, written by qkv prepare).
    corpus: Literal["multi30k", "files", "prepared"] = "multi30k"
    src_lang: str | None = None  # the source language (--src); None: with Multi30k, en -> de; with your own data, not known
    tgt_lang: str | None = None  # the target language, likewise
    # How src_lang/tgt_lang of your own data were set: "given" (--src/--tgt), "inferred" (from the
    # file names, with a warning) or "unknown" (None); "" for Multi30k, and in runs from before this record.
    languages: Literal["", "given", "inferred", "unknown"] = ""
    data_dir: str | None = None  # Multi30k directory (None: $QKV_DATA or the download cache), or with corpus="prepared" what qkv prepare wrote
    train_src: str | None = None  # with corpus="files": two aligned files, or one TSV in train_src
    train_tgt: str | None = None  # the target side, line-aligned with train_src (None: train_src is a TSV)
    valid_src: str | None = None  # validation pairs for corpus="files": a file, or one TSV (None: the last 5% of train, at most 1,000 pairs)
    valid_tgt: str | None = None  # the validation targets, line-aligned with valid_src
    vocab_size: int = 8000  # >= 16; joint source+target subword vocabulary
    max_len: int = 128  # >= 1; subword tokens kept per side
    subword_dropout: float = 0.0  # in [0, 1); BPE-dropout of the training pairs, drawn afresh every epoch; 0: one fixed segmentation
    case_augment: float = 0.0  # in [0, 1); the share of training pairs recased each epoch (half all caps on both sides, half a Title Case source), drawn afresh every epoch
    # Term-aware training (docs/glossary.md): the share of training pairs whose source gets one or two
    # pseudo-terms written inline after their source words each epoch (qkv.data.term_annotation), read
    # from term_file, which qkv pseudo-terms makes from the same training data. 0: off.
    term_share: float = 0.0  # in [0, 1)
    term_file: str | None = None  # with term_share: qkv pseudo-terms' file, one line per training pair
    train_limit: int = 0  # >= 0; use only the first N training pairs (0: all); for quick runs and CI
    valid_limit: int = 0  # >= 0; use only the first N validation pairs (0: all)

    def __post_init__(self) -> None:
        check_types(self, "data")
        if self.corpus == "multi30k":  # Multi30k always has a pair; its default is en -> de
            object.__setattr__(self, "src_lang", self.src_lang or "en")
            object.__setattr__(self, "tgt_lang", self.tgt_lang or "de")
        if self.corpus == "files" and not self.train_src:
            raise ConfigError("corpus 'files' needs train_src (and train_tgt, unless train_src is a TSV)")
        if self.vocab_size < 16:
            raise ConfigError(f"vocab_size must be >= 16, got {self.vocab_size}")
        if self.max_len < 1:
            raise ConfigError(f"max_len must be >= 1, got {self.max_len}")
        for name in ("train_limit", "valid_limit"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: all), got {getattr(self, name)}")
        if not 0 <= self.subword_dropout < 1:
            raise ConfigError(f"subword_dropout must be in [0, 1), got {self.subword_dropout}")
        if not 0 <= self.case_augment < 1:
            raise ConfigError(f"case_augment must be in [0, 1), got {self.case_augment}")
        if not 0 <= self.term_share < 1:
            raise ConfigError(f"term_share must be in [0, 1), got {self.term_share}")
        if self.term_share and not self.term_file:
            raise ConfigError("term_share needs term_file: the file qkv pseudo-terms writes")
        if self.corpus == "prepared":
            if not self.data_dir:
                raise ConfigError("corpus 'prepared' needs data_dir: the directory qkv prepare wrote")
            for name in ("subword_dropout", "case_augment", "term_share"):
                if getattr(self, name):
                    raise ConfigError(
                        f"a prepared corpus holds one segmentation of every pair: {name} applies to text corpora "
                        "(train on the text files to use it)"
                    )


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the run's schedule of evaluations and checkpoints."""

    max_tokens: int = 4096  # >= 1; padded tokens per batch, of its longer side (per process, per micro-batch)
    accumulate: int = 1  # >= 1; micro-batches summed into each optimizer step, per process
    step_tokens: int = 0  # >= 0; padded tokens per optimizer step over all processes, reached by accumulation (accumulation()); 0: accumulate as given
    bf16: bool = False  # GPU: bfloat16 autocast; CPU with bf16 matmuls: the fused loss's products in bf16 (else a warning)
    lr: float = 2e-3  # > 0; peak learning rate, reached at the end of warm-up
    warmup_steps: int = 800  # >= 0; updates of linear warm-up from 0 to lr
    decay: Literal["inverse_sqrt", "none"] = "inverse_sqrt"  # after warm-up: "inverse_sqrt" (the paper's 1/sqrt(step)) or "none" (the peak held)
    cooldown: float = 0.0  # in [0, 1]; last fraction of the run's steps where lr falls linearly to 0
    beta1: float = 0.9  # in [0, 1); Adam's first-moment decay (the paper's)
    beta2: float = 0.98  # in [0, 1); Adam's second-moment decay (the paper's)
    eps: float = 1e-9  # >= 0; Adam's epsilon (the paper's)
    weight_decay: float = 0.0  # >= 0; Adam's L2 penalty on the weights
    label_smoothing: float = 0.1  # in [0, 1); epsilon_ls of section 5.4: that much of each target's probability spread over the vocabulary
    rdrop: float = 0.0  # >= 0; R-Drop's alpha: each batch runs twice, KL between the passes (qkv.train.loss.rdrop_loss); 0: off
    alignment: float = 0.0  # >= 0; guided alignment's weight: one cross-attention head learns eflomal's links of the training pairs (qkv.train.alignment); 0: off
    clip_norm: float = 1.0  # >= 0; the gradients' largest global norm; 0 disables clipping
    max_epochs: int = 1000  # >= 1; passes over the training pairs at most
    max_steps: int = 0  # >= 0; the run's last update (--max-steps); 0: no limit
    time_budget: float = 0.0  # >= 0; seconds of training, turned into a step count after measure_steps; 0: no limit
    measure_steps: int = 0  # >= 0; with time_budget: updates timed before the budget becomes a step count; 0: eval_every
    eval_every: int = 500  # >= 1; steps between validations and checkpoints
    valid_beam: int = 1  # >= 1; beam used for validation BLEU (1 = greedy, fast)
    patience: int = 0  # >= 0; stop after this many validations without a better BLEU; 0: never
    tune_length_penalty: bool = True  # choose final/'s decoding length penalty on the validation set
    calibrate: bool = True  # qkv train and qkv distill end by fitting final/'s confidence on the validation pairs (qkv calibrate does it later)
    keep_last: int = 5  # step checkpoints kept on disk; at least average_last
    average_last: int = 5  # at least 1; checkpoints averaged into final/ (1: no averaging)
    ema: float = 0.0  # in [0, 1); decay of an exponential moving average of the weights, a candidate for final/; 0: none
    seed: int = 1  # seeds the batches' order, dropout and the initial weights
    threads: int = 0  # >= 0; torch intra-op threads; 0: PyTorch's default
    on_nan: Literal["skip", "stop"] = "skip"  # an update whose loss is not finite: "skip" it (counted in the log) or "stop" the run
    # Speed (qkv.model.cpu and docs/cpu-speed.md); each can be turned off to run the earlier, slower path.
    fused_loss: bool = True  # output projection + loss in chunks, never the whole batch's logits
    tune_allocator: bool = True  # keep glibc from returning and re-faulting large blocks every step
    adam: Literal["fused", "foreach", "for"] = "fused"  # Adam's kernel: one fused loop, per-list ops, per tensor
    fast_dropout: bool = True  # CPU: dropout masks from 64-bit random draws (same distribution, other draws than nn.Dropout's)
    dropout_bits: int = 16  # 16 or 32; fast_dropout's random bits per element: 16 (p to 2^-16) or 32 (p to 2^-32, runs saved before 2026-11-26)
    onednn: bool = True  # CPU: fp32 linear layers (and their input gradients) on oneDNN instead of MKL (qkv.model.kernels)
    bf16_layers: bool = False  # CPU, with --bf16 and onednn: the linear layers' products in bf16 too (opt-in: rounds them)

    def __post_init__(self) -> None:
        if isinstance(self.time_budget, str):  # a duration, as --time-budget takes it: "90s", "45m", "1.5h"
            try:
                object.__setattr__(self, "time_budget", parse_duration(self.time_budget))
            except ValueError:
                raise ConfigError(
                    f"train key time_budget must be a number of seconds or a duration such as 90s, 45m or 1.5h, got {self.time_budget!r}"
                ) from None
        check_types(self, "train")
        for name in ("max_tokens", "lr", "eval_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train key {name} must be positive, got {getattr(self, name)}")
        for name in ("label_smoothing", "beta1", "beta2", "ema"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1){' (0: no EMA)' if name == 'ema' else ''}, got {getattr(self, name)}")
        for name in ("warmup_steps", "eps", "rdrop", "alignment", "weight_decay", "clip_norm", "max_steps", "time_budget",
                     "measure_steps", "patience", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train key {name} must be >= 0, got {getattr(self, name)}")
        for name in ("accumulate", "max_epochs", "valid_beam"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.average_last < 1 or self.keep_last < self.average_last:
            raise ConfigError("need 1 <= average_last <= keep_last")
        if self.step_tokens < 0:
            raise ConfigError(f"step_tokens must be >= 0 (0: accumulate as given), got {self.step_tokens}")
        if self.step_tokens and self.accumulate != 1:
            raise ConfigError(f"step_tokens={self.step_tokens} sets the accumulation itself: leave accumulate at 1 (or set step_tokens=0)")
        if self.dropout_bits not in (16, 32):
            raise ConfigError(f"dropout_bits must be 16 or 32, got {self.dropout_bits}")
        if not 0 <= self.cooldown <= 1:
            raise ConfigError(f"cooldown must be in [0, 1], got {self.cooldown}")
        if self.time_budget and self.cooldown == 1:
            raise ConfigError(
                "cooldown must be < 1 with a time budget: the updates timed to plan the run come before its length is known"
            )


    def accumulation(self, world_size: int = 1) -> int:
        """Micro-batches per optimizer step in each of ``world_size`` processes: enough for ``step_tokens``
        (ceil(step_tokens / (max_tokens x world_size))), else ``accumulate``."""
        return math.ceil(self.step_tokens / (self.max_tokens * world_size)) if self.step_tokens else self.accumulate


@dataclass(frozen=True)
class Preset:
    model: str  # a name from qkv.model.config.MODEL_PRESETS
    train: TrainConfig
    data: DataConfig
    model_overrides: tuple[tuple[str, Any], ...] = ()


def _paper(model: str, *, d_model: int, max_steps: int, eval_every: int, last: int) -> Preset:
    """One of the paper's recipes (the comment above ``paper-base`` below): base and big differ only here."""
    return Preset(
        model,
        TrainConfig(max_tokens=6250, step_tokens=25000, lr=(d_model * 4000) ** -0.5, warmup_steps=4000, decay="inverse_sqrt",
                    clip_norm=0.0, label_smoothing=0.1, max_steps=max_steps, eval_every=eval_every, keep_last=last,
                    average_last=last, valid_beam=4, tune_length_penalty=False),
        DataConfig(vocab_size=37000),
    )


def _student(encoder: int, decoder: int) -> Preset:
    """The multi30k recipe at ``encoder`` encoder and ``decoder`` decoder layers."""
    return Preset(
        "transformer-tiny",
        TrainConfig(max_tokens=4096, lr=2e-3, warmup_steps=800, decay="none", cooldown=0.2, eval_every=500),
        DataConfig(vocab_size=8000),
        model_overrides=(("norm_first", True), ("dropout", 0.3), ("n_encoder_layers", encoder), ("n_decoder_layers", decoder)),
    )


# Recipes measured on a 2-core CPU (docs/results.md and docs/recipes.md say what each reached).
TRAIN_PRESETS: dict[str, Preset] = {
    # For tests and a first try of the commands: 500 training and 50 validation pairs, a 200-piece
    # vocabulary, 100 updates, no length-penalty tuning and no calibration (each of which costs more
    # than the training here); a model that translates nothing useful.
    "tiny": Preset(
        "tiny",
        TrainConfig(max_tokens=512, lr=3e-3, warmup_steps=20, eval_every=50, max_steps=100, average_last=2, keep_last=2,
                    tune_length_penalty=False, calibrate=False),
        DataConfig(vocab_size=200, train_limit=500, valid_limit=50),
    ),
    # transformer-tiny with pre-LN (stable at a high learning rate, so it learns fast in little time)
    # and more dropout than the paper (29k sentences are seen ~40 times in an hour).
    "multi30k": Preset(
        "transformer-tiny",
        TrainConfig(max_tokens=4096, lr=2e-3, warmup_steps=800, decay="none", cooldown=0.2, eval_every=500),
        DataConfig(vocab_size=8000),
        model_overrides=(("norm_first", True), ("dropout", 0.3)),
    ),
    # A student for CPU decoding (qkv distill): the multi30k recipe with one decoder layer instead of
    # four. The decoder runs once per output token and beam, the encoder once per sentence.
    "multi30k-student": Preset(
        "transformer-tiny",
        TrainConfig(max_tokens=4096, lr=2e-3, warmup_steps=800, decay="none", cooldown=0.2, eval_every=500),
        DataConfig(vocab_size=8000),
        model_overrides=(("norm_first", True), ("dropout", 0.3), ("n_decoder_layers", 1)),
    ),
    # Deep encoder, shallow decoder (Kasai et al., 2021): students for CPU decoding (qkv distill). The
    # encoder runs once per sentence, the decoder once per output token and beam, so depth moves from the
    # decoder to the encoder; width, dropout and schedule are the multi30k recipe's.
    "multi30k-6-1": _student(6, 1),
    "multi30k-8-1": _student(8, 1),
    "multi30k-6-2": _student(6, 2),
    # The paper's recipes (section 5, table 3), for WMT-sized data and GPUs (docs/training.md): a shared
    # 37,000-piece vocabulary; about 25,000 source and 25,000 target tokens per update, reached by
    # accumulation on however many processes there are; Adam (0.9, 0.98, 1e-9); lr = d_model^-0.5 *
    # min(step^-0.5, step * warmup^-1.5) with 4,000 warm-up steps, which is inverse_sqrt with the peak
    # (d_model * warmup)^-0.5; no gradient clipping; label smoothing 0.1; dropout 0.1 (base) and 0.3
    # (big, in the model preset); 100,000 and 300,000 updates; the last 5 and 20 checkpoints averaged
    # (about the paper's 10-minute intervals on its 8 P100s); beam 4 (validation) and alpha 0.6, not tuned.
    "paper-base": _paper("base", d_model=512, max_steps=100_000, eval_every=1400, last=5),
    "paper-big": _paper("big", d_model=1024, max_steps=300_000, eval_every=600, last=20),
}


def adam_kernel(kind: str) -> dict[str, bool]:
    """``torch.optim.Adam`` keywords for ``kind``: "fused" (one kernel over all tensors), "foreach"
    (one op per step of the update over the list of tensors) or "for" (PyTorch's per-tensor loop)."""
    return {"fused": kind == "fused", "foreach": kind == "foreach"}


def load_corpora(data: DataConfig) -> tuple[ParallelCorpus, ParallelCorpus]:
    if data.corpus == "multi30k":
        train = load_multi30k("train", data.src_lang, data.tgt_lang, data.data_dir)
        valid = load_multi30k("val", data.src_lang, data.tgt_lang, data.data_dir)
    else:
        train = read_parallel(data.train_src, data.train_tgt) if data.train_tgt else read_tsv(data.train_src)
        if data.valid_src:
            valid = read_parallel(data.valid_src, data.valid_tgt) if data.valid_tgt else read_tsv(data.valid_src)
        else:  # hold out the last 5% (at most 1000 pairs) of the training data
            n = held_out(len(train))
            valid = ParallelCorpus(train.src[-n:], train.tgt[-n:], 0, train.name + " (held out)")
            train = ParallelCorpus(train.src[:-n], train.tgt[:-n], train.skipped_empty, train.name)
    if data.train_limit:
        train = ParallelCorpus(train.src[: data.train_limit], train.tgt[: data.train_limit], train.skipped_empty, train.name)
    if data.valid_limit:
        valid = ParallelCorpus(valid.src[: data.valid_limit], valid.tgt[: data.valid_limit], valid.skipped_empty, valid.name)
    return train, valid


DATA_PATHS = ("data_dir", "train_src", "train_tgt", "valid_src", "valid_tgt", "term_file")


def resolved_paths(data: DataConfig) -> DataConfig:
    """``data`` with its files and directories as absolute paths, symlinks resolved: what a run records,
    so that ``--resume`` from another directory reads the same files."""
    paths = {key: str(Path(value).expanduser().resolve()) for key in DATA_PATHS if (value := getattr(data, key))}
    return dataclasses.replace(data, **paths)


def data_sources(data: DataConfig) -> dict[str, dict[str, Any]]:
    """What a run reads, by role: each file's path, size and SHA-256 (a prepared directory: those of its
    manifest, which holds every other file's). ``--resume`` compares them (``qkv.train.resume``)."""
    from qkv.io.manifest import sha256

    return {role: {"path": str(path), "bytes": path.stat().st_size, "sha256": sha256(path)} for role, path in data_files(data).items()}


def data_files(data: DataConfig) -> dict[str, Path]:
    """The files ``data`` names, by role (a prepared directory: its ``prepared.json``); an output may replace none."""
    from qkv.data.corpus import multi30k_dir

    if data.corpus == "prepared":
        files = {"prepared": Path(data.data_dir) / "prepared.json"}
    elif data.corpus == "multi30k":
        directory = multi30k_dir(data.data_dir)
        files = {f"{split}_{side}": directory / f"{split}.{lang}.gz" for split in ("train", "val")
                 for side, lang in (("src", data.src_lang), ("tgt", data.tgt_lang))}
    else:
        files = {key: Path(value) for key in DATA_PATHS[1:] if (value := getattr(data, key))}
    if data.term_file:
        files["term_file"] = Path(data.term_file)
    return files


def build_configs(preset: str, *, model: dict[str, Any], train: dict[str, Any], data: dict[str, Any]) -> tuple[ModelConfig, TrainConfig, DataConfig]:
    """A training preset with overrides applied (unknown keys are rejected with a hint)."""
    if preset not in TRAIN_PRESETS:
        raise ConfigError(f"unknown training preset {preset!r}{did_you_mean(preset, list(TRAIN_PRESETS))}; choose from {', '.join(TRAIN_PRESETS)}")
    p = TRAIN_PRESETS[preset]
    given = {key for key in LANGUAGE_KEYS if data.get(key)}
    data = {**p.data.__dict__, **data}
    if data.get("corpus") != "multi30k":  # Multi30k's default pair says nothing of your own data's
        data = record_languages(data, given)
    return (
        model_preset(p.model, **{**dict(p.model_overrides), **model}),
        config_from_dict(TrainConfig, {**p.train.__dict__, **train}),
        config_from_dict(DataConfig, data),
    )


LANGUAGE_KEYS = ("src_lang", "tgt_lang")


class LanguageWarning(UserWarning):
    """The languages of a run on your own data were inferred from file names, or are not known."""


def record_languages(data: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """``data`` (a DataConfig's keys, your own corpus) with its languages recorded: the ``given`` ones
    (--src/--tgt), else those the training files' names give (a warning says so), else None (a warning
    says what to pass). ``languages`` says which."""
    data = dict(data)
    if data.get("languages"):  # recorded already (a --config file of a run, or a resumed run's)
        return data
    names = {"src_lang": data.get("train_src"), "tgt_lang": data.get("train_tgt")}
    if set(LANGUAGE_KEYS) <= given:
        data["languages"] = "given"
        return data
    inferred = {key: data.get(key) if key in given else language_of(names[key]) for key in LANGUAGE_KEYS}
    if all(inferred.values()) and inferred["src_lang"] != inferred["tgt_lang"]:
        data.update(inferred, languages="inferred")
        warnings.warn(f"the training data's languages are {inferred['src_lang']} -> {inferred['tgt_lang']} by its file names "
                      "(recorded in the run; give --src and --tgt to say otherwise)", LanguageWarning, stacklevel=3)
    else:
        data.update({key: data.get(key) if key in given else None for key in LANGUAGE_KEYS}, languages="unknown")
        warnings.warn("the training data's languages are not known (give --src and --tgt to record them): qkv evaluate "
                      "will score the run only on test files you give it", LanguageWarning, stacklevel=3)
    return data


def parse_duration(text: str) -> float:
    """'90s', '45m', '1.5h' or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ConfigError(f"cannot read duration {text!r}: use for example 90s, 45m or 1.5h") from None


def parse_overrides(pairs: list[str] | None, flag: str = "") -> dict[str, Any]:
    """KEY=VALUE strings -> dict; values are read as JSON when they parse (numbers, true, null), else strings.
    ``pairs`` holds every KEY=VALUE of a repeated flag (``--data a=1 --data b=2`` sets both); a key given
    twice with two different values is a ConfigError naming ``flag`` (the same value twice is one)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"expected KEY=VALUE, got {pair!r}")
        key = key.strip().replace("-", "_")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        if key in out and (out[key] != parsed or type(out[key]) is not type(parsed)):
            raise ConfigError(f"{key} is given twice{' to ' + flag if flag else ''} "
                              f"({json.dumps(out[key])} and {json.dumps(parsed)}): give it once")
        out[key] = parsed
    return out


CONFIG_FILE_KEYS = ("preset", "model", "train", "data")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A ``qkv train --config`` file: TOML with an optional ``preset = "NAME"`` and ``[model]``,
    ``[train]``, ``[data]`` tables holding the keys ``--model/--train/--data KEY=VALUE`` take."""
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        raise ConfigError("--config needs Python 3.11 or newer (tomllib)") from None
    path = Path(path)
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    for key, value in config.items():
        if key not in CONFIG_FILE_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r}{did_you_mean(key, list(CONFIG_FILE_KEYS))}; a config file holds {', '.join(CONFIG_FILE_KEYS)}")
        if key == "preset" and not isinstance(value, str) or key != "preset" and not isinstance(value, dict):
            raise ConfigError(f"{path}: {key!r} must be {'a string' if key == 'preset' else 'a table, [' + key + ']'}")
    return config


FROM_TOKENIZER = ("src_vocab_size", "tgt_vocab_size", "pad_id")  # model keys a run takes from its vocabulary


def dump_config(preset: str, model: ModelConfig, train: TrainConfig, data: DataConfig) -> str:
    """The resolved config as a ``--config`` file (TOML) that gives the same configs back. Keys whose
    value is None (the default "not set") are written as comments."""
    sections = [f"preset = {json.dumps(preset)}"]
    for name, config in (("model", model), ("train", train), ("data", data)):
        lines = [f"\n[{name}]"]
        for key, value in dataclasses.asdict(config).items():
            if name == "model" and key in FROM_TOKENIZER:
                lines.append(f"# {key}: set from the tokenizer when training starts")
            else:
                lines.append(f"# {key} = (not set)" if value is None else f"{key} = {_toml_value(value)}")
        sections.append("\n".join(lines))
    return "\n".join(sections) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string: JSON's escapes are TOML's


FINE_TUNING_OVERRIDES = ("dropout", "attention_dropout", "activation_dropout", "word_dropout")  # what --init-from lets --model change


def fine_tuning_model(parent: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """The model of a run started from a checkpoint (``--init-from``): the parent's, where only the
    regularization may change; any other override would not fit the parent's weights."""
    fixed = sorted(key for key, value in overrides.items() if key not in FINE_TUNING_OVERRIDES and getattr(parent, key, None) != value)
    if fixed:
        raise ConfigError(
            f"--init-from keeps the checkpoint's model: --model {fixed[0]} cannot change "
            f"(it is {getattr(parent, fixed[0], 'not a model key')!r} there; only {', '.join(FINE_TUNING_OVERRIDES)} may)"
        )
    return parent.replace(**overrides)
