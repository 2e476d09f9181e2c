"""A NaN learned threshold made by one of the last training steps of a fit is reported even when no eval forward or
export follows: on CUDA the training forward's check is read late (``LateFlag``), and ``QuantCallback``'s
``on_train_end`` and ``on_save_checkpoint`` read the checks still on their way (``read_late_checks``; found by
review). The CUDA logic runs on the CPU (``tests/host_syncs.py``) with events that complete late, as on a GPU that
runs behind the host.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cb_helpers import make_trainer, seed
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.tensor_quantize import TQTFakeQuantize
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


class PoisonAfter(Callback):
    """What a NaN gradient and an optimizer step leave in the weight threshold, after batch ``batch``."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if i == self.batch:
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
