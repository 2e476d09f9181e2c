"""Mixed precision engine: sizes against hand counts, the allocator against brute force, sensitivity measured with one
layer quantized at a time, Hutchinson's trace against the exact Hessian, and a mixed config against uniform ones."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.sensitivity import (
    LayerSensitivity,
    allocate,
    average_bits,
    hessian_sensitivity,
    hessian_trace,
    measure_sensitivity,
    mixed_precision_config,
    weight_bits,
)


def spec(bits: int, qscheme: str = "per_channel", group: int | None = None, sym: bool = True) -> QuantizationSpec:
    d = {
        "dtype": f"int{bits}" if sym else f"uint{bits}",
        "qscheme": qscheme,
        "symmetric": sym,
        "is_dynamic": False,
        "observer_cls": {
            "per_channel": "PerChannelMinMaxObserver",
            "per_group": "PerGroupMinMaxObserver",
            "per_tensor": "PerTensorMinMaxObserver",
        }[qscheme],
        "round_method": "half_even",
        "scale_type": "float",
    }
    if qscheme == "per_channel":
        d["ch_axis"] = 0
    if qscheme == "per_group":
        d["ch_axis"], d["group_size"] = 1, group
    return QuantizationSpec.from_dict(d)


CANDIDATES = {f"w{b}": QuantizationConfig(weight=spec(b)) for b in (8, 4, 2)}


def test_weight_bits_count_scales_and_zero_points() -> None:
    assert weight_bits(spec(8), (64, 128)) == 8 + 64 * 32 / (64 * 128)  # one float32 scale per output row
    assert weight_bits(spec(4, "per_group", 32, sym=False), (64, 128)) == 4 + (32 + 4) / 32  # scale + uint4 zero point
    assert weight_bits(spec(8, "per_tensor"), (10, 10)) == 8 + 32 / 100
    mx = QuantizationSpec.from_dict(
        {
            "dtype": "mx",
            "mx_element_dtype": "fp4",
            "qscheme": "per_group",
            "ch_axis": 1,
            "group_size": 32,
            "is_dynamic": False,
        }
    )
    assert weight_bits(mx, (64, 128)) == 4 + 8 / 32  # E8M0 per block of 32
    assert weight_bits(None, (3, 3)) == 32


def _brute_force(sens: list[LayerSensitivity], budget_bits: float) -> float:
    total = sum(s.numel for s in sens)
    best = math.inf
    for combo in itertools.product(*[list(s.loss) for s in sens]):
        bits = sum(s.numel * s.bits[c] for s, c in zip(sens, combo, strict=True)) / total
        if bits <= budget_bits:
            best = min(best, sum(s.loss[c] for s, c in zip(sens, combo, strict=True)))
    return best


@pytest.mark.parametrize("seed", range(24))
def test_allocate_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    sens = []
    for i in range(rng.randint(2, 5)):
        s = LayerSensitivity(f"l{i}", rng.choice([100, 1000, 4096, 300]))
        for c, bits in (("a", 8.25), ("b", 4.5), ("c", 3.2), ("d", 2.1)):
            s.bits[c], s.loss[c] = bits, rng.random() * (10 - bits)  # not monotone: some candidates are dominated
        sens.append(s)
    target = rng.uniform(2.2, 8.0)
    if seed % 2:  # a budget met exactly by some choice: it must stay reachable (no rounding may push it over)
        target = average_bits({s.layer: rng.choice(list(s.loss)) for s in sens}, sens)
    choice = allocate(sens, target)
    assert average_bits(choice, sens) <= target * (1 + 1e-12)
    ours = sum(s.loss[choice[s.layer]] for s in sens)
    assert ours <= _brute_force(sens, target) + 1e-12


def test_allocate_refuses_an_unreachable_budget_by_its_minimum() -> None:
    s = LayerSensitivity("fc", 100, {"w8": 1.0, "w4": 2.0}, {"w8": 8.0, "w4": 4.0})
    with pytest.raises(ValueError, match=r"below what the cheapest candidates store \(4.0000"):
        allocate([s], 3.5)
    assert allocate([s], 8.0) == {"fc": "w8"} and allocate([s], 7.9) == {"fc": "w4"}


class TwoPaths(nn.Module):
    """``loud`` sees inputs 50x larger than ``quiet``, so its weight error costs 2500x more output error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.loud, self.quiet = nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loud(x * 50) + self.quiet(x)


