"""GPTQ against a straightforward implementation of the paper's algorithm, bit for bit.

``reference_gptq`` below is the column loop of Frantar et al. (and of the AutoGPTQ / amd-quark code) written plainly:
the weight as [rows, columns], one column at a time, its error spread over the rest of its block by a [rows, 1] @
[1, n] product, the later blocks updated by one matmul per block; torch's own fake-quant kernel (integers) or float8
cast (fp8) per column; min-max qparams from the closed forms of algo_refs. Our conventions on top of the paper: dead
input columns zeroed, damping of ``damp_percent`` of the mean diagonal (taken after the ``desc_act`` order, a Python
float product), groups that stay the format's contiguous input groups, their scales taken from the current weights
when the sweep first reaches one of their columns (or all up front with ``static_groups``).

``gptq_quantize`` holds the weight transposed, quantizes each column with the format's eager core and updates the
rest of its block with an outer product and a subtraction: the same float operations on the same values, so the
quantized weight, scales and zero points must be equal bit for bit (the loss too: the same running sums).

The driver test checks the model-level shortcuts (Hessian and factorization shared by the layers that read one
input, passes stopped once a group has its inputs, no re-quantization of weights already on their grid) against the
driver without them, on a Hugging Face LLaMA.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from algo_refs import EPS, correlated_inputs, int_range, ref_qparams, spec_dict
from torch import nn

import quark.torch.algorithm.api as algo_api
from quark.torch import ModelQuantizer
from quark.torch.algorithm.gptq import gptq_quantize, prepare_hessian
from quark.torch.quantization.config.config import Config, QuantizationSpec

FP8_MAX = 448.0


# ----------------------------------------------------------------------------------------------- the reference
def _int_column(bits: int, sym: bool):  # noqa: ANN202
    qmin, qmax = int_range(bits, sym)

    def quantize(column: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_channel_affine(column[:, None], scale, zp.int(), 0, qmin, qmax)[:, 0]

    return quantize


def _fp8_column(column: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    return (column / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def _fp8_qparams(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert group_size is None
    scale = torch.clamp(w.abs().amax(dim=1) / FP8_MAX, min=EPS)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


@torch.no_grad()
def reference_gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    quantize: Any,
    qparams: Any,
    group_size: int | None,
    *,
    desc_act: bool,
    static_groups: bool,
    block_size: int,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(quantized weight, scale, zero point, loss); ``qparams(w [rows, k], group_size)`` -> per row (and group)."""
    W, H = weight.clone().float(), hessian.clone().float()
    rows, columns = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    size = group_size or columns
    n_groups = columns // size
    scales: list[torch.Tensor | None] = [None] * n_groups
    zps: list[torch.Tensor | None] = [None] * n_groups
    if group_size is None or static_groups:
        s, z = qparams(W, group_size)
        s, z = s.reshape(rows, n_groups), z.reshape(rows, n_groups)
        for g in range(n_groups):
            scales[g], zps[g] = s[:, g], z[:, g]

    perm = torch.argsort(torch.diag(H), descending=True) if desc_act else torch.arange(columns)
    W, H = W[:, perm], H[perm][:, perm]
    H = H + damp * float(torch.diag(H).mean()) * torch.eye(columns)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    position = torch.argsort(perm)

    Q = torch.zeros_like(W)
    losses = torch.zeros(rows)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = int(perm[i1 + i]) // size
            if scales[g] is None:  # this group's columns as they are now: in the block being swept, or after it
                current = torch.stack(
                    [W1[:, p - i1] if p < i2 else W[:, p] for p in position[g * size : (g + 1) * size].tolist()], 1
                )
                s, z = qparams(current, group_size)
                scales[g], zps[g] = s.reshape(rows), z.reshape(rows)
            w, d = W1[:, i], Hinv1[i, i]
            q = quantize(w, scales[g], zps[g])
            Q[:, i1 + i] = q
            losses += (w - q) ** 2 / d**2 / 2
            err = (w - q) / d
            W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    scale, zp = torch.stack(scales, 1), torch.stack(zps, 1)  # type: ignore[arg-type]
    if group_size is None:
        scale, zp = scale[:, 0], zp[:, 0]
    return Q[:, position], scale, zp, float(losses.sum())


# ----------------------------------------------------------------------------------------------- specs and problems
def _spec(name: str) -> tuple[QuantizationSpec, Any, Any, int | None]:
    """(spec, reference column quantizer, reference qparams, group size)."""
    if name == "fp8_per_channel":
        spec = QuantizationSpec.from_dict(
            {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}
        )
        return spec, _fp8_column, _fp8_qparams, None
    bits, qscheme, group, sym = {
        "uint4_g32": (4, "per_group", 32, False),
        "int4_g64_sym": (4, "per_group", 64, True),
        "int8_per_channel": (8, "per_channel", None, True),
    }[name]
    spec = QuantizationSpec.from_dict(spec_dict(bits, qscheme, group, sym))
    return spec, _int_column(bits, sym), lambda w, gs: ref_qparams(w, bits, sym, gs), group


