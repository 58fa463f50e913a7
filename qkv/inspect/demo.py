"""``qkv demo``: train a small Transformer on the embedded dates task, check it, and draw its attention.

No download and no data: the task is generated in code (``qkv.data.tasks``), the model trains with the
same ``Trainer`` as real translation, and the picture shows cross-attention on a real output, where
a person can check by eye that the month name attends to the month digits.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from qkv.errors import QkvError
from qkv.io import checkpoint
from qkv.io.manifest import sha256
from qkv.model.config import model_preset
from qkv.data.corpus import read_tsv
from qkv.infer.search import DecodeConfig
from qkv.io.runs import CHECKPOINT_DIR, QKV_FILES, clear_run, is_run
from qkv.data.tasks import date_splits, exact_match
from qkv.data.tokenizer import Tokenizer
from qkv.train.recipes import DataConfig, TrainConfig
from qkv.train.trainer import Trainer
from qkv.infer.translator import Translator
from qkv.inspect.visualize import capture_attention, plot_attention, token_alignment, write_html

EXAMPLES = ["Tuesday, 9th of May 2017", "09/05/17", "9 mai 2017", "le 14 juillet 1989", "3. Oktober 1990"]

# Sized to learn the task in about a minute on two CPU cores (measured; docs/attention.md).
DEMO_MODEL = dict(d_model=64, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0)
DEMO_TRAIN = TrainConfig(
    max_tokens=3000, lr=3e-3, warmup_steps=100, cooldown=0.2, eval_every=200, max_steps=1000, average_last=2, keep_last=2
)


@dataclass
class DemoResult:
    run_dir: Path
    accuracy: float  # exact match on held-out dates
    n_test: int
    trained: bool  # False when a cached model was reused
    train_seconds: float
    examples: list[tuple[str, str]]
    picture: Path
    page: Path
    alignment: list[tuple[str, str, float]] = field(default_factory=list)  # target piece -> source piece


def _write_tsv(path: Path, pairs: list[tuple[str, str]]) -> None:
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")


def train_dates_model(
    out: Path, *, n_train: int, n_valid: int, n_test: int, seed: int, train: TrainConfig, progress: bool
) -> Trainer:
    """Generate the task into ``out`` (train/valid/test TSVs), train a tokenizer with one piece per digit,
    then the model. Validation and test dates are held out from training, and from each other."""
    train_pairs, held_out = date_splits(n_train, n_valid + n_test, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    _write_tsv(out / "train.tsv", train_pairs)
    _write_tsv(out / "valid.tsv", held_out[:n_valid])
    _write_tsv(out / "test.tsv", held_out[n_valid:])
    if not (out / checkpoint.TOKENIZER).exists():
        texts = [s for s, _ in train_pairs] + [t for _, t in train_pairs]
        Tokenizer.train(texts, 400, out / checkpoint.TOKENIZER, split_digits=True, seed=seed)
    data = DataConfig(corpus="files", train_src=str(out / "train.tsv"), valid_src=str(out / "valid.tsv"), max_len=48)
    trainer = Trainer(out, model_preset("tiny", **DEMO_MODEL), train, data, _checked=True)  # run_demo checked out, and put the tokenizer there
    trainer.run(progress=progress)
    return trainer


DEMO_FILES = ("train.tsv", "valid.tsv", "test.tsv", "attention.png", "attention.html")


def _check_demo_dir(out: Path) -> None:
    """Refuse an ``--out`` holding anything the demo did not write: it rewrites and deletes its own files there."""
    if not out.exists():
        return
    if not out.is_dir():
        raise QkvError(f"--out {out} is a file, not a directory")
    foreign = [
        e.name for e in out.iterdir()
        if not (e.name in DEMO_FILES or e.name in QKV_FILES or CHECKPOINT_DIR.fullmatch(e.name))
    ]
    if foreign:
        raise QkvError(
            f"--out {out} holds files the demo did not write ({', '.join(sorted(foreign)[:3])}): choose a new directory"
        )
    if any(out.iterdir()) and not _is_demo_run(out):  # a train.tsv or a training run of the user's: never touch it
        raise QkvError(f"--out {out} is not empty and holds no run of the demo: choose a new directory")


def _is_demo_run(out: Path) -> bool:
    """A run the demo trained: a qkv run whose checkpoints were trained on ``out/train.tsv``."""
    if not is_run(out):
        return False
    configs = [out / name / checkpoint.CONFIG for name in ("last", "final") if (out / name / checkpoint.CONFIG).is_file()]
    try:
        saved = [json.loads(c.read_text(encoding="utf-8")) for c in configs]
    except (OSError, ValueError):
        return False
    return bool(saved) and all(isinstance(s, dict) and _trained_on(s, out / "train.tsv") for s in saved)


def _trained_on(saved: dict, mine: Path) -> bool:
    """Whether a checkpoint's saved config says it was trained on the file ``mine``. A run records its files
    as resolved absolute paths (``--out`` may be relative, the default runs/demo); a run copied or moved
    since names the place it was trained in, so there the file must have the name, size and SHA-256 the
    run recorded (``qkv.train.recipes.data_sources``)."""
    recorded = (saved.get("data") or {}).get("train_src")
    if not recorded:
        return False
    if Path(recorded).resolve() == mine.resolve():
        return True
    was = (saved.get("sources") or {}).get("train_src") or {}
    return (Path(recorded).name == mine.name and mine.is_file() and was.get("bytes") == mine.stat().st_size
            and was.get("sha256") == sha256(mine))


def run_demo(
    out: str | Path = "runs/demo",
    *,
    retrain: bool = False,
    n_train: int = 20000,
    n_test: int = 500,
    seed: int = 1,
    train: TrainConfig = DEMO_TRAIN,
    progress: bool = True,
) -> DemoResult:
    """Train (or reuse) the dates model, measure exact match on held-out dates, write the attention picture."""
    out = Path(out)
    _check_demo_dir(out)
    trained, seconds = False, 0.0
    if retrain or not (out / "final" / checkpoint.CONFIG).exists():
        if out.is_dir():
            clear_run(out)  # the previous demo run's log, tokenizer and checkpoints: a new run starts clean
        started = time.monotonic()
        train_dates_model(out, n_train=n_train, n_valid=200, n_test=n_test, seed=seed, train=train, progress=progress)
        trained, seconds = True, time.monotonic() - started
    translator = Translator.from_checkpoint(out / "final", DecodeConfig(beam_size=1))
    test = read_tsv(out / "test.tsv")
    accuracy = exact_match(translator.translate(test.src), test.tgt)
    examples = list(zip(EXAMPLES, translator.translate(EXAMPLES)))
    capture = capture_attention(translator.model, translator.tokenizer, EXAMPLES[0], DecodeConfig(beam_size=1))
    picture = plot_attention(capture, out / "attention.png", kind="cross", layer=-1)
    page = write_html(capture, out / "attention.html", kind="cross", layer=-1)
    return DemoResult(out, accuracy, len(test), trained, seconds, examples, picture, page, token_alignment(capture))
