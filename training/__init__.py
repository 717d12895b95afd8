"""Training machinery: distributed setup, sync checks, signals, checkpoints, metrics."""
