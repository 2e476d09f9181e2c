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


def check_fashion(root: Path = FASHION_DIR) -> None:
    """FileNotFoundError with the install command when a file of the dataset is missing."""
    for split in ("train", "t10k"):
        for kind in ("images-idx3", "labels-idx1"):
            path = Path(root) / f"{split}-{kind}-ubyte.gz"
            if not path.exists():
                raise FileNotFoundError(
                    f"Fashion-MNIST: {path} not found. It comes from Debian: "
                    "`sudo apt-get update && sudo apt-get install -y dataset-fashion-mnist` (nothing is downloaded at run time)"
                )


def load_fashion(split: str, root: Path = FASHION_DIR) -> TensorDataset:
    """``split`` "train" or "t10k": images [N, 1, 28, 28] in [0, 1] and int64 labels."""
    root = Path(root)
    check_fashion(root)
    images, labels = root / f"{split}-images-idx3-ubyte.gz", root / f"{split}-labels-idx1-ubyte.gz"
    x = np.frombuffer(gzip.open(images).read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    y = np.frombuffer(gzip.open(labels).read(), np.uint8, offset=8)
    return TensorDataset(torch.tensor(x, dtype=torch.float32) / 255.0, torch.tensor(y, dtype=torch.int64))


class FashionDataModule(L.LightningDataModule):
    """Train on ``train_size`` training images (seeded subset), validate on 5,000 others, test on the 10,000."""

    def __init__(
        self, batch_size: int = 128, train_size: int = 20000, seed: int = 0, root: str | Path = FASHION_DIR
    ) -> None:
        super().__init__()
        self.batch_size, self.train_size, self.seed, self.root = batch_size, train_size, seed, Path(root)
        check_fashion(self.root)  # at construction: a missing dataset stops the run before any Trainer exists

    def setup(self, stage: str | None = None) -> None:
        train = load_fashion("train", self.root)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
        self.val_set = Subset(train, order[:5000])
        self.train_set = Subset(train, order[5000 : 5000 + self.train_size])
        self.test_set = load_fashion("t10k", self.root)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(self.seed)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=500)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=500)
