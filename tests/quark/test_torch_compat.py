"""quark.torch.compat: each private torch API the engine relies on still behaves as relied on (a torch upgrade that
breaks one fails here first, under the wrapper's name), and a missing one gives an error naming torch's version."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils.weight_norm import WeightNorm

from quark.torch import compat


def _cell_and_inputs(cell: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A float cell of ``cell`` type and its inputs (batched)."""
    torch.manual_seed(0)
    module = {"lstm_cell": nn.LSTMCell, "gru_cell": nn.GRUCell, "rnn_tanh_cell": nn.RNNCell}[cell](3, 4)
    x, h = torch.randn(2, 3), torch.randn(2, 4)
    return module, (x, (h, torch.randn(2, 4)) if cell == "lstm_cell" else h)


def test_rnn_kernel_runs_the_float_lstm() -> None:
    """torch._VF.lstm with nn.LSTM's flat weights and arguments gives nn.LSTM's output (both directions)."""
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, bidirectional=True)
    x, h, c = torch.randn(5, 2, 3), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4)
    weights = [getattr(lstm, n) for n in compat.rnn_flat_weight_names(lstm)]
    out, hn, cn = compat.rnn_kernel("lstm")(x, (h, c), weights, True, 1, 0.0, False, True, False)
    ref, (ref_h, ref_c) = lstm(x, (h, c))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(hn, ref_h)
    torch.testing.assert_close(cn, ref_c)


@pytest.mark.parametrize("cell", ["lstm_cell", "gru_cell", "rnn_tanh_cell"])
def test_rnn_kernel_runs_the_float_cells(cell: str) -> None:
    """torch._VF.<cell>(x, h, w_ih, w_hh, b_ih, b_hh) gives the float cell's output."""
    module, (x, h) = _cell_and_inputs(cell)
    weights = [module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh]
    out = compat.rnn_kernel(cell)(x, h, *weights)
    ref = module(x, h)
    for got, want in zip(
        out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,), strict=True
    ):
        torch.testing.assert_close(got, want)


def test_rnn_kernel_missing_names_torch_version() -> None:
    with pytest.raises(compat.CompatError, match=rf"torch\._VF\.no_such_kernel.*torch {re.escape(torch.__version__)}"):
        compat.rnn_kernel("no_such_kernel")


def test_rnn_flat_weight_names_are_the_kernel_order() -> None:
    """Per layer and direction: weight_ih, weight_hh, bias_ih, bias_hh, then weight_hr with a projection."""
    lstm = nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2)
    expected = [
        f"{kind}_l{layer}{suffix}"
        for layer in range(2)
        for suffix in ("", "_reverse")
        for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")
    ]
    assert compat.rnn_flat_weight_names(lstm) == expected


