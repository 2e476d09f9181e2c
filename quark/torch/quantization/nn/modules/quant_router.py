"""Quantized MoE routers: the module choosing each token's experts, found by its structure, quantized only when named.

transformers' MoE routers (Mixtral's ``MixtralTopKRouter``, Qwen2/3-MoE's and OLMoE's ``*TopKRouter``, DeepSeek-V3's,
GPT-OSS's, and Llama4's and PhiMoE's ``nn.Linear`` subclasses) hold a weight [E, H] (GPT-OSS also a bias [E]) and
compute ``F.linear(hidden_states, self.weight)`` before their own softmax / sigmoid, top-k and normalisation.
``router_fit`` recognises them by that structure (a ``top_k`` attribute, an experts count equal to the weight's rows)
and checks their forward on a probe input: the weight must reach exactly one ``F.linear`` (through dtype casts at
most), whose input is the forward's own input (reshaped or cast only). Routers that fail stay float with a reason
naming what differs.

vLLM and amd-quark keep routers float, so the twin is explicit-only: a router is quantized only when
``layer_quant_config`` (or ``layer_type_quant_config``) names it, e.g. ``"*.mlp.gate"``; otherwise coverage reports
``MOE_ROUTER_REASON``, which says so. Named, ``QuantMoERouter`` quantizes its input with the entry's
``input_tensors`` and its weight with ``weight`` (per tensor, channel or group, as for a Linear [E, H]), and runs the
router's *own* forward with the fake-quantized weight in place of the Parameter for that call (top-k, softmax,
normalisation, DeepSeek's correction bias untouched; gradients reach the Parameter through the quantizer, for QAT).
With its quantizers off it computes exactly what the float router does. Its state_dict keys are the float router's
plus the quantizers', and it exports as a Linear (``mlp.gate.weight`` codes, ``weight_scale``, ``input_scale``).
vLLM builds routers unquantized: ``warn_quantized_routers`` says so once per prepare.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from quark.torch.quantization.nn.modules.quant_modules import (
    QuantMixin,
    register_float_rule,
    register_prepare_hook,
    register_structural_twin,
)

__all__ = [
    "MOE_ROUTER_REASON",
    "MOE_ROUTER_FLOAT",
    "SUPPORTED_ROUTER",
    "QuantMoERouter",
    "moe_router_reason",
    "router_fit",
    "router_problems",
    "warn_quantized_routers",
]

MOE_ROUTER_REASON = (
    "MoE router: float by default, as vLLM and amd-quark keep it; name it in layer_quant_config (e.g. '*.mlp.gate') "
    "to quantize it"
)
#: the start of the reason of a router the twin does not handle
MOE_ROUTER_FLOAT = "MoE router: float, as vLLM and amd-quark keep it"
SUPPORTED_ROUTER = (
    "a weight [E, H] (and a bias [E]), top_k and an experts count E, and a forward passing its input, reshaped or "
    "cast only, and the weight to one F.linear"
)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
#: calls that read a tensor's metadata, not its values
_METADATA = frozenset({"__get__", "size", "dim", "numel", "stride", "is_contiguous", "is_floating_point"})
#: calls that give the same values in another dtype or memory layout (the quantized weight passes them alike)
_CASTS = frozenset({"to", "type", "float", "double", "half", "bfloat16", "contiguous", "detach"})
_PROBE_TOKENS = 4
#: (class, weight shape, dtype, device type, bias shape) -> the problems its forward showed on a probe input
_VERDICTS: dict[tuple[Any, ...], tuple[str, ...]] = {}


def _forward_first_argument(cls: type) -> str | None:
    """The name of ``cls.forward``'s first argument after ``self`` (None when it has none or cannot be read)."""
    try:
        params = list(inspect.signature(inspect.unwrap(cls.forward)).parameters)
    except (TypeError, ValueError):
        return None
    return params[1] if len(params) > 1 else None


def _is_router_like(module: nn.Module) -> bool:
    """A module holding a floating-point 2-D ``weight`` Parameter and an integer ``top_k``: what a router looks like."""
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    return (
        isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and weight.is_floating_point()
        and isinstance(getattr(module, "top_k", None), int)
    )


