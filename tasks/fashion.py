"""Fashion-MNIST from Debian's `dataset-fashion-mnist` (apt-get install -y dataset-fashion-mnist): a harder task than
the digits for low-bit comparisons. 60,000 train + 10,000 test images, 28x28, 10 classes."""

from __future__ import annotations

import gzip
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def load_fashion(split: str, root: Path = FASHION_DIR) -> TensorDataset:
    """``split`` "train" or "t10k": images [N, 1, 28, 28] in [0, 1] and int64 labels."""
    images, labels = root / f"{split}-images-idx3-ubyte.gz", root / f"{split}-labels-idx1-ubyte.gz"
    if not images.exists():
        raise FileNotFoundError(f"{images} not found: install it with `apt-get install -y dataset-fashion-mnist`")
    x = np.frombuffer(gzip.open(images).read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    y = np.frombuffer(gzip.open(labels).read(), np.uint8, offset=8)
    return TensorDataset(torch.tensor(x, dtype=torch.float32) / 255.0, torch.tensor(y, dtype=torch.int64))


class FashionDataModule(L.LightningDataModule):
    """Train on ``train_size`` training images (seeded subset), validate on 5,000 others, test on the 10,000."""

    def __init__(self, batch_size: int = 128, train_size: int = 20000, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.train_size, self.seed = batch_size, train_size, seed

    def setup(self, stage: str | None = None) -> None:
        train = load_fashion("train")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
        self.val_set = Subset(train, order[:5000])
        self.train_set = Subset(train, order[5000 : 5000 + self.train_size])
        self.test_set = load_fashion("t10k")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=500)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=500)
