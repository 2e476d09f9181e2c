"""qscheme=per_block (2-D tiles of block_size = [rows, cols], DeepSeek-V3-style block-wise weights) and
ScaleType.float8_e8m0fnu (power-of-two scales rounded up), against independent references: PyTorch's own float8
casts and fake-quantize kernels applied tile by tile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.algorithm.gptq import check_gptq_spec
from quark.torch.export.safetensors import export_safetensors, import_model_from_safetensors
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.config.spec_helpers import Int8PerChannelSpec, MX6Spec
from quark.torch.quantization.config.type import QSchemeType, ScaleType
from quark.torch.quantization.formats import apply_scale_type
from quark.torch.quantization.observer.observer import OBSERVER_MAP, PerBlock2DMinMaxObserver
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, FrozenScaledFakeQuantize

FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
E8M0 = torch.float8_e8m0fnu


def block_spec(dtype: str = "fp8_e4m3", block_size: Any = (128, 128), **overrides: Any) -> QuantizationSpec:
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        qscheme="per_block",
        block_size=block_size,
        observer_cls="PerBlock2DMinMaxObserver",
        symmetric=True,
        is_dynamic=False,
    )
    if not dtype.startswith("fp"):
        kwargs.update(round_method="half_even", scale_type="float")
    kwargs.update(overrides)
    return QuantizationSpec(**kwargs)


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # tiles of very different ranges, so a wrong tile-to-scale mapping cannot pass
    return torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, cols).unsqueeze(0)


def tiles(w: torch.Tensor, block: tuple[int, int]) -> list[tuple[slice, slice]]:
    """The (row, col) slices of every tile, edge tiles partial: an index-based reference of the tiling."""
    return [
        (slice(r, min(r + block[0], w.shape[0])), slice(c, min(c + block[1], w.shape[1])))
        for r in range(0, w.shape[0], block[0])
        for c in range(0, w.shape[1], block[1])
    ]


def n_tiles(w: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    return (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))


def quantize(spec: QuantizationSpec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = FakeQuantizeBase.get_fake_quantize(spec)
    out = q(w)
    scale, zp = q.calculate_qparams()
    return out, scale, zp


SHAPES = [((256, 384), (128, 128)), ((200, 300), (64, 64)), ((70, 50), (32, 16))]


# ----------------------------------------------------------------------------------------------- fp8 per block
@pytest.mark.parametrize(("shape", "block"), SHAPES, ids=["256x384/128", "200x300/64-partial", "70x50/32x16"])
@pytest.mark.parametrize("dtype", list(FP8))
def test_fp8_per_block_equals_torch_cast_reference(dtype: str, shape: tuple[int, int], block: tuple[int, int]) -> None:
    torch_dtype, fmax = FP8[dtype]
    w = weight(*shape)
    out, scale, zp = quantize(block_spec(dtype, list(block)), w)
    assert scale.shape == n_tiles(w, block) and torch.equal(zp, torch.zeros_like(zp))
    ref = torch.empty_like(w)
    for i, (rs, cs) in enumerate(tiles(w, block)):
        tile = w[rs, cs]
        s = tile.abs().amax() / fmax
        assert scale.reshape(-1)[i] == s
        ref[rs, cs] = (tile / s).to(torch_dtype).float() * s
    assert torch.equal(out, ref)


def test_fp8_per_block_whole_tensor_form_of_the_reference() -> None:
    """The task's own wording of the reference: reshape into tiles, amax per tile, scale = amax / 448."""
    w = weight(256, 384, seed=3)
    out, scale, _ = quantize(block_spec(), w)
    t = w.reshape(2, 128, 3, 128)
    s = t.abs().amax(dim=(1, 3)) / 448
    ref = ((t / s[:, None, :, None]).to(torch.float8_e4m3fn).float() * s[:, None, :, None]).reshape(256, 384)
    assert torch.equal(scale, s) and torch.equal(out, ref)


# ----------------------------------------------------------------------------------------------- integers
@pytest.mark.parametrize(("shape", "block"), SHAPES[1:], ids=["200x300/64-partial", "70x50/32x16"])
def test_int8_symmetric_per_block_equals_torch_round_clamp(shape: tuple[int, int], block: tuple[int, int]) -> None:
    w = weight(*shape, seed=1)
    out, scale, zp = quantize(block_spec("int8", list(block)), w)
    ref = torch.empty_like(w)
    for i, (rs, cs) in enumerate(tiles(w, block)):
        tile = w[rs, cs]
        s = tile.abs().amax() / 127.5  # the engine's (Quark's) symmetric rule: amax / ((qmax - qmin) / 2)
        assert scale.reshape(-1)[i] == s and zp.reshape(-1)[i] == 0
        ref[rs, cs] = torch.clamp(torch.round(tile * (1 / s)), -128, 127) * s
    assert torch.equal(out, ref)


