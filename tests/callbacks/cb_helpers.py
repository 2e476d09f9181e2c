"""Models, data, configs and probes shared by the QuantCallback tests (not collected: no ``test_`` prefix).

Everything is deterministic: fixed-seed random tensors, ``shuffle=False`` loaders, ``num_workers=0``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, TQTFakeQuantize
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

# Lightning's advice about dataloader workers, logging intervals and the like is noise here
for message in (
    ".*does not have many workers.*",
    ".*number of training batches.*",
    ".*LightningModule.configure_optimizers.*",
    ".*GPU available but not used.*",
    ".*`max_epochs` was not set.*",
    ".*on_fit_end.*",
):
    warnings.filterwarnings("ignore", message=message)

IN_FEATURES = 16
HIDDEN = 32
CLASSES = 4


# ----------------------------------------------------------------------------------------------- configs
def tqt_spec(dtype: str = "int8") -> dict[str, Any]:
    """A TQT weight spec: int per-tensor symmetric power-of-two, threshold learned from a 3SD initialisation."""
    return {
        "dtype": dtype,
        "qscheme": "per_tensor",
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "scale_type": "pof2",
        "round_method": "half_even",
        "is_dynamic": False,
        "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"},
    }


def tqt_config(weight_dtype: str = "int8") -> Config:
    """TQT weights (learnable thresholds) and min-max int8 activations (observers): both kinds of QAT state."""
    return Config.from_dict(
        {"global_quant_config": {"weight": tqt_spec(weight_dtype), "input_tensors": INT8_PER_TENSOR_ACT}}
    )


def minmax_config() -> Config:
    """Per-tensor min-max int8 weights and activations: every qparam comes from an observer."""
    return Config.from_dict(
        {"global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT}}
    )


# ----------------------------------------------------------------------------------------------- data
def make_data(n: int = 64, seed: int = 0, in_features: int = IN_FEATURES, shift: float = 0.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g) + shift
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def make_images(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def loader(dataset: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


class ResumableLoader:
    """Batches of a dataset in order that resume mid-epoch (``state_dict`` / ``load_state_dict``).

    Lightning resumes a mid-epoch checkpoint with the *same* batches only when the loader is resumable; a plain
    DataLoader starts the epoch over (Lightning warns), which no callback can make bit-exact. The loader has a length,
    so Lightning does not pre-fetch: the batches yielded are the batches trained on.
    """

    def __init__(self, dataset: TensorDataset, batch_size: int = 8) -> None:
        self.loader = loader(dataset, batch_size)
        self.yielded = 0
        self._skip = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        skip = skip if skip < len(self) else 0  # an end-of-epoch state: the next epoch starts from its beginning
        self.yielded = skip
        for i, batch in enumerate(self.loader):
            if i >= skip:
                self.yielded = i + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["yielded"]


class DataModule(LightningDataModule):
    """train / val / test / predict loaders over fixed random tensors (distinct seeds per split)."""

    def __init__(self, n: int = 64, batch_size: int = 8, images: bool = False, resumable: bool = False) -> None:
        super().__init__()
        make = make_images if images else make_data
        self.train, self.val, self.test = make(n, seed=1), make(n // 2, seed=2), make(n // 2, seed=3)
        self.batch_size = batch_size
        self.resumable = resumable

    def train_dataloader(self) -> DataLoader | ResumableLoader:
        if self.resumable:
            return ResumableLoader(self.train, self.batch_size)
        return loader(self.train, self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return loader(self.val, self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return loader(self.test, self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return loader(self.test, self.batch_size)


# ----------------------------------------------------------------------------------------------- models
class BoringMLP(LightningModule):
    """Linear -> ReLU -> Linear classifier; records what each stage returned for the tests to inspect."""

    def __init__(self, lr: float = 0.05, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.weight_decay = weight_decay
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(HIDDEN, CLASSES)
        self.lr = lr
        self.val_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.test_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.calls: list[tuple[bool, bool, torch.Tensor]] = []  # (training, grad enabled, input) of every forward
        self.train_checks: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, logits, manual quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled(), x.detach().clone()))
        return self.fc2(self.act(self.fc1(x)))

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return logits, nn.functional.cross_entropy(logits.float(), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits, loss = self._loss(batch)
        if isinstance(getattr(self, "fc1", None), QuantMixin):
            self.train_checks.append((self.global_step, logits.detach().clone(), manual_forward(self, batch[0])))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits, loss = self._loss(batch)
        self.val_outputs.append((batch[0].detach().clone(), logits.detach().clone()))
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits, loss = self._loss(batch)
        self.test_outputs.append((batch[0].detach().clone(), logits.detach().clone()))
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return self.optimizer


class BNNet(BoringMLP):
    """Tiny CNN with BatchNorm on 1x8x8 images."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr)
        del self.fc1
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc2 = nn.Linear(4 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.bn(self.conv(x))).flatten(1))


