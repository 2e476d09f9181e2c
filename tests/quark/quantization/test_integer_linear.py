"""A fake-quantized Linear's forward on integer codes (``quark.torch.quantization.integer_linear``): where the input and
weight quantizers give symmetric integers of at most 8 bits, ``QuantLinear`` computes ``sx * sw * (qx @ qW^T) + b``
with ``torch._int_mm``. Checked against an exact reference (int64 products, float64 scaling), against ``F.linear`` of
the same fake-quantized tensors (forward, gradients, a few training steps), on NaN inputs and weights, and on every
case that must keep the float GEMM (bit for bit ``F.linear``)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization import integer_linear as il
from quark.torch.quantization.nn.modules.quant_modules import QuantLinear
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.recipes import INT4_G32_WEIGHT, INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
UINT8_ASYM = {**INT8_PER_TENSOR_ACT, "dtype": "uint8", "symmetric": False}
INT8_ASYM = {**INT8_PER_TENSOR_ACT, "symmetric": False}
_POF2 = {"observer_cls": "PerTensorMinMaxObserver", "symmetric": True, "scale_type": "pof2", "is_dynamic": False}
_TQT = {**_POF2, "round_method": "half_even", "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"}}
#: the learned quantizers: the w4a8_tqt preset (int4 weights, int8 inputs, power-of-two thresholds) and LSQ
LEARNED = {
    "tqt": {
        "weight": {**_TQT, "dtype": "int4", "qscheme": "per_tensor"},
        "input_tensors": {**_TQT, "dtype": "int8", "qscheme": "per_tensor"},
    },
    "tqt per channel": {
        "weight": {
            **_TQT,
            "dtype": "int8",
            "qscheme": "per_channel",
            "ch_axis": 0,
            "observer_cls": "PerChannelMinMaxObserver",
        },
        "input_tensors": {**_TQT, "dtype": "int8", "qscheme": "per_tensor"},
    },
    "lsq": {
        "weight": {**INT8_PER_CHANNEL_WEIGHT, "qat_spec": {"method": "lsq"}},
        "input_tensors": {**INT8_PER_TENSOR_ACT, "qat_spec": {"method": "lsq"}},
    },
}
IN, OUT = 1024, 1024  # a weight of INTEGER_GEMM_MIN_WEIGHT_NUMEL elements: the smallest that takes the integer GEMM


class _Spy:
    """Counts ``torch._int_mm`` calls (the integer GEMM taken) and forwards them."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = torch._int_mm
        self.__name__ = self.__qualname__ = "_int_mm"  # inductor, imported with the spy in place, names its kernel

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.real(a, b)


@pytest.fixture
def int_mm(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Spy]:
    """The spy in place of ``torch._int_mm``, the integer GEMM on; the switch as it was afterwards."""
    spy = _Spy()
    monkeypatch.setattr(torch, "_int_mm", spy)
    enabled = il.integer_gemm_enabled()
    il.set_integer_gemm(True)
    yield spy
    il.set_integer_gemm(enabled)


