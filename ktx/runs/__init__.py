"""Runs: the training loop and its periodic actions, evaluation, inference, the run directory."""
