"""Files: checkpoints, prepared corpora, the output-file rules, the layout of a run directory. Imports model and data only."""
