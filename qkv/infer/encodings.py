"""The encoder outputs a search computed, kept for a pass that reads the same sentences after it.

A translation's alignment pass (``qkv.inspect.align``, a document's markup placed by it) and its trust
pass (``qkv.inspect.trust.assess``) run the model again over what it read and wrote: the encoder's part
of that pass is the search's own, so ``Encodings`` keeps it while the search runs and hands it back.
"""

from __future__ import annotations

import threading


class Encodings:
    """The encoder outputs a search in this process computed, kept by source sentence while it runs, so
    that the alignment pass does not encode the same sentences again (``encode``: ``model.encode`` for a
    batch, from what was kept where every sentence of it was, else computed). Hooks on the model's source
    embedding (its input: the batch) and final encoder norm (its output: the memory), removed on exit;
    they read only the passes of the thread that made it (a server's batcher searches the same model beside it).
    Entered again while it is active (a glossary's mending inside ``--confidence``'s pass), it keeps one
    set of hooks; ``kept_encodings`` hands out the active one."""

    _active: dict[tuple[int, int], Encodings] = {}  # (id of the model, thread): the Encodings entered there

    def __init__(self, model, pad_id: int) -> None:
        self.model, self.pad_id, self.kept, self.src, self.hooks = model, pad_id, {}, None, []
        self.thread = threading.get_ident()  # the thread that searches with it (its hooks see every thread's)
        self.depth = 0

    def __enter__(self) -> Encodings:
        if self.depth == 0:
            self.hooks = [self.model.src_embed.register_forward_pre_hook(self._source),
                          self.model.encoder_norm.register_forward_hook(self._memory)]
            Encodings._active[id(self.model), self.thread] = self
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for hook in self.hooks:
                hook.remove()
            Encodings._active.pop((id(self.model), self.thread), None)

    def _source(self, module, args) -> None:
        if threading.get_ident() != self.thread:
            return
        self.src = args[0]  # (B, S); a tied embedding also sees target tokens, after the encoder's norm

    def _memory(self, module, args, output) -> None:
        if threading.get_ident() != self.thread or self.src is None or self.src.shape != output.shape[:2]:
            return
        for b in range(self.src.size(0)):
            ids = self.src[b][self.src[b] != self.pad_id]
            self.kept[tuple(ids.tolist())] = output[b, : ids.numel()]  # (S_b, D), EOS included

    def encode(self, src):
        rows = [self.kept.get(tuple(row[row != self.pad_id].tolist())) for row in src]
        if any(r is None for r in rows):
            return self.model.encode(src)
        memory = rows[0].new_zeros(src.size(0), src.size(1), rows[0].size(-1))  # (B, S, D), padding zero (masked)
        for b, r in enumerate(rows):
            memory[b, : r.size(0)] = r
        return memory, src != self.pad_id, []


def kept_encodings(translator, model) -> Encodings | None:
    """An ``Encodings`` of ``model`` for ``translator``'s searches where they may run ``model`` in this
    process, else None: another model (an int8 copy), or decoding workers, which fork and would keep the
    hooks they inherit for good. With CTranslate2 (whose translator holds the qkv model for the passes
    after its search) the hooks see no search of its, and every pass encodes again."""
    if model is None or getattr(translator, "model", None) is not model or getattr(translator, "workers", 1) > 1:
        return None
    active = Encodings._active.get((id(model), threading.get_ident()))
    return active if active is not None else Encodings(model, translator.tokenizer.pad_id)
