"""Training: label-smoothed loss, Adam with warm-up and inverse-square-root decay (or the peak held),
validation with real decoding (``qkv.train.validation``), checkpoints that resume exactly, averaging, early
stopping and a time budget (section 5).

A run directory (``qkv.io.runs``) holds ``log.jsonl`` (one JSON object per event), ``curves.png``,
``last/`` (the newest checkpoint with everything needed to resume), ``step-NNNNNN/`` (the last few,
for averaging), ``best/`` (best validation BLEU) and ``final/`` (chosen on validation at the end). A signal stops the
run at a step boundary and saves ``last/`` (``qkv.train.stopping``).

Under ``torchrun`` the same loop trains with DistributedDataParallel (``qkv.train.distributed``): every rank
steps on its share of each optimizer step's batches, and rank 0 alone validates and writes the run.
"""

from __future__ import annotations

import contextlib
import sys
import signal
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from qkv.errors import NonFiniteLoss, QkvError
from qkv.io import checkpoint
from qkv.model import cpu
from qkv.train import distributed
from qkv.model import kernels
from qkv.train import alignment, validation
from qkv.model.config import ConfigError, ModelConfig, config_from_dict
from qkv.data.corpus import Batches, EncodedCorpus, collate, encode_corpus, token_batches
from qkv.data.sentences import case_augmented
from qkv.data.term_annotation import annotated, read_pseudo_terms
from qkv.io.prepared import MappedSide, Prepared, load_prepared
from qkv.model.devices import resolve_device
from qkv.train.ema import WeightEMA
from qkv.train.loss import label_smoothed_loss, projected_label_smoothed_loss, rdrop_loss
from qkv.train.schedule import budget_steps, constant_lr, cooldown_factor, inverse_sqrt_lr
from qkv.model.transformer import Transformer
from qkv.train.progress import PlainProgress
from qkv.train.progress import progress as show_progress
from qkv.model.dropout import use_fast_dropout
from qkv.train.recipes import DataConfig, TrainConfig, adam_kernel, data_sources, load_corpora, resolved_paths
from qkv.io.checkpoint import step_dirs
from qkv.train.precision import Precision
from qkv.train.resume import check_sources, resumed_train_config, restore_tokenizer, saved_train_config
from qkv.train.log import RunLog, open_tensorboard, plot_curves
from qkv.io.runs import check_new_run, clear_run, mark_run
from qkv.train.stopping import StopRequested, StopSignals
from qkv.train.vocabulary import run_tokenizer
from qkv.data.marian_tokenizer import MarianTokenizer
from qkv.data.tokenizer import Tokenizer, load_tokenizer

# Sections of a parent's config.json that a fine-tuned model keeps: they describe the model, not a run
# (an imported model's "marian": the generation settings ``qkv export --format marian`` writes back).
INHERITED_CONFIGS = ("marian",)


