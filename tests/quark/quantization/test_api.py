"""ModelQuantizer: resolution, swapping, calibration, state, errors and freezing."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from specs import int_spec
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from quark.torch import LayerPlan, ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.formats import fake_quantize
from quark.torch.quantization.nn.modules.quant_modules import QuantConv1d, QuantLinear, QuantMixin
from quark.torch.quantization.observer.observer import (
    ObserverBase,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
)
from quark.torch.quantization.tensor_quantize import (
    BakedFakeQuantize,
    FakeQuantizeBase,
    FrozenScaledFakeQuantize,
    NonScaledFakeQuantize,
    ScaledFakeQuantize,
)


# ----------------------------------------------------------------------------------------------- specs
def per_channel(ch_axis: int = 0, **overrides: Any) -> QuantizationSpec:
    return int_spec(qscheme="per_channel", observer_cls=PerChannelMinMaxObserver, ch_axis=ch_axis, **overrides)


def per_group(group_size: int, dtype: str = "int4", ch_axis: int = -1, **overrides: Any) -> QuantizationSpec:
    return int_spec(
        dtype=dtype,
        qscheme="per_group",
        observer_cls=PerGroupMinMaxObserver,
        ch_axis=ch_axis,
        group_size=group_size,
        **overrides,
    )


def fp8_spec() -> QuantizationSpec:
    return QuantizationSpec(dtype="fp8_e4m3", qscheme="per_tensor", observer_cls=PerTensorMinMaxObserver)


def mx_spec(element: str = "fp4", group_size: int = 32) -> QuantizationSpec:
    return QuantizationSpec(dtype="mx", mx_element_dtype=element, group_size=group_size)


STATIC = QuantizationConfig(input_tensors=int_spec(), weight=per_channel(0))
STATIC_IO = QuantizationConfig(input_tensors=int_spec(), output_tensors=int_spec(), weight=per_channel(0))
WEIGHT_ONLY = QuantizationConfig(weight=per_channel(0))


def config(qc: QuantizationConfig = STATIC, **kwargs: Any) -> Config:
    return Config(global_quant_config=qc, **kwargs)


# ----------------------------------------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class KeywordMLP(MLP):
    """Takes its input by keyword only: dict batches must be passed as model(**batch)."""

    def forward(self, *, features: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(features)


class MyLinear(nn.Linear):
    """A user subclass of nn.Linear: resolves via its base class name."""


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """conv -> block (fc1, fc2) -> other (fc1, fc2) -> head (a Linear subclass)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.block = Tower()
        self.other = Tower()
        self.head = MyLinear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(1)
        return self.head(self.other(self.block(h)))


class Recorder(nn.Module):
    """Records (training, grad enabled) on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled()))
        return x


class RecordingMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.rec = Recorder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.rec(self.fc1(x))))


class WatchedMLP(MLP):
    """Records every submodule assigned to it once ``watch`` is set."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module) and self.__dict__.get("watch"):
            self.__dict__.setdefault("swaps", []).append(name)
        super().__setattr__(name, value)

    @property
    def swaps(self) -> list[str]:
        return self.__dict__.get("swaps", [])


def mlp(seed: int = 0, cls: type[MLP] = MLP, **kwargs: Any) -> MLP:
    torch.manual_seed(seed)
    return cls(**kwargs)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def net_input(seed: int = 0) -> torch.Tensor:
    return randn(4, 2, 4, seed=seed)


def scaled_quantizers(model: nn.Module) -> dict[str, FakeQuantizeBase]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ScaledFakeQuantize | FrozenScaledFakeQuantize)}


def qparams(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: tuple(t.clone() for t in q.calculate_qparams()) for n, q in scaled_quantizers(model).items()}


def assert_same_qparams(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name][0], b[name][0]), name
        assert torch.equal(a[name][1], b[name][1]), name


def assert_float_model(model: nn.Module, originals: dict[str, nn.Module]) -> None:
    """Every module is the original object, no quantizer anywhere, no quant_config."""
    assert dict(model.named_modules()) == originals
    assert not any(isinstance(m, QuantMixin | FakeQuantizeBase) for m in model.modules())
    assert not hasattr(model, "quant_config")


def fq_tensor(t: torch.Tensor, q: FakeQuantizeBase, qmin: int = -128, qmax: int = 127) -> torch.Tensor:
    scale, zp = q.calculate_qparams()
    return torch.fake_quantize_per_tensor_affine(t, scale.reshape(()), zp.reshape(()).to(torch.int32), qmin, qmax)


def fq_channel(t: torch.Tensor, q: FakeQuantizeBase, axis: int = 0) -> torch.Tensor:
    scale, zp = q.calculate_qparams()
    return torch.fake_quantize_per_channel_affine(t, scale.reshape(-1), zp.reshape(-1).to(torch.int32), axis, -128, 127)