def test_module_twin_shares_tensors_with_own_registries() -> None:
    """The twin holds the same Parameters / buffers / children; registering on it leaves the original unchanged."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    seq.register_buffer("scratch", torch.ones(1), persistent=False)
    twin = compat.module_twin(seq, nn.Sequential)
    assert twin[0] is seq[0] and twin[1] is seq[1] and twin.scratch is seq.scratch
    twin.register_module("extra", nn.ReLU())
    twin.register_parameter("p", nn.Parameter(torch.zeros(1)))
    twin.register_buffer("b", torch.zeros(1), persistent=False)
    assert (
        "extra" not in seq._modules and "p" not in dict(seq.named_parameters()) and "b" not in dict(seq.named_buffers())
    )
    assert "scratch" not in twin.state_dict()  # non-persistent stays so


def test_module_twin_drops_children_and_attributes() -> None:
    lin = nn.Linear(2, 2)
    lin.register_module("probe", nn.Identity())
    lin.note = "x"
    plain = compat.module_twin(lin, nn.Linear, drop=["probe", "note"])
    assert type(plain) is nn.Linear and plain.weight is lin.weight
    assert not hasattr(plain, "probe") and not hasattr(plain, "note")
    torch.testing.assert_close(plain(torch.ones(1, 2)), lin(torch.ones(1, 2)))


def test_parameter_registry_replaces_parameters() -> None:
    lin = nn.Linear(2, 2)
    new = nn.Parameter(torch.zeros(2, 2))
    compat.parameter_registry(lin)["weight"] = new
    assert dict(lin.named_parameters())["weight"] is new and lin.weight is new


def test_buffer_registry_replaces_buffers_keeping_persistence() -> None:
    bn = nn.BatchNorm1d(2)
    bn.register_buffer("scratch", torch.ones(1), persistent=False)
    compat.buffer_registry(bn)["running_mean"] = torch.full((2,), 3.0)
    compat.buffer_registry(bn)["scratch"] = torch.full((1,), 5.0)
    state = bn.state_dict()
    torch.testing.assert_close(state["running_mean"], torch.full((2,), 3.0))
    assert "scratch" not in state and float(bn.scratch) == 5.0


def test_forward_pre_hooks_hold_weight_norm() -> None:
    """Old-style weight_norm is a WeightNorm forward pre-hook there; deleting it stops the recomputation."""
    with warnings.catch_warnings():  # deprecated, still what older checkpoints and models use
        warnings.simplefilter("ignore", FutureWarning)
        lin = torch.nn.utils.weight_norm(nn.Linear(2, 2))
    hooks = compat.forward_pre_hooks(lin)
    keys = [k for k, h in hooks.items() if isinstance(h, WeightNorm) and h.name == "weight"]
    assert len(keys) == 1
    del hooks[keys[0]]
    assert not any(isinstance(h, WeightNorm) for h in lin._forward_pre_hooks.values())


def test_tensor_version_counts_in_place_writes_only() -> None:
    p = nn.Parameter(torch.ones(2))
    before = compat.tensor_version(p)
    with torch.no_grad():
        p.add_(1.0)
    assert compat.tensor_version(p) == before + 1
    p.data.mul_(2.0)  # through .data: the counter stays
    assert compat.tensor_version(p) == before + 1


def test_fake_quantize_learnable_backward_is_the_lsq_estimator() -> None:
    """grad_x: grad inside [qmin, qmax], 0 outside; grad_scale: sum of grad * (round(v) - v) inside, grad * qmin /
    qmax at the clipped ends (round half to even), computed here independently."""
    torch.manual_seed(0)
    x, grad = torch.randn(64) * 3, torch.randn(64)
    scale, zero = torch.tensor([0.05]), torch.tensor([0.0])
    qmin, qmax = -8, 7
    gx, gs, _ = compat.fake_quantize_learnable_backward(grad, x, scale, zero, qmin, qmax, 1.0)
    v = x / scale
    r = torch.round(v)
    inside = (r >= qmin) & (r <= qmax)
    local = torch.where(inside, r - v, torch.where(r < qmin, torch.full_like(v, qmin), torch.full_like(v, qmax)))
    torch.testing.assert_close(gx, grad * inside)
    torch.testing.assert_close(gs.reshape(()), (grad * local).sum(), rtol=1e-4, atol=1e-5)


def test_dynamo_recompile_limit_sets_and_returns_the_config_value() -> None:
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    original = getattr(torch._dynamo.config, name)
    try:
        assert compat.dynamo_recompile_limit() == original
        assert compat.dynamo_recompile_limit(original + 7) == original
        assert getattr(torch._dynamo.config, name) == original + 7
    finally:
        setattr(torch._dynamo.config, name, original)


def test_inplace_overload_finds_aten_in_place_forms() -> None:
    aten = torch.ops.aten
    assert compat.inplace_overload(aten.sigmoid.default) is aten.sigmoid_.default
    assert compat.inplace_overload(aten.masked_fill.Scalar) is aten.masked_fill_.Scalar
    assert compat.inplace_overload(aten.linear.default) is None  # no linear_
    assert compat.inplace_overload(F.relu) is None  # not an OpOverload


def test_private_aten_ops_used_by_graph_rules_exist() -> None:
    """The underscore aten ops graph mode has rules for (graph/rules.py names them directly)."""
    aten = torch.ops.aten
    for op in (aten._to_copy.default, aten._softmax.default, aten._weight_norm.default):
        assert isinstance(op, torch._ops.OpOverload)


def test_export_guards_attr_is_a_submodule_of_the_exported_module() -> None:
    """torch.export's module() keeps its shape guards in a submodule under EXPORT_GUARDS_ATTR, called by the graph."""
    program = torch.export.export(nn.Linear(3, 2), (torch.randn(2, 3),))
    gm = program.module()
    assert isinstance(getattr(gm, compat.EXPORT_GUARDS_ATTR), nn.Module)
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) == compat.EXPORT_GUARDS_ATTR]
    assert len(calls) == 1


def test_ddp_ignore_states_keeps_buffers_out_of_ddp(tmp_path: Path) -> None:
    """A single-process DDP leaves the named buffers out of its broadcast (``parameters_to_ignore``)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert compat.ddp_ignore_states(model, ["1.running_mean"]) == ["1.running_mean"]
    assert compat.ddp_ignore_states(model, ["1.running_mean", "1.running_var"]) == ["1.running_mean", "1.running_var"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        ignored = set(ddp.parameters_to_ignore)
        # DDP's reducer holds the process group, and its destructor joins gloo's threads: freed after the group was
        # destroyed, that join can wait forever (a CI run hung there once)
        del ddp
    finally:
        dist.destroy_process_group()
    assert {"1.running_mean", "1.running_var"} <= ignored


# nn.Module's protected extension points (overridden by quark's own subclasses; no wrapper, tested here)
class _Probe(nn.Module):
    """Records the protected nn.Module hooks torch calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.ones(2))
        self.calls: list[str] = []

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.calls.append("_apply")
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        self.calls.append("_save_to_state_dict")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append(f"_load_from_state_dict:{prefix}")
        self._buffers["stat"] = torch.empty_like(state_dict[prefix + "stat"])  # resized before the copy
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_protected_module_hooks_are_called_as_relied_on() -> None:
    """``.to(dtype)`` goes through ``_apply``, ``state_dict`` through ``_save_to_state_dict``, and
    ``load_state_dict`` through ``_load_from_state_dict`` (with the prefix) before it copies, so a resize there works."""
    outer = nn.Sequential(_Probe())
    probe = outer[0]
    outer.to(torch.float64)
    state = outer.state_dict()
    outer.load_state_dict({"0.stat": torch.arange(5.0)})
    assert probe.calls == ["_apply", "_save_to_state_dict", "_load_from_state_dict:0."]
    assert state["0.stat"].dtype == torch.float64
    torch.testing.assert_close(probe.stat, torch.arange(5.0))