def _layout_problems(module: nn.Module) -> list[str]:
    """What keeps a router-like module's tensors and attributes from the supported layout."""
    weight = module.weight
    experts = weight.shape[0]
    problems = []
    counts = {a: getattr(module, a) for a in _EXPERT_COUNTS if isinstance(getattr(module, a, None), int)}
    if not counts:
        problems.append(f"no experts count ({' / '.join(_EXPERT_COUNTS)})")
    elif any(v != experts for v in counts.values()):
        problems.append(f"experts count {counts} but a weight of {experts} rows")
    others = sorted(n for n, _ in module.named_parameters(recurse=False) if n not in ("weight", "bias"))
    if others:
        problems.append(f"Parameters {others} besides weight and bias")
    bias = module._parameters.get("bias")
    if isinstance(bias, torch.Tensor) and tuple(bias.shape) != (experts,):
        problems.append(f"a bias of shape {list(bias.shape)} instead of [{experts}]")
    if any(True for _ in module.children()):
        problems.append(f"submodules {[n for n, _ in module.named_children()]}")
    if parametrize.is_parametrized(module):
        problems.append("a parametrized weight")
    return problems


class _WeightUse(TorchFunctionMode):
    """Records how a forward uses the router's weight and bias: the ``linear`` calls that take them, and any other
    call that reads their values (casts of them are followed as the same tensor)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.aliases = {id(t): name for name, t in tensors.items()}
        self.keep = list(tensors.values())  # alive while probing, so no id is reused
        self.linears: list[tuple[Any, str | None, str | None]] = []  # (input, weight's name, bias's name)
        self.problems: list[str] = []

    def _alias(self, value: Any) -> str | None:
        return self.aliases.get(id(value)) if isinstance(value, torch.Tensor) else None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        touched = [a for a in (*args, *kwargs.values()) if self._alias(a) is not None]
        if not touched or name in _METADATA:
            return out
        if name == "linear":
            inputs = (*args, None, None, None)
            weight = kwargs.get("weight", inputs[1])
            bias = kwargs.get("bias", inputs[2])
            self.linears.append((kwargs.get("input", inputs[0]), self._alias(weight), self._alias(bias)))
        elif name in _CASTS and args and self._alias(args[0]) is not None and isinstance(out, torch.Tensor):
            self.aliases[id(out)] = self._alias(args[0])  # type: ignore[assignment]
            self.keep.append(out)
        else:
            self.problems.append(f"passes its {self._alias(touched[0])} to {name}")
        return out


def _same_values(a: Any, x: torch.Tensor) -> bool:
    """Whether ``a`` holds the probe input's values in the same order (reshaped or cast only; shapes alone on the
    meta device)."""
    if not isinstance(a, torch.Tensor) or a.numel() != x.numel() or a.shape[-1] != x.shape[-1]:
        return False
    if a.is_meta or x.is_meta:
        return True
    return torch.equal(a.detach().reshape(-1).double(), x.reshape(-1).double())


def _probe(module: nn.Module) -> tuple[str, ...]:
    """The problems of the router's forward (eval mode, no grad, hooks and the random state untouched) on a probe
    input [4, H]: the weight must reach exactly one ``F.linear``, with the bias (if any) and the input itself."""
    weight = module.weight
    bias = module._parameters.get("bias")
    tensors = {"weight": weight} | ({"bias": bias} if isinstance(bias, torch.Tensor) else {})
    x = torch.linspace(-1.0, 1.0, _PROBE_TOKENS * weight.shape[1], dtype=weight.dtype, device=weight.device)
    x = x.reshape(_PROBE_TOKENS, weight.shape[1])
    use = _WeightUse(tensors)
    training = module.training
    devices = [weight.device.index or 0] if weight.device.type == "cuda" else []
    try:
        module.training = False
        with torch.random.fork_rng(devices=devices), torch.no_grad(), use:
            type(module).forward(module, x)
    except Exception as err:  # a forward that needs more than its hidden states, or cannot run on them
        return (f"its forward(hidden_states [{_PROBE_TOKENS}, H]) could not run on a probe input ({err})",)
    finally:
        module.training = training
    problems = list(dict.fromkeys(use.problems))
    with_weight = [call for call in use.linears if call[1] == "weight"]
    if len(with_weight) != 1:
        problems.append(f"its forward passes the weight to F.linear {len(with_weight)} times instead of once")
    else:
        inp, _, bias_name = with_weight[0]
        if "bias" in tensors and bias_name != "bias":
            problems.append("its bias is not the bias of its F.linear")
        if not _same_values(inp, x):
            problems.append("its F.linear's input is not the forward's input (reshaped or cast only)")
    return tuple(problems)


def router_problems(module: nn.Module) -> list[str]:
    """What keeps ``module`` from the router twin's supported structure (``SUPPORTED_ROUTER``); empty when it fits.
    The forward's verdict is kept per class, weight shape, dtype and device."""
    if not _is_router_like(module):
        return ["no floating-point weight [E, H] Parameter and integer top_k attribute"]
    problems = _layout_problems(module)
    if problems:
        return problems
    weight, bias = module.weight, module._parameters.get("bias")
    key = (type(module), tuple(weight.shape), weight.dtype, weight.device.type, None if bias is None else bias.shape)
    if key not in _VERDICTS:
        _VERDICTS[key] = _probe(module)
    return list(_VERDICTS[key])


