"""The vocabulary a run trains with: a parent's when fine-tuning, a prepared corpus's, one trained
afresh on the training pairs, or a resumed run's own (``run_dir/tokenizer.model``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from qkv.data.corpus import DataError, ParallelCorpus
from qkv.data.marian_tokenizer import MarianTokenizer
from qkv.data.tokenizer import Tokenizer, load_tokenizer
from qkv.io.checkpoint import TOKENIZER, Checkpoint
from qkv.io.prepared import Prepared


def run_tokenizer(
    run_dir: Path, vocab_size: int, seed: int, train_data: ParallelCorpus, *, init_from: Checkpoint | None = None,
    prepared: Prepared | None = None, start_over: bool = False, main: bool = True,
) -> tuple[Tokenizer | MarianTokenizer | None, bool]:
    """The run's tokenizer, and whether ``run_dir`` has yet to receive it (rank 0 writes it once
    ``--overwrite`` has cleared the old run, so a new one is trained aside, in a temporary directory).

    ``init_from``: fine-tuning keeps the parent's vocabulary, or its embeddings mean nothing.
    ``prepared``: its pairs were encoded with its tokenizer, which must be the resumed run's too.
    Otherwise rank 0 trains one on the training pairs (a new run, or ``start_over``) or reads the
    run's own; the other ranks get None and read what rank 0 writes.
    """
    path = run_dir / TOKENIZER
    if init_from is not None:
        if prepared and init_from.tokenizer.model_proto != prepared.tokenizer.model_proto:
            raise DataError(f"{prepared.path} was prepared with another tokenizer than --init-from's: prepare it with that one")
        return init_from.tokenizer, True
    if prepared:
        if main and not start_over and path.is_file() and path.read_bytes() != prepared.tokenizer.model_proto:
            raise DataError(  # a resumed run's (its last/ copy): its weights belong to that vocabulary
                f"{prepared.path} holds another tokenizer than the run {run_dir}: it was prepared again since; "
                "resume with the directory the run was trained on"
            )
        return prepared.tokenizer, True
    if main and (start_over or not path.exists()):
        with tempfile.TemporaryDirectory(prefix="qkv-tokenizer-") as aside:
            return Tokenizer.train(train_data.src + train_data.tgt, vocab_size, Path(aside) / TOKENIZER, seed=seed), True
    if main:  # a resumed run's
        return load_tokenizer(path), False
    return None, False
