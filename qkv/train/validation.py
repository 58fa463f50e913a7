"""Validation: the loss and BLEU a run logs every ``eval_every`` updates, with the checkpoints written
then (step-N/, best/, last/), and at the end of the run ``final/``, chosen on the validation split:
an average of the newest checkpoints (or the EMA of the weights), with the length penalty its beam
search scored best with.

Nothing here reads a test set: the choices a run makes are made on validation only.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any, Protocol

import torch

from qkv.io import checkpoint
from qkv.data.corpus import EncodedCorpus, ParallelCorpus, collate, token_batches
from qkv.infer.search import DecodeConfig
from qkv.infer.bleu import score
from qkv.train.loss import label_smoothed_loss
from qkv.model.transformer import Transformer
from qkv.train.recipes import TrainConfig
from qkv.io.checkpoint import step_dirs
from qkv.train.ema import WeightEMA
from qkv.train.log import RunLog, plot_curves
from qkv.train.stopping import Abandoned, StopRequested, StopSignals
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import Translator



class Run(Protocol):
    """What validating, checkpointing and choosing final/ need of a training run (``qkv.train.trainer.Trainer`` is one)."""

    run_dir: Path
    model: Transformer
    tokenizer: TextTokenizer
    log: RunLog
    train_cfg: TrainConfig
    ema: WeightEMA | None
    stop: StopSignals
    step: int
    epoch: int
    best_bleu: float
    bad_evals: int
    valid_ids: EncodedCorpus
    valid_data: ParallelCorpus

    def validate(self) -> dict[str, Any]: ...

    def validate_and_save(self) -> bool: ...

    def save(self, directory: Path, *, resumable: bool = True, rank_rng: list[dict[str, str]] | None = None) -> None: ...

    def configs(self) -> dict[str, Any]: ...

# final/'s length penalty is chosen among these on the validation set, with this beam (qkv's default).
LENGTH_PENALTIES = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0)
TUNING_BEAM = 5


@torch.no_grad()
def validate(model: Transformer, tok: TextTokenizer, ids: EncodedCorpus, references: list[str], train: TrainConfig) -> dict[str, Any]:
    """Teacher-forced validation loss (label-smoothed, as in training), and BLEU/chrF of real
    translations (beam ``train.valid_beam``; 1 is greedy) against ``references``."""
    model.eval()
    total, count = 0.0, 0
    order = token_batches([len(s) for s in ids.src_ids], [len(t) for t in ids.tgt_ids], 4096, seed=0, epoch=0, shuffle=False)
    for batch in order:
        src, tgt_in, tgt_out = (t.to(model.device) for t in collate(
            [ids.src_ids[i] for i in batch], [ids.tgt_ids[i] for i in batch],
            pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
        ))
        loss_sum, n = label_smoothed_loss(model(src, tgt_in), tgt_out, pad_id=tok.pad_id, smoothing=train.label_smoothing)
        total, count = total + loss_sum.item(), count + int(n)
    translator = Translator(model, tok, DecodeConfig(beam_size=train.valid_beam))
    hyps = [tok.decode(h[0].tokens) for h in translator.translate_ids(ids.src_ids)]
    scores = score(hyps, references)
    return {"valid_loss": round(total / count, 4), "bleu": scores["bleu"], "bleu_lc": scores["bleu_lc"], "chrf": scores["chrf"]}


def validate_and_save(trainer: Run, rank_rng: list[dict[str, str]] | None = None) -> bool:
    """This process alone: validate, write step-N/, best/ (when better) and last/, drop the step
    checkpoints past ``keep_last``; True when early stopping says stop. ``rank_rng``: every
    rank's generators (a distributed run), saved in last/."""
    try:
        with trainer.stop.abandonable():  # a signal abandons validation, so that last/ is saved soon
            metrics = trainer.validate()
    except Abandoned:
        trainer.log.write(event="valid_abandoned", step=trainer.step)
        return False
    improved = metrics["bleu"] > trainer.best_bleu
    if improved:
        trainer.best_bleu, trainer.bad_evals = metrics["bleu"], 0
    else:
        trainer.bad_evals += 1
    trainer.log.write(event="valid", step=trainer.step, epoch=trainer.epoch, **metrics)
    trainer.save(trainer.run_dir / f"step-{trainer.step:06d}", resumable=False)
    if improved:
        trainer.save(trainer.run_dir / "best", resumable=False)
    trainer.save(trainer.run_dir / "last", rank_rng=rank_rng)
    # Old step checkpoints go only once every save has succeeded: a full disk keeps them all.
    for old in step_dirs(trainer.run_dir)[: -trainer.train_cfg.keep_last]:
        if checkpoint.is_checkpoint_dir(old):  # a step-N directory holding other files is not ours
            shutil.rmtree(old)
    plot_curves(trainer.log.records, trainer.run_dir / "curves.png")
    return bool(trainer.train_cfg.patience) and trainer.bad_evals >= trainer.train_cfg.patience


