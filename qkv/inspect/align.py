"""Word alignments from cross-attention, for whole files, in the Pharaoh format ("0-0 1-2 ...").

For each line pair the target (a given reference, or the model's own translation) is read by the
decoder in one teacher-forced pass, and the chosen layer's cross-attention (one head, or the mean of
the heads) aligns each target word with the source word it attends to most (``align_words``:
subword pieces merged into words). Pharaoh pairs are "source-target" word indices, 0-based, in
whitespace-separated words of the detokenized text; with ``pieces=True`` they are indices of the
SentencePiece pieces instead (EOS left out), each target piece aligned on its own.
"""

from __future__ import annotations

import warnings

import torch

from qkv.errors import QkvError
from qkv.data.corpus import collate
from qkv.infer.search import DecodeConfig
from qkv.model.transformer import Transformer
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import Translator, length_batches
from qkv.inspect.visualize import align_words


@torch.inference_mode()
def align(
    model: Transformer, tokenizer: TextTokenizer, sources: list[str], targets: list[str] | None = None, *,
    layer: int = -1, head: int | None = None, config: DecodeConfig | None = None, max_tokens: int = 4096,
    pieces: bool = False,
) -> list[list[tuple[int, int]]]:
    """Pharaoh pairs (source word, target word) for each line, in input order.

    ``targets`` None: align each source with the model's own translation (searched with ``config``).
    ``layer``: a Python index over the decoder layers (-1: the last); ``head``: one head, 0-based, or
    None for the mean over heads. ``pieces``: pairs of piece indices (``tokenizer.pieces`` of the
    encoded source and target, EOS left out) instead of words. An empty source or target gives no pairs.
    """
    model.eval()
    translator = Translator(model, tokenizer, config or DecodeConfig())
    src_ids = [translator.encode(s) for s in sources]  # cut to the model's positions, with a warning
    if targets is None:
        tgt_ids = [h[0].tokens for h in translator.translate_ids(src_ids)]
    else:
        if len(targets) != len(sources):
            raise QkvError(f"{len(sources)} sources but {len(targets)} targets: align needs one target per source")
        limit = model.config.max_len - 1  # room for the EOS
        tgt_ids = [tokenizer.encode_target(t) for t in targets]  # a Marian tokenizer has a target model of its own
        if any(len(ids) > limit for ids in tgt_ids):
            warnings.warn(f"a target longer than the model's {limit} positions was cut to fit; its words past them are not aligned", stacklevel=2)
        tgt_ids = [ids[:limit] for ids in tgt_ids]
    results: list[list[tuple[int, int]]] = [[] for _ in sources]
    todo = [i for i in range(len(sources)) if src_ids[i] and tgt_ids[i]]
    device = next(model.parameters()).device
    lengths = [max(len(src_ids[i]), len(tgt_ids[i])) for i in todo]
    for batch in length_batches(lengths, max_tokens=max_tokens, max_sentences=256):
        indices = [todo[j] for j in batch]
        src, tgt_in, _ = (t.to(device) for t in collate(
            [src_ids[i] for i in indices], [tgt_ids[i] for i in indices],
            pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
        ))  # (B, S), (B, T)
        memory, src_mask, _ = model.encode(src)
        _, weights = model.decode_hidden(tgt_in, memory, src_mask, need_weights=True)  # no logits needed
        cross = weights.cross[layer].float()  # (B, H, T, S)
        cross = cross.mean(dim=1) if head is None else cross[:, head]  # (B, T, S)
        for row, i in enumerate(indices):
            src_pieces = tokenizer.pieces([*src_ids[i], tokenizer.eos_id])
            tgt_pieces = tokenizer.pieces([*tgt_ids[i], tokenizer.eos_id])
            w = cross[row, : len(tgt_pieces), : len(src_pieces)]  # this sentence, without padding
            if pieces:  # each target piece with the source piece it attends to most, EOS on neither side
                best = w[:-1, :-1].argmax(dim=1).tolist()  # (T-1,)
                results[i] = [(s, t) for t, s in enumerate(best)]
            else:
                results[i] = [(s, t) for s, t, _ in align_words(w, src_pieces, tgt_pieces)]
    return results


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    return " ".join(f"{s}-{t}" for s, t in pairs)
