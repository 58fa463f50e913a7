"""qkv: the Transformer of "Attention Is All You Need" as a library and command-line tool.

The package is layered; each layer imports only from itself and the layers before it
(``tests/unit/test_layers.py`` checks it):

    qkv.errors                 the one base error, ``QkvError``
    qkv.model, qkv.data        the Transformer and its config; corpora and tokenizers
    qkv.io                     checkpoints, prepared corpora, output files, run directories
    qkv.infer                  search, the Translator, workers, ensembles, scores, BLEU
    qkv.train, qkv.interop     training; Marian (OPUS-MT) and CTranslate2 formats
    qkv.inspect                attention step by step, pictures, traces, self-checks, the demo
    qkv.document               documents (HTML, Markdown, subtitles, PO): readers, writers, markup placement
    qkv.serve                  the HTTP server
    qkv.cli                    the command line

``qkv.__all__`` is the stable public API: the names below, importable from ``qkv`` itself and each
described in docs/model.md ("The Python API"; ``tests/unit/test_api.py`` checks both). Importing
``qkv`` loads only the model layer, the rest on first use. Other modules are reachable but not promised.
"""

from __future__ import annotations

from typing import Any

from qkv.model.attention import MultiHeadAttention, scaled_dot_product_attention
from qkv.model.config import ModelConfig, model_preset
from qkv.model.transformer import Transformer

_LAZY = {  # name -> module, imported when the name is first used
    "QkvError": "qkv.errors",
    "Translator": "qkv.infer.translator",
    "DecodeConfig": "qkv.infer.search",
    "Tokenizer": "qkv.data.tokenizer",
    "Trainer": "qkv.train.trainer",
    "TrainConfig": "qkv.train.recipes",
    "DataConfig": "qkv.train.recipes",
    "load_checkpoint": "qkv.io.checkpoint",
    "build_configs": "qkv.train.recipes",
    "Glossary": "qkv.infer.glossary",
    "translate_with_glossary": "qkv.inspect.terms",
    "assess": "qkv.inspect.trust",
    "translate_with_confidence": "qkv.inspect.trust",
    "TextOptions": "qkv.data.sentences",
    "translate_document": "qkv.document.translate",
}

__all__ = ["ModelConfig", "MultiHeadAttention", "Transformer", "model_preset", "scaled_dot_product_attention", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'qkv' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_LAZY[name])
    return getattr(module, "load" if name == "load_checkpoint" else name)
