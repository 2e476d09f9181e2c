"""A steady-state QAT step of ``Trainer.fit`` reads no tensor on the host: on CUDA each such read would stall the GPU.

Lightning's own ``BoringModel`` (a two-layer MLP in its ``layer``) trains under ``QuantCallback(mode="qat")`` with
TQT, LSQ and min-max quantizers; from the fourth batch on (observers fixed, thresholds initialised) every op of the
training step, backward, optimizer step and every callback's batch hooks included, is watched. The CUDA paths' logic runs on the CPU
(``tests/host_syncs.py``): the quantizers' switches through their memo, the TQT/LSQ checks through late reads.
Every spec preset of ``conf/quant/spec`` is run too, a warm-up step and steady steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cb_helpers import make_trainer, seed
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.recipes import MXFP4
from tests.host_syncs import HostSyncs, as_if_on_cuda

MX6 = {
    "dtype": "mx6",
    "qscheme": "per_group",
    "ch_axis": -1,
    "group_size": 16,
    "observer_cls": "PerBlockMXObserver",
    "is_dynamic": False,
}
STEADY_FROM = 3  # batches 0-1 observe (observer_steps=2), batch 2 fixes the observers: 3 on are steady


def _spec(method: str | None, qscheme: str = "per_tensor") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "dtype": "int8",
        "qscheme": qscheme,
        "observer_cls": "PerTensorMinMaxObserver" if qscheme == "per_tensor" else "PerChannelMinMaxObserver",
        "symmetric": True,
        "round_method": "half_even",
        "is_dynamic": False,
        "scale_type": "float",
    }
    if qscheme == "per_channel":
        spec["ch_axis"] = 0
    if method == "tqt":
        spec.update(scale_type="pof2", qat_spec={"method": "tqt", "threshold_init_meth": "_3SD"})
    elif method == "lsq":
        spec["qat_spec"] = {"method": "lsq"}
    return spec


CONFIGS = {
    "tqt": (_spec("tqt"), _spec("tqt")),
    "tqt_per_channel_weights": (_spec("tqt", "per_channel"), _spec("tqt")),
    "lsq_per_channel_weights": (_spec("lsq", "per_channel"), _spec("lsq")),
    "minmax_observers_fixed": (_spec(None, "per_channel"), _spec(None)),
    "minmax_dynamic_activations": (_spec(None, "per_channel"), {**_spec(None), "is_dynamic": True}),
    "mxfp4_mxfp8": (MXFP4, {**MXFP4, "mx_element_dtype": "fp8_e4m3"}),
    "mx6": (MX6, MX6),
    "bfp16": ({**MX6, "dtype": "bfp16", "group_size": 8, "observer_cls": "PerBlockBFPObserver"},) * 2,
}


class TwoLayerBoring(BoringModel):
    """Lightning's BoringModel with a hidden layer: two quantized Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))


def _watched(batch_idx: int, batches: set[int] | None) -> bool:
    """Whether the probe watches batch ``batch_idx``: those in ``batches``, by default every one from ``STEADY_FROM``."""
    return batch_idx >= STEADY_FROM if batches is None else batch_idx in batches


class Open(Callback):
    """Opens the probe before every other callback's ``on_train_batch_start`` (listed first: Lightning calls the
    callbacks in list order) of the watched batches (``_watched``)."""

    def __init__(self, probe: HostSyncs, batches: set[int] | None = None) -> None:
        self.probe, self.batches = probe, batches

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if _watched(batch_idx, self.batches):
            self.probe.__enter__()


class Close(Callback):
    """Closes it after every other callback's ``on_train_batch_end`` (listed last)."""

    def __init__(self, probe: HostSyncs, batches: set[int] | None = None) -> None:
        self.probe, self.batches = probe, batches
        self.watched = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if _watched(args[-1], self.batches):
            self.probe.__exit__(None, None, None)
            self.watched += 1