# ----------------------------------------------------------------------------------------------- resolution
@pytest.mark.parametrize("linear_key", [nn.Linear, "Linear"], ids=["class", "name"])
def test_resolution_precedence_exact_name_over_pattern_over_type_over_global(linear_key: Any) -> None:
    cfg = Config(
        global_quant_config=QuantizationConfig(input_tensors=int_spec(), weight=int_spec(dtype="int8")),
        layer_type_quant_config={
            linear_key: QuantizationConfig(weight=int_spec(dtype="int4"), output_tensors=int_spec(dtype="int16"))
        },
        # the pattern is given first: the exact name still wins
        layer_quant_config={
            "*.fc2": QuantizationConfig(weight=int_spec(dtype="int6")),
            "block.fc2": QuantizationConfig(weight=int_spec(dtype="int5")),
        },
    )
    model = Net()
    plans = {p.name: p for p in ModelQuantizer(cfg).resolve(model)}
    assert all(isinstance(p, LayerPlan) for p in plans.values())
    assert list(plans) == ["conv", "block.fc1", "block.fc2", "other.fc1", "other.fc2", "head"]  # module order

    expected_weight = {
        "block.fc2": ("int5", "layer 'block.fc2'"),
        "other.fc2": ("int6", "layer '*.fc2'"),
        "block.fc1": ("int4", "type 'Linear'"),
        "other.fc1": ("int4", "type 'Linear'"),
        "head": ("int4", "type 'Linear'"),  # MyLinear resolves via its base class name
        "conv": ("int8", "global"),
    }
    for name, (dtype, source) in expected_weight.items():
        assert plans[name].qconfig.weight.dtype.name == dtype, name
        assert plans[name].source["weight"] == source, name
    assert plans["head"].layer_type == "Linear"

    ModelQuantizer(cfg).prepare(model)
    layers = dict(model.named_modules())
    for name, (dtype, _) in expected_weight.items():
        assert layers[name]._weight_quantizer.spec.dtype.name == dtype, name
    assert type(model.head) is QuantLinear and isinstance(model.head, nn.Linear)
    assert type(model.conv) is QuantConv1d and model.conv._output_quantizer is None  # the Linear type config only


def test_an_entry_is_the_layers_whole_config_as_in_amd_quark() -> None:
    """amd-quark 0.13's rule (the default): the first matching entry replaces everything; its None roles stay float."""
    cfg = Config(
        global_quant_config=QuantizationConfig(input_tensors=int_spec(dtype="int8"), weight=int_spec(dtype="int8")),
        layer_type_quant_config={"Linear": QuantizationConfig(output_tensors=int_spec(dtype="int16"))},
        layer_quant_config={
            "block.fc2": QuantizationConfig(weight=int_spec(dtype="int5")),
            "*.fc2": QuantizationConfig(input_tensors=int_spec(dtype="int7"), weight=int_spec(dtype="int6")),
        },
    )
    plans = {p.name: p for p in ModelQuantizer(cfg).resolve(Net())}
    fc2 = plans["block.fc2"].qconfig
    assert fc2.weight.dtype.name == "int5" and fc2.input_tensors is None and fc2.output_tensors is None
    assert plans["block.fc2"].source == {"weight": "layer 'block.fc2'"}
    other = plans["other.fc2"].qconfig
    assert other.input_tensors.dtype.name == "int7" and other.output_tensors is None
    fc1 = plans["block.fc1"]  # the type entry: output only, no weight and no input
    assert fc1.qconfig.weight is None and fc1.qconfig.input_tensors is None
    assert fc1.qconfig.output_tensors.dtype.name == "int16" and fc1.source == {"output_tensors": "type 'Linear'"}
    assert plans["conv"].source == {"input_tensors": "global", "weight": "global"}
    empty = Config(global_quant_config=cfg.global_quant_config, layer_quant_config={"block.fc1": QuantizationConfig()})
    assert "block.fc1" not in {p.name for p in ModelQuantizer(empty).resolve(Net())}  # an empty entry: float


def test_inherit_roles_falls_back_role_by_role() -> None:
    cfg = Config(
        global_quant_config=QuantizationConfig(input_tensors=int_spec(dtype="int8"), weight=int_spec(dtype="int8")),
        layer_type_quant_config={"Linear": QuantizationConfig(output_tensors=int_spec(dtype="int16"))},
        layer_quant_config={
            "block.fc2": QuantizationConfig(weight=int_spec(dtype="int5")),
            "*.fc2": QuantizationConfig(input_tensors=int_spec(dtype="int7"), weight=int_spec(dtype="int6")),
        },
        inherit_roles=True,
    )
    model = Net()
    plans = {p.name: p for p in ModelQuantizer(cfg).resolve(model)}
    fc2 = plans["block.fc2"]
    assert fc2.qconfig.weight.dtype.name == "int5" and fc2.source["weight"] == "layer 'block.fc2'"
    assert fc2.qconfig.input_tensors.dtype.name == "int7" and fc2.source["input_tensors"] == "layer '*.fc2'"
    assert fc2.qconfig.output_tensors.dtype.name == "int16" and fc2.source["output_tensors"] == "type 'Linear'"
    assert fc2.qconfig.bias is None and "bias" not in fc2.source  # None at every level: not quantized
    fc1 = plans["block.fc1"]
    assert fc1.qconfig.input_tensors.dtype.name == "int8" and fc1.source["input_tensors"] == "global"
    assert fc1.qconfig.weight.dtype.name == "int8" and fc1.source["weight"] == "global"

    ModelQuantizer(cfg).prepare(model)
    layer = model.block.fc2
    assert layer._input_quantizer.spec.dtype.name == "int7"
    assert layer._output_quantizer.spec.dtype.name == "int16"
    assert layer._weight_quantizer.spec.dtype.name == "int5"
    assert layer._bias_quantizer is None
    assert model.conv._output_quantizer is None and model.conv._bias_quantizer is None


