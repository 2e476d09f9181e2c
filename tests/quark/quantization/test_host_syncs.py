"""The engine's reads without host syncs, run on the CPU as on CUDA (``tests/host_syncs.py``): the quantizers' switches
through their memo (``FakeQuantizeBase.flag``) and the TQT/LSQ training checks read late (``LateFlag``).

The memo must see every write that goes through the tensor (an in-place write, ``load_state_dict``, ``.data =``, a
device move, torch.ao's helpers), and the late check must still refuse a bad learned value: in a later forward while
its copy is on its way, at once where an exact answer is needed (``calculate_qparams``, eval), and after at most
``MAX_PENDING`` forwards when the device never catches up.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.late_flag import MAX_PENDING, LateFlag
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
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = Config.from_dict({"global_quant_config": {"weight": spec, "input_tensors": spec}})
    model = ModelQuantizer(config).prepare(model)
    model(torch.randn(8, 16))  # the first batch: statistics, thresholds, step sizes
    return model


def _fix_observers(model: nn.Module) -> None:
    for q in model.modules():
        if isinstance(q, FakeQuantizeBase):
            q.disable_observer()  # written through set_flag: the memo knows the value without a read


def _reads(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    with HostSyncs() as probe:
        model(x)
    return dict(probe.found)


# ----------------------------------------------------------------------------------------------- the switches' memo
def test_a_quantizer_reads_its_switches_once_until_written(monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch):
        model = _model(MINMAX)
        _fix_observers(model)
        x = torch.randn(8, 16)
        model(x)
        assert _reads(model, x) == {}
        model[0]._input_quantizer.fake_quant_enabled.fill_(0)  # a write the memo did not make: read once, then known
        assert sum(_reads(model, x).values()) == 1
        assert _reads(model, x) == {}


@pytest.mark.parametrize("write", ["fill_", "index_put", "load_state_dict", "assign", "data", "method"])
def test_every_write_through_the_tensor_is_seen(write: str, monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch):
        model = _model(MINMAX)
        _fix_observers(model)
        x = torch.randn(8, 16)
        q = model[0]._input_quantizer
        assert not torch.equal(q(x), x)  # rounds to its grid; the switches are in the memo now
        if write == "fill_":
            q.fake_quant_enabled.fill_(0)
        elif write == "index_put":
            q.fake_quant_enabled[...] = 0
        elif write in ("load_state_dict", "assign"):  # copied into the buffer / the buffer replaced
            state = model.state_dict()
            state["0._input_quantizer.fake_quant_enabled"] = torch.tensor(0, dtype=torch.uint8)
            model.load_state_dict(state, assign=write == "assign")
        elif write == "data":  # the same tensor object on another storage
            q.fake_quant_enabled.data = torch.tensor(0, dtype=torch.uint8)
        elif write == "method":
            q.disable_fake_quant()
        assert torch.equal(q(x), x), write  # passed through, as the buffer now says
        assert torch.equal(model(x), _float_fc1_then_quantized_fc2(model, x)), write
        if write == "method":
            q.enable_fake_quant()
            assert not torch.equal(q(x), x)


def _float_fc1_then_quantized_fc2(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output with fc1's input in float: its weight still quantized, fc2 as configured."""
    fc1 = model[0]
    h = nn.functional.linear(x, fc1._weight_quantizer(fc1.weight), fc1.bias)
    return model[2](torch.relu(h))


def test_copies_and_pickles_leave_the_memo_behind(monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch):
        model = _model(MINMAX)
        _fix_observers(model)
        model(torch.randn(8, 16))
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            q = twin[0]._input_quantizer
            assert "_flags_known" not in q.__dict__
            q.fake_quant_enabled.fill_(0)  # version 1 again in a copy: a memo carried over could match it
            x = torch.randn(8, 16)
            assert torch.equal(q(x), x)


# ----------------------------------------------------------------------------------------------- late checks
def _break_learned(model: nn.Module, spec: dict[str, Any]) -> None:
    """What a NaN gradient and an optimizer step leave in fc2's weight quantizer."""
    q = model[2]._weight_quantizer
    with torch.no_grad():
        (q.log_threshold if spec is TQT else q.scale).fill_(float("nan"))


@pytest.mark.parametrize("spec", [TQT, LSQ], ids=["tqt", "lsq"])
def test_a_training_forward_queues_its_check_and_a_later_one_raises(spec: dict[str, Any], monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False) as events:
        model = _model(spec)
        _break_learned(model, spec)
        x = torch.randn(8, 16)
        out = model(x)  # the check's copy is on its way: no wait, no error yet (on CUDA the GPU runs behind)
        assert not torch.isfinite(out).all()
        assert _reads(model, x) == {}  # nor does the next forward wait while the copies are pending
        events.done = True  # the device caught up
        with pytest.raises(ValueError, match=r"layer '2' \(Linear, weight\).*no finite positive scale"):
            model(x)