def _learned(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in model.named_parameters() if n.endswith(("log_threshold", ".scale"))]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_steady_qat_step_reads_no_tensor_on_the_host(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    weight, act = CONFIGS[name]
    config = Config.from_dict({"global_quant_config": {"weight": weight, "input_tensors": act}})
    seed(0)
    model = TwoLayerBoring()
    probe = HostSyncs()
    close = Close(probe)
    learned: list[list[torch.Tensor]] = []

    class Snapshot(Callback):
        def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
            learned.append(_learned(pl_module))

    with as_if_on_cuda(monkeypatch) as events:
        callbacks = [Open(probe), QuantCallback(config, mode="qat", observer_steps=2), Snapshot(), close]
        make_trainer(tmp_path, callbacks, limit_train_batches=8).fit(model)

    assert close.watched == 8 - STEADY_FROM
    assert not probe.found, f"host reads in steady QAT steps: {dict(probe.found)}"
    quantizers = [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]
    assert len(quantizers) == 4 and all(q.flag("fake_quant_enabled") for q in quantizers)
    if name.startswith(("tqt", "lsq")):
        # the thresholds / step sizes learned in the watched steps, and each forward queued its check late
        assert all(not torch.equal(a, b) for a, b in zip(learned[STEADY_FROM - 1], learned[-1], strict=True))
        assert events.recorded >= 4 * 8


class WithUnusedHead(TwoLayerBoring):
    """A layer no training batch reaches (an unused head; an MoE expert no token is routed to): QuantCallback asks
    its quantizers every batch whether they have qparams yet (``_fix_pending``)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(32, 2)


@pytest.mark.parametrize("name", ["minmax_observers_fixed", "tqt"])
def test_a_layer_no_batch_reaches_costs_no_host_read_per_step(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    weight, act = CONFIGS[name]
    config = Config.from_dict({"global_quant_config": {"weight": weight, "input_tensors": act}})
    seed(0)
    probe = HostSyncs()
    close = Close(probe)
    with as_if_on_cuda(monkeypatch):
        callbacks = [Open(probe), QuantCallback(config, mode="qat", observer_steps=2), close]
        make_trainer(tmp_path, callbacks, limit_train_batches=6).fit(WithUnusedHead())
    assert close.watched == 6 - STEADY_FROM
    assert not probe.found, f"host reads in steady QAT steps: {dict(probe.found)}"


@pytest.mark.parametrize("name", ["minmax_observers_fixed", "mx6"])
def test_a_warm_up_qat_step_reads_no_tensor_on_the_host(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    """Observers on in every watched step (QuantCallback's warm-up: weights' statistics reset and observed again per
    batch, activations' running ones), on the eager observe path these small layers take."""
    weight, act = CONFIGS[name]
    config = Config.from_dict({"global_quant_config": {"weight": weight, "input_tensors": act}})
    seed(0)
    model = TwoLayerBoring()
    probe = HostSyncs()
    close = Close(probe)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the weight's row maxima at a batch's start, observed)

    def expected(w: torch.Tensor) -> torch.Tensor:  # what the weight's observer records of ``w``
        return w.amax(dim=1) if name.startswith("minmax") else w.abs().reshape(w.shape[0], -1, 16).amax(dim=-1)

    def observed(observer: nn.Module) -> torch.Tensor:
        return observer.max_val if name.startswith("minmax") else observer.amax

    class RowMaxima(Callback):
        def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
            self.before = expected(pl_module.layer[0].weight.detach())

        def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
            seen.append((self.before, observed(pl_module.layer[0]._weight_quantizer.observer).clone()))

    with as_if_on_cuda(monkeypatch):
        callbacks = [Open(probe), QuantCallback(config, mode="qat", observer_steps=100), RowMaxima(), close]
        make_trainer(tmp_path, callbacks, limit_train_batches=6).fit(model)
    assert close.watched == 6 - STEADY_FROM
    assert not probe.found, f"host reads in warm-up QAT steps: {dict(probe.found)}"
    # each batch observed the weight as it was then (its statistics reset per batch), not a running range
    assert len(seen) == 6 and all(torch.equal(before, observed) for before, observed in seen)
    assert not torch.equal(seen[0][1], seen[-1][1])


def _preset_specs() -> list[Any]:
    """Every spec preset of ``conf/quant/spec`` that a weight can take (per-token dynamic is for activations)."""
    import yaml

    root = Path(__file__).resolve().parents[2] / "conf" / "quant" / "spec"
    specs = [(p.stem, yaml.safe_load(p.read_text())) for p in sorted(root.glob("*.yaml"))]
    return [pytest.param(spec, id=name) for name, spec in specs if "per_token" not in name]


@pytest.mark.parametrize("spec", _preset_specs())
def test_no_preset_spec_reads_the_host_in_a_qat_step(spec: dict[str, Any], tmp_path: Any, monkeypatch: Any) -> None:
    """Every spec preset for weights and activations: a warm-up step (batch 1: observers on, weights' statistics reset)
    and the steady steps (3-5: observers fixed at batch 2) read no tensor on the host."""
    from quark.torch.quantization.formats import kernel_cache

    # no direct kernels, as on CUDA (they serve CPU tensors only): building one checks its first result on the host,
    # once per signature, which would land in a watched step wherever a signature reached the threshold there
    monkeypatch.setattr(kernel_cache, "DIRECT_AFTER_CALLS", None)
    config = Config.from_dict({"global_quant_config": {"weight": spec, "input_tensors": spec}})
    seed(0)
    probe, batches = HostSyncs(), {1, 3, 4, 5}
    close = Close(probe, batches)
    with as_if_on_cuda(monkeypatch):
        callbacks = [Open(probe, batches), QuantCallback(config, mode="qat", observer_steps=2), close]
        make_trainer(tmp_path, callbacks, limit_train_batches=6).fit(TwoLayerBoring())
    assert close.watched == 4
    assert not probe.found, f"host reads in QAT steps: {dict(probe.found)}"


@pytest.mark.slow
@pytest.mark.parametrize("spec", _preset_specs())
def test_no_preset_spec_reads_the_host_in_a_compiled_qat_step(
    spec: dict[str, Any], tmp_path: Any, monkeypatch: Any, compiled: None
) -> None:
    """The same with the compiled kernels from the first call (the fused observe pass and the format kernels a large
    layer takes; slow: each format compiles its kernels once, or loads them from the kernel store)."""
    test_no_preset_spec_reads_the_host_in_a_qat_step(spec, tmp_path, monkeypatch)