def test_uint4_asymmetric_per_block_equals_torch_kernel_per_tile() -> None:
    w = weight(96, 80, seed=2) + 0.3
    block = (32, 32)
    out, scale, zp = quantize(block_spec("uint4", list(block), symmetric=False), w)
    assert scale.shape == zp.shape == (3, 3)
    ref = torch.empty_like(w)
    for i, (rs, cs) in enumerate(tiles(w, block)):
        tile = w[rs, cs]
        lo, hi = tile.min().clamp(max=0), tile.max().clamp(min=0)
        s = (hi - lo) / 15
        z = int(torch.clamp(0 - torch.round(lo / s), 0, 15))
        assert torch.allclose(scale.reshape(-1)[i], s) and int(zp.reshape(-1)[i]) == z
        ref[rs, cs] = torch.fake_quantize_per_tensor_affine(tile, float(scale.reshape(-1)[i]), z, 0, 15)
    assert torch.equal(out, ref)


def test_observer_keeps_running_tile_ranges_and_reloads() -> None:
    spec = block_spec("fp8_e4m3", [64, 64])
    obs = PerBlock2DMinMaxObserver(spec)
    a, b = weight(100, 130, seed=4), weight(100, 130, seed=5) * 3
    obs(a)
    obs(b)
    scale, _ = obs.calculate_qparams()
    amax = torch.maximum(a.abs(), b.abs())
    expected = torch.stack([amax[rs, cs].amax() for rs, cs in tiles(a, (64, 64))]).reshape(2, 3) / 448
    assert torch.equal(scale, expected)
    fresh = PerBlock2DMinMaxObserver(spec)
    fresh.load_state_dict(obs.state_dict())
    assert torch.equal(fresh.calculate_qparams()[0], scale)
    assert OBSERVER_MAP["PerBlock2DMinMaxObserver"] is PerBlock2DMinMaxObserver
    with pytest.raises(ValueError, match=r"2-D tensor.*\(2, 3, 4\)"):
        obs(torch.randn(2, 3, 4))


def test_dynamic_per_block_and_straight_through_gradient() -> None:
    w = weight(64, 96, seed=6).requires_grad_()
    out, scale, _ = quantize(block_spec("fp8_e4m3", [32, 32], is_dynamic=True), w)
    assert scale.shape == (2, 3)
    out.sum().backward()
    # straight-through: 1 inside the range; only a tile's own maximum can land a rounding error past max_normal
    tile_max = torch.zeros_like(w)
    for rs, cs in tiles(w, (32, 32)):
        tile_max[rs, cs] = w[rs, cs].abs().amax()
    assert set(w.grad.unique().tolist()) <= {0.0, 1.0}
    assert bool((w.detach().abs()[w.grad == 0] == tile_max[w.grad == 0]).all())
    assert int((w.grad == 0).sum()) <= 6


# ----------------------------------------------------------------------------------------------- float8_e8m0fnu
def _assert_e8m0(scale: torch.Tensor, amax: torch.Tensor, qmax: float) -> None:
    mantissa, _ = torch.frexp(scale)
    assert bool((mantissa == 0.5).all()), "not powers of two"
    assert bool((scale >= amax / qmax).all()) and bool((scale < 2 * amax / qmax).all())
    assert torch.equal(scale.to(E8M0).float(), scale)  # exactly representable as torch.float8_e8m0fnu


def test_e8m0_per_block_scales_are_ceil_powers_of_two_and_nothing_clips() -> None:
    w = weight(200, 300, seed=7)
    out, scale, _ = quantize(block_spec("fp8_e4m3", [64, 64], scale_type="float8_e8m0fnu"), w)
    amax = torch.stack([w[rs, cs].abs().amax() for rs, cs in tiles(w, (64, 64))]).reshape(scale.shape)
    _assert_e8m0(scale, amax, 448.0)
    ref = torch.empty_like(w)
    for i, (rs, cs) in enumerate(tiles(w, (64, 64))):
        s = scale.reshape(-1)[i]
        assert float((w[rs, cs] / s).abs().max()) <= 448.0  # rounded up: no value clips
        ref[rs, cs] = (w[rs, cs] / s).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(out, ref)


