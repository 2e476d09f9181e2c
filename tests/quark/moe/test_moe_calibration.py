"""Calibration of fused MoE experts, per expert:

- each expert's input quantizer is calibrated from exactly the tokens the router sent to it (its scale is the amax of
  those tokens / 127.5, computed here from the routed inputs), its down projection's from that expert's own
  activations, and the twin counts the tokens each expert received;
- an expert no calibration token reaches is named in a warning; its weights are quantized and its input quantizers
  take the largest scale of its siblings', so freeze, size reports and the forward treat it as quantized.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe_models import EXPERTS, HIDDEN, W8A8, build, experts_layers, token_batches
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.report import model_size_bits

pytestmark = pytest.mark.filterwarnings("ignore:.*stay float")

EPS = torch.finfo(torch.float32).eps


def int8_scale(x: torch.Tensor) -> torch.Tensor:
    """The symmetric int8 min-max scale of ``x``: amax / 127.5 (amd-quark's observers), floored at eps."""
    return torch.clamp(x.abs().amax() / 127.5, min=EPS)


def test_each_expert_is_calibrated_from_the_tokens_routed_to_it() -> None:
    model = build("mixtral")
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen.setdefault(name, []).append((args[0].detach().clone(), args[1].detach().clone()))

        return hook

    quantizer = ModelQuantizer(W8A8)
    quantizer.prepare(model)
    float_weights = {
        n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for n, m in experts_layers(model).items()
    }
    hooks = [m.register_forward_pre_hook(record(n)) for n, m in experts_layers(model).items()]
    quantizer.calibrate(model, token_batches(n=3))
    for h in hooks:
        h.remove()

    for name, twin in experts_layers(model).items():
        hidden = torch.cat([h for h, _ in seen[name]])
        routes = torch.cat([r for _, r in seen[name]])
        gate_up, down = float_weights[name]
        own_scale_below_global = False
        for e in range(EXPERTS):
            mine = (routes == e).any(dim=-1)
            x = hidden[mine]
            assert twin.expert_tokens[e] == int(mine.sum()) > 0, (name, e)
            scale, zero_point = getattr(twin, f"_e{e}_input_quantizer").calculate_qparams()
            assert torch.equal(scale, int8_scale(x)) and int(zero_point) == 0, (name, e)
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
            down_scale, _ = getattr(twin, f"_e{e}_down_input_quantizer").calculate_qparams()
            assert torch.equal(down_scale, int8_scale(F.silu(gate) * up)), (name, e)
            own_scale_below_global |= bool(scale < int8_scale(hidden))
        assert own_scale_below_global, name  # not one scale for all the layer's tokens
        assert sum(twin.expert_tokens) == routes.numel()  # every (token, choice) counted once


class ExpertsOnly(nn.Module):
    """One Mixtral experts module fed routed tokens directly: the calibration chooses which experts see data."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = build("mixtral").model.layers[0].mlp.experts

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, idx, w)


def routed_batches(n: int, never: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Tokens with their top-2 experts, expert ``never`` chosen by none."""
    g = torch.Generator().manual_seed(5)
    others = torch.tensor([e for e in range(EXPERTS) if e != never])
    out = []
    for i in range(n):
        x = torch.randn(16, HIDDEN, generator=g) * (1 + i)
        picks = torch.stack([torch.randperm(len(others), generator=g)[:2] for _ in range(16)])
        out.append((x, others[picks], torch.rand(16, 2, generator=g)))
    return out


def test_an_expert_no_token_reaches_is_named_and_takes_its_siblings_largest_input_scale() -> None:
    model = ExpertsOnly()
    batches = routed_batches(3, never=3)
    with pytest.warns(
        UserWarning, match=r"experts: expert\(s\) \[3\] received no calibration token.*largest input scale"
    ):
        ModelQuantizer(W8A8).quantize_model(model, forward_loop=lambda m: [m(*b) for b in batches])
    twin = model.experts
    assert twin.expert_tokens[3] == 0 and all(twin.expert_tokens[e] > 0 for e in range(3))
    for kind in ("input", "down_input"):
        siblings = [getattr(twin, f"_e{e}_{kind}_quantizer").calculate_qparams()[0] for e in range(3)]
        own = getattr(twin, f"_e3_{kind}_quantizer").calculate_qparams()[0]
        assert torch.equal(own, max(siblings)), kind
        assert own > min(siblings)  # the largest, not just any
    # its weights are quantized with its own scales, and it runs quantized
    w = twin.gate_up_proj[3, : twin.down_proj.shape[-1]].detach()
    assert torch.equal(
        twin._e3_gate_weight_quantizer.calculate_qparams()[0], torch.clamp(w.abs().amax(1) / 127.5, min=EPS)
    )
    ModelQuantizer.freeze(model)  # no "no qparams" error: nothing left uncalibrated
    assert not twin.unreached
    bits, float_bits = model_size_bits(model)
    assert bits == float_bits // 4  # every weight of every expert counts 8 bits
    x = torch.randn(4, HIDDEN)
    idx = torch.full((4, 2), 3)
    idx[:, 1] = 0
    with torch.no_grad():
        out = model(x, idx, torch.ones(4, 2))
        float_out = twin.to_float()(x, idx, torch.ones(4, 2))
    assert not torch.allclose(out, float_out, rtol=1e-4, atol=1e-4)


def test_the_warning_is_given_once() -> None:
    model = ExpertsOnly()
    batches = routed_batches(1, never=0)
    with pytest.warns(UserWarning, match=r"expert\(s\) \[0\]"):
        ModelQuantizer(W8A8).quantize_model(model, forward_loop=lambda m: [m(*b) for b in batches])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelQuantizer.freeze(model)  # the scales were given at calibration: nothing to say again