def _model(config: dict, seed: int = 0, features: tuple[int, int] = (IN, OUT)) -> nn.Module:
    """A two-Linear model quantized with ``config``, calibrated on one batch (on the float GEMM: no ``_int_mm`` call
    counted), observers then off."""
    enabled = il.integer_gemm_enabled()
    il.set_integer_gemm(False)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(*features), nn.GELU(), nn.Linear(features[1], 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ModelQuantizer(config).prepare(model)
    with torch.no_grad():
        model(torch.randn(32, features[0]))
    for q in model.modules():
        if isinstance(q, FakeQuantizeBase):
            q.enable_observer(False)
    il.set_integer_gemm(enabled)
    return model


def _float_gemm(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """What ``QuantLinear`` computed before: ``F.linear`` of the fake-quantized input and weight."""
    weight, bias = layer.quantized_weight_and_bias()
    return F.linear(x if layer._input_quantizer is None else layer._input_quantizer(x), weight, bias)


def test_codes_read_back_exactly_for_every_code_and_scale() -> None:
    """The design's premise: ``round(fl(q * s) * fl(1 / s)) == q`` for every code ``q - zp`` in [-256, 256] (int8's and
    uint8's around any zero point in range) and scales over the range wider than the accepted one (2^-126 .. 2^100
    against 2^-63 .. 2^63), its ends included: float32 arithmetic, as the kernels do it."""
    gen = torch.Generator().manual_seed(0)
    exps = torch.empty(20000).uniform_(-126, 100, generator=gen)
    scales = torch.cat(
        [torch.exp2(exps) * torch.empty(20000).uniform_(1, 2, generator=gen), torch.tensor([2.0**-126, 2.0**100])]
    )
    scales = scales.clamp(2.0**-126, 2.0**100).float()
    codes = torch.arange(-256, 257, dtype=torch.float32)
    values = codes[None, :] * scales[:, None]  # (q - 0) * s, rounded to float32 as a fake quantizer writes it
    back = torch.round(values * torch.reciprocal(scales)[:, None])
    assert torch.equal(back, codes.expand_as(back))


def _assert_exact_product(layer: QuantLinear, x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` is the exact ``sx * sw * sum((qx - zx) * qW) + b`` (codes read back in float64, int64 products, float64
    scaling) to float32 rounding: within 3 ulp of the product's and the bias's magnitudes, and no further from it
    than the float GEMM of the dequantized values."""
    iq, wq = layer._input_quantizer, layer._weight_quantizer
    with torch.no_grad():
        sx = iq.scale.detach().double().reshape(())
        sw = wq.scale.detach().double().reshape(1, -1)
        vx = iq(x).double() / sx  # q - zp, up to float32's rounding of the fake-quantized value
        vw = wq(layer.weight).double() / sw.reshape(-1, 1)
        nx, nw = vx.round(), vw.round()
        assert float((vx - nx).abs().max()) < 1e-3 and float((vw - nw).abs().max()) < 1e-3  # on the grid
        assert int(nx.abs().max()) <= 255 and int(nw.abs().max()) <= 128
        product = (nx.long() @ nw.long().t()).double() * sx * sw
        exact = product + layer.bias.double()
        tolerance = 3 * torch.finfo(torch.float32).eps * (product.abs() + layer.bias.double().abs())
        assert bool(((out.detach().double() - exact).abs() <= tolerance).all())
        float_error = (_float_gemm(layer, x).double() - exact).abs()
        assert float((out.detach().double() - exact).abs().max()) <= float(float_error.max())


def test_forward_is_the_exact_integer_product(int_mm: _Spy) -> None:
    """The output is the exact integer product, scaled (``_assert_exact_product``)."""
    model = _model(W8A8)
    layer = model[0]
    x = torch.randn(64, IN) * 3
    out = layer(x)
    assert int_mm.calls == 1
    _assert_exact_product(layer, x, out)


@pytest.mark.parametrize(
    "inputs,zero_points",
    [(UINT8_ASYM, (None, 0, 255, 37)), (INT8_ASYM, (None, -128, 127, 37))],
    ids=["uint8", "int8 asymmetric"],
)
def test_asymmetric_inputs_take_the_integer_gemm_exactly(
    int_mm: _Spy, inputs: dict, zero_points: tuple[int | None, ...]
) -> None:
    """Inputs around a nonzero zero point, unsigned or signed (calibrated, then set at the ends of the format's range:
    the largest shifts either way, and between): codes ``q - zp`` read as ``q - offset`` in int8, the product
    corrected by ``shift * sum(qW)``. The output is the exact product, and gradients are the float GEMM's."""
    layer = _model({"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": inputs}})[0]
    iq = layer._input_quantizer
    for calls, zp in enumerate(zero_points, start=1):
        if zp is not None:
            iq.set_qparams(torch.tensor(0.04), torch.tensor(zp, dtype=torch.int32))
        x = (torch.randn(24, IN) * 4).requires_grad_()  # past both ends of the range: every code, clamped ones too
        out = layer(x)
        assert int_mm.calls == calls
        _assert_exact_product(layer, x, out)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (x, layer.weight, layer.bias), g)
        il.set_integer_gemm(False)
        ref_grads = torch.autograd.grad(_float_gemm(layer, x), (x, layer.weight, layer.bias), g)
        il.set_integer_gemm(True)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int(iq.zero_point) == zero_points[-1]


def test_shifted_inputs_keep_the_float_gemm_past_the_exact_bound(int_mm: _Spy) -> None:
    """With shifted codes (uint8 inputs) the int32 sum is exact for fewer than 2^16 input features: a 65536-wide
    layer keeps the float GEMM there, and takes the integer one with symmetric int8 inputs (bound 2^17)."""
    wide = (1 << 16, 16)
    x = torch.randn(4, wide[0])
    uint8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": UINT8_ASYM}}
    _assert_float_gemm(_model(uint8, features=wide), x, int_mm)
    with torch.no_grad():
        _model(W8A8, features=wide)[0](x)
    assert int_mm.calls == 1


@pytest.mark.parametrize("method", list(LEARNED))
def test_learned_quantizers_take_the_integer_gemm(int_mm: _Spy, method: str) -> None:
    """TQT (power-of-two scales from the learned thresholds; the w4a8_tqt preset's int4 weights, and int8 per
    channel) and LSQ: the exact product forward, every gradient (input, weight, bias and the learned thresholds /
    scales, which come through the quantizers' own backward) the float GEMM's, and ten QAT steps following it."""
    config = {"global_quant_config": LEARNED[method]}
    layer = _model(config)[0]
    iq, wq = layer._input_quantizer, layer._weight_quantizer
    assert type(iq).__name__ == type(wq).__name__ == ("LSQFakeQuantize" if method == "lsq" else "TQTFakeQuantize")
    learned = [iq.learned_parameter, wq.learned_parameter]
    x = torch.randn(32, IN, requires_grad=True)
    out = layer(x)
    assert int_mm.calls == 1
    _assert_exact_product(layer, x, out)
    g = torch.randn_like(out)
    wrt = (x, layer.weight, layer.bias, *learned)
    grads = torch.autograd.grad(out, wrt, g)
    il.set_integer_gemm(False)
    ref_grads = torch.autograd.grad(_float_gemm(layer, x), wrt, g)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    losses = {}
    for integer in (True, False):
        il.set_integer_gemm(integer)
        model = _model(config, seed=1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)  # LSQ's weight steps are ~1e-3
        gen = torch.Generator().manual_seed(2)
        batch, y = torch.randn(32, IN, generator=gen), torch.randint(0, 16, (32,), generator=gen)
        losses[integer] = []
        for _ in range(10):
            loss = F.cross_entropy(model(batch), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[integer].append(loss.item())
    assert int_mm.calls == 11
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)  # a flipped code at the next quantizer carries on
    assert losses[True][-1] < losses[True][0]


@pytest.mark.parametrize("shape", [(32, IN), (4, 7, IN), (1, IN)])
def test_forward_and_gradients_match_the_float_gemm(int_mm: _Spy, shape: tuple[int, ...]) -> None:
    """Forward and every gradient (input, weight, bias) agree with ``F.linear`` of the same fake-quantized tensors to
    float32 rounding, for 2-D, 3-D and single-row inputs; gradients of a second order too (create_graph)."""
    model = _model(W8A8)
    layer = model[0]
    x = torch.randn(*shape, requires_grad=True)
    out = layer(x)
    assert int_mm.calls == 1 and out.shape == (*shape[:-1], OUT)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, layer.weight, layer.bias), g, create_graph=True)
    il.set_integer_gemm(False)
    ref = _float_gemm(layer, x)
    ref_grads = torch.autograd.grad(ref, (x, layer.weight, layer.bias), g, create_graph=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    second = torch.autograd.grad(grads[0].square().sum(), layer.weight)[0]
    ref_second = torch.autograd.grad(ref_grads[0].square().sum(), layer.weight)[0]
    torch.testing.assert_close(second, ref_second, rtol=1e-4, atol=1e-5)


def test_training_steps_follow_the_float_gemm(int_mm: _Spy) -> None:
    """QAT with observers on then off, Adam, ten steps each way: the integer GEMM's losses follow the float GEMM's."""
    losses = {}
    for integer in (True, False):
        il.set_integer_gemm(integer)
        model = _model(W8A8, seed=1)
        for q in model.modules():
            if isinstance(q, FakeQuantizeBase):
                q.enable_observer(True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(2)
        x, y = torch.randn(32, IN, generator=gen), torch.randint(0, 16, (32,), generator=gen)
        losses[integer] = []
        for step in range(10):  # one batch, learned by heart: the loss must fall
            if step == 5:
                for q in model.modules():
                    if isinstance(q, FakeQuantizeBase):
                        q.enable_observer(False)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[integer].append(float(loss))
    assert int_mm.calls >= 10
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    assert losses[True][-1] < losses[True][0]  # it trains


def test_int4_weights_with_int8_inputs(int_mm: _Spy) -> None:
    """int4 per-channel weights: their codes sit in int8 too, and the product is the float GEMM's."""
    config = {
        "global_quant_config": {
            "weight": {**INT8_PER_CHANNEL_WEIGHT, "dtype": "int4"},
            "input_tensors": INT8_PER_TENSOR_ACT,
        }
    }
    model = _model(config)
    x = torch.randn(16, IN)
    out = model[0](x)
    assert int_mm.calls == 1
    il.set_integer_gemm(False)
    torch.testing.assert_close(out, _float_gemm(model[0], x), rtol=1e-5, atol=1e-5)


def test_nan_reaches_the_outputs_the_float_gemm_reaches(int_mm: _Spy) -> None:
    """A NaN in the fake-quantized input makes its output row NaN, one in the fake-quantized weight its output column,
    as in ``F.linear``: an int8 code cannot hold a NaN, so the kernel carries it beside the codes."""
    layer = _model(W8A8)[0]
    iq, wq = layer._input_quantizer, layer._weight_quantizer
    with torch.no_grad():
        x = iq(torch.randn(8, IN))
        w = wq(layer.weight).clone()
        x[3, 100] = float("nan")
        w[5, 7] = float("nan")
        out = il.integer_linear(x, w, layer.bias, iq, wq)
    assert int_mm.calls == 1
    assert torch.equal(out.isnan(), F.linear(x, w, layer.bias).isnan())
    assert bool(out[3].isnan().all()) and bool(out[:, 5].isnan().all()) and int(out.isnan().sum()) == OUT + 8 - 1


def _assert_float_gemm(model: nn.Module, x: torch.Tensor, spy: _Spy) -> None:
    """The first layer kept the float GEMM: no ``_int_mm``, and bit for bit ``F.linear`` of the quantized tensors."""
    with torch.no_grad():
        out = model[0](x)
        assert spy.calls == 0
        torch.testing.assert_close(out, _float_gemm(model[0], x), rtol=0, atol=0, equal_nan=True)  # bit for bit


@pytest.mark.parametrize(
    "weight,inputs",
    [
        (
            {
                **INT8_PER_CHANNEL_WEIGHT,
                "dtype": "fp8_e4m3",
                "qscheme": "per_tensor",
                "observer_cls": "PerTensorMinMaxObserver",
            },
            INT8_PER_TENSOR_ACT,
        ),
        (INT4_G32_WEIGHT, INT8_PER_TENSOR_ACT),
        ({**INT8_PER_CHANNEL_WEIGHT, "dtype": "uint8", "symmetric": False}, INT8_PER_TENSOR_ACT),
        (INT8_PER_CHANNEL_WEIGHT, {**INT8_PER_TENSOR_ACT, "dtype": "uint16", "symmetric": False}),
        (INT8_PER_CHANNEL_WEIGHT, None),
    ],
    ids=["fp8 weight", "int4 per-group weight", "asymmetric uint8 weight", "uint16 input", "weight only"],
)
def test_formats_the_integer_gemm_cannot_serve_keep_the_float_one(
    int_mm: _Spy, weight: dict, inputs: dict | None
) -> None:
    config = {"global_quant_config": {"weight": weight, **({"input_tensors": inputs} if inputs else {})}}
    _assert_float_gemm(_model(config), torch.randn(8, IN), int_mm)


def test_small_weights_switch_off_and_fake_quant_off_keep_the_float_gemm(int_mm: _Spy) -> None:
    x = torch.randn(8, IN)
    _assert_float_gemm(_model(W8A8, features=(IN, OUT // 2)), x, int_mm)  # below INTEGER_GEMM_MIN_WEIGHT_NUMEL
    model = _model(W8A8)
    il.set_integer_gemm(False)
    _assert_float_gemm(model, x, int_mm)
    il.set_integer_gemm(True)
    model[0]._input_quantizer.enable_fake_quant(False)
    _assert_float_gemm(model, x, int_mm)


def test_qparams_outside_the_exact_range_keep_the_float_gemm(int_mm: _Spy) -> None:
    """A subnormal scale (set by hand) would not give its codes back: the float GEMM runs. So do an input zero point
    outside int8's range or not integral, and a nonzero weight zero point."""
    model = _model(W8A8)
    x = torch.randn(8, IN)
    q = model[0]._input_quantizer
    q.set_qparams(torch.tensor(1e-39), torch.tensor(0, dtype=torch.int32))
    _assert_float_gemm(model, x * 1e-37, int_mm)
    q.set_qparams(torch.tensor(0.05), torch.tensor(200, dtype=torch.int32))  # codes q - zp down to -328
    _assert_float_gemm(model, x, int_mm)
    for zp in (2.5, math.nan, math.inf):  # a float zero point: q - zp not an integer, or no number at all
        q.set_qparams(torch.tensor(0.05), torch.tensor(zp))
        _assert_float_gemm(model, x, int_mm)
    q.set_qparams(torch.tensor(0.05), torch.tensor(0, dtype=torch.int32))
    wq = model[0]._weight_quantizer
    scale = wq.scale.clone()
    wq.set_qparams(scale, torch.full((OUT,), 3, dtype=torch.int32))
    _assert_float_gemm(model, x, int_mm)
    wq.set_qparams(scale, torch.zeros(OUT, dtype=torch.int32))
    with torch.no_grad():
        model[0](x)
    assert int_mm.calls == 1  # the same quantizers with servable qparams take it


def test_traces_and_autocast_keep_the_float_gemm(int_mm: _Spy) -> None:
    """TorchScript tracing (ONNX export's) records ``F.linear``, and autocast runs it in its dtype: no ``_int_mm``."""
    model = _model(W8A8)
    x = torch.randn(4, IN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model[0], x, check_trace=False)
    assert "_int_mm" not in str(traced.graph)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0](x).dtype == torch.bfloat16
    assert int_mm.calls == 0


def test_quantized_model_copies_keep_working(int_mm: _Spy) -> None:
    """The per-quantizer memo of the checks is not shared wrongly by a deep copy: both take the integer GEMM and agree."""
    model = _model(W8A8)
    x = torch.randn(8, IN)
    with torch.no_grad():
        a = model[0](x)
        b = copy.deepcopy(model)[0](x)
    assert int_mm.calls == 2 and torch.equal(a, b)
    assert math.isfinite(float(a.sum()))


def test_gpt2_conv1d_layers_take_the_integer_gemm(int_mm: _Spy) -> None:
    """transformers' ``Conv1D`` (GPT-2's MLP, weight stored [in, out], per-channel along its axis 1) takes the integer
    GEMM too: each large enough projection once per forward, its output the float GEMM's to float32 rounding. (The
    logits can differ by a step where the next quantizer's rounding flips on such a difference.)"""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=512, n_layer=1, n_head=8)
    model = transformers.GPT2LMHeadModel(config).eval()
    qconfig = {**W8A8, "exclude": ["lm_head"]}
    ids = torch.randint(0, 64, (2, 16))
    enabled = il.integer_gemm_enabled()
    il.set_integer_gemm(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ModelQuantizer(qconfig).quantize_model(model, [{"input_ids": ids}])
    il.set_integer_gemm(enabled)
    big = [
        m
        for m in model.modules()
        if type(m).__name__ == "QuantConv1D" and m.weight.numel() >= il.INTEGER_GEMM_MIN_WEIGHT_NUMEL
    ]
    with torch.no_grad():
        model(ids)
        assert len(big) == 2 and int_mm.calls == 2  # c_fc [512, 2048] and the MLP's c_proj [2048, 512]
        for layer in big:
            hidden = torch.randn(2, 16, layer.weight.shape[0])  # Conv1D's weight is [in, out]
            il.set_integer_gemm(True)
            integer = layer(hidden)
            il.set_integer_gemm(False)
            torch.testing.assert_close(integer, layer(hidden), rtol=1e-5, atol=1e-5)
    assert int_mm.calls == 4


def test_output_can_be_modified_in_place(int_mm: _Spy) -> None:
    """``F.linear``'s output takes in-place ops under autograd (``nn.ReLU(inplace=True)`` after a Linear, as in VGG's
    and MobileNetV3's classifiers): the integer GEMM's must too (not a view made inside the Function)."""
    layer = _model(W8A8)[0]
    for shape in [(8, IN), (2, 3, IN), (IN,)]:
        x = torch.randn(*shape, requires_grad=True)
        out = layer(x)
        torch.relu_(out)
        out.sum().backward()
    assert int_mm.calls == 3


def test_inference_mode_dynamic_and_calibrated_there(int_mm: _Spy) -> None:
    """Under ``torch.inference_mode`` a dynamic input quantizer (and any observing one) holds inference tensors, which
    have no version counter; a calibration run there leaves them held afterwards (Lightning validates there)."""
    dynamic = {
        "global_quant_config": {
            "weight": INT8_PER_CHANNEL_WEIGHT,
            "input_tensors": {**INT8_PER_TENSOR_ACT, "is_dynamic": True},
        }
    }
    layer = _model(dynamic)[0]
    x = torch.randn(8, IN)
    with torch.inference_mode():
        out = layer(x)
    il.set_integer_gemm(False)
    torch.testing.assert_close(out, _float_gemm(layer, x), rtol=1e-5, atol=1e-5)
    il.set_integer_gemm(True)
    model = _model(W8A8)
    for q in model.modules():
        if isinstance(q, FakeQuantizeBase):
            q.enable_observer(True)
    with torch.inference_mode():
        model(x)
    for q in model.modules():
        if isinstance(q, FakeQuantizeBase):
            q.enable_observer(False)
    assert model[0]._input_quantizer.scale.is_inference()
    model(x.requires_grad_()).sum().backward()
    assert int_mm.calls == 3


def test_a_hook_on_a_quantizer_keeps_the_float_gemm(int_mm: _Spy) -> None:
    """A forward hook may replace a quantizer's output by values off its grid (rotation training's
    ``add_scale_gradient`` does for clipped outliers): the codes could not be read back from them."""
    from quark.torch.algorithm.rotation.scale_grad import add_scale_gradient

    layer = _model(W8A8)[0]
    layer._input_quantizer.register_forward_hook(add_scale_gradient)
    x = torch.randn(8, IN)
    x[0, 0] = 3e7
    _assert_float_gemm(nn.Sequential(layer), x.requires_grad_(), int_mm)


def test_scales_whose_product_overflows_keep_the_float_gemm(int_mm: _Spy) -> None:
    """Each scale in range, their product not a finite float32: an accumulator of 0 would give 0 * inf = NaN."""
    layer = _model(W8A8)[0]
    layer._input_quantizer.set_qparams(torch.tensor(2.0**70), torch.tensor(0, dtype=torch.int32))
    layer._weight_quantizer.set_qparams(torch.full((OUT,), 2.0**70), torch.zeros(OUT, dtype=torch.int32))
    _assert_float_gemm(nn.Sequential(layer), torch.zeros(2, IN), int_mm)


def test_make_fx_records_the_float_gemm(int_mm: _Spy) -> None:
    """A dispatch mode (make_fx, FlopCounterMode) sees the ops and traces values: the float GEMM, as in other traces."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layer = _model(W8A8)[0]
    graph = make_fx(layer)(torch.randn(4, IN))
    assert "_int_mm" not in str(graph.graph) and int_mm.calls == 0


def test_qparams_written_through_data_are_seen(int_mm: _Spy) -> None:
    """A weight zero point written through ``.data`` (no version bump) after an integer-GEMM call: the next call reads
    it and keeps the float GEMM (weights are served around a zero point of 0 only)."""
    layer = _model(W8A8)[0]
    x = torch.randn(8, IN)
    with torch.no_grad():
        layer(x)
    assert int_mm.calls == 1
    int_mm.calls = 0
    layer._weight_quantizer.zero_point.data.fill_(5)
    _assert_float_gemm(nn.Sequential(layer), x, int_mm)


def test_default_follows_the_cpus_int8_dot_product(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default only where ``/proc/cpuinfo`` reports VNNI or AMX (the threshold was measured with VNNI);
    ``QUARK_INTEGER_GEMM`` overrides it either way, and a bad value is refused naming the variable."""
    vnni, avx2 = tmp_path / "vnni", tmp_path / "avx2"
    vnni.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert il.cpu_has_int8_dot(str(vnni)) and not il.cpu_has_int8_dot(str(avx2))
    assert not il.cpu_has_int8_dot(str(tmp_path / "missing"))
    monkeypatch.setattr(il, "cpu_has_int8_dot", lambda: False)
    for setting, expected in (("", False), ("1", True), ("0", False)):
        monkeypatch.setenv("QUARK_INTEGER_GEMM", setting)
        assert il._enabled_from_env() is expected
    monkeypatch.setattr(il, "cpu_has_int8_dot", lambda: True)
    monkeypatch.setenv("QUARK_INTEGER_GEMM", "")
    assert il._enabled_from_env() is True
    monkeypatch.setenv("QUARK_INTEGER_GEMM", "yes")
    with pytest.raises(ValueError, match="QUARK_INTEGER_GEMM='yes'"):
        il._enabled_from_env()
    enabled = il.integer_gemm_enabled()
    il.set_integer_gemm(None)
    assert il.integer_gemm_enabled() is True  # the default, with the CPU patched to have VNNI
    il.set_integer_gemm(enabled)