@pytest.mark.parametrize("qscheme", ["per_tensor", "per_channel", "per_group"])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "int8"])
def test_e8m0_with_the_other_qschemes(qscheme: str, dtype: str) -> None:
    w = weight(48, 64, seed=8)
    observer = {
        "per_tensor": "PerTensorMinMaxObserver",
        "per_channel": "PerChannelMinMaxObserver",
        "per_group": "PerGroupMinMaxObserver",
    }[qscheme]
    extra: dict[str, Any] = {
        "per_tensor": {},
        "per_channel": {"ch_axis": 0},
        "per_group": {"ch_axis": 1, "group_size": 16},
    }[qscheme]
    spec = QuantizationSpec(
        dtype=dtype,
        qscheme=qscheme,
        observer_cls=observer,
        symmetric=True,
        is_dynamic=False,
        scale_type="float8_e8m0fnu",
        round_method="half_even",
        **extra,
    )
    out, scale, _ = quantize(spec, w)
    if qscheme == "per_tensor":
        amax = w.abs().amax()
    elif qscheme == "per_channel":
        amax = w.abs().amax(dim=1)
    else:
        amax = w.abs().reshape(48, 4, 16).amax(dim=-1)
    qmax = 448.0 if dtype == "fp8_e4m3" else 127.5
    assert scale.shape == amax.shape
    _assert_e8m0(scale, amax, qmax)


def test_e8m0_rule_range_and_pof2_unchanged() -> None:
    s = torch.tensor([0.7, 1.0, 1.5, 3.0, 2.0**-130, 1e-45, 2.0**127 * 1.5 / 2, 3.0e38])
    e8m0 = apply_scale_type(s, ScaleType.float8_e8m0fnu, torch.float32)
    expected = torch.tensor([1.0, 1.0, 2.0, 4.0, 2.0**-127, 2.0**-127, 2.0**127, 2.0**127])
    assert torch.equal(e8m0, expected)
    assert torch.equal(e8m0.to(E8M0).float(), e8m0)
    # pof2 keeps Quark's rounding to the nearest power of two in the log domain
    assert torch.equal(
        apply_scale_type(torch.tensor([0.7, 1.5, 3.0]), ScaleType.pof2, torch.float32), torch.tensor([0.5, 2.0, 4.0])
    )
    assert ScaleType("ue8m0") is ScaleType.float8_e8m0fnu and ScaleType("FLOAT8_E8M0FNU") is ScaleType.float8_e8m0fnu
    assert ScaleType.float8_e8m0fnu.to_torch_dtype() is E8M0 and ScaleType.bfloat16.to_torch_dtype() is torch.bfloat16
    with pytest.raises(ValueError, match="pof2"):
        ScaleType.pof2.to_torch_dtype()


# ----------------------------------------------------------------------------------------------- end to end
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 64))


@pytest.mark.parametrize(
    "spec_kw",
    [
        {"dtype": "fp8_e4m3"},
        {"dtype": "int8", "scale_type": "float8_e8m0fnu"},
        {"dtype": "fp8_e4m3", "scale_type": "float8_e8m0fnu"},
    ],
    ids=["fp8", "int8-e8m0", "fp8-e8m0"],
)
def test_linear_model_quantizes_freezes_and_round_trips_safetensors(spec_kw: dict[str, Any], tmp_path: Path) -> None:
    spec = block_spec(block_size=[64, 64], **spec_kw)
    config = Config(global_quant_config=QuantizationConfig(weight=spec))
    x = torch.randn(16, 300, generator=torch.Generator().manual_seed(9))
    model = ModelQuantizer(config).quantize_model(_model(), [x[:8]])
    y = model(x)
    # the layer's output equals F.linear with the reference per-block weights
    float_model = _model()
    h = x
    for i in (0, 2):
        w = float_model[i].weight.detach()
        wq = torch.empty_like(w)
        for rs, cs in tiles(w, (64, 64)):
            t = w[rs, cs]
            s = t.abs().amax() / (127.5 if spec.dtype.name == "int8" else 448)
            if spec.scale_type == ScaleType.float8_e8m0fnu:
                s = torch.exp2(torch.ceil(torch.log2(s)))  # UE8M0, "ceil" as DeepGEMM rounds block scales
            if spec.dtype.name == "int8":
                wq[rs, cs] = torch.clamp(torch.round(t * (1 / s)), -128, 127) * s
            else:
                wq[rs, cs] = (t / s).to(torch.float8_e4m3fn).float() * s
        h = F.linear(h, wq, float_model[i].bias)
        h = torch.relu(h) if i == 0 else h
    assert torch.allclose(y, h, atol=1e-5, rtol=1e-5)
    frozen = ModelQuantizer.freeze(model)
    assert isinstance(frozen[0]._weight_quantizer, FrozenScaledFakeQuantize)
    assert frozen[0]._weight_quantizer.scale.shape == (4, 5) and frozen[2]._weight_quantizer.scale.shape == (1, 4)
    y_frozen = frozen(x)
    assert torch.equal(y_frozen, y)
    path = export_safetensors(frozen, tmp_path, custom_mode=None)
    from safetensors.torch import load_file

    stored = load_file(str(path))
    assert stored["0.weight_scale"].shape == (4, 5)
    assert stored["0.weight_scale"].dtype == (E8M0 if spec.scale_type == ScaleType.float8_e8m0fnu else torch.float32)
    restored = import_model_from_safetensors(_model(), tmp_path)
    assert torch.equal(restored(x), y_frozen)