def _problem(rows: int, columns: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and the Hessian 2/n X^T X of correlated random inputs, two input columns always zero (dead)."""
    x = correlated_inputs(4 * columns, columns, seed=seed)
    x[:, [1, columns // 2]] = 0.0
    w = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed + 100)) * 0.05
    return w, 2.0 / x.shape[0] * x.T @ x


CASES = [
    # (spec, desc_act, static_groups, rows, columns, block size)
    ("uint4_g32", False, False, 40, 256, 128),
    ("uint4_g32", True, False, 40, 256, 128),
    ("uint4_g32", True, True, 40, 256, 128),
    ("uint4_g32", False, True, 24, 192, 48),
    ("uint4_g32", True, False, 33, 320, 48),
    ("int4_g64_sym", True, False, 24, 256, 96),
    ("int8_per_channel", False, False, 40, 256, 128),
    ("int8_per_channel", True, False, 17, 200, 64),
    ("fp8_per_channel", False, False, 40, 256, 128),
    ("fp8_per_channel", True, False, 24, 192, 80),
]


@pytest.mark.parametrize("name, desc_act, static_groups, rows, columns, block", CASES)
def test_gptq_equals_the_straightforward_algorithm_bit_for_bit(
    name: str, desc_act: bool, static_groups: bool, rows: int, columns: int, block: int
) -> None:
    spec, quantize, qparams, group = _spec(name)
    w, h = _problem(rows, columns, seed=columns + rows)
    expected_w, expected_s, expected_z, expected_loss = reference_gptq(
        w, h, quantize, qparams, group, desc_act=desc_act, static_groups=static_groups, block_size=block
    )
    result = gptq_quantize(w, h, spec, desc_act=desc_act, static_groups=static_groups, block_size=block)
    assert torch.equal(result.weight, expected_w)
    assert torch.equal(result.scale, expected_s)
    assert result.zero_point.dtype == torch.int32 and torch.equal(result.zero_point, expected_z.to(torch.int32))
    assert result.loss == expected_loss  # the same running sums of the same values: a check on every column's error
    assert result.damp == 0.01
    # a shared factorization (layers that read one input) gives the very same result
    inverse = prepare_hessian(h, damp_percent=0.01, desc_act=desc_act)
    again = gptq_quantize(w, h, spec, desc_act=desc_act, static_groups=static_groups, block_size=block, inverse=inverse)
    assert torch.equal(again.weight, result.weight) and torch.equal(again.scale, result.scale)
    assert again.loss == result.loss


def test_reference_is_not_trivially_round_to_nearest() -> None:
    """The problems above exercise the compensation: GPTQ moves many weights off their nearest grid point."""
    spec, quantize, qparams, group = _spec("uint4_g32")
    w, h = _problem(40, 256, seed=296)
    gptq_weight = reference_gptq(w, h, quantize, qparams, group, desc_act=True, static_groups=True, block_size=128)[0]
    scale, zp = qparams(w, group)
    rtn = torch.fake_quantize_per_channel_affine(w.reshape(-1, group), scale.reshape(-1), zp.reshape(-1), 0, 0, 15)
    assert float((gptq_weight != rtn.reshape(w.shape)).float().mean()) > 0.1


# ----------------------------------------------------------------------------------------------- the driver
def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _naive_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver without its shortcuts: one Hessian per layer, every pass through the whole layer, weights already
    quantized fake-quantized again on every forward."""
    real_pass, real_collector = algo_api._group_pass, algo_api._Collector
    monkeypatch.setattr(algo_api, "_Collector", lambda modules, share: real_collector(modules, False))
    monkeypatch.setattr(
        algo_api,
        "_group_pass",
        lambda layer, modules, inputs, calls, share: real_pass(
            layer, modules, inputs, [Counter() for _ in calls], False
        ),
    )
    monkeypatch.setattr(algo_api, "_same_bits", lambda a, b: False)


@pytest.mark.filterwarnings("ignore:.*stay float")
@pytest.mark.parametrize(
    "algo",
    [
        {"name": "gptq", "desc_act": True, "static_groups": False},
        {"name": "gptq", "desc_act": False, "static_groups": True, "block_size": 32},
        {"name": "gptq", "true_sequential": False},
    ],
)
def test_driver_shortcuts_change_nothing(monkeypatch: pytest.MonkeyPatch, algo: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 128, (2, 16), generator=g)} for _ in range(3)]
    batches.append({"input_ids": torch.randint(0, 128, (1, 11), generator=g)})
    config = {"global_quant_config": {"weight": spec_dict(4, "per_group", 32, sym=False)}, "algo_config": algo}
    calls: Counter[str] = Counter()

    def count(name: str) -> Any:
        return lambda module, args: calls.update([name])

    fast_model = _tiny_llama()
    for name, module in fast_model.named_modules():
        if name.endswith("mlp.down_proj") or name.endswith("self_attn.q_proj"):
            module.register_forward_pre_hook(count(name.rsplit(".", 1)[1]))
    fast = ModelQuantizer(Config.from_dict(config)).quantize_model(fast_model, batches)
    fast_calls = dict(calls)
    calls.clear()
    with monkeypatch.context() as patch:
        _naive_driver(patch)
        naive = ModelQuantizer(Config.from_dict(config)).quantize_model(_tiny_llama(), batches)
    state, expected = fast.state_dict(), naive.state_dict()
    assert list(state) == list(expected)
    for key in expected:
        assert state[key].dtype == expected[key].dtype and torch.equal(state[key], expected[key]), key
    if algo.get("true_sequential", True):  # passes for q/k/v, o, gate/up stop before down_proj runs
        assert fast_calls["down_proj"] < fast_calls["q_proj"]