def test_patterns_apply_in_the_order_given() -> None:
    cfg = config(
        WEIGHT_ONLY,
        layer_quant_config={
            "block.*": QuantizationConfig(weight=int_spec(dtype="int4")),
            "*.fc2": QuantizationConfig(weight=int_spec(dtype="int6")),
        },
    )
    plans = {p.name: p for p in ModelQuantizer(cfg).resolve(Net())}
    assert plans["block.fc2"].qconfig.weight.dtype.name == "int4"
    assert plans["other.fc2"].qconfig.weight.dtype.name == "int6"


def test_role_none_everywhere_leaves_the_layer_float() -> None:
    cfg = config(QuantizationConfig(), layer_type_quant_config={"Linear": WEIGHT_ONLY})
    model = Net()
    conv = model.conv
    ModelQuantizer(cfg).prepare(model)
    assert model.conv is conv and type(conv) is nn.Conv1d  # no role anywhere: stays float
    lin = model.block.fc1
    assert type(lin) is QuantLinear
    assert lin._weight_quantizer is not None
    assert lin._input_quantizer is None and lin._output_quantizer is None and lin._bias_quantizer is None


def test_exclude_with_fnmatch_leaves_layers_float_even_when_named() -> None:
    cfg = config(STATIC, exclude=["other.*", "con?"], layer_quant_config={"other.fc2": WEIGHT_ONLY})
    model = Net()
    kept = {n: m for n, m in model.named_modules() if n.startswith("other.") or n == "conv"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = ModelQuantizer(cfg).resolve(model)
        ModelQuantizer(cfg).prepare(model)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "match no layer" in m]  # every key and pattern matches a layer
    # the excluded layers are named once, with the reason
    assert len(messages) == 1 and "excluded by Config.exclude" in messages[0]
    assert all(name in messages[0] for name in ("other.fc1 (Linear)", "other.fc2 (Linear)", "conv (Conv1d)"))
    assert [p.name for p in plans] == ["block.fc1", "block.fc2", "head"]
    layers = dict(model.named_modules())
    for name, module in kept.items():
        assert layers[name] is module and not isinstance(module, QuantMixin)
    assert isinstance(model.block.fc1, QuantLinear) and isinstance(model.head, QuantLinear)


def test_names_and_patterns_that_match_nothing_are_warned_about() -> None:
    cfg = config(
        STATIC,
        layer_quant_config={"block.fc2": WEIGHT_ONLY, "blok.fc2": WEIGHT_ONLY, "*.fc9": WEIGHT_ONLY},
        exclude=["head", "nothing*"],
    )
    model = Net()
    with pytest.warns(UserWarning) as record:
        ModelQuantizer(cfg).prepare(model)
    messages = [str(w.message) for w in record]
    layer_msgs = [m for m in messages if "layer_quant_config" in m]
    exclude_msgs = [m for m in messages if "exclude" in m]
    assert layer_msgs and exclude_msgs
    assert "'blok.fc2'" in layer_msgs[0] and "'*.fc9'" in layer_msgs[0] and "'block.fc2'" not in layer_msgs[0]
    assert "'nothing*'" in exclude_msgs[0] and "'head'" not in exclude_msgs[0]
    assert isinstance(model.block.fc2, QuantLinear)  # a warning, not an error

    with pytest.warns(UserWarning) as record:
        ModelQuantizer(cfg).summary(Net())  # the same check, without changing the model
    assert any("'blok.fc2'" in str(w.message) for w in record) and any("'nothing*'" in str(w.message) for w in record)


def test_summary_is_a_readable_table_of_the_resolution() -> None:
    cfg = Config(
        global_quant_config=QuantizationConfig(input_tensors=int_spec(is_dynamic=True), weight=per_channel(0)),
        layer_type_quant_config={"Linear": QuantizationConfig(weight=per_group(4))},
        layer_quant_config={"head": QuantizationConfig(weight=mx_spec())},
        exclude=["other.*"],
        inherit_roles=True,
    )
    model = Net()
    before = dict(model.named_modules())
    table = ModelQuantizer(cfg).summary(model)
    assert dict(model.named_modules()) == before and not hasattr(model, "quant_config")  # summary changes nothing

    table, _, floats = table.partition("\n\n")
    assert floats.splitlines()[0].split() == ["float", "layer", "type", "why"]
    assert {tuple(line.split(None, 2)) for line in floats.splitlines()[2:]} == {
        ("other.fc1", "Linear", "excluded by Config.exclude"),
        ("other.fc2", "Linear", "excluded by Config.exclude"),
    }
    lines = table.splitlines()
    assert lines[0].split() == ["layer", "type", "role", "dtype", "qscheme", "observer", "from"]
    assert set(lines[1]) <= {"-", " "}
    rows = [line.split(None, 6) for line in lines[2:]]
    by_key = {(r[0], r[2]): r for r in rows}
    assert set(by_key) == {
        (n, role) for n in ("conv", "block.fc1", "block.fc2", "head") for role in ("input_tensors", "weight")
    }
    expected_rows = [
        "conv | Conv1d | weight | int8 | per_channel | PerChannelMinMaxObserver | global",
        "block.fc1 | Linear | weight | int4 | per_group(g4) | PerGroupMinMaxObserver | type 'Linear'",
        "head | Linear | weight | mx[fp4] | per_group(g32) | PerBlockMXObserver | layer 'head'",
    ]
    for row in expected_rows:
        cells = row.split(" | ")
        assert by_key[(cells[0], cells[2])] == cells
    fc1_in = lines[2 + rows.index(by_key[("block.fc1", "input_tensors")])]
    assert "int8, dynamic" in fc1_in and fc1_in.rstrip().endswith("global")
    assert not any(line.startswith("other.") for line in lines)


