"""Training: label-smoothed loss, Adam with warm-up and inverse-square-root decay, validation with real
decoding, checkpoints that resume exactly, averaging, early stopping and a wall-clock budget (section 5).

A run directory holds ``log.jsonl`` (one JSON object per event), ``curves.png``, ``last/`` (the
newest checkpoint with everything needed to resume), ``step-NNNNNN/`` (the last few, for averaging),
``best/`` (best validation BLEU) and ``final/`` (the averaged model, evaluated at the end).

Under ``torchrun`` the same loop trains with DistributedDataParallel (``qkv.distributed``): every rank
steps on its share of each optimizer step's batches, and rank 0 alone validates and writes the run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import shutil
import signal
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from qkv import checkpoint, distributed
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

    max_tokens: int = 4096  # padded target+source tokens per batch (per process, per micro-batch)
    accumulate: int = 1  # micro-batches summed into each optimizer step, per process
    bf16: bool = False  # bfloat16 autocast on a GPU; ignored (with a warning) on the CPU
    lr: float = 2e-3  # peak learning rate, reached at the end of warm-up
    warmup_steps: int = 800
    cooldown: float = 0.0  # last fraction of the run (of time_budget or max_steps) where lr falls linearly to 0
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
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {self.accumulate}")
        if not 0 <= self.cooldown <= 1:
            raise ValueError(f"cooldown must be in [0, 1], got {self.cooldown}")


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
        TrainConfig(max_tokens=4096, lr=2e-3, warmup_steps=800, cooldown=0.2, eval_every=500),
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


def cooldown_factor(progress: float | None, cooldown: float) -> float:
    """1 until the last ``cooldown`` fraction of the run, then falling linearly to 0 at its end.

    ``progress`` is the fraction of the run done (of the time budget, or of max_steps), None when the
    run has no known end. A short linear decay at the end of a fixed budget ("warm-up, stable, decay")
    lands in a sharper minimum than stopping at a still-high learning rate; measured on Multi30k in the README.
    """
    if progress is None or cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))


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
    """Appends JSON lines to ``log.jsonl``; keeps the records for the curves plot.

    With ``enabled=False`` (ranks other than 0) records are kept in memory only, so a run's log is
    written once however many processes train it.
    """

    def __init__(self, path: Path, *, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        if path.exists():
            self.records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def write(self, **record: Any) -> None:
        record = {"time": round(time.time(), 3), **record}
        self.records.append(record)
        if not self.enabled:
            return
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


def _no_buffer_sync() -> dict[str, bool]:
    """DDP's option not to re-send buffers before every forward: the model's only buffer is the
    constant positional table. Newer PyTorch calls it forward_sync_buffers (broadcast_buffers warns)."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def _rank_seed(seed: int, rank: int, step: int) -> int:
    """A seed for one rank's dropout, distinct per (seed, rank, step)."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % 2**63


class Trainer:
    """One training run in ``run_dir``; ``Trainer.resume(run_dir)`` continues it after a crash.

    In a process group (``qkv.distributed.init_from_env`` under torchrun) every rank builds the same
    Trainer; ``self.model`` is always the plain model (saved without wrapper prefixes), and
    ``self.train_model`` the DistributedDataParallel wrapper that training steps go through.
    """

    def __init__(self, run_dir: str | Path, model_config: ModelConfig, train: TrainConfig, data: DataConfig) -> None:
        self.run_dir = Path(run_dir)
        self.train_cfg, self.data_cfg = train, data
        self.dist = distributed.current()
        self.device = self.dist.device
        if train.threads:
            torch.set_num_threads(train.threads)
        self.train_data, self.valid_data = load_corpora(data)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = RunLog(self.run_dir / "log.jsonl", enabled=self.dist.is_main)
        tokenizer_path = self.run_dir / checkpoint.TOKENIZER
        tokenizer = None
        if not tokenizer_path.exists() and self.dist.is_main:
            texts = self.train_data.src + self.train_data.tgt
            tokenizer = Tokenizer.train(texts, data.vocab_size, tokenizer_path, seed=train.seed)
        distributed.barrier(self.dist)  # the other ranks read the tokenizer rank 0 has just written
        self.tokenizer = tokenizer or Tokenizer.load(tokenizer_path)
        tok = self.tokenizer
        self.model_config = model_config.replace(
            src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id
        )
        torch.manual_seed(train.seed)
        self.model = Transformer(self.model_config).to(self.device)
        self.train_model: torch.nn.Module = self.model
        if self.dist.world_size > 1:
            # The seed above gave every rank the same initial weights (DDP also broadcasts rank 0's);
            # dropout should differ between ranks, so each now draws from a generator of its own.
            torch.manual_seed(_rank_seed(train.seed, self.dist.rank, 0))
            device_ids = [self.device] if self.device.type == "cuda" else None
            self.train_model = DistributedDataParallel(self.model, device_ids=device_ids, **_no_buffer_sync())
        self.autocast = train.bf16 and self.device.type == "cuda"
        if train.bf16 and not self.autocast and self.dist.is_main:
            warnings.warn("bf16 needs a GPU: training on the CPU stays in float32", stacklevel=2)
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
        ctx = trainer.dist
        if ctx.world_size > 1:
            # load_trainer restored rank 0's generators on every rank; give each rank its own back.
            saved = state.get("rank_rng") or []
            if len(saved) == ctx.world_size:
                distributed.set_rng_state(saved[ctx.rank], ctx)
            else:  # saved by another number of processes (or at Ctrl-C): fresh, distinct draws
                torch.manual_seed(_rank_seed(train.seed, ctx.rank, trainer.step))
        return trainer

    def configs(self) -> dict[str, Any]:
        return {"train": self.train_cfg.__dict__, "data": self.data_cfg.__dict__}

    def save(self, directory: Path, *, resumable: bool = True, rank_rng: list[dict[str, str]] | None = None) -> None:
        """Write a checkpoint of ``self.model``; ``rank_rng``: every rank's generators (distributed runs)."""
        trainer_state = {
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,  # in the epoch's batches, counted over all ranks
            "elapsed": self.elapsed,
            "best_bleu": self.best_bleu,
            "bad_evals": self.bad_evals,
        }
        if rank_rng is not None:
            trainer_state["rank_rng"] = rank_rng
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

    def _collate(self, indices: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        tok = self.tokenizer
        tensors = collate(
            [self.train_ids.src_ids[i] for i in indices],
            [self.train_ids.tgt_ids[i] for i in indices],
            pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
        )
        return tuple(t.to(self.device) for t in tensors)  # type: ignore[return-value]

    def progress(self) -> float | None:
        """Fraction of the run done (of the time budget or of max_steps, whichever ends it first); None if open-ended."""
        cfg = self.train_cfg
        fractions = [self.elapsed / cfg.time_budget] if cfg.time_budget else []
        fractions += [self.step / cfg.max_steps] if cfg.max_steps else []
        return max(fractions, default=None)

    def train_step(self, batches: list[list[int]]) -> tuple[float, int, bool]:
        """One optimizer update on this process's micro-batches (lists of example indices).

        Gradients of the summed loss are accumulated over the micro-batches and all-reduced over the
        ranks, and the sum is divided by the target tokens of the whole step (all micro-batches on
        all ranks), so N ranks x K micro-batches make the same update as one batch holding them all.
        Returns (loss per token over the whole step, its target tokens, whether it was applied).
        """
        cfg, tok, ctx = self.train_cfg, self.tokenizer, self.dist
        inputs = [self._collate(indices) for indices in batches]
        local_tokens = sum(int((tgt_out != tok.pad_id).sum()) for _, _, tgt_out in inputs)
        n_tokens = int(distributed.all_reduce_sum(torch.tensor([local_tokens]), ctx).item())
        lr = inverse_sqrt_lr(self.step + 1, peak=cfg.lr, warmup=cfg.warmup_steps) * cooldown_factor(self.progress(), cfg.cooldown)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.train_model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = torch.zeros((), device=self.device)
        ddp = isinstance(self.train_model, DistributedDataParallel)
        for i, (src, tgt_in, tgt_out) in enumerate(inputs):
            # DDP all-reduces gradients inside backward(): only on the last micro-batch; before it they
            # accumulate locally. (Ranks may hold different numbers of micro-batches at an epoch's end:
            # each still all-reduces exactly once.)
            is_last = i == len(inputs) - 1
            with self.train_model.no_sync() if ddp and not is_last else contextlib.nullcontext():
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    logits = self.train_model(src, tgt_in)
                loss_sum, _ = label_smoothed_loss(logits, tgt_out, pad_id=tok.pad_id, smoothing=cfg.label_smoothing)
                # DDP averages gradients over the ranks; times world_size, the average becomes the sum.
                (loss_sum / n_tokens * ctx.world_size).backward()
            loss_total += loss_sum.detach()
        # Summed over ranks, a non-finite loss anywhere is non-finite everywhere: all ranks skip together.
        loss = distributed.all_reduce_sum(loss_total, ctx) / n_tokens
        if not torch.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            if cfg.on_nan == "skip" and ctx.is_main:
                warnings.warn(f"non-finite loss at step {self.step + 1}: the update is skipped (on_nan=skip)", stacklevel=2)
            if cfg.on_nan == "stop":
                raise FloatingPointError(f"loss is {loss.item()} at step {self.step + 1}; last good checkpoint: {self.run_dir / 'last'}")
            return float("nan"), n_tokens, False
        if cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        self.optimizer.step()
        return loss.item(), n_tokens, True

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Teacher-forced validation loss, and BLEU/chrF on real (greedy or beam) translations."""
        self.model.eval()
        tok, ids = self.tokenizer, self.valid_ids
        total, count = 0.0, 0
        order = token_batches([len(s) for s in ids.src_ids], [len(t) for t in ids.tgt_ids], 4096, seed=0, epoch=0, shuffle=False)
        for batch in order:
            src, tgt_in, tgt_out = (t.to(self.device) for t in collate(
                [ids.src_ids[i] for i in batch], [ids.tgt_ids[i] for i in batch],
                pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
            ))
            loss_sum, n = label_smoothed_loss(self.model(src, tgt_in), tgt_out, pad_id=tok.pad_id, smoothing=self.train_cfg.label_smoothing)
            total, count = total + loss_sum.item(), count + int(n)
        translator = Translator(self.model, tok, DecodeConfig(beam_size=self.train_cfg.valid_beam))
        hyps = [tok.decode(h[0].tokens) for h in translator.translate_ids(ids.src_ids)]
        scores = score(hyps, self.valid_data.tgt)
        return {"valid_loss": round(total / count, 4), "bleu": scores["bleu"], "bleu_lc": scores["bleu_lc"], "chrf": scores["chrf"]}

    def _step_dirs(self) -> list[Path]:
        return sorted(self.run_dir.glob("step-[0-9]*[0-9]"))

    def checkpoint_and_validate(self) -> bool:
        """Validate, save step/last/best checkpoints; return True when early stopping says stop.

        Every rank calls it; rank 0 alone validates and writes, and its decision is every rank's.
        """
        rank_rng = distributed.gather_rng_states(self.dist) if self.dist.world_size > 1 else None
        stop = self.dist.is_main and self._checkpoint_and_validate(rank_rng)
        return distributed.broadcast_flag(stop, self.dist)

    def _checkpoint_and_validate(self, rank_rng: list[dict[str, str]] | None) -> bool:
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
        self.save(self.run_dir / "last", rank_rng=rank_rng)
        plot_curves(self.log.records, self.run_dir / "curves.png")
        return bool(self.train_cfg.patience) and self.bad_evals >= self.train_cfg.patience

    def finish(self) -> dict[str, Any]:
        """Write final/: the average of the last k checkpoints for the k <= average_last that validates best.

        Averaging smooths the noise of the last updates (the paper averages the last 5 or 20
        checkpoints), but in a short run the older checkpoints come from a stretch where the model was
        still improving fast and drag the average back (measured on Multi30k: the average of 5
        checkpoints 500 steps apart validated 1.8 BLEU below the newest alone). So every k from
        average_last down to 1 (the newest checkpoint alone, already validated) is tried on the
        validation set, and the best by BLEU is kept; a tie goes to the larger average.
        """
        dirs = self._step_dirs()
        if not dirs:  # no evaluation ever ran: validate and save the live weights first
            self._checkpoint_and_validate(None)
            dirs = self._step_dirs()
        # state_dict() shares storage with the parameters: copy, or loading others would overwrite it too.
        live = {name: value.clone() for name, value in self.model.state_dict().items()}
        newest = next((r for r in reversed(self.log.records) if r.get("event") == "valid"), None)
        best: tuple[float, int, dict[str, Any], dict[str, torch.Tensor] | None] | None = None
        tried: dict[str, float] = {}
        for k in range(min(self.train_cfg.average_last, len(dirs)), 0, -1):
            if k == 1 and newest is not None and newest["step"] == int(dirs[-1].name.split("-")[1]):
                state, metrics = None, {key: newest[key] for key in ("valid_loss", "bleu", "bleu_lc", "chrf")}
            else:
                state = checkpoint.average(dirs[-k:]) if k > 1 else None
                self.model.load_state_dict(state if k > 1 else checkpoint.load(dirs[-1]).model.state_dict(), strict=False)
                metrics = self.validate()
            tried[str(k)] = metrics["bleu"]
            if best is None or metrics["bleu"] > best[0]:
                best = (metrics["bleu"], k, metrics, state)
        self.model.load_state_dict(live)
        _, k, metrics, state = best
        if k > 1:
            checkpoint.save(self.run_dir / "final", self.model, self.tokenizer, configs=self.configs(), state_dict=state)
        else:
            shutil.copytree(dirs[-1], self.run_dir / "final.tmp", dirs_exist_ok=True)
            checkpoint._publish(self.run_dir / "final.tmp", self.run_dir / "final")
        self.log.write(event="final", step=self.step, averaged=[d.name for d in dirs[-k:]], tried_bleu=tried, **metrics)
        return metrics

    def run(self, *, progress: bool = True) -> TrainResult:
        cfg, ctx = self.train_cfg, self.dist
        self.log.write(
            event="start", step=self.step, params=self.model.num_parameters(), train_pairs=len(self.train_data),
            valid_pairs=len(self.valid_data), skipped_empty=self.train_data.skipped_empty,
            truncated=self.train_ids.n_truncated, vocab_size=self.tokenizer.vocab_size,
            world_size=ctx.world_size, accumulate=cfg.accumulate, device=str(self.device), bf16=self.autocast,
        )
        total = cfg.max_steps or None
        bar = tqdm(total=total, initial=self.step, disable=not (progress and ctx.is_main), unit="step", dynamic_ncols=True)
        started, stopped_because = time.monotonic() - self.elapsed, "max_epochs"
        window_tokens, window_start, skipped = 0, time.monotonic(), 0
        # Ctrl-C only raises a flag, and training stops after the current step: a KeyboardInterrupt
        # raised at an arbitrary point could be swallowed by library code, and a rank must not stop
        # alone in the middle of a collective (the others would fail with a broken connection, and
        # nothing would be saved); torchrun passes Ctrl-C on to every rank, and they stop together.
        # A second Ctrl-C interrupts at once.
        interrupted, stopping_together = [], False
        previous_handler = None

        def on_sigint(signum: int, frame: Any) -> None:
            if interrupted:
                raise KeyboardInterrupt
            interrupted.append(signum)

        if threading.current_thread() is threading.main_thread():
            previous_handler = signal.signal(signal.SIGINT, on_sigint)
        try:
            while self.epoch < cfg.max_epochs and stopped_because == "max_epochs":
                batches = self.batches(self.epoch)
                while self.position < len(batches):
                    mine, used = distributed.step_share(
                        batches, self.position, rank=ctx.rank, world_size=ctx.world_size, accumulate=cfg.accumulate
                    )
                    if not used:  # fewer batches left than ranks: this epoch ends here
                        self.position = len(batches)
                        continue
                    loss, n_tokens, applied = self.train_step(mine)
                    self.position += used
                    self.step += 1
                    skipped += not applied
                    window_tokens += n_tokens
                    # Rank 0's clock on every rank: the learning rate and the stop depend on it.
                    self.elapsed = distributed.broadcast_value(time.monotonic() - started, ctx)
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
                    # Clocks differ between processes: the ranks stop together when any one is out of time.
                    out_of_time, stopping_together = distributed.any_rank(
                        [bool(cfg.time_budget) and self.elapsed >= cfg.time_budget, bool(interrupted)], ctx
                    )
                    if stopping_together:
                        raise KeyboardInterrupt
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
            # Only after a stop all ranks agreed on can they still talk (and send rank 0 their generators).
            rank_rng = distributed.gather_rng_states(ctx) if stopping_together and ctx.parallel else None
            if ctx.is_main:
                self.save(self.run_dir / "last", rank_rng=rank_rng)
                self.log.write(event="interrupted", step=self.step)
            raise
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
        bar.close()
        if self.step % cfg.eval_every and stopped_because == "max_epochs":
            self.checkpoint_and_validate()
        final: dict[str, Any] = {}
        if ctx.is_main:
            final = self.finish()
            plot_curves(self.log.records, self.run_dir / "curves.png")
        distributed.barrier(ctx)  # the run ends when final/ is written, for every rank
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
