"""Review 42: tests the host-sync round (dea0c55) lacked (each kills a mutant of the code that the round's tests let
live), and repros of what the flag memo and the probe miss (``xfail(strict=True)``: they pass once fixed)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.late_flag import LateFlag
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, LSQFakeQuantize, TQTFakeQuantize
from tests.host_syncs import HostSyncs, as_if_on_cuda


def _spec(**kw: Any) -> dict[str, Any]:
    base = {
        "dtype": "int8",
        "qscheme": "per_tensor",
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "round_method": "half_even",
        "is_dynamic": False,
        "scale_type": "float",
    }
    return base | kw


TQT = _spec(scale_type="pof2", qat_spec={"method": "tqt"})
LSQ = _spec(qat_spec={"method": "lsq"})
MINMAX = _spec()


def _model(spec: dict[str, Any]) -> nn.Module:
    """A quantized MLP after its first batch (statistics, thresholds, step sizes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = Config.from_dict({"global_quant_config": {"weight": spec, "input_tensors": spec}})
    model = ModelQuantizer(config).prepare(model)
    model(torch.randn(8, 16))
    return model


def _fix_observers(model: nn.Module) -> None:
    for q in model.modules():
        if isinstance(q, FakeQuantizeBase):
            q.disable_observer()


def _break_learned(model: nn.Module, spec: dict[str, Any]) -> None:
    """What a NaN gradient and an optimizer step leave in fc2's weight quantizer."""
    q = model[2]._weight_quantizer
    with torch.no_grad():
        (q.log_threshold if spec is TQT else q.scale).fill_(float("nan"))


def test_flags_that_are_inference_tensors_are_read_directly(monkeypatch: Any) -> None:
    """A model prepared and run under ``torch.inference_mode`` holds inference tensors, which have no version counter
    (``buf._version`` raises): ``flag`` must read them (its ``is_inference`` branch; no other test reaches it)."""
    with as_if_on_cuda(monkeypatch), torch.inference_mode():
        model = _model(MINMAX)
        _fix_observers(model)
        q = model[0]._input_quantizer
        assert q.fake_quant_enabled.is_inference()
        x = torch.randn(8, 16)
        assert not torch.equal(q(x), x)
        q.disable_fake_quant()
        assert torch.equal(q(x), x)
        q.fake_quant_enabled.fill_(1)
        assert not torch.equal(q(x), x)


@pytest.mark.parametrize("spec", [TQT, LSQ], ids=["tqt", "lsq"])
def test_copies_and_pickles_leave_pending_late_checks_behind(spec: dict[str, Any], monkeypatch: Any) -> None:
    """Pending checks hold CUDA events (not copyable, not picklable): a deepcopy or pickle of a learnable quantizer
    with checks on their way must leave them behind (``_MEMOS`` names ``_late_check``; no test covered it)."""
    with as_if_on_cuda(monkeypatch, events_complete=False):
        model = _model(spec)
        model(torch.randn(8, 16))
        q = model[2]._weight_quantizer
        assert q.__dict__["_late_check"]._pending
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert "_late_check" not in twin[2]._weight_quantizer.__dict__
        assert q.__dict__["_late_check"]._pending  # the original keeps its own


@pytest.mark.parametrize("spec", [TQT, LSQ], ids=["tqt", "lsq"])
def test_an_exact_answer_reads_every_pending_check_not_only_the_newest(spec: dict[str, Any], monkeypatch: Any) -> None:
    """A bad check queued before a good one is still reported by ``calculate_qparams`` (``LateFlag.wait`` reads all)."""
    with as_if_on_cuda(monkeypatch, events_complete=False):
        model = _model(spec)
        q = model[2]._weight_quantizer
        assert isinstance(q, TQTFakeQuantize | LSQFakeQuantize)
        _break_learned(model, spec)
        model(torch.randn(8, 16))  # queues the bad check
        with torch.no_grad():
            (q.log_threshold if spec is TQT else q.scale).fill_(0.5)
        model(torch.randn(8, 16))  # queues a good one after it
        with pytest.raises(ValueError, match="earlier training step"):
            q.calculate_qparams()


# ----------------------------------------------------------------------------------------------- the probe's blind spots
# Each is a host read on CUDA that ``HostSyncs`` does not record (on CPU tensors they dispatch no op it watches, or
# read the data without dispatching at all), so a steady-step test cannot catch them in the engine or the callbacks.
_BLIND = {
    "tolist": lambda t, m: t.tolist(),
    "equal": lambda t, m: torch.equal(t, t),
    "allclose": lambda t, m: torch.allclose(t, t),
    "index_put_bool_mask": lambda t, m: t.clone().__setitem__(m, 0.0),
    "bincount": lambda t, m: torch.bincount(m.long()),
    "histc": lambda t, m: torch.histc(t),
    # its zero-point range check: aminmax, then two .item() inside the op, on CUDA as on the CPU
    "fake_quantize_per_channel_affine": lambda t, m: torch.fake_quantize_per_channel_affine(
        t.reshape(2, 4), torch.ones(2), torch.zeros(2, dtype=torch.int32), 0, -128, 127
    ),
}


@pytest.mark.xfail(strict=True, reason="review42: HostSyncs does not record this host read")
@pytest.mark.parametrize("read", list(_BLIND))
def test_the_probe_records_host_reads(read: str) -> None:
    t = torch.randn(8)
    with HostSyncs() as probe:
        _BLIND[read](t, t > 0)
    assert probe.found


class PerChannelKernelCalls(HostSyncs):
    """Also records torch's per-channel fake-quant kernel called with an integer zero point: the op checks the zero
    points' range with two ``.item()`` of an ``aminmax`` inside its C++ body (below any dispatch mode), so each call
    is two host syncs on CUDA that ``HostSyncs`` cannot see."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if str(func) == "aten.fake_quantize_per_channel_affine_cachemask.default" and not args[2].is_floating_point():
            self.found["aten.fake_quantize_per_channel_affine_cachemask (int zero point: 2 x .item())"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.xfail(strict=True, reason="review42: small per-channel weights take torch's kernel, which syncs twice")
def test_the_tested_per_channel_config_makes_no_hidden_sync(monkeypatch: Any) -> None:
    """``test_quant_host_syncs``'s ``minmax_observers_fixed`` config (per-channel int8 weights, 2048 and 128 elements:
    under ``TORCH_KERNEL_MAX_NUMEL``) in a steady step: each weight quantizer calls the kernel once per forward."""

    weight = _spec(qscheme="per_channel", observer_cls="PerChannelMinMaxObserver", ch_axis=0)
    with as_if_on_cuda(monkeypatch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
        config = Config.from_dict({"global_quant_config": {"weight": weight, "input_tensors": MINMAX}})
        model = ModelQuantizer(config).prepare(model)
        x = torch.randn(8, 32)
        model(x)
        _fix_observers(model)
        model(x).sum().backward()
        with PerChannelKernelCalls() as probe:
            model(x).sum().backward()
    assert not probe.found, dict(probe.found)


# ----------------------------------------------------------------------------------------------- the real CUDA path
# (never run in this review: no GPU was lent; the CPU tests replace the pinned copy and the event by stand-ins)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("index", [0, 1], ids=["current_device", "other_device"])
def test_a_late_flag_is_read_after_its_copy_on_the_flags_own_device(index: int) -> None:
    """The event waits for the copy on the flag's device, also when another device is current (``torch.Event``'s
    ``record()`` without a stream records on the current device's stream)."""
    if index >= torch.cuda.device_count():
        pytest.skip("needs two CUDA devices")
    device = torch.device("cuda", index)
    late = LateFlag()
    with torch.cuda.device(0):  # cuda:0 current (and idle, for the other device's case)
        with torch.cuda.device(device):
            torch.cuda._sleep(10**9)  # noqa: SLF001 - the flag's device runs behind the host
        late.raised(torch.ones((), dtype=torch.bool, device=device))
        assert late.wait()  # waits for the copy, then reads True (not the pinned buffer's unwritten bytes)