@pytest.mark.parametrize("spec", [TQT, LSQ], ids=["tqt", "lsq"])
def test_an_exact_answer_waits_for_the_pending_check(spec: dict[str, Any], monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False) as events:
        model = _model(spec)
        model(torch.randn(8, 16))
        q = model[2]._weight_quantizer
        assert isinstance(q, TQTFakeQuantize | LSQFakeQuantize)
        q.calculate_qparams()  # valid: waits for the queued checks, finds nothing
        assert events.waited >= 1
        _break_learned(model, spec)
        model(torch.randn(8, 16))
        # the learned value is made valid again before anyone looked: the pending check still reports the step
        with torch.no_grad():
            (q.log_threshold if spec is TQT else q.scale).fill_(0.5)
        with pytest.raises(ValueError, match=r"layer '2' \(Linear, weight\).*earlier training step"):
            q.calculate_qparams()


def test_the_late_check_waits_once_the_device_is_max_pending_behind(monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False) as events:
        model = _model(TQT)  # its first batch queued one check per quantizer, of valid values
        _break_learned(model, TQT)
        x = torch.randn(8, 16)
        for _ in range(MAX_PENDING):  # each forward queues one more check, of fc2's bad weight threshold
            model(x)  # none completes: past MAX_PENDING the oldest is waited for (the valid one)
        assert events.waited == 4  # one per quantizer
        with pytest.raises(ValueError, match=r"layer '2' \(Linear, weight\)"):
            model(x)  # the oldest waited for now is the first bad one


def test_eval_checks_at_once(monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False):
        model = _model(LSQ)
        _break_learned(model, LSQ)
        model.eval()
        with pytest.raises(ValueError, match=r"layer '2' \(Linear, weight\)"):
            model(torch.randn(8, 16))


def test_on_the_cpu_the_check_is_read_in_the_same_forward() -> None:
    flag = LateFlag()
    assert not flag.raised(torch.tensor(False))
    assert flag.raised(torch.tensor(True))
    assert not flag.wait()


# ----------------------------------------------------------------------------------------------- the fused observe pass
def _fused_quantizer() -> FakeQuantizeBase:
    spec = Config.from_dict({"global_quant_config": {"input_tensors": _spec(symmetric=False, dtype="uint8")}})
    fq = FakeQuantizeBase.get_fake_quantize(spec.global_quant_config.input_tensors)
    fq.where = fq.observer.where = "layer 'fc1' (Linear, input_tensors)"
    return fq


def test_an_observing_forward_on_the_fused_pass_reads_nothing_on_the_host(compiled: None, monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False):
        fq = _fused_quantizer()
        x = torch.randn(96, 128)  # 12288 elements: the fused pass
        fq(x)  # compiles (outside the probe)
        with HostSyncs() as probe:
            fq(x * 2)
        assert not probe.found, dict(probe.found)
        assert torch.equal(fq.observer.max_val, (x * 2).max())  # it did observe


def test_a_nan_batch_on_the_fused_pass_is_refused_late_and_changes_nothing(compiled: None, monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False) as events:
        fq = _fused_quantizer()
        x = torch.randn(96, 128)
        fq(x)
        kept = (fq.observer.min_val.clone(), fq.observer.max_val.clone(), fq.scale.clone(), fq.zero_point.clone())
        bad = x.clone()
        bad[3, 3] = float("nan")
        fq(bad)  # its check is on its way: no wait, no error yet
        # nothing the bad batch computed outlives its forward: statistics and the held qparams are the good ones
        got = (fq.observer.min_val, fq.observer.max_val, fq.scale, fq.zero_point)
        assert all(torch.equal(a, b) for a, b in zip(got, kept, strict=True))
        assert torch.equal(fq(x), fq(x))  # later batches (still pending) quantize as before
        events.done = True
        with pytest.raises(ValueError, match=r"fc1.*NaN or Inf"):
            fq(x)


@pytest.mark.parametrize("reader", ["enable_observer(False)", "calculate_qparams"])
def test_fixing_or_reading_the_qparams_waits_for_a_pending_nan_check(
    reader: str, compiled: None, monkeypatch: Any
) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False):
        fq = _fused_quantizer()
        x = torch.randn(96, 128)
        fq(x)
        bad = x.clone()
        bad[0, 0] = float("inf")
        fq(bad)
        with pytest.raises(ValueError, match=r"fc1.*NaN or Inf"):
            fq.disable_observer() if reader.startswith("enable") else fq.calculate_qparams()


# ----------------------------------------------------------------------------------------------- the eager observe path
DYNAMIC = _spec(is_dynamic=True)


