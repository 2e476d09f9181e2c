"""GPTQ as a tensor algorithm: gptq_quantize against round-to-nearest and closed forms, the Hessian accumulator and
the im2col input rows of convolutions. References are computed here with torch ops (algo_refs), never with the code
under test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from algo_refs import correlated_inputs, int_range, make_spec, output_error, ref_qparams, ref_rtn, requantize
from torch import nn

from quark.torch.algorithm.awq import rtn
from quark.torch.algorithm.gptq import HessianAccumulator, check_gptq_spec, gptq_quantize, layer_input_rows
from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.tensor_quantize import apply_format

ROWS, COLUMNS = 24, 128

# (bits, qscheme, group_size, symmetric)
SCHEMES = {
    "per_channel_int4": (4, "per_channel", None, True),
    "per_group16_uint4": (4, "per_group", 16, False),
    "per_group32_int3": (3, "per_group", 32, True),
    "per_group64_uint3": (3, "per_group", 64, False),
}


@pytest.fixture(scope="module")
def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight, strongly correlated inputs and their Hessian 2/n X^T X."""
    x = correlated_inputs(1024, COLUMNS)
    w = torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(1))
    return w, x, 2.0 / x.shape[0] * x.T @ x


def damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    return h + damp * torch.diag(h).mean() * torch.eye(h.shape[0])


# ----------------------------------------------------------------------------------------------- against RTN
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("scheme", ["per_channel_int4", "per_group32_int3"])
def test_gptq_output_error_far_below_rtn_on_correlated_inputs(problem, scheme: str, desc_act: bool) -> None:
    w, x, h = problem
    bits, qscheme, group, sym = SCHEMES[scheme]
    result = gptq_quantize(w, h, make_spec(bits, qscheme, group, sym), desc_act=desc_act)
    rtn_error = output_error(x, ref_rtn(w, bits, sym, group), w)
    gptq_error = output_error(x, result.weight, w)
    assert gptq_error < 0.3 * rtn_error  # measured ~0.05x: correlations let later columns absorb the rounding error
    # the engine's rtn (used by AWQ as its baseline) is the same round-to-nearest as the independent reference
    assert torch.equal(rtn(w, make_spec(bits, qscheme, group, sym)), ref_rtn(w, bits, sym, group))


@pytest.mark.parametrize("static_groups", [False, True])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_identity_hessian_is_exactly_round_to_nearest(
    problem, scheme: str, desc_act: bool, static_groups: bool
) -> None:
    """With H = I the columns do not interact: nothing is compensated, every column rounds on its own."""
    w, _, _ = problem
    bits, qscheme, group, sym = SCHEMES[scheme]
    result = gptq_quantize(
        w, torch.eye(COLUMNS), make_spec(bits, qscheme, group, sym), desc_act=desc_act, static_groups=static_groups
    )
    assert torch.equal(result.weight, ref_rtn(w, bits, sym, group))
    scale, zp = ref_qparams(w, bits, sym, group)
    torch.testing.assert_close(result.scale, scale, rtol=0, atol=0)
    assert torch.equal(result.zero_point.to(torch.int32), zp)


