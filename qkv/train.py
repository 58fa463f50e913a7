"""Training: label-smoothed loss, Adam with warm-up and inverse-square-root decay, validation with real
decoding, checkpoints that resume exactly, averaging, early stopping and a wall-clock budget (section 5).

A run directory holds ``log.jsonl`` (one JSON object per event), ``curves.png``, ``last/`` (the
newest checkpoint with everything needed to resume), ``step-NNNNNN/`` (the last few, for averaging),
``best/`` (best validation BLEU) and ``final/`` (the averaged model, evaluated at the end).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from qkv import checkpoint
from qkv.config import ModelConfig, config_from_dict, model_preset
from qkv.data import ParallelCorpus, collate, encode_corpus, load_multi30k, read_parallel, read_tsv, token_batches
from qkv.decode import DecodeConfig
from qkv.evaluate import score
from qkv.model import Transformer
from qkv.tokenizer import Tokenizer
from qkv.translate import Translator


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel text comes from and how it is tokenized."""

    corpus: Literal["multi30k", "files"] = "multi30k"
    src_lang: str = "en"
    tgt_lang: str = "de"
    data_dir: str | None = None  # Multi30k directory; None: $QKV_DATA or the download cache
    train_src: str | None = None  # with corpus="files": two aligned files, or one TSV in train_src
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    vocab_size: int = 8000  # joint source+target subword vocabulary
    max_len: int = 128  # subword tokens kept per side
    train_limit: int = 0  # use only the first N training pairs (0: all); for quick runs and CI
    valid_limit: int = 0

    def __post_init__(self) -> None:
        if self.corpus not in ("multi30k", "files"):
            raise ValueError(f"corpus must be multi30k or files, got {self.corpus!r}")
        if self.corpus == "files" and not self.train_src:
            raise ValueError("corpus 'files' needs train_src (and train_tgt, unless train_src is a TSV)")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the run's schedule of evaluations and checkpoints."""

    max_tokens: int = 4096  # padded target+source tokens per batch
    lr: float = 2e-3  # peak learning rate, reached at the end of warm-up
    warmup_steps: int = 800
    beta1: float = 0.9
    beta2: float = 0.98  # the paper's
    eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 1.0  # 0 disables clipping
    max_epochs: int = 1000
    max_steps: int = 0  # 0: no limit
    time_budget: float = 0.0  # seconds of training wall-clock; 0: no limit
    eval_every: int = 500  # steps between validations and checkpoints
    valid_beam: int = 1  # beam used for validation BLEU (1 = greedy, fast)
    patience: int = 0  # stop after this many validations without a better BLEU; 0: never
    keep_last: int = 5  # step checkpoints kept on disk
    average_last: int = 5  # checkpoints averaged into final/ (1: no averaging)
    seed: int = 1
    threads: int = 0  # torch intra-op threads; 0: PyTorch's default
    on_nan: Literal["skip", "stop"] = "skip"

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.lr <= 0 or self.warmup_steps < 0 or self.eval_every <= 0:
            raise ValueError("max_tokens, lr and eval_every must be positive and warmup_steps >= 0")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.on_nan not in ("skip", "stop"):
            raise ValueError(f"on_nan must be skip or stop, got {self.on_nan!r}")
        if self.average_last < 1 or self.keep_last < self.average_last:
            raise ValueError("need 1 <= average_last <= keep_last")


@dataclass(frozen=True)
class Preset:
    model: str  # a name from qkv.config.MODEL_PRESETS
    train: TrainConfig
    data: DataConfig
    model_overrides: tuple[tuple[str, Any], ...] = ()


# Recipes measured on a 2-core CPU (see the README for what each reached).
TRAIN_PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        TrainConfig(max_tokens=512, lr=3e-3, warmup_steps=20, eval_every=50, max_steps=100, average_last=2, keep_last=2),
        DataConfig(vocab_size=200, train_limit=500, valid_limit=50),
    ),
    # transformer-tiny with pre-LN (stable at a high learning rate, so it learns fast in little time)
    # and more dropout than the paper (29k sentences are seen ~40 times in an hour).
    "multi30k": Preset(
        "transformer-tiny",
        TrainConfig(max_tokens=4096, lr=2e-3, warmup_steps=800, eval_every=500),
        DataConfig(vocab_size=8000),
        model_overrides=(("norm_first", True), ("dropout", 0.2)),
    ),
}


