"""Test settings: one torch thread per process so forked ranks don't oversubscribe 2 cores."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
