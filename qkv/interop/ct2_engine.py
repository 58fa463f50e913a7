"""CTranslate2 as the search engine behind qkv's commands (``--engine ctranslate2``).

The checkpoint is exported once (``export_ctranslate2``) into qkv's cache, a directory named for the
checkpoint's manifest: ``$XDG_CACHE_HOME/qkv/ctranslate2/<manifest sha256>`` (``~/.cache`` by default;
``QKV_CT2_CACHE`` sets another root). A checkpoint whose files change has another manifest, hence
another export; the checkpoint's own directory and any directory the user did not give are never
written. A new export (``<hash>.unchecked`` until then) is checked against qkv's own search, as ``qkv export`` checks it: the first
sentences it translates, greedy, must come out the same by both engines (``PARITY_SENTENCES``,
``PARITY_MIN``), or the export is removed and the command stops with an error.

``CTranslate2Translator`` is a ``Translator`` whose ``translate_ids`` runs CTranslate2 under qkv's
search rules (``ct2_translate_ids``: the checkpoint's beam and length penalty, beam-size finished
hypotheses, as ``--stop-early``); everything above it (sentence splitting, streams, scores, the
trust signals computed by qkv's own teacher-forced pass over CTranslate2's output) is qkv's.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

import torch

from qkv.errors import QkvError
from qkv.infer.search import DecodeConfig, Hypothesis
from qkv.infer.translator import Translator
from qkv.interop.ctranslate2 import import_ctranslate2, ct2_translate_ids, export_ctranslate2, is_export_dir
from qkv.io import checkpoint
from qkv.io.manifest import MANIFEST

PARITY_SENTENCES = 20  # a new export is checked on this many of the first sentences it translates
PARITY_MIN = 0.9  # the share of them that must come out the same as qkv's greedy search
UNCHECKED = ".unchecked"  # an export not yet checked (a process killed before its check leaves one to check again)


def cache_root() -> Path:
    if os.environ.get("QKV_CT2_CACHE"):
        return Path(os.environ["QKV_CT2_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv" / "ctranslate2"


def export_dir(checkpoint_dir: Path) -> Path:
    """Where the checkpoint's export lives: named for its manifest, so an export is reused exactly
    while the checkpoint's files are unchanged."""
    digest = hashlib.sha256((Path(checkpoint_dir) / MANIFEST).read_bytes()).hexdigest()[:32]
    return cache_root() / digest


def ensure_export(checkpoint_dir: str | Path, *, log=lambda m: print(m, file=sys.stderr)) -> tuple[Path, bool]:
    """The checkpoint's CTranslate2 export, made if it is not in the cache; and whether it was just
    made (then ``CTranslate2Translator(check=True)`` checks it on the first sentences it translates)."""
    resolved = checkpoint.resolve(checkpoint_dir)
    out = export_dir(resolved)
    if is_export_dir(out):
        return out, False
    unchecked = out.with_name(out.name + UNCHECKED)  # renamed to ``out`` once it passed its check
    if not is_export_dir(unchecked):
        unchecked.parent.mkdir(parents=True, exist_ok=True)
        log(f"exporting {resolved} to CTranslate2 once, into {out}")
        export_ctranslate2(resolved, unchecked)  # refuses a directory it did not write
    return unchecked, True


