"""Inference: search, the Translator, decoding workers, ensembles, forced-decoding scores, BLEU."""
