"""Quantized fused MoE experts: transformers 5's experts modules, found by their structure, quantized per expert.

transformers 5 stores the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, PhiMoE and many more as one
module with two stacked Parameters, ``gate_up_proj`` [E, 2I, H] (expert ``e``'s gate rows ``[:I]`` then its up rows
``[I:]``) and ``down_proj`` [E, H, I], no bias, an ``act_fn``, and ``forward(hidden_states, top_k_index,
top_k_weights)`` computing ``act_fn(x W_gate^T) * (x W_up^T)`` then ``W_down`` for each token's chosen experts, scaled
by its routing weights and summed. Any module with that structure gets the twin here (``fused_experts_fit``), whatever
its class is called; other layouts (GPT-OSS's transposed, interleaved experts with biases, Llama4's dense ``bmm`` over
every expert) stay float with the reason ``fused_experts_fit`` gives.

The twin shares the two Parameters (state_dict keys unchanged; QAT trains them through the quantizers) and runs
transformers' eager per-expert loop itself, whatever ``config._experts_implementation`` says (``grouped_mm``, the
default, never shows an expert's own inputs). Each expert's gate, up and down weights are quantized as 2-D [out, in]
weights of their own with the layer's weight spec (``TensorPart`` slots: per tensor is one scale per expert and
projection, as vLLM's ``w13_weight_scale`` [E, 2] / ``w2_weight_scale`` [E]; per channel, rows of that expert; per
group, groups along its inputs); the tokens routed to expert ``e`` pass ``_e{e}_input_quantizer`` (gate and up read
the same input) and its down projection's input ``_e{e}_down_input_quantizer``. With every quantizer off the twin
computes exactly what the float module's eager forward does. The algorithms see each expert's projections as Linears
``"{e}.gate_proj"`` / ``"{e}.up_proj"`` / ``"{e}.down_proj"`` (``linear_parts.LinearPart``: their weights are views of
the stacked blocks, their input hooks get exactly the rows the forward multiplies), so GPTQ's Hessians and AWQ's
statistics are per expert, from the tokens routed to it.

Calibration counts the tokens each expert received (``expert_tokens``). An expert no calibration token reached keeps
quantized weights; its static input quantizers take the largest scale among its sibling experts'
(``finish_calibration``, named in a warning), which is what vLLM does with differing input scales when it loads
them. The router (``mlp.gate``: ``F.linear`` on a Parameter of its own) has a twin of its own, quantized only when
named (``quant_router``; ``moe_router_reason`` is the reason it stays float otherwise, as vLLM builds it unquantized).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.nn.modules.linear_parts import feed_part
from quark.torch.quantization.nn.modules.quant_modules import (
    QuantMixin,
    register_structural_twin,
)
from quark.torch.quantization.nn.modules.quant_router import MOE_ROUTER_REASON, moe_router_reason
from quark.torch.quantization.nn.modules.slots import QuantSlot, TensorPart

__all__ = ["QuantFusedExperts", "fused_experts_fit", "moe_router_reason", "MOE_ROUTER_REASON", "SUPPORTED_LAYOUT"]

SUPPORTED_LAYOUT = (
    "gate_up_proj [E, 2I, H] = [gate; up] and down_proj [E, H, I] without bias, act_fn(gate) * up, "
    "forward(hidden_states, top_k_index, top_k_weights)"
)
_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
#: the projections of one expert: (name in exports, Parameter, gate_up half: 0 gate, 1 up, None the whole tensor)
PROJECTIONS = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1), ("down_proj", "down_proj", None))


def _forward_args(cls: type) -> tuple[str, ...]:
    """The argument names of ``cls.forward`` after ``self`` (transformers' dispatching wrapper unwrapped)."""
    try:
        params = list(inspect.signature(inspect.unwrap(cls.forward)).parameters)
    except (TypeError, ValueError):
        return ()
    return tuple(params[1:])


def _layout_problems(module: nn.Module, gate_up: torch.Tensor, down: torch.Tensor) -> list[str]:
    """What keeps a module with 3-D ``gate_up_proj`` / ``down_proj`` Parameters from the supported layout."""
    problems = []
    others = sorted(n for n, _ in module.named_parameters(recurse=False) if n not in ("gate_up_proj", "down_proj"))
    if others or getattr(module, "has_bias", False):
        problems.append(f"expert biases {others}")
    transposed = bool(getattr(module, "is_transposed", False))
    if transposed:
        problems.append("transposed weights (gate_up_proj [E, H, 2I], x @ W[e])")
    if getattr(module, "is_concatenated", True) is False:
        problems.append("interleaved gate/up columns")
    if getattr(module, "has_gate", True) is False or getattr(module, "has_post_expert_norm", False):
        problems.append("no gate, or a norm after each expert")
    experts, two_i, hidden = gate_up.shape
    if not transposed and (two_i % 2 or tuple(down.shape) != (experts, hidden, two_i // 2)):
        problems.append(
            f"gate_up_proj {list(gate_up.shape)} / down_proj {list(down.shape)} are not [E, 2I, H] / [E, H, I]"
        )
    elif getattr(module, "num_experts", experts) != experts:
        problems.append(f"num_experts={module.num_experts} but {experts} stacked experts")
    args = _forward_args(type(module))
    if args == ("hidden_states",):
        problems.append(
            "forward(hidden_states) runs every expert on every token (dense bmm, routing weights on the input)"
        )
    elif args[:3] != _FORWARD_ARGS:
        problems.append(f"forward({', '.join(args)}) instead of forward({', '.join(_FORWARD_ARGS)})")
    gate = getattr(type(module), "_apply_gate", None)
    if not callable(getattr(module, "act_fn", None)) or (
        gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"
    ):
        problems.append("its own gate function instead of act_fn(gate) * up")
    return problems


def fused_experts_fit(module: nn.Module) -> bool | str:
    """True for a module with transformers 5's fused-experts structure (module docstring), a sentence naming the
    layout and what differs for a module with stacked ``gate_up_proj`` / ``down_proj`` Parameters in another
    layout (GPT-OSS, Llama4), False for any other module."""
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.ndim != 3 or down.ndim != 3:
        return False
    problems = _layout_problems(module, gate_up, down)
    if not problems:
        return True
    return (
        f"fused MoE experts in a layout the experts twin does not handle: {'; '.join(problems)} "
        f"(it handles {SUPPORTED_LAYOUT})"
    )


def _slots(experts: int, hidden: int, inter: int) -> tuple[QuantSlot, ...]:
    """Per expert: its input, its down projection's input, then its gate, up and down weights (blocks of the stacked
    Parameters, named as amd-quark's unfused experts name them)."""
    slots = []
    for e in range(experts):
        slots.append(QuantSlot("input_tensors", f"_e{e}_input_quantizer"))
        slots.append(QuantSlot("input_tensors", f"_e{e}_down_input_quantizer"))
        for proj, tensor, half in PROJECTIONS:
            start, stop = (0, hidden) if half is None else (half * inter, (half + 1) * inter)
            part = TensorPart(e, start, stop, f"{e}.{proj}.weight")
            slots.append(QuantSlot("weight", f"_e{e}_{proj.removesuffix('_proj')}_weight_quantizer", tensor, part))
    return tuple(slots)


class QuantFusedExperts(QuantMixin):
    """The behaviour of every fused-experts twin (see the module docstring); the twin of a class is made on first
    sight, subclassing it (``twin_of_foreign_class``)."""

    roles = ("input_tensors", "weight")
    data_dependent = "which experts run, on which tokens, depends on the router's choice for each input"
    #: tokens routed to each expert while its input quantizer observed (calibration, QAT's observer steps)
    expert_tokens: list[int]

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        experts, hidden, inter = module.down_proj.shape  # type: ignore[union-attr]
        return _slots(experts, hidden, inter)

    @classmethod
    def linear_parts_for(cls, module: nn.Module) -> tuple[tuple[str, QuantSlot, QuantSlot | None], ...]:
        """Each expert's gate, up and down projections as Linears ``"{e}.gate_proj"`` ...: gate and up read the
        expert's input, down its down projection's input."""
        by_attr = {s.attr: s for s in cls.slots_for(module)}
        out = []
        for e in range(module.down_proj.shape[0]):  # type: ignore[union-attr]
            for proj, _, half in PROJECTIONS:
                weight = by_attr[f"_e{e}_{proj.removesuffix('_proj')}_weight_quantizer"]
                source = by_attr[f"_e{e}_input_quantizer" if half is not None else f"_e{e}_down_input_quantizer"]
                out.append((f"{e}.{proj}", weight, source))
        return tuple(out)

    @staticmethod
    def linear_part_stage(name: str) -> int:
        """0 for an expert's gate and up projections (they read the routed tokens), 1 for its down projection (it
        reads what they compute): ``linear_parts.LinearPart.stage``."""
        return 1 if name.endswith(".down_proj") else 0

    @classmethod
    def from_float(cls, module: nn.Module, qconfig: Any) -> QuantMixin:
        twin = super().from_float(module, qconfig)
        twin.expert_tokens = [0] * module.down_proj.shape[0]  # type: ignore[union-attr]
        return twin

    def to_float(self) -> nn.Module:
        module = super().to_float()
        module.__dict__.pop("expert_tokens", None)
        return module

    def _quantizer(self, kind: str, e: int) -> nn.Module | None:
        return getattr(self, f"_e{e}_{kind}_quantizer", None)

    def _gate_up_weight(self, e: int) -> torch.Tensor:
        """Expert ``e``'s [2I, H] gate and up weights as its product sees them (its Parameter block itself when neither
        is quantized: the float module's very tensor)."""
        gate_q, up_q = self._quantizer("gate_weight", e), self._quantizer("up_weight", e)
        if gate_q is None and up_q is None:
            return self.gate_up_proj[e]
        inter = self.down_proj.shape[-1]
        return torch.cat(
            [self._quantize(gate_q, self.gate_up_proj[e, :inter]), self._quantize(up_q, self.gate_up_proj[e, inter:])]
        )

    def forward(  # type: ignore[override]
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The eager loop of transformers over the experts that received tokens, with each expert's quantizers."""
        experts = self.gate_up_proj.shape[0]
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for hit in expert_hit:
            e = int(hit[0])
            if e == experts:  # a token routed to no local expert (expert parallelism)
                continue
            top_k_pos, token_idx = torch.where(expert_mask[e])
            source = self._quantizer("input", e)
            if source is not None and bool(getattr(source, "observer_enabled", False)):
                self.expert_tokens[e] += int(token_idx.numel())
            current_state = hidden_states[token_idx]
            feed_part(self, f"{e}.gate_proj", current_state)  # the algorithms' hooks (linear_parts)
            feed_part(self, f"{e}.up_proj", current_state)
            gate, up = F.linear(self._quantize(source, current_state), self._gate_up_weight(e)).chunk(2, dim=-1)
            current = self.act_fn(gate) * up
            feed_part(self, f"{e}.down_proj", current)
            current = self._quantize(self._quantizer("down_input", e), current)
            current = F.linear(current, self._quantize(self._quantizer("down_weight", e), self.down_proj[e]))
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states

    def finish_calibration(self) -> str | None:
        """Give the static input quantizers of experts that saw no data the qparams of the sibling quantizer (same
        kind, other expert) with the largest scale; a sentence naming those experts, or None."""
        experts = self.gate_up_proj.shape[0]
        filled: set[int] = set()
        for kind in ("input", "down_input"):
            quantizers = [self._quantizer(kind, e) for e in range(experts)]
            fillable = [
                q is not None and not q.is_dynamic and hasattr(q, "set_qparams") and hasattr(q, "initialized")
                for q in quantizers
            ]
            ready = [q for q, ok in zip(quantizers, fillable, strict=True) if ok and _has_qparams(q)]
            missing = [e for e, ok in enumerate(fillable) if ok and not _has_qparams(quantizers[e])]
            if not ready or not missing:
                continue
            scale, zero_point = max(
                (q.calculate_qparams() for q in ready),  # type: ignore[union-attr]
                key=lambda qp: float(qp[0].detach().float().max()),
            )
            for e in missing:
                quantizers[e].set_qparams(scale.detach().clone(), zero_point.detach().clone())  # type: ignore[union-attr, operator]
                filled.add(e)
        if not filled:
            return None
        return (
            f"expert(s) {sorted(filled)} received no calibration token (tokens per expert: {self.expert_tokens}): "
            "their weights are quantized and their input quantizers take the largest input scale of their sibling "
            "experts, as vLLM does when it loads them"
        )

    def extra_repr(self) -> str:
        experts, hidden, inter = self.down_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={inter}, calibration tokens per expert={self.expert_tokens}"


def _has_qparams(q: Any) -> bool:
    """Whether a static quantizer holds qparams (lazily computed ones brought up to date first)."""
    q.calculate_qparams()
    return bool(q.initialized)


register_structural_twin(fused_experts_fit, QuantFusedExperts)
