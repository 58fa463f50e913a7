"""Training: the Trainer, loss, schedule, recipes, validation, the run's log, EMA, signals, torchrun."""