class HeldPeakWarning(UserWarning):
    """decay=none in a run with no known end: its learning rate never leaves the peak."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    stopped_because: str
    final: dict[str, Any]  # validation scores of final/


class Trainer:
    """One training run in ``run_dir``; ``Trainer.resume(run_dir)`` continues it after a crash.

    In a process group (``qkv.train.distributed.init_from_env`` under torchrun) every rank builds the same
    Trainer; ``self.model`` is always the plain model (saved without wrapper prefixes), and
    ``self.train_model`` the DistributedDataParallel wrapper that training steps go through.
    """

    def __init__(
        self, run_dir: str | Path, model_config: ModelConfig, train: TrainConfig, data: DataConfig, *,
        start_over: bool = False, init_from: checkpoint.Checkpoint | None = None, device: torch.device | None = None,
        tensorboard: str | Path | None = None, _checked: bool = False,
    ) -> None:
        """``run_dir`` must be new or empty, as ``qkv train --out`` requires (``qkv.io.runs.check_new_run``):
        a run already there is continued with ``Trainer.resume(run_dir)`` or started over with
        ``start_over=True``, and a directory holding anything else is refused (QkvError). ``_checked``:
        the caller has made or checked ``run_dir`` itself (``Trainer.resume``; the demo, which puts its
        tokenizer there first).
        ``start_over``: delete what qkv wrote in ``run_dir`` (``--overwrite``), but only once the data
        (with ``term_share``, its pseudo-terms file too), the tokenizer, the TensorBoard writer and the
        model have been made, so that a setting that fails
        costs the old run nothing; ``self.deleted`` names what went.
        ``device``: where a single process trains (default: the first GPU if there is one, else the
        CPU); under torchrun each process takes the device its rank was given. ``tensorboard``: a
        directory where the log's training and validation numbers also go as TensorBoard scalars."""
        self.run_dir = Path(run_dir)
        data = resolved_paths(data)  # the run records where its data is, not where it was started from
        self.train_cfg, self.data_cfg = train, data
        self.dist = distributed.current()
        if not _checked:  # every rank checks before any writes, as qkv train does
            problem = check_new_run(self.run_dir, overwrite=start_over)
            if distributed.any_rank([problem is not None], self.dist)[0]:
                raise QkvError(f"{problem or f'{self.run_dir} was refused by another process'} (in Python: "
                               "Trainer.resume(run_dir) continues a run, Trainer(..., start_over=True) starts it over)")
        self.device = self.dist.device if self.dist.enabled else (device or resolve_device("auto"))
        self.accumulate = train.accumulation(self.dist.world_size)  # micro-batches per optimizer step and process
        if train.threads:
            torch.set_num_threads(train.threads)
        if train.tune_allocator:  # process-wide, from here on (qkv.model.cpu)
            cpu.tune_allocator()
        kernels.prefer_onednn(train.onednn)  # process-wide too (qkv.model.kernels)
        # Everything that can fail on the user's settings comes before --overwrite deletes the old run:
        # the data and its pseudo-terms, the tokenizer (trained aside), the TensorBoard writer and the model's memory.
        prepared = load_prepared(data.data_dir) if data.corpus == "prepared" else None  # arrays mapped, not read
        self.train_data, self.valid_data = (prepared, prepared.validation(data.valid_limit)) if prepared else load_corpora(data)
        self.sources = data_sources(data)  # what --resume compares: each file's path, size and SHA-256
        # term_share's pseudo-terms (qkv.data.term_annotation): a file that is unreadable, malformed or made
        # from other pairs fails here, not at the first batch after the old run was cleared.
        self._pseudo_terms = (read_pseudo_terms(data.term_file, self.train_data.src, self.train_data.tgt)
                              if data.term_share else None)
        main = self.dist.is_main
        tokenizer_path = self.run_dir / checkpoint.TOKENIZER
        tokenizer, new_tokenizer = run_tokenizer(self.run_dir, data.vocab_size, train.seed, self.train_data, init_from=init_from,
                                                 prepared=prepared, start_over=start_over, main=main)
        writer = open_tensorboard(tensorboard) if tensorboard and main else None
        model = None if tokenizer is None else self._new_model(model_config, tokenizer, train.seed, fine_tune=init_from is not None)
        ids = None if tokenizer is None else self._pair_ids(prepared, tokenizer, model.config)
        links = None if ids is None else self._alignment_links(ids[1])  # eflomal's, before anything is deleted
        self.deleted = clear_run(self.run_dir) if start_over and main and self.run_dir.is_dir() else []
        if main:
            mark_run(self.run_dir)
            if new_tokenizer:
                tokenizer.save(tokenizer_path)
            if links is not None and links[2]:
                alignment.save_links(self.run_dir / alignment.LINKS_FILE, links[0], links[1])
        self.log = RunLog(self.run_dir / "log.jsonl", enabled=main, writer=writer)
        distributed.barrier(self.dist)  # the other ranks read the tokenizer rank 0 has just written
        if tokenizer is None:
            tokenizer = load_tokenizer(tokenizer_path)
            model = self._new_model(model_config, tokenizer, train.seed, fine_tune=init_from is not None)
            ids = self._pair_ids(prepared, tokenizer, model.config)
            links = self._alignment_links(ids[1])
        self.train_links = None if links is None else links[0]  # per training pair, (n, 2) source-target piece positions
        self.tokenizer, self.model = tokenizer, model
        self.model_config = model.config
        self.max_len, self.train_ids, self.valid_ids = ids
        self.init_from = None if init_from is None else str(init_from.path)
        self.inherited = {key: init_from.config[key] for key in INHERITED_CONFIGS if key in init_from.config} if init_from else {}
        if init_from is not None:  # strict: every weight, every shape (a one-line error otherwise)
            checkpoint.load_weights(self.model, init_from.model.state_dict(), f"--init-from {init_from.path}")
        self.ema = WeightEMA(self.model, train.ema) if train.ema else None  # from the initial weights
        if train.fast_dropout and self.device.type == "cpu":  # on a GPU, PyTorch's dropout is fast already
            use_fast_dropout(self.model, train.dropout_bits)
        self.train_model: torch.nn.Module = self.model
        if self.dist.world_size > 1:
            # The seed above gave every rank the same initial weights (DDP also broadcasts rank 0's);
            # dropout should differ between ranks, so each now draws from a generator of its own.
            torch.manual_seed(distributed.rank_seed(train.seed, self.dist.rank, 0))
            device_ids = [self.device] if self.device.type == "cuda" else None
            self.train_model = DistributedDataParallel(self.model, device_ids=device_ids, **distributed.no_buffer_sync())
        # Where the step computes in bfloat16 (qkv.train.precision), warning once of what this device cannot do.
        precision = Precision.choose(train, self.device, warn=self.dist.is_main)
        self.autocast, self.fused_loss = precision.autocast, precision.fused_loss
        self.loss_bf16, self.linear_bf16 = precision.loss_bf16, precision.linear_bf16
        if train.decay == "none" and not (train.max_steps or train.time_budget) and self.dist.is_main:
            warnings.warn("decay=none holds the peak learning rate until the cool-down, which needs the run's end: "
                          "without --max-steps or --time-budget the rate stays at its peak (give one of them, or "
                          "--train decay=inverse_sqrt)", HeldPeakWarning, stacklevel=2)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
            weight_decay=train.weight_decay, **adam_kernel(train.adam)
        )
        self._sampled: tuple[int, EncodedCorpus] | None = None  # the epoch whose segmentation was drawn last
        self.step, self.epoch, self.position = 0, 0, 0
        self.elapsed = 0.0  # training seconds before this process (resumed runs)
        self.best_bleu, self.bad_evals = -1.0, 0
        self.planned_steps: int | None = None  # the time budget as a step count, once measured
        self.saved_step: int | None = None  # the step last/ holds, when this process wrote it
        self.stop = StopSignals()  # handles signals only while run() is inside it

    def _pair_ids(
        self, prepared: Prepared | None, tokenizer: Tokenizer | MarianTokenizer, config: ModelConfig
    ) -> tuple[int, EncodedCorpus, EncodedCorpus]:
        """The longest side kept (one less than the model's ``max_len``: each side gains an EOS, the
        decoder's input a BOS) and the training and validation pairs' ids: mapped from a prepared corpus, else
        encoded here (with subword_dropout, ``epoch_ids`` draws each epoch's anew)."""
        max_len = min(self.data_cfg.max_len, config.max_len - 1)
        if max_len < 1:
            raise ConfigError(f"--model max_len={config.max_len} leaves no room for a sentence: it must be at least 2")
        train_ids = (prepared.train_ids(max_len, self.data_cfg.train_limit) if prepared
                     else encode_corpus(tokenizer, self.train_data, max_len))
        return max_len, train_ids, encode_corpus(tokenizer, self.valid_data, max_len)

    def _alignment_links(self, train_ids: EncodedCorpus) -> tuple[alignment.Links, str, bool] | None:
        """Guided alignment's links of the training pairs (``qkv.train.alignment.run_links``), or None without it."""
        if not self.train_cfg.alignment:
            return None
        return alignment.run_links(self.run_dir, train_ids.src_ids, train_ids.tgt_ids, seed=self.train_cfg.seed,
                                   log=lambda m: print(m, file=sys.stderr) if self.dist.is_main else None)

    def _new_model(self, config: ModelConfig, tokenizer: Tokenizer | MarianTokenizer, seed: int, *, fine_tune: bool = False) -> Transformer:
        """The run's model, its vocabulary from ``tokenizer``, initialised from ``seed``, on its device. A new
        alignment head placed here (no ``alignment_layer`` given) is trained in the pass
        ``alignment.default_context(fine_tune)`` names unless the model config names one (``fine_tune``: the
        weights come from a parent, --init-from)."""
        config = config.replace(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
        if self.train_cfg.alignment:  # guided alignment trains a head: the model records which one
            alignment.check_alignment_settings(self.train_cfg.alignment, self.data_cfg, config.n_decoder_layers)
            if self.train_cfg.rdrop:
                raise ConfigError("guided alignment (--train alignment) and R-Drop (--train rdrop) are not combined: choose one")
            if config.alignment_layer is None:  # a new head: the penultimate layer's
                config = config.replace(alignment_layer=alignment.default_alignment_layer(config.n_decoder_layers),
                                        alignment_context=config.alignment_context or alignment.default_context(fine_tune))
        torch.manual_seed(seed)
        try:
            return Transformer(config).to(self.device)
        except RuntimeError as error:  # torch.OutOfMemoryError is one too
            if "allocate" not in str(error) and "out of memory" not in str(error):
                raise
        with torch.device("meta"):  # shapes without memory, for the message
            n = Transformer(config).num_parameters()
        raise ConfigError(f"the model's {n:,} parameters ({4 * n / 2**30:,.1f} GiB in float32) cannot be allocated on "
                          f"{self.device}: choose a smaller --model d_model, d_ff or number of layers")

    @classmethod
    def resume(
        cls, run_dir: str | Path, *, device: torch.device | None = None, tensorboard: str | Path | None = None, **train_overrides: Any
    ) -> Trainer:
        """Continue a run from ``run_dir/last``: weights, optimizer, RNGs and data position.

        Overrides that could not take effect are refused (ConfigError): Adam's betas, eps and weight
        decay come back with its saved state, max_tokens and seed made the epochs' batches that the
        saved position counts into, and fast_dropout, dropout_bits, onednn and bf16_layers would change
        the numbers an exact resume repeats (``qkv.train.resume``). A new adam kernel is taken, with a
        warning: the run is then not bitwise equal to an uninterrupted one. A new time_budget is planned
        again into a step count."""
        last = checkpoint.resolve(Path(run_dir) / "last")
        config = checkpoint.read_config(last)  # verifies last/ first
        saved = saved_train_config(config["train"])
        train = resumed_train_config(saved, train_overrides, warn=distributed.current().is_main)
        if distributed.current().is_main:
            restore_tokenizer(Path(run_dir), last)
        trainer = cls(run_dir, ModelConfig.from_dict(config["model"]), train, config_from_dict(DataConfig, config["data"]), device=device,
                      tensorboard=tensorboard, _checked=True)
        trainer.inherited = {key: config[key] for key in INHERITED_CONFIGS if key in config}
        check_sources(Path(run_dir), config.get("sources"), trainer.sources)
        loaded = checkpoint.load(last)
        trainer.model.load_state_dict(loaded.model.state_dict())
        state = checkpoint.load_trainer(last, trainer.optimizer)
        for group in trainer.optimizer.param_groups:  # the saved groups name the kernel they ran with
            group.update(adam_kernel(train.adam))
        trainer.step, trainer.epoch, trainer.position = state["step"], state["epoch"], state["position"]
        if trainer.ema is not None:  # the saved average, or (EMA asked for only now) one from the saved weights
            trainer.ema = WeightEMA(trainer.model, train.ema)
            if state["tensors"]:
                trainer.ema.load_state_dict(state["tensors"])
        trainer.elapsed, trainer.best_bleu, trainer.bad_evals = state["elapsed"], state["best_bleu"], state["bad_evals"]
        trainer.saved_step = trainer.step
        if train.time_budget == saved.time_budget:  # a new budget is measured and planned afresh
            trainer.planned_steps = state.get("planned_steps")
        ctx = trainer.dist
        if ctx.world_size > 1:
            # load_trainer restored rank 0's generators on every rank; give each rank its own back.
            saved = state.get("rank_rng") or []
            if len(saved) == ctx.world_size:
                distributed.set_rng_state(saved[ctx.rank], ctx)
            else:  # saved by another number of processes (or at Ctrl-C): fresh, distinct draws
                torch.manual_seed(distributed.rank_seed(train.seed, ctx.rank, trainer.step))
        return trainer

    def configs(self) -> dict[str, Any]:
        return {**self.inherited, "train": self.train_cfg.__dict__, "data": self.data_cfg.__dict__, "sources": self.sources}

    def save(self, directory: Path, *, resumable: bool = True, rank_rng: list[dict[str, str]] | None = None) -> None:
        """Write a checkpoint of ``self.model``; ``rank_rng``: every rank's generators (distributed runs)."""
        trainer_state = {
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,  # in the epoch's batches, counted over all ranks
            "elapsed": self.elapsed,
            "best_bleu": self.best_bleu,
            "bad_evals": self.bad_evals,
            "planned_steps": self.planned_steps,
        }
        if rank_rng is not None:
            trainer_state["rank_rng"] = rank_rng
        try:
            checkpoint.save(
                directory,
                self.model,
                self.tokenizer,
                configs=self.configs(),
                trainer=trainer_state if resumable else None,
                optimizer=self.optimizer if resumable else None,
                trainer_tensors=self.ema.state_dict() if resumable and self.ema is not None else None,
            )
        except OSError as error:  # a full disk, most often: the checkpoints already there are whole
            raise validation.save_failure(directory, self.run_dir, error) from None
        if directory.name == "last":
            self.saved_step = self.step

    def epoch_ids(self, epoch: int) -> EncodedCorpus:
        """The training pairs as the model sees them in ``epoch``: one segmentation for every epoch,
        or with ``subword_dropout`` (and ``case_augment``, the pairs recased) one drawn for this epoch
        (from the seed and the epoch alone, so a resumed run draws it again)."""
        dropout, recase, terms = self.data_cfg.subword_dropout, self.data_cfg.case_augment, self.data_cfg.term_share
        if not dropout and not recase and not terms:
            return self.train_ids
        if self._sampled is None or self._sampled[0] != epoch:
            seed = self.train_cfg.seed * 1_000_003 + epoch
            data = self.train_data
            if recase:  # this epoch's share of pairs in capitals or Title Case (qkv.data.sentences.case_augmented)
                src, tgt = case_augmented(data.src, data.tgt, recase, seed)
                data = replace(data, src=src, tgt=tgt)
            if terms:  # this epoch's share of pairs with pseudo-terms written inline (read in __init__)
                data = replace(data, src=annotated(data.src, self._pseudo_terms, terms, seed))
            self._sampled = (epoch, encode_corpus(self.tokenizer, data, self.max_len, dropout=dropout, seed=seed))
        return self._sampled[1]

    def batches(self, epoch: int) -> Batches:
        ids = self.epoch_ids(epoch)
        src_len = ids.src_ids.lengths() if isinstance(ids.src_ids, MappedSide) else [len(s) for s in ids.src_ids]
        tgt_len = ids.tgt_ids.lengths() if isinstance(ids.tgt_ids, MappedSide) else [len(t) for t in ids.tgt_ids]
        return token_batches(src_len, tgt_len, self.train_cfg.max_tokens, seed=self.train_cfg.seed, epoch=epoch)

    def _collate(self, indices: list[int]) -> tuple[Tensor, ...]:
        """src (B, S), tgt_in (B, T), tgt_out (B, T); with guided alignment also the head's targets (B, T, S)."""
        tok, ids = self.tokenizer, self.epoch_ids(self.epoch)
        tensors = collate(
            [ids.src_ids[i] for i in indices],
            [ids.tgt_ids[i] for i in indices],
            pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
        )
        tensors = tuple(t.to(self.device) for t in tensors)
        if self.train_links is not None:
            src, _, tgt_out = tensors
            tensors += (alignment.link_targets([self.train_links[i] for i in indices], tgt_out.size(1), src.size(1), self.device),)
        return tensors  # type: ignore[return-value]

    def end_step(self) -> int | None:
        """The step the run ends at: max_steps or the steps planned from the time budget, whichever
        comes first; None while neither is known."""
        ends = [n for n in (self.train_cfg.max_steps, self.planned_steps) if n]
        return min(ends, default=None)

    def progress(self) -> float | None:
        """Fraction of the run's steps done; None while its end is not known."""
        end = self.end_step()
        return None if end is None else self.step / end

    def plan_due(self) -> bool:
        """Whether the time budget is still to be planned, now (the same answer on every rank)."""
        cfg = self.train_cfg
        return bool(cfg.time_budget) and self.planned_steps is None and self.step >= (cfg.measure_steps or cfg.eval_every)

    def plan_budget(self) -> None:
        """Turn the time budget into a number of steps, once: the pace of the updates so far (by
        default the first ``eval_every``, with their validation and checkpoints) gives the steps that
        fit in the budget.

        From then on the learning rate and the stop depend on the step alone, so a budgeted run is
        reproducible and resumes exactly: with ``planned_steps`` N it trains as ``--max-steps N``
        does. N is at least large enough that the cool-down starts after the measured updates, which
        ran at the full schedule, as they would under ``--max-steps N``.
        """
        cfg = self.train_cfg
        self.planned_steps = budget_steps(cfg.time_budget, self.elapsed, self.step, cfg.cooldown)
        self.log.write(event="budget", step=self.step, planned_steps=self.planned_steps, seconds_per_step=round(self.elapsed / self.step, 6))

    def train_step(self, batches: list[list[int]]) -> tuple[float, int, bool]:
        """One optimizer update on this process's micro-batches (lists of example indices).

        Gradients of the summed loss are accumulated over the micro-batches and all-reduced over the
        ranks, and the sum is divided by the target tokens of the whole step (all micro-batches on
        all ranks), so N ranks x K micro-batches make the same update as one batch holding them all.
        Returns (loss per token over the whole step, its target tokens, whether it was applied); with
        R-Drop (``rdrop``) the loss is the two passes' mean cross-entropy, without the KL term.
        """
        cfg, tok, ctx = self.train_cfg, self.tokenizer, self.dist
        inputs = [self._collate(indices) for indices in batches]
        local_tokens = sum(int((batch[2] != tok.pad_id).sum()) for batch in inputs)
        n_tokens = int(distributed.all_reduce_sum(torch.tensor([local_tokens]), ctx).item())
        schedule = inverse_sqrt_lr if cfg.decay == "inverse_sqrt" else constant_lr
        lr = schedule(self.step + 1, peak=cfg.lr, warmup=cfg.warmup_steps) * cooldown_factor(self.progress(), cfg.cooldown)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.train_model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = torch.zeros((), device=self.device)
        ddp = isinstance(self.train_model, DistributedDataParallel)
        for i, (src, tgt_in, tgt_out, *links) in enumerate(inputs):
            # DDP all-reduces gradients inside backward(): only on the last micro-batch; before it they
            # accumulate locally. (Ranks may hold different numbers of micro-batches at an epoch's end:
            # each still all-reduces exactly once.)
            is_last = i == len(inputs) - 1
            with self.train_model.no_sync() if ddp and not is_last else contextlib.nullcontext(), \
                    kernels.bf16_products(self.linear_bf16):
                gen, smoothing = self.model.generator, cfg.label_smoothing
                if cfg.rdrop:  # R-Drop: the batch twice in one (2B rows), each copy with its own dropout masks
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                        out = self.train_model(torch.cat([src, src]), torch.cat([tgt_in, tgt_in]), project=False)  # (2B, T, D)
                        objective, loss_sum, _ = rdrop_loss(out, gen, tgt_out, pad_id=tok.pad_id, smoothing=smoothing, alpha=cfg.rdrop)
                else:
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                        out = self.train_model(src, tgt_in, project=not self.fused_loss, alignment=bool(links))  # logits or (B, T, D)
                    out, head = out if links else (out, None)  # guided alignment: the head's weights (B, T, S)
                    # fused: the projection inside the loss, in chunks
                    objective, _ = projected_label_smoothed_loss(out, gen.weight, gen.bias, tgt_out, pad_id=tok.pad_id,
                                                                 smoothing=smoothing, bf16=self.loss_bf16) \
                        if self.fused_loss else label_smoothed_loss(out, tgt_out, pad_id=tok.pad_id, smoothing=smoothing)
                    loss_sum = objective
                    if head is not None:  # the translation's cross-entropy is what the log reports
                        objective = objective + cfg.alignment * alignment.alignment_loss(head, links[0])
                # DDP averages gradients over the ranks; times world_size, the average becomes the sum.
                (objective / n_tokens * ctx.world_size).backward()
            loss_total += loss_sum.detach()  # the cross-entropy: with R-Drop, the two passes' mean
        # Summed over ranks, a non-finite loss anywhere is non-finite everywhere: all ranks skip together.
        loss = distributed.all_reduce_sum(loss_total, ctx) / n_tokens
        if not torch.isfinite(loss):
            return self._skip_step("loss", loss.item(), n_tokens)
        # A finite loss can still have an infinite or NaN gradient (an overflow in backward): Adam
        # would turn the weights and its moments into NaN for good. The norm is needed to clip
        # anyway; the ranks hold the same all-reduced gradients, and decide together all the same.
        params = [p for p in self.model.parameters() if p.grad is not None]
        if cfg.clip_norm:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
        else:  # the same 2-norm, without scaling (torch.nn.utils.get_total_norm is new in PyTorch 2.6)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        if distributed.any_rank([not torch.isfinite(norm).item()], ctx)[0]:
            self._skip_step("gradient norm", norm.item(), n_tokens)
            return loss.item(), n_tokens, False
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.step + 1)
        return loss.item(), n_tokens, True

    def _skip_step(self, what: str, value: float, n_tokens: int) -> tuple[float, int, bool]:
        """Drop the step's gradients after a non-finite ``what``: skip the update, or stop (on_nan)."""
        self.optimizer.zero_grad(set_to_none=True)
        step = self.step + 1
        if self.train_cfg.on_nan == "stop":
            raise NonFiniteLoss(f"{what} is {value} at step {step}; last good checkpoint: {self.run_dir / 'last'}")
        if self.dist.is_main:
            warnings.warn(f"non-finite {what} at step {step}: the update is skipped (on_nan=skip)", stacklevel=3)
        return float("nan"), n_tokens, False

    def validate(self) -> dict[str, Any]:
        """Teacher-forced validation loss, and BLEU/chrF on real (greedy or beam) translations."""
        return validation.validate(self.model, self.tokenizer, self.valid_ids, self.valid_data.tgt, self.train_cfg)

    def checkpoint_and_validate(self) -> bool:
        """Validate, save step/last/best checkpoints; return True when early stopping says stop.

        Every rank calls it; rank 0 alone validates and writes, and its decision is every rank's.
        """
        rank_rng = distributed.gather_rng_states(self.dist) if self.dist.world_size > 1 else None
        stop = self.dist.is_main and self.validate_and_save(rank_rng)
        return distributed.broadcast_flag(stop, self.dist)

    def validate_and_save(self, rank_rng: list[dict[str, str]] | None = None) -> bool:
        """This process alone: validate and write the step, best and last checkpoints
        (``qkv.train.validation.validate_and_save``); True when early stopping says stop."""
        return validation.validate_and_save(self, rank_rng)

    def finish(self) -> dict[str, Any]:
        """Write final/, chosen on validation (``qkv.train.validation.write_final``); returns its scores."""
        return validation.write_final(self)

    @property
    def bf16_mode(self) -> str | None:
        """Where training computes in bfloat16 (``qkv.train.precision.Precision.mode``)."""
        return Precision(self.autocast, self.fused_loss, self.loss_bf16, self.linear_bf16).mode

    def run(self, *, progress: bool = True) -> TrainResult:
        """Train until max_steps, the planned steps of the time budget, early stopping or max_epochs;
        then write final/. A signal (SIGINT, SIGTERM, SIGHUP) ends it with StopRequested once last/
        holds the state after the current step (``qkv.train.stopping``)."""
        cfg, ctx = self.train_cfg, self.dist
        self.log.write(
            event="start", step=self.step, params=self.model.num_parameters(), train_pairs=len(self.train_ids.src_ids),
            valid_pairs=len(self.valid_data), skipped_empty=self.train_data.skipped_empty,
            truncated=self.train_ids.n_truncated, vocab_size=self.tokenizer.vocab_size,
            world_size=ctx.world_size, accumulate=self.accumulate, device=str(self.device), bf16=self.bf16_mode or False,
            **({"init_from": self.init_from} if self.init_from else {}),
        )
        bar = show_progress(total=self.end_step(), initial=self.step, enabled=progress and ctx.is_main)
        together = True  # whether a stop comes at a step boundary that all ranks reached (they can still talk)
        with self.stop, contextlib.closing(self.log):
            try:
                stopped_because = self._train(bar)
                bar.close()
                # The run ends with a checkpoint of its last step (unless one was just written).
                newest = step_dirs(self.run_dir)[-1:] if ctx.is_main else []
                if distributed.broadcast_flag(ctx.is_main and [d.name for d in newest] != [f"step-{self.step:06d}"], ctx):
                    self.checkpoint_and_validate()
                    self._stop_if_signalled()
                together = False  # rank 0 alone writes final/
                final: dict[str, Any] = {}
                if ctx.is_main:
                    final = self.finish()
                    plot_curves(self.log.records, self.run_dir / "curves.png")
            except StopRequested:
                bar.close()
                # Only ranks that stopped together can still talk (and send rank 0 their generators).
                rank_rng = distributed.gather_rng_states(ctx) if together and ctx.parallel else None
                if ctx.is_main and self.saved_step != self.step:
                    self.save(self.run_dir / "last", rank_rng=rank_rng)
                if ctx.is_main:
                    name = signal.Signals(self.stop.signum or signal.SIGINT).name
                    self.log.write(event="interrupted", step=self.step, signal=name)
                raise
        distributed.barrier(ctx)  # the run ends when final/ is written, for every rank
        return TrainResult(self.run_dir, self.step, stopped_because, final)

    def _stop_if_signalled(self) -> None:
        """Every rank raises StopRequested at the same step boundary when any rank got a signal."""
        if distributed.any_rank([self.stop.requested], self.dist)[0]:
            raise StopRequested(self.stop.signum or signal.SIGINT)

    def _train(self, bar: tqdm | PlainProgress) -> str:
        """The training loop; returns why it stopped."""
        cfg, ctx = self.train_cfg, self.dist
        started, stopped_because = time.monotonic() - self.elapsed, "max_epochs"
        window_tokens, window_start, skipped = 0, time.monotonic(), 0
        end = self.end_step()
        if end is not None and self.step >= end:  # resumed after its last step (stopped while writing final/)
            return "max_steps" if end == cfg.max_steps else "time_budget"
        while self.epoch < cfg.max_epochs and stopped_because == "max_epochs":
            batches = self.batches(self.epoch)
            while self.position < len(batches):
                mine, used = distributed.step_share(
                    batches, self.position, rank=ctx.rank, world_size=ctx.world_size, accumulate=self.accumulate
                )
                if not used:  # fewer batches left than ranks: this epoch ends here
                    self.position = len(batches)
                    continue
                loss, n_tokens, applied = self.train_step(mine)
                self.position += used
                self.step += 1
                skipped += not applied
                window_tokens += n_tokens
                self.elapsed = distributed.broadcast_value(time.monotonic() - started, ctx)  # rank 0's clock
                end = self.end_step()
                bar.total = end
                if self.step % 50 == 0 or not applied:
                    rate = window_tokens / max(time.monotonic() - window_start, 1e-9)
                    lr = self.optimizer.param_groups[0]["lr"]
                    self.log.write(event="train", step=self.step, epoch=self.epoch, loss=round(loss, 4), lr=lr, tokens_per_s=round(rate), skipped=skipped)
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:.0f}", epoch=self.epoch)
                    window_tokens, window_start = 0, time.monotonic()
                bar.update(1)
                self._stop_if_signalled()
                at_end = end is not None and self.step >= end
                if self.step % cfg.eval_every == 0 or at_end:
                    early = self.checkpoint_and_validate()
                    self._stop_if_signalled()  # a signal during validation abandoned it: save last/ now
                    if early:
                        stopped_because = "early_stopping"
                    elif at_end:
                        stopped_because = "max_steps" if end == cfg.max_steps else "time_budget"
                    if stopped_because != "max_epochs":
                        break
                if self.plan_due():  # after this step's validation, so that the pace includes it
                    self.elapsed = distributed.broadcast_value(time.monotonic() - started, ctx)
                    self.plan_budget()
                    if self.step >= self.end_step():  # the budget is spent already
                        stopped_because = "max_steps" if self.end_step() == cfg.max_steps else "time_budget"
                        break
            else:
                self.epoch, self.position = self.epoch + 1, 0
        return stopped_because