def test_sensitivity_quantizes_one_layer_at_a_time_and_leaves_the_model_as_it_was() -> None:
    model = TwoPaths()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randn(8, 32) for _ in range(3)]
    table = {s.layer: s for s in measure_sensitivity(model, CANDIDATES, batches, method="mse")}
    assert set(table) == {"loud", "quiet"}
    for s in table.values():
        assert s.loss["w8"] < s.loss["w4"] < s.loss["w2"]
        assert s.bits["w2"] < s.bits["w4"] < s.bits["w8"]
    assert table["loud"].loss["w4"] > 100 * table["quiet"].loss["w4"]
    # exactly the output error of the model with only that layer quantized, computed independently
    only_quiet = ModelQuantizer(
        Config(global_quant_config=QuantizationConfig(), layer_quant_config={"quiet": CANDIDATES["w4"]})
    )
    reference = TwoPaths()
    q = only_quiet.quantize_model(TwoPaths(), batches)
    expected = sum(float((q(b).double() - reference(b).double()).pow(2).mean()) for b in batches) / 3
    assert table["quiet"].loss["w4"] == pytest.approx(expected, rel=1e-9)
    assert not any(isinstance(m, QuantMixin) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_sensitivity_by_a_task_metric() -> None:
    model = TwoPaths()
    x = torch.randn(16, 32)
    target = model(x).detach()

    def neg_mse(m: nn.Module) -> float:
        with torch.no_grad():
            return -float((m(x) - target).pow(2).mean())

    table = {s.layer: s for s in measure_sensitivity(model, CANDIDATES, [x], metric=neg_mse)}
    assert table["loud"].loss["w2"] > table["quiet"].loss["w2"] > 0
    assert table["quiet"].loss["w8"] >= 0


def test_hutchinson_trace_matches_the_exact_hessian() -> None:
    """Loss sum((W x - y)^2) over a batch: the Hessian in W is 2 X^T X per output row, trace 2 * out * sum(x^2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3, bias=False))
    x, y = torch.randn(20, 6), torch.randn(20, 3)
    traces = hessian_trace(model, ["0"], [(x, y)], lambda m, b: (m(b[0]) - b[1]).pow(2).sum(), samples=400)
    exact = 2 * 3 * float(x.pow(2).sum()) / model[0].weight.numel()
    assert traces["0"] == pytest.approx(exact, rel=0.05)
    assert model[0].weight.grad is None and model[0].weight.requires_grad


def test_hessian_sensitivity_ranks_the_loud_layer_first() -> None:
    model = TwoPaths()
    batches = [torch.randn(8, 32) for _ in range(2)]
    table = {
        s.layer: s for s in hessian_sensitivity(model, CANDIDATES, batches, lambda m, b: m(b).pow(2).sum(), samples=8)
    }
    assert table["loud"].loss["w4"] > 100 * table["quiet"].loss["w4"]
    assert table["loud"].loss["w8"] < table["loud"].loss["w2"]


def test_the_mixed_config_beats_uniform_at_the_same_size() -> None:
    """Budget of 5 bits (8 + 2 averaged, both layers the same size): the allocator gives the loud layer 8 bits, and
    the result is better than the uniform 4-bit config (fewer bits would be worse still) and than the swapped mix."""
    model = TwoPaths()
    batches = [torch.randn(8, 32) for _ in range(3)]
    sens = measure_sensitivity(model, CANDIDATES, batches, method="mse")
    target = (weight_bits(spec(8), (16, 32)) + weight_bits(spec(2), (16, 32))) / 2
    choice = allocate(sens, target)
    assert choice == {"loud": "w8", "quiet": "w2"}
    base = Config(global_quant_config=QuantizationConfig())
    reference = [model(b).detach() for b in batches]

    def error(config: Config) -> float:
        q = ModelQuantizer(config).quantize_model(TwoPaths(), batches)
        return sum(float((q(b) - r).pow(2).mean()) for b, r in zip(batches, reference, strict=True))

    mixed = error(mixed_precision_config(base, choice, CANDIDATES))
    assert mixed < error(Config(global_quant_config=CANDIDATES["w4"]))
    assert mixed < error(mixed_precision_config(base, {"loud": "w2", "quiet": "w8"}, CANDIDATES))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="method='l1'"):
        measure_sensitivity(TwoPaths(), CANDIDATES, [torch.randn(2, 32)], method="l1")
    with pytest.raises(ValueError, match=r"layers \['nope'\]"):
        measure_sensitivity(TwoPaths(), CANDIDATES, [torch.randn(2, 32)], layers=["nope"])
    with pytest.raises(ValueError, match=r"candidates \['w3'\]"):
        mixed_precision_config(Config(global_quant_config=QuantizationConfig()), {"loud": "w3"}, CANDIDATES)