# ----------------------------------------------------------------------------------------------- config
def test_block_size_round_trips_through_dict_and_json() -> None:
    spec = block_spec(block_size=(128, 64))
    assert spec.block_size == [128, 64] and spec.qscheme is QSchemeType.per_block
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["block_size"] == [128, 64] and data["qscheme"] == "per_block"
    assert QuantizationSpec.from_dict(data) == spec
    config = Config(global_quant_config=QuantizationConfig(weight=spec))
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert block_spec("int8", [2, 2], ch_axis=None).to_dict()["block_size"] == [2, 2]
    assert QuantizationSpec(dtype="bfloat16").block_size is None


@pytest.mark.parametrize("bad", [None, [128], [128, 128, 1], [0, 128], [128, -1], [1.5, 2], [True, 2], "128x128", 128])
def test_bad_block_size_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_spec(block_size=bad)


def test_block_size_and_per_block_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match=r"block_size=\[2, 2\] is used only with qscheme=per_block.*per_group"):
        QuantizationSpec(
            dtype="int8",
            qscheme="per_group",
            ch_axis=1,
            group_size=32,
            block_size=[2, 2],
            observer_cls="PerGroupMinMaxObserver",
            symmetric=True,
            round_method="half_even",
            scale_type="float",
        )
    with pytest.raises(ValueError, match="per_block needs an integer or minifloat dtype"):
        QuantizationSpec(dtype="bfloat16", qscheme="per_block", block_size=[2, 2])
    with pytest.raises(ValueError, match=r"group_size=32 cannot be used with qscheme=per_block"):
        block_spec(group_size=32)
    with pytest.raises(ValueError, match="PerBlock2DMinMaxObserver"):
        block_spec(observer_cls="PerTensorMinMaxObserver")
    with pytest.raises(ValueError, match=r"QuantizationConfig.input_tensors: qscheme=per_block.*weight only"):
        QuantizationConfig(input_tensors=block_spec())
    with pytest.raises(ValueError, match="GPTQ.*per_block"):
        check_gptq_spec(block_spec(), "layer 'fc'")


def test_spec_helpers_keep_block_size_as_their_group_size() -> None:
    mx6 = MX6Spec(ch_axis=-1, block_size=16).to_quantization_spec()
    assert mx6.group_size == 16 and mx6.block_size is None
    int8 = Int8PerChannelSpec(ch_axis=0, scale_type="float8_e8m0fnu").to_quantization_spec()
    assert int8.scale_type is ScaleType.float8_e8m0fnu


@pytest.mark.parametrize("mode", ["eager_mode", "fx_graph_mode"])
def test_per_block_on_a_conv_weight_names_the_layer(mode: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    config = Config(global_quant_config=QuantizationConfig(weight=block_spec(block_size=[16, 16])), quant_mode=mode)
    with pytest.raises(ValueError, match=r"layer '0' \(Conv2d, weight of shape \(8, 3, 3, 3\)\): qscheme=per_block"):
        ModelQuantizer(config).quantize_model(model, [torch.randn(2, 3, 8, 8)])
