"""Training machinery: the train step and Trainer, optimizers, checkpoints, summaries, ahead-of-time compiles."""
