"""Review 42 repros: ``tests/callbacks/test_quant_host_syncs.py`` opens its probe in its own ``on_train_batch_start``
and closes it in its own ``on_train_batch_end``; Lightning calls callbacks in list order, and the watcher is listed
after ``QuantCallback``, so ``QuantCallback.on_train_batch_start`` runs outside the window. There ``_update_observers``
asks ``is_ready(q)`` -> ``bool(q.initialized)`` of every TQT / LSQ quantizer on every batch: a host sync per learnable
quantizer per step on CUDA. Watched from before every callback's batch start to after every callback's batch end
(``Open`` listed first, ``Close`` last), the reads showed (12 in 3 batches: TQT and LSQ; 6: the min-max
quantizers of a layer no batch reaches, which ``_fix_pending`` asks each batch) until ``is_ready`` read the flag
through ``FakeQuantizeBase.flag``.
"""

from __future__ import annotations

from typing import Any

import pytest
from cb_helpers import make_trainer, seed
from lightning.pytorch import Callback, LightningModule, Trainer
from test_quant_host_syncs import CONFIGS, STEADY_FROM, TwoLayerBoring
from torch import nn

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from tests.host_syncs import HostSyncs, as_if_on_cuda


class Open(Callback):
    """Opens the probe before every other callback's ``on_train_batch_start`` (listed first)."""

    def __init__(self, probe: HostSyncs) -> None:
        self.probe = probe

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx >= STEADY_FROM:
            self.probe.__enter__()


class Close(Callback):
    """Closes it after every other callback's ``on_train_batch_end`` (listed last)."""

    def __init__(self, probe: HostSyncs) -> None:
        self.probe = probe
        self.watched = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if args[-1] >= STEADY_FROM:
            self.probe.__exit__(None, None, None)
            self.watched += 1


def _fit(name: str, model: nn.Module, tmp_path: Any, monkeypatch: Any) -> dict[str, int]:
    weight, act = CONFIGS[name]
    config = Config.from_dict({"global_quant_config": {"weight": weight, "input_tensors": act}})
    probe = HostSyncs()
    close = Close(probe)
    with as_if_on_cuda(monkeypatch):
        callbacks = [Open(probe), QuantCallback(config, mode="qat", observer_steps=2), close]
        make_trainer(tmp_path, callbacks, limit_train_batches=6).fit(model)
    assert close.watched == 6 - STEADY_FROM
    return dict(probe.found)


@pytest.mark.parametrize("name", ["tqt", "lsq_per_channel_weights", "minmax_observers_fixed"])
def test_a_whole_steady_batch_reads_no_tensor_on_the_host(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    seed(0)
    found = _fit(name, TwoLayerBoring(), tmp_path, monkeypatch)
    assert not found, f"host reads in steady QAT steps: {found}"


class WithUnusedHead(TwoLayerBoring):
    """A layer no training batch reaches (an unused head; an MoE expert no token is routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(32, 2)


def test_a_layer_no_batch_reaches_costs_no_host_read_per_step(tmp_path: Any, monkeypatch: Any) -> None:
    seed(0)
    found = _fit("minmax_observers_fixed", WithUnusedHead(), tmp_path, monkeypatch)
    assert not found, f"host reads in steady QAT steps: {found}"