# ----------------------------------------------------------------------------------------------- trainers
def make_trainer(tmp_path: Any, callbacks: list[Callback] | None = None, **overrides: Any) -> Trainer:
    kwargs: dict[str, Any] = dict(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        limit_test_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
        deterministic=True,
    )
    kwargs["enable_checkpointing"] = any(isinstance(c, ModelCheckpoint) for c in callbacks or [])
    kwargs.update(overrides)
    return Trainer(callbacks=callbacks or [], **kwargs)


def seed(value: int = 0) -> None:
    pl.seed_everything(value, verbose=False)


# ----------------------------------------------------------------------------------------------- state
def quantizers(module: nn.Module) -> Iterator[tuple[str, FakeQuantizeBase]]:
    """(layer.role, quantizer) for every quantizer of ``module``."""
    for name, m in module.named_modules():
        if isinstance(m, QuantMixin):
            for role, q in m.quantizers():
                yield f"{name}.{role}", q


def tqt_params(module: nn.Module) -> list[nn.Parameter]:
    return [q.log_threshold for _, q in quantizers(module) if isinstance(q, TQTFakeQuantize)]


def qstate(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantizer's buffers and parameters (observer min/max, scale, zero point, thresholds, flags), cloned."""
    out = {}
    for name, q in quantizers(module):
        for key, value in q.state_dict(keep_vars=False).items():
            out[f"{name}.{key}"] = value.detach().clone()
        if hasattr(q, "calculate_qparams"):
            scale, zp = q.calculate_qparams()
            out[f"{name}.<scale>"] = scale.detach().clone()
            out[f"{name}.<zero_point>"] = zp.detach().clone()
    return out


def observer_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Observer statistics and static qparams of the non-learnable quantizers."""
    return {
        k: v for k, v in qstate(module).items() if "min_val" in k or "max_val" in k or k.endswith("scale") or "<" in k
    }


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


_QRANGE = {"int8": (-128, 127), "int4": (-8, 7), "int3": (-4, 3)}


def fake_quant(q: FakeQuantizeBase | None, t: torch.Tensor) -> torch.Tensor:
    """``t`` through the qparams of ``q`` with torch's own fused kernels (independent of the engine's arithmetic)."""
    if q is None:
        return t
    qmin, qmax = _QRANGE[q.spec.dtype.name]
    scale, zp = q.calculate_qparams()
    if scale.numel() == 1:
        return torch.fake_quantize_per_tensor_affine(t, float(scale), int(zp), qmin, qmax)
    return torch.fake_quantize_per_channel_affine(t, scale.float(), zp.int(), q.spec.ch_axis % t.ndim, qmin, qmax)


def manual_forward(model: BoringMLP, x: torch.Tensor) -> torch.Tensor:
    """The quantized forward of a BoringMLP computed by hand: every configured quantizer applied, whatever its flags."""

    def layer(m: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(
            fake_quant(m._input_quantizer, h), fake_quant(m._weight_quantizer, m.weight), m.bias
        )

    with torch.no_grad():
        return layer(model.fc2, torch.relu(layer(model.fc1, x)))


def float_forward(model: BoringMLP, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = torch.relu(nn.functional.linear(x, model.fc1.weight, model.fc1.bias))
        return nn.functional.linear(h, model.fc2.weight, model.fc2.bias)


class Probe(Callback):
    """Records what the tests need at chosen hooks: quantizer state per training step, BN statistics per epoch."""

    def __init__(self) -> None:
        self.states_before_step: list[dict[str, torch.Tensor]] = []
        self.weights_before_step: list[dict[str, torch.Tensor]] = []
        self.states_after_step: list[dict[str, torch.Tensor]] = []
        self.bn_means: list[tuple[int, torch.Tensor]] = []
        self.at_sanity_start: dict[str, torch.Tensor] | None = None
        self.at_sanity_end: dict[str, torch.Tensor] | None = None
        self.at_fit_start: dict[str, torch.Tensor] | None = None
        self.at_train_start: dict[str, torch.Tensor] | None = None
        self.bn_training: list[tuple[int, bool]] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.at_fit_start = qstate(pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.at_train_start = qstate(pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.states_before_step.append(qstate(pl_module))
        self.weights_before_step.append(
            {n: p.detach().clone() for n, p in pl_module.named_parameters() if n.endswith("weight")}
        )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.states_after_step.append(qstate(pl_module))
        for m in pl_module.modules():
            if isinstance(m, nn.BatchNorm2d):
                self.bn_means.append((trainer.current_epoch, m.running_mean.detach().clone()))
                self.bn_training.append((trainer.current_epoch, m.training))

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.at_sanity_start = qstate(pl_module)

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.at_sanity_end = qstate(pl_module)


class CrashAt(Callback):
    """Raises at the start of the training batch where ``global_step == step`` (a simulated crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


__all__ = [
    "BNNet",
    "BoringMLP",
    "CrashAt",
    "DataModule",
    "Probe",
    "QuantCallback",
    "assert_states_equal",
    "fake_quant",
    "float_forward",
    "manual_forward",
    "loader",
    "make_data",
    "make_images",
    "make_trainer",
    "minmax_config",
    "observer_state",
    "qstate",
    "quantizers",
    "seed",
    "tqt_config",
    "tqt_params",
]
