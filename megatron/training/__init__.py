"""Training: the loop, step variants, optimizers, LR schedules and checkpoints."""