class CTranslate2Translator(Translator):
    """A ``Translator`` whose search runs in CTranslate2 (``compute_type`` "float32" or "int8"); the
    model is qkv's, for the tokenizer, the limits and whatever reads its internals."""

    def __init__(self, model, tokenizer, config: DecodeConfig | None, *, ct2_dir: Path, compute_type: str = "float32",
                 threads: int = 0, check: bool | dict = False, log=lambda m: print(m, file=sys.stderr), engine=None,
                 **kwargs) -> None:
        """``check``: True to check a new export on the first sentences translated; the server passes one
        dict ``{"pending": bool, "failed": message or None}`` to all its Translators, so that a failed
        check stops every later batch too. ``engine``: a ``ctranslate2.Translator`` of ``ct2_dir`` to reuse
        (the server makes one Translator per batch and loads the model once)."""
        super().__init__(model, tokenizer, config, **kwargs)
        self.ct2_dir, self.log = Path(ct2_dir), log
        self.parity = check if isinstance(check, dict) else {"pending": bool(check), "failed": None}
        if self.config.sampling or self.config.n_best > 1:
            raise QkvError("--engine ctranslate2 searches for the best translation: not with --sampling or --n-best")
        if self.shortlist is not None or self.workers > 1:
            raise QkvError("--engine ctranslate2 runs with its own threads: not with --shortlist or --workers")
        ct2 = import_ctranslate2()
        supported = ct2.get_supported_compute_types("cpu")
        if compute_type not in supported:
            raise QkvError(f"CTranslate2 on this CPU computes in {', '.join(sorted(supported))}, not {compute_type}")
        self.compute_type, self.threads = compute_type, threads or torch.get_num_threads()
        # CTranslate2's throughput layout: one batch per thread (inter_threads), each on one thread.
        self.engine = engine or ct2.Translator(str(ct2_dir), device="cpu", compute_type=compute_type,
                                               inter_threads=self.threads, intra_threads=1)

    def translate_ids(self, src_ids: list[list[int]]) -> list[list[Hypothesis]]:
        """CTranslate2's best translation of each source (scores are not kept: NaN); empty sources give ''."""
        if self.parity["failed"]:
            raise QkvError(self.parity["failed"])
        if self.parity["pending"]:
            self._check_parity(src_ids)
        found = ct2_translate_ids(self.engine, self.tokenizer, src_ids, self.config, max_len=self.model.config.max_len,
                                  max_tokens=self.max_tokens)
        return [[Hypothesis(tokens, math.nan, math.nan)] for tokens in found]

    def _check_parity(self, src_ids: list[list[int]]) -> None:
        """A new export's check: the first sentences, greedy, by qkv and by CTranslate2 (module docstring)."""
        sample = [ids for ids in src_ids if ids][:PARITY_SENTENCES]
        if not sample:
            return
        greedy = DecodeConfig(beam_size=1, max_len_a=self.config.max_len_a, max_len_b=self.config.max_len_b)
        ours = [h[0].tokens for h in Translator(self.model, self.tokenizer, greedy).translate_ids(sample)]
        engine = self.engine  # the export is checked in float32, as qkv computes (int8 is an approximation of it)
        if self.compute_type != "float32":
            engine = import_ctranslate2().Translator(str(self.ct2_dir), device="cpu", intra_threads=self.threads)
        theirs = ct2_translate_ids(engine, self.tokenizer, sample, greedy, max_len=self.model.config.max_len)
        same = sum(a == b for a, b in zip(ours, theirs))
        self.log(f"parity: {same} of {len(sample)} sentences translated the same by qkv and CTranslate2 (greedy)")
        if same < PARITY_MIN * len(sample):
            if self._unchecked_in_cache():  # qkv's own export only: a directory the caller gave is left alone
                import shutil

                shutil.rmtree(self.ct2_dir, ignore_errors=True)
            self.parity["failed"] = (f"CTranslate2's export translated only {same} of {len(sample)} sentences as qkv does: "
                                     "not using it (qkv export --check shows the differences)")
            raise QkvError(self.parity["failed"])
        self.parity["pending"] = False
        if self._unchecked_in_cache():  # checked: the export is the checkpoint's from now on
            checked = self.ct2_dir.with_name(self.ct2_dir.name.removesuffix(UNCHECKED))
            try:
                os.replace(self.ct2_dir, checked)
                self.ct2_dir = checked
            except OSError:  # another process put its checked export there first
                pass

    def _unchecked_in_cache(self) -> bool:
        """Whether ``ct2_dir`` is an export ``ensure_export`` made and has not checked yet: the only
        directory this class renames or removes."""
        d = self.ct2_dir
        return d.parent == cache_root() and d.name.endswith(UNCHECKED) and is_export_dir(d)