# ----------------------------------------------------------------------------------------------- grid, shapes, loss
@pytest.mark.parametrize("static_groups", [False, True])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_result_on_grid_with_right_shapes_and_closed_form_loss(
    problem, scheme: str, desc_act: bool, static_groups: bool
) -> None:
    w, x, h = problem
    bits, qscheme, group, sym = SCHEMES[scheme]
    result = gptq_quantize(
        w, h, make_spec(bits, qscheme, group, sym), desc_act=desc_act, static_groups=static_groups, block_size=48
    )
    assert result.weight.shape == w.shape and result.weight.dtype == w.dtype
    expected_shape = (ROWS,) if qscheme == "per_channel" else (ROWS, COLUMNS // group)
    assert tuple(result.scale.shape) == expected_shape and tuple(result.zero_point.shape) == expected_shape
    assert bool((result.scale > 0).all())
    qmin, qmax = int_range(bits, sym)
    assert bool(((result.zero_point >= qmin) & (result.zero_point <= qmax)).all())
    if sym:
        assert bool((result.zero_point == 0).all())
    # on the grid: torch's own fake quantization with the returned qparams leaves it exactly as it is
    assert torch.equal(requantize(result.weight, result.scale, result.zero_point, bits, sym), result.weight)
    # qparams fixed up front come from the original weight (per channel always; per group when static)
    if qscheme == "per_channel" or static_groups:
        scale, zp = ref_qparams(w, bits, sym, group)
        torch.testing.assert_close(result.scale, scale, rtol=0, atol=0)
        assert torch.equal(result.zero_point.to(torch.int32), zp)
    # GPTQ's loss is the OBS objective it minimises: 1/2 tr(dW H_damped dW^T), a closed form of the final weights
    delta = (result.weight - w).double()
    objective = 0.5 * float(torch.trace(delta @ damped(h, 0.01).double() @ delta.T))
    assert result.loss == pytest.approx(objective, rel=1e-3)
    assert result.damp == 0.01
    assert output_error(x, result.weight, w) < output_error(x, ref_rtn(w, bits, sym, group), w)


def test_desc_act_and_static_groups_change_the_result(problem) -> None:
    w, _, h = problem
    spec = make_spec(4, "per_group", 16, False)
    natural = gptq_quantize(w, h, spec, desc_act=False)
    ordered = gptq_quantize(w, h, spec, desc_act=True)
    static = gptq_quantize(w, h, spec, desc_act=False, static_groups=True)
    assert not torch.equal(natural.weight, ordered.weight)
    assert not torch.equal(natural.scale, static.scale)  # dynamic group scales see the compensated weights


# ----------------------------------------------------------------------------------------------- damping
def _with_negative_eigenvalue(n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    eig = torch.linspace(1.0, 2.0, n)
    eig[0] = -0.05  # 1% damping of the ~1.5 diagonal mean (0.015) does not lift it; 10% (0.15) does
    return q @ torch.diag(eig) @ q.T


def test_not_positive_definite_hessian_is_retried_with_more_damping() -> None:
    h = _with_negative_eigenvalue()
    assert float(torch.linalg.eigvalsh(h).min()) < 0
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    result = gptq_quantize(w, h, make_spec(4), damp_percent=0.01, desc_act=False)
    assert result.damp > 0.01
    assert result.damp == pytest.approx(0.1)
    assert bool(torch.isfinite(result.weight).all())
    scale, zp = ref_qparams(w, 4, True)
    assert torch.equal(requantize(result.weight, scale, zp, 4, True), result.weight)
    delta = (result.weight - w).double()
    assert result.loss == pytest.approx(
        0.5 * float(torch.trace(delta @ damped(h, result.damp).double() @ delta.T)), rel=1e-3
    )


def test_hopeless_hessian_raises_naming_damp_percent() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="damp_percent"):
        gptq_quantize(w, -torch.eye(16), make_spec(4))  # negative definite: more damping only makes it worse
    with pytest.raises(ValueError, match="damp_percent"):
        gptq_quantize(w, _with_negative_eigenvalue(16), make_spec(4), retries=0)


def test_dead_input_columns() -> None:
    """Inputs that are always zero give a zero Hessian diagonal: those columns meet no input (zero in the result)
    and everything else is still compensated."""
    x = correlated_inputs(512, 64, seed=5)
    dead = torch.tensor([0, 7, 30, 63])
    x[:, dead] = 0.0
    h = 2.0 / x.shape[0] * x.T @ x
    assert bool((torch.diag(h)[dead] == 0).all())
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    for desc_act in (False, True):
        result = gptq_quantize(w, h, make_spec(4, "per_group", 16, False), desc_act=desc_act)
        assert bool(torch.isfinite(result.weight).all()) and bool(torch.isfinite(result.scale).all())
        assert bool((result.weight[:, dead] == 0).all())
        assert torch.equal(requantize(result.weight, result.scale, result.zero_point, 4, False), result.weight)
        assert output_error(x, result.weight, w) < 0.5 * output_error(x, ref_rtn(w, 4, False, 16), w)


# ----------------------------------------------------------------------------------------------- spec checks
@pytest.mark.parametrize(
    "spec, match",
    [
        (QuantizationSpec(dtype="mx", mx_element_dtype="fp4", group_size=32), "integer or minifloat"),
        (QuantizationSpec(dtype="bfloat16"), "integer or minifloat"),
        (QuantizationSpec.from_dict({**make_spec(8).to_dict(), "is_dynamic": True}), "is_dynamic=False"),
        (QuantizationSpec.from_dict({**make_spec(8).to_dict(), "ch_axis": 1}), "ch_axis=0"),
    ],
)
def test_check_gptq_spec_rejects(spec: QuantizationSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_gptq_spec(spec, "layer 'x'")


def test_group_size_must_divide_columns() -> None:
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(torch.randn(4, 48), torch.eye(48), make_spec(4, "per_group", 32, False))


# ----------------------------------------------------------------------------------------------- Hessian
def test_hessian_accumulator_equals_direct_two_over_n_xtx() -> None:
    g = torch.Generator().manual_seed(7)
    first = torch.randn(2, 19, 24, generator=g)  # 38 rows, as a 3-D activation
    second = torch.randn(91, 24, generator=g) * 3 + 1
    acc = HessianAccumulator(24)
    acc.add(first)
    acc.add(torch.zeros(0, 24))  # an empty chunk changes nothing
    acc.add(second)
    x = torch.cat([first.reshape(-1, 24), second]).double()
    expected = 2.0 / x.shape[0] * x.T @ x
    assert acc.count == 38 + 91
    assert acc.hessian.dtype == torch.float32
    torch.testing.assert_close(acc.hessian.double(), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- convolutions
def _im2col_reference(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Patches by explicit slicing: one row per (image, output position), columns in [in_channel, kh, kw] order."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    xp = F.pad(x, (pw, pw, ph, ph))
    out_h = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for b in range(x.shape[0]):
        for i in range(out_h):
            for j in range(out_w):
                patch = xp[b, :, i * sh : i * sh + dh * (kh - 1) + 1 : dh, j * sw : j * sw + dw * (kw - 1) + 1 : dw]
                rows.append(patch.reshape(-1))
    return torch.stack(rows)


def test_layer_input_rows() -> None:
    g = torch.Generator().manual_seed(8)
    conv = nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
    x = torch.randn(2, 3, 7, 6, generator=g)
    rows = layer_input_rows(conv, x)
    torch.testing.assert_close(rows, _im2col_reference(x, conv))
    # the matrix the flattened weight multiplies: rows @ W^T + b is the convolution's output
    y = conv(x)
    via_rows = rows @ conv.weight.reshape(5, -1).T + conv.bias
    torch.testing.assert_close(via_rows, y.permute(0, 2, 3, 1).reshape(-1, 5), rtol=1e-5, atol=1e-5)
    linear = nn.Linear(6, 2)
    assert torch.equal(layer_input_rows(linear, x[..., :6]), x[..., :6].reshape(-1, 6))
    # padding modes other than zeros: the rows hold the reflected / replicated / wrapped values the layer sees
    for mode in ("reflect", "replicate", "circular"):
        padded = nn.Conv2d(3, 5, 3, padding=(1, 2), padding_mode=mode)
        out = padded(x).permute(0, 2, 3, 1).reshape(-1, 5)
        rows = layer_input_rows(padded, x)
        torch.testing.assert_close(rows @ padded.weight.reshape(5, -1).T + padded.bias, out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="groups"):
        layer_input_rows(nn.Conv2d(4, 4, 3, groups=2), torch.randn(1, 4, 5, 5))
    with pytest.raises(ValueError, match="padding"):
        layer_input_rows(nn.Conv2d(3, 4, 3, padding="same"), x)
    with pytest.raises(ValueError, match="Conv1d"):
        layer_input_rows(nn.Conv1d(3, 4, 3), torch.randn(1, 3, 8))


def test_gptq_on_conv2d_beats_rtn() -> None:
    g = torch.Generator().manual_seed(9)
    images = F.avg_pool2d(
        torch.randn(16, 4, 18, 18, generator=g), 5, stride=1, padding=2
    )  # smooth: neighbours correlate
    conv = nn.Conv2d(4, 8, 3, padding=1)
    acc = HessianAccumulator(4 * 9)
    for chunk in images.split(5):
        acc.add(layer_input_rows(conv, chunk))
    w = conv.weight.detach()
    result = gptq_quantize(w.reshape(8, -1), acc.hessian, make_spec(4), desc_act=True)
    w_gptq = result.weight.reshape(w.shape)

    def err(weight: torch.Tensor) -> float:
        return float(((F.conv2d(images, weight, padding=1) - F.conv2d(images, w, padding=1)) ** 2).sum())

    assert err(w_gptq) < 0.5 * err(ref_rtn(w, 4, True))


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("qscheme", ["per_channel", "per_tensor"])
def test_minifloat_fp8_weights(problem, qscheme: str, desc_act: bool) -> None:
    """fp8_e4m3 with a scale: on torch's own float8_e4m3fn grid (scaled), far better than round-to-nearest."""
    w, x, h = problem
    observer = {"per_channel": "PerChannelMinMaxObserver", "per_tensor": "PerTensorMinMaxObserver"}[qscheme]
    spec = QuantizationSpec.from_dict(
        {
            "dtype": "fp8_e4m3",
            "qscheme": qscheme,
            "observer_cls": observer,
            **({"ch_axis": 0} if qscheme == "per_channel" else {}),
        }
    )
    result = gptq_quantize(w, h, spec, desc_act=desc_act)
    amax = w.abs().amax(dim=1) if qscheme == "per_channel" else w.abs().amax()
    torch.testing.assert_close(result.scale, amax / 448.0)  # e4m3fn's largest normal
    s = result.scale.reshape(-1, 1) if qscheme == "per_channel" else result.scale
    assert torch.equal((result.weight / s).to(torch.float8_e4m3fn).float() * s, result.weight)
    rtn_weight = (w / s).to(torch.float8_e4m3fn).float() * s
    assert output_error(x, result.weight, w) < 0.3 * output_error(x, rtn_weight, w)


@pytest.mark.parametrize("round_method", ["half_even", "round", "floor"])
@pytest.mark.parametrize("scheme", ["per_channel_int4", "per_group32_int3"])
def test_gptq_weights_are_fixed_points_of_the_layers_quantizer(problem, scheme: str, round_method: str) -> None:
    """GPTQ leaves weights on the grid of the spec's own rounding: the layer's quantizer (same qparams) returns them
    unchanged, for floor too (where a bare floor of ``w * (1 / s)`` used to drop some codes a step)."""
    w, _, h = problem
    bits, qscheme, group, sym = SCHEMES[scheme]
    spec = QuantizationSpec.from_dict({**make_spec(bits, qscheme, group, sym).to_dict(), "round_method": round_method})
    result = gptq_quantize(w, h, spec)
    assert torch.equal(apply_format(result.weight, spec, result.scale, result.zero_point), result.weight)
    assert not torch.equal(result.weight, w)
