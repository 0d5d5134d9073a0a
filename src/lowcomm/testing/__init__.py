"""Helpers for tests of lowcomm and of code built on it."""

from lowcomm.testing.distributed import distributed, run_distributed

__all__ = ["distributed", "run_distributed"]
