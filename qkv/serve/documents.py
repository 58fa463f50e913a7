"""``/v1/translate`` with a ``format``: each text a whole document, translated as ``qkv translate --format`` does.

Each text is read by its format's reader first (a broken document is a 422 naming its line, before any
search), charged by its segments' source tokens as a text of lines is, and translated by
``qkv.document.translate_document`` in a worker thread with the server's engine, the request's search
settings, the checkpoint's length penalty and the server's loop guard. Documents are translated one request at a
time, beside the batcher's searches (``DocumentTranslator.lock``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

from qkv.errors import QkvError
from qkv.data.sentences import TextOptions
from qkv.document.formats import read
from qkv.document.translate import translate_read

NOT_WITH_DOCUMENTS = ("n_best", "sampling", "attention", "max_length")


class DocumentTranslator:
    """The server's document path: the batcher's models, tokenizer and settings, one document request at a time."""

    def __init__(self, batcher, *, src_lang: str, tgt_lang: str | None, calibration: dict | None) -> None:
        self.batcher, self.src_lang, self.tgt_lang, self.calibration = batcher, src_lang, tgt_lang, calibration
        self.lock = threading.Lock()  # held by the worker thread itself: a request that timed out keeps it until done

    def refusal(self, body) -> tuple[str, str] | None:
        """(field, message) where the request asks a document for what only lines have."""
        for name in NOT_WITH_DOCUMENTS:
            value = getattr(body, name)
            if value not in (None, False):
                return name, f"{name} goes with texts of lines, not with a format's documents"
        return None

    def read(self, body) -> list:
        """The request's documents, read (a QkvError names a broken one); what ``translate`` translates."""
        out = []
        for i, text in enumerate(body.texts):
            try:
                out.append(read(text, body.format, target_lang=self.tgt_lang))
            except QkvError as error:
                raise QkvError(f"texts[{i}]: {error}") from None
        return out

    def _translate(self, body, settings, documents: list) -> dict[str, Any]:
        with self.lock:
            return self._translate_now(body, settings, documents)

    def _translate_now(self, body, settings, documents: list) -> dict[str, Any]:
        batcher = self.batcher
        config = replace(settings.decode_config(), length_penalty=batcher.length_penalty, loop_guard=batcher.loop_guard)
        options = TextOptions(split=self.src_lang if body.split else None, recase=not body.keep_case)
        translator = batcher.make_translator(config, text=options)  # the server's engine, as for lines
        results = [translate_read(translator, document, glossary=settings.glossary, confidence=body.confidence,
                                  calibration=self.calibration, model=batcher.model) for document in documents]
        answer: dict[str, Any] = {"translations": [r.text for r in results]}
        if body.confidence:
            answer["segments"] = [[s.as_dict() for s in r.segments] for r in results]
        return answer

    async def translate(self, body, settings, documents: list) -> dict[str, Any]:
        return await asyncio.to_thread(self._translate, body, settings, documents)