@pytest.mark.parametrize("spec", [MINMAX, DYNAMIC], ids=["observing", "dynamic"])
def test_an_observing_forward_on_the_eager_path_reads_nothing_on_the_host(
    spec: dict[str, Any], monkeypatch: Any
) -> None:
    """Tensors under the fused pass's size (and every tensor before compiled kernels run) observe step by step: the
    NaN / Inf check is read late and the qparams of the statistics just folded are taken without asking whether
    there are any."""
    with as_if_on_cuda(monkeypatch):
        model = _model(spec)
        x = torch.randn(8, 16)
        model(x)
        assert _reads(model, x * 3) == {}
        q = model[0]._input_quantizer
        assert torch.equal(q.observer.max_val, (x * 3).max()) or not spec["is_dynamic"]  # it did observe
        assert torch.equal(q.scale, q.observer.calculate_qparams()[0])  # and holds those statistics' qparams


@pytest.mark.parametrize("spec", [MINMAX, DYNAMIC], ids=["observing", "dynamic"])
def test_a_nan_batch_on_the_eager_path_is_refused_late(spec: dict[str, Any], monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False) as events:
        model = _model(spec)
        q = model[0]._input_quantizer
        x = torch.randn(8, 16)
        model(x)
        kept = (q.observer.min_val.clone(), q.observer.max_val.clone())
        bad = x.clone()
        bad[2, 2] = float("nan")
        model(bad)  # its check is on its way: no wait, no error yet
        if not spec["is_dynamic"]:  # the running statistics stay as they were
            assert torch.equal(q.observer.min_val, kept[0]) and torch.equal(q.observer.max_val, kept[1])
        events.done = True
        with pytest.raises(ValueError, match=r"layer '0' \(Linear, input_tensors\).*NaN or Inf"):
            model(x)


@pytest.mark.parametrize("dtype", ["mx6", "bfp16"])
def test_a_nan_batch_in_a_block_observer_is_refused_late_and_its_maxima_stay(dtype: str, monkeypatch: Any) -> None:
    spec = {"dtype": dtype, "qscheme": "per_group", "ch_axis": -1, "group_size": 16 if dtype == "mx6" else 8}
    spec |= {"observer_cls": "PerBlockMXObserver" if dtype == "mx6" else "PerBlockBFPObserver", "is_dynamic": False}
    with as_if_on_cuda(monkeypatch, events_complete=False) as events:
        model = _model(spec)
        observer = model[0]._input_quantizer.observer
        x = torch.randn(8, 16)
        model(x)
        kept = {k: v.clone() for k, v in observer.state_dict().items()}  # block maxima (and BFP's block steps)
        bad = x * 100
        bad[1, 1] = float("inf")
        assert _reads(model, bad) == {}  # no wait, no error yet
        assert all(torch.equal(observer.state_dict()[k], v) for k, v in kept.items())  # the statistics stay
        assert torch.equal(observer(x * 100), x * 100) and not torch.equal(observer.amax, kept["amax"])  # (they move)
        events.done = True
        with pytest.raises(ValueError, match=r"layer '0' \(Linear, input_tensors\).*NaN or Inf"):
            model(x)


def test_fixing_the_observers_waits_for_an_eager_nan_check(monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False):
        model = _model(MINMAX)
        bad = torch.randn(8, 16)
        bad[0, 0] = float("inf")
        model(bad)
        with pytest.raises(ValueError, match=r"layer '0' \(Linear, input_tensors\).*NaN or Inf"):
            model[0]._input_quantizer.disable_observer()


def test_copies_and_pickles_leave_an_observers_pending_checks_behind(monkeypatch: Any) -> None:
    with as_if_on_cuda(monkeypatch, events_complete=False):
        model = _model(MINMAX)
        model(torch.randn(8, 16))
        observer = model[0]._input_quantizer.observer
        assert observer.__dict__["_late_nonfinite"]._pending
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert "_late_nonfinite" not in twin[0]._input_quantizer.observer.__dict__
        assert observer.__dict__["_late_nonfinite"]._pending  # the original keeps its own


# ----------------------------------------------------------------------------------------------- found by review
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


# ----------------------------------------------------------------------------------------------- the probe itself
# Host reads on CUDA that dispatch no op the first probe watched, or read the data without dispatching at all
# (``tolist``): the probe records each (found by review).
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


@pytest.mark.parametrize("read", list(_BLIND))
def test_the_probe_records_every_kind_of_host_read(read: str) -> None:
    t = torch.randn(8)
    with HostSyncs() as probe:
        _BLIND[read](t, t > 0)
    assert probe.found


def test_small_per_channel_weights_skip_torchs_kernel_where_it_syncs(monkeypatch: Any) -> None:
    """Per-channel int8 weights of 2048 and 128 elements (under ``TORCH_KERNEL_MAX_NUMEL``) take torch's per-channel
    kernel on the CPU; on CUDA that kernel checks its integer zero points with two ``.item()`` inside the op, so the
    elementwise chain serves them there (found by review)."""

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
        with HostSyncs() as probe:
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