def inverse_sqrt_lr(step: int, *, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` at ``warmup`` steps, then decay with 1/sqrt(step) (section 5.3, rescaled)."""
    step = max(step, 1)
    if warmup == 0:
        return peak
    return peak * min(step / warmup, math.sqrt(warmup / step))


def label_smoothed_loss(logits: Tensor, target: Tensor, *, pad_id: int, smoothing: float) -> tuple[Tensor, Tensor]:
    """Sum of label-smoothed cross-entropy over non-padding targets (section 5.4), and the token count.

    logits: (B, T, V), target: (B, T). The true class gets 1 - smoothing + smoothing/V, every class
    smoothing/V; padding positions contribute nothing.
    """
    V = logits.size(-1)
    loss = F.cross_entropy(
        logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=pad_id, label_smoothing=smoothing, reduction="sum"
    )
    return loss, (target != pad_id).sum()


def load_corpora(data: DataConfig) -> tuple[ParallelCorpus, ParallelCorpus]:
    if data.corpus == "multi30k":
        train = load_multi30k("train", data.src_lang, data.tgt_lang, data.data_dir)
        valid = load_multi30k("val", data.src_lang, data.tgt_lang, data.data_dir)
    else:
        train = read_parallel(data.train_src, data.train_tgt) if data.train_tgt else read_tsv(data.train_src)
        if data.valid_src:
            valid = read_parallel(data.valid_src, data.valid_tgt) if data.valid_tgt else read_tsv(data.valid_src)
        else:  # hold out the last 5% (at most 1000 pairs) of the training data
            n = max(1, min(1000, len(train) // 20))
            valid = ParallelCorpus(train.src[-n:], train.tgt[-n:], 0, train.name + " (held out)")
            train = ParallelCorpus(train.src[:-n], train.tgt[:-n], train.skipped_empty, train.name)
    if data.train_limit:
        train = ParallelCorpus(train.src[: data.train_limit], train.tgt[: data.train_limit], train.skipped_empty, train.name)
    if data.valid_limit:
        valid = ParallelCorpus(valid.src[: data.valid_limit], valid.tgt[: data.valid_limit], valid.skipped_empty, valid.name)
    return train, valid


class RunLog:
    """Appends JSON lines to ``log.jsonl``; keeps the records for the curves plot."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path.exists():
            self.records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def write(self, **record: Any) -> None:
        record = {"time": round(time.time(), 3), **record}
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def plot_curves(records: list[dict[str, Any]], path: Path) -> None:
    """Training loss, validation loss and validation BLEU against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("event") == "train"]
    valid = [r for r in records if r.get("event") == "valid"]
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", alpha=0.7)
    ax_loss.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss (label-smoothed, per token)", title="loss")
    ax_loss.legend()
    ax_bleu.plot([r["step"] for r in valid], [r["bleu"] for r in valid], "o-", color="tab:green")
    ax_bleu.set(xlabel="step", ylabel="BLEU", title="validation BLEU (real decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    stopped_because: str
    final: dict[str, Any]  # validation scores of final/


class Trainer:
    """One training run in ``run_dir``; ``Trainer.resume(run_dir)`` continues it after a crash."""

    def __init__(self, run_dir: str | Path, model_config: ModelConfig, train: TrainConfig, data: DataConfig) -> None:
        self.run_dir = Path(run_dir)
        self.train_cfg, self.data_cfg = train, data
        if train.threads:
            torch.set_num_threads(train.threads)
        self.train_data, self.valid_data = load_corpora(data)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(self.run_dir / "log.jsonl")
        tokenizer_path = self.run_dir / checkpoint.TOKENIZER
        if tokenizer_path.exists():
            self.tokenizer = Tokenizer.load(tokenizer_path)
        else:
            texts = self.train_data.src + self.train_data.tgt
            self.tokenizer = Tokenizer.train(texts, data.vocab_size, tokenizer_path, seed=train.seed)
        tok = self.tokenizer
        self.model_config = model_config.replace(
            src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id
        )
        torch.manual_seed(train.seed)
        self.model = Transformer(self.model_config)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
            weight_decay=train.weight_decay,
        )
        max_len = min(data.max_len, self.model_config.max_len - 1)
        self.train_ids = encode_corpus(tok, self.train_data, max_len)
        self.valid_ids = encode_corpus(tok, self.valid_data, max_len)
        self.step, self.epoch, self.position = 0, 0, 0
        self.elapsed = 0.0  # training seconds before this process (resumed runs)
        self.best_bleu, self.bad_evals = -1.0, 0

    @classmethod
    def resume(cls, run_dir: str | Path, **train_overrides: Any) -> Trainer:
        """Continue a run from ``run_dir/last``: weights, optimizer, RNGs and data position."""
        last = Path(run_dir) / "last"
        config = checkpoint.read_config(last)
        train = config_from_dict(TrainConfig, {**config["train"], **train_overrides})
        trainer = cls(run_dir, ModelConfig.from_dict(config["model"]), train, config_from_dict(DataConfig, config["data"]))
        loaded = checkpoint.load(last)
        trainer.model.load_state_dict(loaded.model.state_dict())
        state = checkpoint.load_trainer(last, trainer.optimizer)
        trainer.step, trainer.epoch, trainer.position = state["step"], state["epoch"], state["position"]
        trainer.elapsed, trainer.best_bleu, trainer.bad_evals = state["elapsed"], state["best_bleu"], state["bad_evals"]
        return trainer

    def configs(self) -> dict[str, Any]:
        return {"train": self.train_cfg.__dict__, "data": self.data_cfg.__dict__}

    def save(self, directory: Path, *, resumable: bool = True) -> None:
        trainer_state = {
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            "elapsed": self.elapsed,
            "best_bleu": self.best_bleu,
            "bad_evals": self.bad_evals,
        }
        checkpoint.save(
            directory,
            self.model,
            self.tokenizer,
            configs=self.configs(),
            trainer=trainer_state if resumable else None,
            optimizer=self.optimizer if resumable else None,
        )

    def batches(self, epoch: int) -> list[list[int]]:
        src_len = [len(s) for s in self.train_ids.src_ids]
        tgt_len = [len(t) for t in self.train_ids.tgt_ids]
        return token_batches(src_len, tgt_len, self.train_cfg.max_tokens, seed=self.train_cfg.seed, epoch=epoch)

    def train_step(self, indices: list[int]) -> tuple[float, int, bool]:
        """One optimizer update on a batch. Returns (loss per token, target tokens, whether it was applied)."""
        cfg, tok = self.train_cfg, self.tokenizer
        src, tgt_in, tgt_out = collate(
            [self.train_ids.src_ids[i] for i in indices],
            [self.train_ids.tgt_ids[i] for i in indices],
            pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
        )
        lr = inverse_sqrt_lr(self.step + 1, peak=cfg.lr, warmup=cfg.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        loss_sum, n_tokens = label_smoothed_loss(
            self.model(src, tgt_in), tgt_out, pad_id=tok.pad_id, smoothing=cfg.label_smoothing
        )
        loss = loss_sum / n_tokens
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            if cfg.on_nan == "stop":
                raise FloatingPointError(f"loss is {loss.item()} at step {self.step + 1}; last good checkpoint: {self.run_dir / 'last'}")
            return float("nan"), int(n_tokens), False
        loss.backward()
        if cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        self.optimizer.step()
        return loss.item(), int(n_tokens), True

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Teacher-forced validation loss, and BLEU/chrF on real (greedy or beam) translations."""
        self.model.eval()
        tok, ids = self.tokenizer, self.valid_ids
        total, count = 0.0, 0
        order = token_batches([len(s) for s in ids.src_ids], [len(t) for t in ids.tgt_ids], 4096, seed=0, epoch=0, shuffle=False)
        for batch in order:
            src, tgt_in, tgt_out = collate(
                [ids.src_ids[i] for i in batch], [ids.tgt_ids[i] for i in batch],
                pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
            )
            loss_sum, n = label_smoothed_loss(self.model(src, tgt_in), tgt_out, pad_id=tok.pad_id, smoothing=self.train_cfg.label_smoothing)
            total, count = total + loss_sum.item(), count + int(n)
        translator = Translator(self.model, tok, DecodeConfig(beam_size=self.train_cfg.valid_beam))
        hyps = [tok.decode(h[0].tokens) for h in translator.translate_ids(ids.src_ids)]
        scores = score(hyps, self.valid_data.tgt)
        return {"valid_loss": round(total / count, 4), "bleu": scores["bleu"], "bleu_lc": scores["bleu_lc"], "chrf": scores["chrf"]}

    def _step_dirs(self) -> list[Path]:
        return sorted(self.run_dir.glob("step-[0-9]*[0-9]"))

    def checkpoint_and_validate(self) -> bool:
        """Validate, save step/last/best checkpoints; return True when early stopping says stop."""
        metrics = self.validate()
        improved = metrics["bleu"] > self.best_bleu
        if improved:
            self.best_bleu, self.bad_evals = metrics["bleu"], 0
        else:
            self.bad_evals += 1
        self.log.write(event="valid", step=self.step, epoch=self.epoch, **metrics)
        self.save(self.run_dir / f"step-{self.step:06d}", resumable=False)
        for old in self._step_dirs()[: -self.train_cfg.keep_last]:
            shutil.rmtree(old)
        if improved:
            self.save(self.run_dir / "best", resumable=False)
        self.save(self.run_dir / "last")
        plot_curves(self.log.records, self.run_dir / "curves.png")
        return bool(self.train_cfg.patience) and self.bad_evals >= self.train_cfg.patience

    def finish(self) -> dict[str, Any]:
        """Average the last checkpoints into final/ and validate it."""
        dirs = self._step_dirs()[-self.train_cfg.average_last :]
        if len(dirs) > 1:
            checkpoint.save(self.run_dir / "final", self.model, self.tokenizer, configs=self.configs(), state_dict=checkpoint.average(dirs))
        else:
            shutil.copytree(dirs[-1] if dirs else self.run_dir / "last", self.run_dir / "final.tmp", dirs_exist_ok=True)
            checkpoint._publish(self.run_dir / "final.tmp", self.run_dir / "final")
        final = checkpoint.load(self.run_dir / "final")
        # state_dict() shares storage with the parameters: copy, or loading final/ would overwrite it too.
        live = {name: value.clone() for name, value in self.model.state_dict().items()}
        self.model.load_state_dict(final.model.state_dict())
        metrics = self.validate()
        self.model.load_state_dict(live)
        self.log.write(event="final", step=self.step, averaged=[d.name for d in dirs], **metrics)
        return metrics

    def run(self, *, progress: bool = True) -> TrainResult:
        cfg = self.train_cfg
        self.log.write(
            event="start", step=self.step, params=self.model.num_parameters(), train_pairs=len(self.train_data),
            valid_pairs=len(self.valid_data), skipped_empty=self.train_data.skipped_empty,
            truncated=self.train_ids.n_truncated, vocab_size=self.tokenizer.vocab_size,
        )
        total = cfg.max_steps or None
        bar = tqdm(total=total, initial=self.step, disable=not progress, unit="step", dynamic_ncols=True)
        started, stopped_because = time.monotonic() - self.elapsed, "max_epochs"
        window_tokens, window_start, skipped = 0, time.monotonic(), 0
        try:
            while self.epoch < cfg.max_epochs and stopped_because == "max_epochs":
                batches = self.batches(self.epoch)
                while self.position < len(batches):
                    loss, n_tokens, applied = self.train_step(batches[self.position])
                    self.position += 1
                    self.step += 1
                    skipped += not applied
                    window_tokens += n_tokens
                    self.elapsed = time.monotonic() - started
                    if self.step % 50 == 0 or not applied:
                        rate = window_tokens / max(time.monotonic() - window_start, 1e-9)
                        lr = self.optimizer.param_groups[0]["lr"]
                        self.log.write(event="train", step=self.step, epoch=self.epoch, loss=round(loss, 4), lr=lr, tokens_per_s=round(rate), skipped=skipped)
                        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:.0f}", epoch=self.epoch)
                        if cfg.time_budget and not cfg.max_steps:
                            # The bar's total (hence its ETA) follows the steps the time budget allows.
                            steps_per_s = self.step / max(self.elapsed, 1e-9)
                            bar.total = self.step + int((cfg.time_budget - self.elapsed) * steps_per_s)
                        window_tokens, window_start = 0, time.monotonic()
                    bar.update(1)
                    out_of_time = cfg.time_budget and self.elapsed >= cfg.time_budget
                    out_of_steps = cfg.max_steps and self.step >= cfg.max_steps
                    if self.step % cfg.eval_every == 0 or out_of_time or out_of_steps:
                        if self.checkpoint_and_validate():
                            stopped_because = "early_stopping"
                        elif out_of_time:
                            stopped_because = "time_budget"
                        elif out_of_steps:
                            stopped_because = "max_steps"
                        if stopped_because != "max_epochs":
                            break
                else:
                    self.epoch, self.position = self.epoch + 1, 0
        except KeyboardInterrupt:
            bar.close()
            self.save(self.run_dir / "last")
            self.log.write(event="interrupted", step=self.step)
            raise
        bar.close()
        if self.step % cfg.eval_every and stopped_because == "max_epochs":
            self.checkpoint_and_validate()
        final = self.finish()
        plot_curves(self.log.records, self.run_dir / "curves.png")
        return TrainResult(self.run_dir, self.step, stopped_because, final)


def build_configs(preset: str, *, model: dict[str, Any], train: dict[str, Any], data: dict[str, Any]) -> tuple[ModelConfig, TrainConfig, DataConfig]:
    """A training preset with overrides applied (unknown keys are rejected with a hint)."""
    if preset not in TRAIN_PRESETS:
        from qkv.config import _did_you_mean

        raise ValueError(f"unknown training preset {preset!r}{_did_you_mean(preset, list(TRAIN_PRESETS))}; choose from {', '.join(TRAIN_PRESETS)}")
    p = TRAIN_PRESETS[preset]
    return (
        model_preset(p.model, **{**dict(p.model_overrides), **model}),
        config_from_dict(TrainConfig, {**p.train.__dict__, **train}),
        config_from_dict(DataConfig, {**p.data.__dict__, **data}),
    )


__all__ = ["DataConfig", "TrainConfig", "Trainer", "TRAIN_PRESETS", "build_configs", "replace"]