def router_fit(module: nn.Module) -> bool | str:
    """The structural test of the router twin: True for a router it quantizes, a sentence naming what differs for a
    router-like module (a ``weight`` [E, H] and ``top_k``) it does not, False for any other module."""
    if not _is_router_like(module):
        return False
    problems = router_problems(module)
    if not problems:
        return True
    return f"an MoE router the router twin does not handle: {'; '.join(problems)} (it handles {SUPPORTED_ROUTER})"


def moe_router_reason(name: str, module: nn.Module, parent: nn.Module | None) -> str | None:
    """Why an MoE router stays float: ``MOE_ROUTER_REASON`` (how to quantize it) for a router the twin handles
    (``router_fit``), ``MOE_ROUTER_FLOAT`` with what differs for another module with a 2-D ``weight`` [E, H] beside a
    module holding 3-D expert Parameters [E, ...] (fused experts, in any layout); None for anything else."""
    if router_fit(module) is True:
        return MOE_ROUTER_REASON
    weight = getattr(module, "weight", None)
    if parent is None or not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return None
    beside_experts = any(
        sibling is not module and any(p.ndim == 3 and p.shape[0] == weight.shape[0] for p in sibling.parameters(False))
        for sibling in parent.children()
    )
    if not beside_experts:
        return None
    return f"{MOE_ROUTER_FLOAT}; the router twin cannot quantize it: {'; '.join(router_problems(module))}"


@contextmanager
def _substituted(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s Parameters replaced by ``tensors`` of the same names inside the block (what
    ``torch.func.functional_call`` does, without calling the module again: its hooks run once), restored after."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        for name, value in tensors.items():
            module._parameters[name] = value  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


class QuantMoERouter(QuantMixin):
    """The behaviour of every router twin (see the module docstring); the twin of a class is made on first sight,
    subclassing it (``twin_of_foreign_class``)."""

    roles = ("input_tensors", "weight", "bias")

    @property
    def _activation_channels(self) -> dict[tuple[str, int], int]:
        return {("input_tensors", -1): self.weight.shape[1]}

    def _quantized_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with the hidden states (the first argument, positional or by name) quantized."""
        if args:
            return (self._quantize(self._input_quantizer, args[0]), *args[1:]), kwargs
        first = _forward_first_argument(self._float_class)
        if first in kwargs:
            return args, {**kwargs, first: self._quantize(self._input_quantizer, kwargs[first])}  # type: ignore[index]
        return args, kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The float router's own forward on the quantized input, with the fake-quantized weight (and bias, when a
        spec quantizes it) in place of the Parameters."""
        args, kwargs = self._quantized_input(args, kwargs)
        weight, bias = self.quantized_weight_and_bias()
        tensors = {"weight": weight} | ({"bias": bias} if self._bias_quantizer is not None else {})
        with _substituted(self, tensors):
            return self._float_class.forward(self, *args, **kwargs)

    def extra_repr(self) -> str:
        experts, hidden = self.weight.shape
        return f"experts={experts}, hidden={hidden}, top_k={self.top_k}"


def warn_quantized_routers(model: nn.Module) -> None:
    """One warning naming the quantized MoE routers of a prepared ``model``: vLLM does not load them quantized."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantMoERouter) and any(True for _ in m.quantizers())]
    if names:
        warnings.warn(
            f"MoE router(s) {names} are quantized (named in the Config). vLLM builds MoE routers unquantized "
            "(quant_config=None) and has no place for their weight_scale / input_scale, so an amd-quark export of this "
            "model will not load there (nor through transformers' quark loader, which quantizes nn.Linear modules "
            "only, unless the router is one); this project's import loads it. Leave the routers unnamed (or exclude them) to serve the model "
            "elsewhere.",
            stacklevel=4,
        )


register_structural_twin(router_fit, QuantMoERouter, explicit_only=True)
register_float_rule(moe_router_reason)
register_prepare_hook(warn_quantized_routers)
