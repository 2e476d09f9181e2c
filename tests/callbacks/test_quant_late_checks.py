"""A NaN learned threshold made by one of the last training steps of a fit is reported even when no eval forward or
export follows: on CUDA the training forward's check is read late (``LateFlag``), and ``QuantCallback``'s
``on_train_end`` and ``on_save_checkpoint`` read the checks still on their way (``read_late_checks``; found by
review). An observer still on has its NaN / Inf check of each batch read late too; a checkpoint reads it, so a
diverged warm-up is not saved. The CUDA logic runs on the CPU (``tests/host_syncs.py``) with events that complete
late, as on a GPU that runs behind the host.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cb_helpers import make_trainer, seed
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize, TQTFakeQuantize
from tests.host_syncs import as_if_on_cuda

TQT = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "round_method": "half_even",
    "is_dynamic": False,
    "scale_type": "pof2",
    "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"},
}


MINMAX = {
    "dtype": "int8",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "observer_cls": "PerChannelMinMaxObserver",
    "symmetric": True,
    "round_method": "half_even",
    "is_dynamic": False,
    "scale_type": "float",
}


class PoisonAfter(Callback):
    """What a NaN gradient and an optimizer step leave in the weight threshold (``weight``: in the weight itself),
    after batch ``batch``."""

    def __init__(self, batch: int, weight: bool = False) -> None:
        self.batch, self.weight = batch, weight

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if i == self.batch and self.weight:
            with torch.no_grad():
                pl_module.layer.weight.fill_(float("nan"))
        elif i == self.batch:
            for m in pl_module.modules():
                if isinstance(m, TQTFakeQuantize):
                    with torch.no_grad():
                        m.log_threshold.fill_(float("nan"))


def test_a_nan_threshold_from_the_second_to_last_step_is_reported(tmp_path: Any, monkeypatch: Any) -> None:
    config = Config.from_dict({"global_quant_config": {"weight": TQT}})
    seed(0)
    model = BoringModel()
    with as_if_on_cuda(monkeypatch, events_complete=False):
        trainer = make_trainer(
            tmp_path,
            [QuantCallback(config, mode="qat", observer_steps=1), PoisonAfter(batch=4)],
            limit_train_batches=6,
            limit_val_batches=0,
        )
        with pytest.raises(ValueError, match="no finite positive scale"):
            trainer.fit(model)  # batch 5's forward queued the check of the NaN threshold; nothing read it


def test_no_checkpoint_is_saved_after_a_nan_batch_while_observing(tmp_path: Any, monkeypatch: Any) -> None:
    """The last batch of epoch 0 observes a NaN weight (its check queued, observers still on): the checkpoint of that
    epoch reads the check and stops the fit before anything is written, instead of saving a diverged model and
    failing only when the fit ends."""
    config = Config.from_dict({"global_quant_config": {"weight": MINMAX}})
    seed(0)
    model = BoringModel()
    ckpt_dir = tmp_path / "ckpt"
    with as_if_on_cuda(monkeypatch, events_complete=False):
        trainer = make_trainer(
            tmp_path,
            [
                QuantCallback(config, mode="qat", observer_steps=100),
                PoisonAfter(batch=4, weight=True),
                ModelCheckpoint(dirpath=ckpt_dir, save_last=True),
            ],
            limit_train_batches=6,
            limit_val_batches=0,
            max_epochs=2,
        )
        with pytest.raises(ValueError, match="observed a tensor containing NaN or Inf"):
            trainer.fit(model)
    assert trainer.current_epoch == 0
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())
    observer = next(m for m in model.modules() if isinstance(m, ScaledFakeQuantize)).observer
    # not folded in (a weight's statistics are reset before each warm-up batch: they are the fold's identities)
    assert not observer.min_val.isnan().any() and not observer.max_val.isnan().any()
