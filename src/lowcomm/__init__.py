"""lowcomm: communication-efficient distributed deep-learning training on PyTorch."""

__version__ = "0.1.0"
