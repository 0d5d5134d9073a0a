"""Small models for the embedded datasets: MNIST-1D (40 features) and sklearn digits (64).

They are the default workload of ``make demo`` and of most tests, so they must be cheap on
two CPU cores yet learn something real: ``cnn1d`` follows the MNIST-1D paper's reference
CNN (three strided 1-D convs, ~94% there) with BN added; ``mlp`` is its reference MLP
(~68% on MNIST-1D). Both take ``input_dim`` so the same names work on 64-feature digits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lowcomm.models import ModelInfo, register_model


def _conv_out(length: int, kernel: int, stride: int, padding: int) -> int:
    return (length + 2 * padding - kernel) // stride + 1


class CNN1d(nn.Module):
    """``forward(x: (B, input_dim) or (B, 1, input_dim)) -> (B, num_classes)``."""

    def __init__(self, *, input_dim: int, num_classes: int, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=2)
        self.bn1 = nn.BatchNorm1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm1d(channels)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.bn3 = nn.BatchNorm1d(channels)
        self.relu = nn.ReLU(inplace=True)
        length = input_dim
        for k, s, p in [(5, 2, 2), (3, 2, 1), (3, 2, 1)]:
            length = _conv_out(length, k, s, p)
        # Flatten, not global pooling: MNIST-1D digits are defined by *where* features are.
        self.fc = nn.Linear(channels * length, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        if x.dim() == 2:
            x = x.unsqueeze(1)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = self.relu(self.bn3(self.conv3(x)))
        return self.fc(torch.flatten(x, 1))


class MLP(nn.Module):
    """Two hidden ReLU layers; ``forward(x: (B, input_dim)) -> (B, num_classes)``."""

    def __init__(self, *, input_dim: int, num_classes: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc = nn.Linear(hidden, num_classes)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        x = torch.flatten(x, 1)
        return self.fc(self.relu(self.fc2(self.relu(self.fc1(x)))))


@register_model("cnn1d", info=ModelInfo("classification", (40,), default_num_classes=10,
                                       description="1-D CNN for MNIST-1D / digits"))
def cnn1d(*, input_dim: int = 40, num_classes: int = 10, channels: int = 32) -> CNN1d:
    """Registry entry: the small 1-D CNN (MNIST-1D; fast enough for tests and demos)."""
    return CNN1d(input_dim=input_dim, num_classes=num_classes, channels=channels)


@register_model("mlp", info=ModelInfo("classification", (40,), default_num_classes=10,
                                     description="2-hidden-layer MLP for MNIST-1D / digits"))
def mlp(*, input_dim: int = 40, num_classes: int = 10, hidden: int = 100) -> MLP:
    """Registry entry: the two-layer MLP (MNIST-1D)."""
    return MLP(input_dim=input_dim, num_classes=num_classes, hidden=hidden)