def save_failure(directory: Path, run_dir: Path, error: OSError) -> OSError:
    """A checkpoint that could not be written (a full disk, most often) as a one-line error that says
    what the user still has and how to go on: a save replaces nothing until it is whole."""
    failure = OSError(
        f"cannot write checkpoint {directory} ({error.strerror or error}); the run's earlier checkpoints "
        f"are as they were: make room, then continue with qkv train --resume {run_dir}"
    )
    failure.errno = error.errno
    return failure


def write_final(trainer: Run) -> dict[str, Any]:
    """Write final/: of the averages of the newest k step checkpoints, k = average_last down to 1
    (the newest alone), and the EMA of the weights when the run keeps one (``ema``), the one with
    the best validation BLEU; a tie goes to the larger average, and the EMA must beat them all.

    Averaging smooths the noise of the last updates (the paper averages the last 5 or 20
    checkpoints), but in a short run the older checkpoints come from a stretch where the model was
    still improving fast and drag the average back (measured on Multi30k: the average of 5
    checkpoints 500 steps apart validated below the newest alone), so each is validated.
    A stop signal abandons this (last/ already holds the run's final step; --resume finishes it).
    Returns the validation scores of final/.
    """
    run_dir, model, stop = trainer.run_dir, trainer.model, trainer.stop
    dirs = step_dirs(run_dir)
    if not dirs:  # no evaluation ever ran: validate and save the live weights first
        trainer.validate_and_save()
        dirs = step_dirs(run_dir)
    # state_dict() shares storage with the parameters: copy, or loading others would overwrite it too.
    live = {name: value.clone() for name, value in model.state_dict().items()}
    newest = next((r for r in reversed(trainer.log.records) if r.get("event") == "valid"), None)
    best: tuple[float, int, dict[str, Any], dict[str, torch.Tensor] | None] | None = None
    tried: dict[str, float] = {}
    try:
        for k in range(min(trainer.train_cfg.average_last, len(dirs)), 0, -1):
            if k == 1 and newest is not None and newest["step"] == checkpoint.step_number(dirs[-1]):
                state, metrics = None, {key: newest[key] for key in ("valid_loss", "bleu", "bleu_lc", "chrf")}
            else:
                state = checkpoint.average(dirs[-k:]) if k > 1 else None
                model.load_state_dict(state if k > 1 else checkpoint.load(dirs[-1]).model.state_dict(), strict=False)
                with stop.abandonable():
                    metrics = trainer.validate()
            tried[str(k)] = metrics["bleu"]
            if best is None or metrics["bleu"] > best[0]:
                best = (metrics["bleu"], k, metrics, state)
        if trainer.ema is not None:  # k = 0 stands for the EMA: final/ only if it beats every average
            state = trainer.ema.weights()
            model.load_state_dict(state, strict=False)
            with stop.abandonable():
                metrics = trainer.validate()
            tried["ema"] = metrics["bleu"]
            if metrics["bleu"] > best[0]:
                best = (metrics["bleu"], 0, metrics, state)
    except Abandoned:
        raise StopRequested(stop.signum or signal.SIGINT) from None
    finally:
        model.load_state_dict(live)
    _, k, metrics, state = best
    try:  # final/ holds the chosen weights and, in config.json, the length penalty chosen for them
        model.load_state_dict(state if state is not None else checkpoint.load(dirs[-1]).model.state_dict(), strict=False)
        with stop.abandonable():
            decode = tune_length_penalty(trainer) if trainer.train_cfg.tune_length_penalty else {}
        try:
            checkpoint.save(run_dir / "final", model, trainer.tokenizer, configs={**trainer.configs(), "decode": decode})
        except OSError as error:  # last/ holds the final step: --resume writes final/ again, training nothing
            raise save_failure(run_dir / "final", run_dir, error) from None
    except Abandoned:
        raise StopRequested(stop.signum or signal.SIGINT) from None
    finally:
        model.load_state_dict(live)
    averaged = [d.name for d in dirs[-k:]] if k else []
    trainer.log.write(event="final", step=trainer.step, averaged=averaged, ema=k == 0, tried_bleu=tried, **metrics)
    return metrics


@torch.no_grad()
def tune_length_penalty(trainer: Run) -> dict[str, float]:
    """The length penalty (GNMT's alpha) of the best validation BLEU with beam search, one of
    ``LENGTH_PENALTIES``, for the weights the trainer's model holds now; a tie goes to the one
    nearer the usual 0.6. Saved in final/'s config.json ("decode"), translate, evaluate, align,
    attend and serve use it unless told another."""
    trainer.model.eval()
    tok, sources, references, tried = trainer.tokenizer, trainer.valid_ids.src_ids, trainer.valid_data.tgt, {}
    for alpha in LENGTH_PENALTIES:
        translator = Translator(trainer.model, tok, DecodeConfig(beam_size=TUNING_BEAM, length_penalty=alpha))
        hyps = [tok.decode(h[0].tokens) for h in translator.translate_ids(sources)]
        tried[alpha] = score(hyps, references)["bleu"]
    chosen = max(tried, key=lambda alpha: (tried[alpha], -abs(alpha - 0.6)))
    trainer.log.write(event="length_penalty", step=trainer.step, beam=TUNING_BEAM, chosen=chosen, tried_bleu={str(a): b for a, b in tried.items()})
    return {"length_penalty": chosen}
