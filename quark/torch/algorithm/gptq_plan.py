"""What GPTQ's model-level driver (``algorithm.api``) works on: the layers it quantizes (Linear / Conv2d twins and the
Linear-equivalent parts of twins: every fused MoE expert's gate, up and down projections, ``linear_parts``), their
weight specs as seen [out, in], the groups of one decoder layer it quantizes from one pass, which of a group's layers
share one Hessian, and the experts that keep round-to-nearest because too few calibration tokens reached them."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.config import GPTQConfig, QuantizationSpec
from quark.torch.quantization.hf import is_hf_conv1d, is_linear, linear_weight, transpose_weight_spec
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.linear_parts import LinearPart, named_modules_with_parts
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

__all__ = [
    "COMMON_INPUT",
    "expert_min_tokens",
    "gptq_groups",
    "gptq_targets",
    "linear_spec",
    "share_key",
    "tied_weights",
    "warn_rtn_experts",
]

logger = logging.getLogger(__name__)

#: the sharing key of the Linear layers of a group that read one tensor (``share_key``)
COMMON_INPUT = "group"


def gptq_targets(model: nn.Module) -> dict[str, nn.Module]:
    """Quantized layers, and Linear-equivalent parts of twins (each MoE expert's gate, up and down projections:
    ``linear_parts``), whose weight quantizer has scales GPTQ can set (integer / minifloat, static)."""
    return {
        name: m
        for name, m in named_modules_with_parts(model)
        if isinstance(m, QuantMixin | LinearPart)
        and isinstance(getattr(m, "_weight_quantizer", None), ScaledFakeQuantize)
        and (is_linear(m) or isinstance(m, nn.Conv2d))
    }


def linear_spec(module: nn.Module) -> QuantizationSpec:
    """The weight spec as for the weight seen [out, in] (a Conv1D's quantizer holds it transposed)."""
    spec = module._weight_quantizer.spec
    return transpose_weight_spec(spec) if is_hf_conv1d(module) else spec  # type: ignore[return-value]


def tied_weights(model: nn.Module, targets: dict[str, nn.Module]) -> dict[str, list[str]]:
    """Targets whose weight Parameter another module also holds (an lm_head tied to the input embeddings), with the
    names of those modules."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(name)
    return {
        name: [n for n in holders[id(m.weight)] if n != name]
        for name, m in targets.items()
        if len(set(holders.get(id(m.weight), []))) > 1
    }


# ----------------------------------------------------------------------------------------------- experts
def expert_min_tokens(module: nn.Module, algo: GPTQConfig) -> int:
    """The routed calibration tokens an expert's projection needs for GPTQ (``GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE``
    times its input features, at least one: without any, every input column is dead and GPTQ would zero the
    weight); 0 for any other layer."""
    if not isinstance(module, LinearPart):
        return 0
    return max(1, math.ceil(algo.MIN_EXPERT_TOKENS_PER_FEATURE * linear_weight(module).shape[1]))


def warn_rtn_experts(kept: dict[str, int], algo: GPTQConfig) -> None:
    """One warning naming the expert projections GPTQ left at round-to-nearest (``kept``: name -> the tokens routed
    to its expert), per expert: ``"model.layers.1.mlp.experts.3 (12 tokens): gate_proj, up_proj, down_proj"``."""
    if not kept:
        return
    experts: dict[str, list[str]] = {}
    for name in kept:
        expert, _, projection = name.rpartition(".")
        experts.setdefault(expert, []).append(projection)
    logger.warning(
        "GPTQ: %d expert projection(s) received fewer calibration tokens than %g x their input features "
        "(GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE) and keep round-to-nearest: %s",
        len(kept),
        algo.MIN_EXPERT_TOKENS_PER_FEATURE,
        "; ".join(
            f"{expert} ({kept[f'{expert}.{projections[0]}']} tokens): {', '.join(projections)}"
            for expert, projections in experts.items()
        ),
    )


# ----------------------------------------------------------------------------------------------- groups
def share_key(module: nn.Module) -> Any:
    """What the modules sharing one Hessian accumulator have in common: an expert's parts their input slot
    (``LinearPart.input_key``: its gate and up), any other Linear of the group ``COMMON_INPUT``."""
    return module.input_key if isinstance(module, LinearPart) else COMMON_INPUT


def gptq_groups(
    modules: dict[str, nn.Module], first_inputs: dict[str, torch.Tensor], true_sequential: bool
) -> list[list[str]]:
    """The names of ``modules`` cut into groups in order: with ``true_sequential`` the first module still to do and
    the others whose first input is the very same tensor (a module not called stays alone); for a part of a twin
    (an MoE expert's projection) the other parts of that twin at its stage (every expert's gate and up; then every
    expert's down: ``LinearPart.stage``), whose inputs none of them changes. Otherwise one group."""
    names = list(modules)
    if not true_sequential:
        return [names]
    groups, remaining = [], names
    while remaining:
        first, head = remaining[0], modules[remaining[0]]
        x = first_inputs.get(first)
        if isinstance(head, LinearPart):
            group = [n for n in remaining if _same_stage(modules[n], head)]
        else:
            group = [first] if x is None else [n for n in remaining if first_inputs.get(n) is x]
        groups.append(group)
        remaining = [n for n in remaining if n not in group]
    return groups


def _same_stage(module: nn.Module, part: LinearPart) -> bool:
    """Whether ``module`` is a part of ``part``'s twin at its stage."""
    return isinstance(module, LinearPart) and module.owner is part.owner and module.stage == part.stage
