"""The data layer (bottom): parallel corpora, tokenizers, the synthetic tasks."""
