"""The 8x8 digits of scikit-learn (1,797 images, 10 classes) and a small CNN for them: plain PyTorch.

Used by the quality benchmarks and tests; the Lightning front end wraps the same pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def load_digits_tensors(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of images [N, 1, 8, 8] scaled to [0, 1] and int64 labels; a fixed stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        range(len(y)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    return TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_test], y[idx_test])


class DigitsCNN(nn.Module):
    """conv(1->w) -> conv(w->2w) -> maxpool (-> average pool to 4x4) -> fc(32w->128) -> fc(128->10)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8x8 input: [N, 2w, 4, 4]
        x = F.adaptive_avg_pool2d(x, 4)  # larger inputs (28x28 Fashion-MNIST) pooled to 4x4; identity for 4x4
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def train_digits_cnn(
    epochs: int = 12, seed: int = 0, batch_size: int = 64
) -> tuple[DigitsCNN, TensorDataset, TensorDataset]:
    """Train the CNN with Adam from a fixed seed; returns (model in eval mode, train set, test set)."""
    torch.manual_seed(seed)
    train, test = load_digits_tensors(seed=seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval(), train, test


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, batch_size: int = 256) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    correct = 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        correct += int((model(x).argmax(dim=1) == y).sum())
    return 100.0 * correct / len(dataset)
