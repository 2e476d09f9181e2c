"""``QuantCallback`` QAT on a LightningModule the user compiled (``trainer.fit(torch.compile(module))``): the swapped
quantized layers are traced into the module's graph without a break, and the observers stop when the callback fixes
them (the compiled forward recompiles for the new switches)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import QuantCallback
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
        self.ranges: list[list[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, *args: object) -> None:
        self.ranges.append(
            [m.observer.max_val.detach().clone() for m in self.modules() if isinstance(m, FakeQuantizeBase)]
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_qat_on_a_compiled_lightning_module_has_no_graph_break_and_fixes_its_observers() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = Classifier()
    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))
    trainer = Trainer(
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[QuantCallback(W8A8, mode="qat", observer_steps=4)],
    )
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(torch.compile(module, backend="eager"), DataLoader(data, batch_size=8))
    torch._dynamo.reset()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert len(module.ranges) == 8 and len(module.ranges[0]) == 4
    pairs = zip(module.ranges[:-1], module.ranges[1:], strict=True)
    moved = [any(not torch.equal(a, b) for a, b in zip(r0, r1, strict=True)) for r0, r1 in pairs]
    assert any(moved[:3])  # observing: the ranges grow with the weights
    assert not any(moved[4:])  # fixed after 4 batches: the compiled forward observes no more