# ----------------------------------------------------------------------------------------------- swapping
def test_swap_keeps_the_parameter_objects() -> None:
    model = Net()
    before = dict(model.named_parameters())
    ModelQuantizer(
        config(QuantizationConfig(input_tensors=int_spec(), weight=per_channel(0), bias=int_spec()))
    ).prepare(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name in before:
        assert after[name] is before[name], name
    for m in model.modules():
        if isinstance(m, QuantMixin):
            assert isinstance(m, m._float_class)


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer-before-prepare", "optimizer-after-prepare"])
def test_an_optimizer_trains_the_weights_the_quantized_forward_uses(optimizer_first: bool) -> None:
    model = mlp()
    x = randn(16, 8, seed=1)
    w1 = model.fc1.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer_first else None
    ModelQuantizer(config()).quantize_model(model, [x])
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    layer = model.fc1
    assert layer.weight is w1
    w_before = layer.weight.detach().clone()
    wq_before = layer._weight_quantizer(layer.weight).detach()
    out_before = model(x).detach()

    loss = (model(x) - 1.0).pow(2).sum()
    loss.backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0  # straight-through
    opt.step()

    assert layer.weight is w1
    assert not torch.equal(layer.weight, w_before)
    wq_after = layer._weight_quantizer(layer.weight).detach()
    assert not torch.equal(wq_after, wq_before)
    with torch.no_grad():
        out_after = model(x)
        expected = F.linear(
            fq_tensor(x, layer._input_quantizer), fq_channel(layer.weight, layer._weight_quantizer), layer.bias
        )
        assert torch.equal(layer(x), expected)
    assert not torch.equal(out_after, out_before)


def test_prepare_is_idempotent_and_never_touches_quantized_layers() -> None:
    model = mlp()
    x = randn(8, 8, seed=1)
    quantizer = ModelQuantizer(config())
    quantizer.quantize_model(model, [x])
    modules = dict(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(x)

    assert quantizer.resolve(model) == []  # nothing left to swap
    assert quantizer.prepare(model) is model
    other = config(QuantizationConfig(weight=per_group(4), output_tensors=fp8_spec()))
    ModelQuantizer(other).prepare(model)  # another config: still nothing to swap
    assert dict(model.named_modules()) == modules  # the same objects, quantizers included
    for name, module in modules.items():
        assert dict(model.named_modules())[name] is module
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k in state:
        assert torch.equal(after[k], state[k]), k
    assert torch.equal(model(x), out)


# ----------------------------------------------------------------------------------------------- calibration
X1 = randn(4, 8, seed=11)
X2 = randn(4, 8, seed=12, scale=2.0)
Y_HUGE = randn(4, 8, seed=13, scale=100.0)  # targets: using one as input would change every scale


def calibrated_qparams(data: Any = None, cls: type[MLP] = MLP, **kwargs: Any) -> dict[str, Any]:
    model = mlp(cls=cls)
    ModelQuantizer(config(STATIC_IO)).quantize_model(model, data, **kwargs)
    return qparams(model)


BATCH_FORMS: dict[str, Any] = {
    "tuple": lambda: {"data": [(X1, Y_HUGE), (X2, Y_HUGE)]},
    "list": lambda: {"data": [[X1, Y_HUGE], [X2, Y_HUGE]]},
    "dataloader": lambda: {
        "data": DataLoader(TensorDataset(torch.cat([X1, X2]), torch.cat([Y_HUGE, Y_HUGE])), batch_size=4)
    },
    "generator": lambda: {"data": (x for x in (X1, X2))},
    "forward_loop": lambda: {"forward_loop": lambda m: [m(X1), m(X2)]},
    "dict": lambda: {"data": [{"features": X1}, {"features": X2}], "cls": KeywordMLP},  # model(**batch)
}


@pytest.mark.parametrize("form", list(BATCH_FORMS))
def test_every_batch_form_gives_identical_scales(form: str) -> None:
    reference = calibrated_qparams([X1, X2])
    amax = torch.maximum(X1.abs().max(), X2.abs().max())
    assert torch.equal(reference["fc1._input_quantizer"][0], amax / 127.5)  # both batches were seen
    assert_same_qparams(calibrated_qparams(**BATCH_FORMS[form]()), reference)


def test_the_two_halves_equal_quantize_model() -> None:
    reference = calibrated_qparams([X1, X2])
    model = mlp()
    quantizer = ModelQuantizer(config(STATIC_IO))
    quantizer.prepare(model)
    assert isinstance(model.fc1, QuantLinear) and model.quant_config is quantizer.config
    assert not bool(model.fc1._input_quantizer.initialized)  # prepared, not calibrated
    assert quantizer.calibrate(model, [X1, X2]) is model
    assert_same_qparams(qparams(model), reference)


class CountingLoader:
    """An iterable without __len__ that counts the batches it handed out."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches
        self.pulled = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for b in self.batches:
            self.pulled += 1
            yield b


def test_max_batches_limits_calibration() -> None:
    big = randn(4, 8, seed=14, scale=50.0)
    two = calibrated_qparams([X1, X2])
    loader = CountingLoader([X1, X2, big])
    limited = calibrated_qparams(loader, max_batches=2)
    assert_same_qparams(limited, two)
    assert loader.pulled == 2  # the third batch is not even fetched
    three = calibrated_qparams([X1, X2, big])
    assert not torch.equal(three["fc1._input_quantizer"][0], two["fc1._input_quantizer"][0])


def test_weight_only_config_needs_no_data() -> None:
    model = mlp()
    x = randn(5, 8, seed=2)
    float_out = model(x).detach()
    assert ModelQuantizer(config(WEIGHT_ONLY)).quantize_model(model) is model
    layer = model.fc1
    assert bool(layer._weight_quantizer.initialized)
    assert torch.equal(layer._weight_quantizer.scale, layer.weight.detach().abs().amax(dim=1) / 127.5)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, fq_channel(layer.weight, layer._weight_quantizer), layer.bias))
        assert not torch.equal(model(x), float_out)


def test_dynamic_activations_need_no_data_and_follow_each_call() -> None:
    model = mlp()
    cfg = config(QuantizationConfig(input_tensors=int_spec(is_dynamic=True), weight=per_channel(0)))
    ModelQuantizer(cfg).quantize_model(model)
    layer = model.fc1
    for seed, scale in ((3, 1.0), (4, 10.0)):
        x = randn(5, 8, seed=seed, scale=scale)
        with torch.no_grad():
            out = layer(x)
            xq = torch.fake_quantize_per_tensor_affine(
                x, x.abs().max() / 127.5, torch.zeros((), dtype=torch.int32), -128, 127
            )
            expected = F.linear(xq, fq_channel(layer.weight, layer._weight_quantizer), layer.bias)
        assert torch.equal(out, expected)
        assert torch.equal(layer._input_quantizer.scale, x.abs().max() / 127.5)


def test_block_format_activations_need_no_data() -> None:
    model = mlp(d_in=32)
    ModelQuantizer(config(QuantizationConfig(input_tensors=mx_spec(), weight=mx_spec()))).quantize_model(model)
    assert isinstance(model.fc1._input_quantizer, NonScaledFakeQuantize)
    x = randn(3, 32, seed=5)
    with torch.no_grad():
        expected = F.linear(
            fake_quantize(x, "mx", mx_element_dtype="fp4", qscheme="per_group", axis=-1, group_size=32),
            fake_quantize(model.fc1.weight, "mx", mx_element_dtype="fp4", qscheme="per_group", axis=-1, group_size=32),
            model.fc1.bias,
        )
        assert torch.equal(model.fc1(x), expected)


def float_snapshot(model: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    return dict(model.named_modules()), list(model.state_dict())


@pytest.mark.parametrize(
    "data, match",
    [(None, "calibration data"), ([], "empty"), (DataLoader(TensorDataset(torch.empty(0, 8)), batch_size=4), "empty")],
    ids=["none", "empty-list", "empty-dataloader"],
)
def test_static_activations_without_data_raise_before_the_model_changes(data: Any, match: str) -> None:
    model = mlp(cls=WatchedMLP)
    modules, keys = float_snapshot(model)
    model.watch = True
    with pytest.raises(ValueError, match=match):
        ModelQuantizer(config()).quantize_model(model, data)
    assert model.swaps == []  # raised before the first swap, not undone afterwards
    model.watch = False
    assert_float_model(model, modules)
    assert list(model.state_dict()) == keys
    assert type(model.fc1) is nn.Linear


def test_calibrate_without_data_raises_before_touching_the_quantizers() -> None:
    model = mlp()
    quantizer = ModelQuantizer(config())
    quantizer.prepare(model)
    with pytest.raises(ValueError, match="calibration data"):
        quantizer.calibrate(model)
    assert not bool(model.fc1._weight_quantizer.initialized)  # not even the weights were observed
    assert bool(model.fc1._weight_quantizer.observer_enabled)


def test_an_empty_iterator_raises_and_restores_the_float_model() -> None:
    model = mlp()
    modules, _ = float_snapshot(model)
    with pytest.raises(ValueError, match="no batch"):
        ModelQuantizer(config()).quantize_model(model, iter([]))
    assert_float_model(model, modules)


def failing_batches() -> Iterator[torch.Tensor]:
    yield X1
    raise RuntimeError("the loader broke")


@pytest.mark.parametrize(
    "data, error",
    [(failing_batches, "the loader broke"), (lambda: [X1, torch.randn(4, 5)], "shape")],
    ids=["loader-raises", "bad-batch"],
)
def test_a_failure_during_calibration_leaves_the_original_float_modules(data: Any, error: str) -> None:
    model = mlp()
    model.train()
    x = randn(3, 8, seed=6)
    float_out = model(x).detach()
    modules, keys = float_snapshot(model)
    with pytest.raises(RuntimeError, match=error):
        ModelQuantizer(config()).quantize_model(model, data())
    assert_float_model(model, modules)
    assert type(model.fc1) is nn.Linear and "_input_quantizer" not in model.fc1._modules
    assert list(model.state_dict()) == keys
    assert model.training and model.fc1.training
    assert torch.equal(model(x), float_out)


@pytest.mark.parametrize("use_loop", [False, True], ids=["dataloader", "forward_loop"])
def test_calibration_runs_in_eval_mode_without_grad_and_restores_the_mode(use_loop: bool) -> None:
    model = mlp(cls=RecordingMLP)
    model.train()
    model.fc2.eval()  # a frozen submodule inside a training model keeps its own mode
    kwargs: dict[str, Any] = {"forward_loop": lambda m: [m(X1), m(X2)]} if use_loop else {"dataloader": [X1, X2]}
    ModelQuantizer(config()).quantize_model(model, **kwargs)
    assert model.rec.calls == [(False, False), (False, False)]
    assert model.training and model.fc1.training and model.rec.training
    assert not model.fc2.training
    assert torch.is_grad_enabled()

    model.eval()
    model.rec.calls.clear()
    ModelQuantizer(config()).calibrate(model, [X1])
    assert model.rec.calls == [(False, False)]
    assert not any(m.training for m in model.modules())


# ----------------------------------------------------------------------------------------------- state
ROUND_TRIP_CONFIGS = {
    "int8-per-channel-weights": QuantizationConfig(input_tensors=int_spec(), weight=per_channel(0)),
    "uint8-asymmetric": QuantizationConfig(
        input_tensors=int_spec(dtype="uint8", symmetric=False),
        output_tensors=int_spec(dtype="uint8", symmetric=False),
        weight=per_channel(0, dtype="uint8", symmetric=False),
    ),
    "int4-per-group": QuantizationConfig(input_tensors=int_spec(), weight=per_group(4)),
    "fp8": QuantizationConfig(input_tensors=fp8_spec(), output_tensors=fp8_spec(), weight=fp8_spec()),
    "mx-fp4": QuantizationConfig(input_tensors=int_spec(), weight=mx_spec(group_size=8)),
}


@pytest.mark.parametrize("qc", list(ROUND_TRIP_CONFIGS.values()), ids=list(ROUND_TRIP_CONFIGS))
def test_state_dict_round_trip_is_bit_exact(qc: QuantizationConfig) -> None:
    model = mlp(seed=0)
    ModelQuantizer(config(qc)).quantize_model(model, [X1, X2])
    state = model.state_dict()
    for name, q in scaled_quantizers(model).items():
        assert f"{name}.scale" in state and f"{name}.zero_point" in state, name
        assert bool(q.initialized)
        assert torch.equal(state[f"{name}.scale"], q.scale)

    fresh = mlp(seed=1)  # other weights, never calibrated
    ModelQuantizer(config(qc)).prepare(fresh)
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    x = randn(6, 8, seed=7, scale=3.0)  # wider than the calibration data: a running observer would move
    expected = model(x)
    assert torch.equal(fresh(x), expected)
    assert torch.equal(fresh(x), expected)
    assert_same_qparams(qparams(fresh), qparams(model))
    if qc.weight.dtype.name == "uint8":
        assert torch.any(model.fc1._weight_quantizer.zero_point != 128)  # asymmetric zero points travelled


def quantized_mlp() -> tuple[MLP, torch.Tensor, torch.Tensor]:
    model = mlp()
    ModelQuantizer(config(STATIC_IO)).quantize_model(model, [X1, X2])
    x = randn(5, 8, seed=8)
    return model, x, model(x).detach()


def test_deepcopy_gives_an_independent_equal_model() -> None:
    model, x, out = quantized_mlp()
    clone = copy.deepcopy(model)
    assert torch.equal(clone(x), out)
    assert type(clone.fc1) is QuantLinear and clone.quant_config == model.quant_config
    assert clone.fc1.weight is not model.fc1.weight
    assert clone.fc1._input_quantizer is not model.fc1._input_quantizer
    with torch.no_grad():
        clone.fc1._input_quantizer.scale.mul_(4)
        clone.fc1.weight.add_(1)
    assert not torch.equal(clone(x), out)
    assert torch.equal(model(x), out)


def test_torch_save_and_pickle_of_the_whole_module() -> None:
    model, x, out = quantized_mlp()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.fc1) is QuantLinear and isinstance(loaded.fc1._input_quantizer, ScaledFakeQuantize)
    assert torch.equal(loaded(x), out)
    assert isinstance(loaded.quant_config, Config) and loaded.quant_config == model.quant_config

    unpickled = pickle.loads(pickle.dumps(ModelQuantizer.freeze(copy.deepcopy(model))))
    assert isinstance(unpickled.fc1._input_quantizer, FrozenScaledFakeQuantize)
    assert torch.equal(unpickled(x), out)


def test_to_another_dtype_runs() -> None:
    model, x, out = quantized_mlp()
    model.to(torch.float64)
    assert model.fc1.weight.dtype == torch.float64
    assert model.fc1._input_quantizer.scale.dtype == torch.float64
    out64 = model(x.double())
    assert out64.dtype == torch.float64
    assert torch.allclose(out64, out.double(), atol=1e-4)
    model.to(torch.float32)  # float32 -> float64 -> float32 is exact
    assert torch.equal(model(x), out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda_runs() -> None:
    model, x, out = quantized_mlp()
    model.to("cuda")
    assert model.fc1._input_quantizer.scale.is_cuda and model.fc1._weight_quantizer.scale.is_cuda
    assert torch.allclose(model(x.cuda()).cpu(), out, atol=1e-5)
    ModelQuantizer.freeze(model)
    assert torch.allclose(model(x.cuda()).cpu(), out, atol=1e-5)


def test_model_carries_its_config() -> None:
    cfg = config()
    model = mlp()
    ModelQuantizer(cfg).quantize_model(model, [X1])
    assert model.quant_config is cfg

    from_dict = mlp()
    ModelQuantizer(cfg.to_dict()).quantize_model(from_dict, [X1])
    assert isinstance(from_dict.quant_config, Config) and from_dict.quant_config == cfg
    assert_same_qparams(qparams(from_dict), qparams(model))


# ----------------------------------------------------------------------------------------------- errors
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


def test_group_size_that_does_not_divide_names_the_layer_and_shape() -> None:
    model = Encoder()
    modules = dict(model.named_modules())
    with pytest.raises(ValueError) as err:
        ModelQuantizer(config(QuantizationConfig(weight=per_group(32)))).quantize_model(model)
    message = str(err.value)
    assert "'enc.2'" in message and "Linear" in message and "(8, 48)" in message and "group_size=32" in message
    assert "enc.0" not in message  # 64 is a multiple of 32
    assert_float_model(model, modules)

    ModelQuantizer(config(QuantizationConfig(weight=per_group(32)), exclude=["enc.2"])).quantize_model(model)
    assert isinstance(model.enc[0], QuantLinear) and type(model.enc[2]) is nn.Linear
    other = Encoder()
    cfg = config(
        QuantizationConfig(weight=per_group(32)), layer_quant_config={"enc.2": QuantizationConfig(weight=per_group(16))}
    )
    ModelQuantizer(cfg).quantize_model(other)
    assert other.enc[2]._weight_quantizer.spec.group_size == 16


@pytest.mark.parametrize(
    "spec",
    [mx_spec("fp4", 32), QuantizationSpec(dtype="mx6", group_size=16), QuantizationSpec(dtype="bfp16")],
    ids=["mx-fp4-32", "mx6-16", "bfp16-8"],
)
def test_block_formats_pad_a_ragged_last_block(spec: QuantizationSpec) -> None:
    d_in = 40 if spec.group_size == 32 else spec.group_size + spec.group_size // 2  # never a multiple
    assert d_in % spec.group_size
    model = mlp(d_in=d_in)
    ModelQuantizer(config(QuantizationConfig(input_tensors=spec, weight=spec))).quantize_model(model)
    x = randn(3, d_in, seed=9)
    pad = (-d_in) % spec.group_size

    def by_padding(t: torch.Tensor) -> torch.Tensor:  # zero-pad to whole blocks, quantize, crop
        padded = F.pad(t, (0, pad))
        return fake_quantize(
            padded,
            spec.dtype,
            qscheme="per_group",
            axis=-1,
            group_size=spec.group_size,
            mx_element_dtype=spec.mx_element_dtype,
        )[..., :d_in]

    with torch.no_grad():
        out = model.fc1(x)
        expected = F.linear(by_padding(x), by_padding(model.fc1.weight), model.fc1.bias)
    assert out.shape == (3, 16) and torch.isfinite(out).all()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("ch_axis", [2, -3])
def test_ch_axis_out_of_range_names_the_layer(ch_axis: int) -> None:
    model = mlp()
    modules = dict(model.named_modules())
    with pytest.raises(ValueError) as err:
        ModelQuantizer(config(QuantizationConfig(weight=per_channel(ch_axis)))).quantize_model(model)
    message = str(err.value)
    assert "'fc1'" in message and f"ch_axis={ch_axis}" in message and "(16, 8)" in message
    assert_float_model(model, modules)

    conv = nn.Sequential(nn.Conv2d(2, 3, 3))  # four dimensions: the same axis is valid here
    ModelQuantizer(config(QuantizationConfig(weight=per_channel(ch_axis)))).quantize_model(conv)
    assert conv[0]._weight_quantizer.scale.shape == (conv[0].weight.shape[ch_axis],)


@pytest.mark.parametrize("key", ["Dense", nn.LayerNorm], ids=["Dense", "LayerNorm"])
def test_unsupported_layer_type_is_rejected_with_the_supported_list(key: Any) -> None:
    cfg = config(layer_type_quant_config={key: WEIGHT_ONLY})
    with pytest.raises(ValueError) as err:
        ModelQuantizer(cfg)
    message = str(err.value)
    name = key if isinstance(key, str) else key.__name__
    assert f"'{name}'" in message
    supported = "Linear Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d Embedding EmbeddingBag".split()
    for layer_type in supported:
        assert f"'{layer_type}'" in message


# ----------------------------------------------------------------------------------------------- freeze
def test_freeze_fixes_quantizers_and_removes_observers() -> None:
    model, x, out = quantized_mlp()
    for q in scaled_quantizers(model).values():
        q.enable_observer()  # as after QAT with observers on: freezing must still stop them
    before = qparams(model)
    assert ModelQuantizer.freeze(model) is model
    quantizers = [q for m in model.modules() if isinstance(m, QuantMixin) for _, q in m.quantizers()]
    assert len(quantizers) == 6 and all(type(q) is FrozenScaledFakeQuantize for q in quantizers)
    assert not any(isinstance(m, ObserverBase) for m in model.modules())
    assert torch.equal(model(x), out)

    for q in quantizers:
        q.enable_observer()
    model(randn(16, 8, seed=10, scale=1000.0))  # very different data
    assert_same_qparams(qparams(model), before)
    assert torch.equal(model(x), out)


def test_freeze_keeps_dynamic_quantizers_dynamic() -> None:
    model = mlp()
    ModelQuantizer(
        config(QuantizationConfig(input_tensors=int_spec(is_dynamic=True), weight=per_channel(0)))
    ).quantize_model(model)
    x = randn(5, 8, seed=3)
    out = model(x)
    ModelQuantizer.freeze(model)
    assert type(model.fc1._input_quantizer) is ScaledFakeQuantize and model.fc1._input_quantizer.is_dynamic
    assert type(model.fc1._weight_quantizer) is FrozenScaledFakeQuantize
    assert torch.equal(model(x), out)
    big = randn(5, 8, seed=4, scale=10.0)
    model(big)
    assert torch.equal(model.fc1._input_quantizer.scale, big.abs().max() / 127.5)


def test_freeze_turns_off_block_format_observers() -> None:
    model = mlp(d_in=32)
    ModelQuantizer(config(QuantizationConfig(input_tensors=mx_spec()))).prepare(model)  # nothing to calibrate
    ModelQuantizer.freeze(model)
    q = model.fc1._input_quantizer
    assert not bool(q.observer_enabled)
    amax = q.observer.amax.clone()
    model(randn(3, 32, seed=5))
    assert torch.equal(q.observer.amax, amax)


def test_freezing_an_uncalibrated_model_raises_and_changes_nothing() -> None:
    model = mlp()
    ModelQuantizer(config()).prepare(model)
    modules = dict(model.named_modules())
    with pytest.raises(ValueError, match="'fc1'.*calibrate"):
        ModelQuantizer.freeze(model)
    assert dict(model.named_modules()) == modules
    assert all(type(q) is ScaledFakeQuantize for q in scaled_quantizers(model).values())


def test_freeze_after_observing_by_hand_uses_the_observed_ranges() -> None:
    model = mlp()
    ModelQuantizer(config()).prepare(model)
    for q in scaled_quantizers(model).values():
        q.enable_observer()
        q.disable_fake_quant()
    with torch.no_grad():
        model(X1)
        model(X2)
    for q in scaled_quantizers(model).values():
        q.enable_fake_quant()
    ModelQuantizer.freeze(model)
    q = model.fc1._input_quantizer
    assert type(q) is FrozenScaledFakeQuantize
    assert torch.equal(q.scale, torch.maximum(X1.abs().max(), X2.abs().max()) / 127.5)
    assert torch.equal(model.fc1._weight_quantizer.scale, model.fc1.weight.detach().abs().amax(dim=1) / 127.5)


def test_freeze_bake_weights_writes_quantized_values_into_the_weights() -> None:
    model = mlp()
    qc = QuantizationConfig(input_tensors=int_spec(), weight=per_channel(0), bias=int_spec(dtype="int16"))
    ModelQuantizer(config(qc)).quantize_model(model, [X1, X2])
    x = randn(5, 8, seed=8)
    out = model(x).detach()
    weights = {n: (m.weight, m.bias) for n, m in model.named_modules() if isinstance(m, QuantMixin)}
    with torch.no_grad():
        expected = {
            n: (m._weight_quantizer(m.weight).clone(), m._bias_quantizer(m.bias).clone(), m._weight_quantizer)
            for n, m in model.named_modules()
            if isinstance(m, QuantMixin)
        }

    ModelQuantizer.freeze(model, bake_weights=True)
    assert torch.equal(model(x), out)
    for name, m in model.named_modules():
        if not isinstance(m, QuantMixin):
            continue
        w_expected, b_expected, wq = expected[name]
        assert type(m._weight_quantizer) is BakedFakeQuantize and type(m._bias_quantizer) is BakedFakeQuantize
        assert torch.equal(m._weight_quantizer.scale, wq.scale)  # kept for the exports
        assert type(m._input_quantizer) is FrozenScaledFakeQuantize
        assert m.weight is weights[name][0] and m.bias is weights[name][1]  # in place
        assert torch.equal(m.weight, w_expected) and torch.equal(m.bias, b_expected)
        assert torch.equal(fq_channel(m.weight.detach(), wq), m.weight)  # already on the int8 grid


def test_frozen_model_runs_under_torch_compile() -> None:
    torch._dynamo.reset()
    model, x, out = quantized_mlp()
    ModelQuantizer.freeze(model)
    frozen_out = model(x).detach()
    assert torch.equal(frozen_out, out)
    compiled = torch.compile(model)
    with torch.no_grad():
        assert torch.allclose(compiled(x), frozen_out, atol=1e-6)


# ----------------------------------------------------------------------------------------------- regressions
class LinearWithOwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class CustomMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.fc2 = LinearWithOwnForward(16, 4)


def test_a_subclass_with_its_own_forward_stays_float_with_a_warning() -> None:
    model = mlp(cls=CustomMLP)
    with pytest.warns(UserWarning, match=r"own forward stay float: \['fc2'\]"):
        ModelQuantizer(config(WEIGHT_ONLY)).quantize_model(model)
    assert type(model.fc2) is LinearWithOwnForward  # its doubling forward survives
    assert isinstance(model.fc1, QuantMixin)
    ones = torch.ones(1, 16)
    assert torch.equal(model.fc2(ones), 2 * F.linear(ones, model.fc2.weight, model.fc2.bias))


def test_quantize_model_warns_once_about_unmatched_names() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelQuantizer(config(WEIGHT_ONLY, exclude=["nope"])).quantize_model(mlp())
    assert sum("nope" in str(w.message) for w in caught) == 1


def test_recalibration_takes_the_current_weights_not_the_old_range() -> None:
    model = mlp()
    quantizer = ModelQuantizer(config(WEIGHT_ONLY))
    quantizer.quantize_model(model)
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)  # e.g. after more training
    quantizer.calibrate(model)
    scale, _ = model.fc1._weight_quantizer.calculate_qparams()
    expected = model.fc1.weight.detach().abs().amax(dim=1) / 127.5
    assert torch.equal(scale, expected)
