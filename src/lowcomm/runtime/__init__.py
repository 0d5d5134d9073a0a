"""Runtime: launching workers, the training loop, checkpoints, timers and logs."""
