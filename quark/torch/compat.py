"""Every private torch API the engine relies on, in one place (the bottom layer: imports torch only).

Each wrapper says what it wraps and the torch versions it was checked on; when the private API is missing it raises
``CompatError`` naming the installed torch version and the feature that needs it, instead of an ``AttributeError``
deep inside a forward. ``tests/quark/test_torch_compat.py`` checks that each private API still behaves as relied on, so a
torch upgrade that breaks one fails there first, under the wrapper's name.

Relied on without a wrapper (nn.Module's protected extension points, used by subclasses on themselves and covered by
the same tests): overriding ``_apply``, ``_load_from_state_dict`` and ``_save_to_state_dict``, and a subclass
reading its own ``_buffers`` / ``_modules``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "CHECKED_TORCH",
    "CompatError",
    "EXPORT_GUARDS_ATTR",
    "buffer_registry",
    "ddp_ignore_states",
    "dynamo_recompile_limit",
    "fake_quantize_learnable_backward",
    "forward_pre_hooks",
    "inplace_overload",
    "make_fx_tracing",
    "module_twin",
    "parameter_registry",
    "rnn_flat_weight_names",
    "rnn_kernel",
    "tensor_version",
]

#: the torch versions every wrapper below was checked on (2.13: CPU, the test suite; 2.11: CUDA, the engine tests)
CHECKED_TORCH = ("2.11", "2.13")

#: the attribute torch.export's ``ExportedProgram.module()`` holds its input-shape guards in (a submodule, torch >= 2.9)
EXPORT_GUARDS_ATTR = "_guards_fn"

M = TypeVar("M", bound=nn.Module)

#: nn.Module's per-instance registries a twin gets its own copy of (same Parameters, buffers and children inside)
_REGISTRIES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class CompatError(ValueError):
    """A private torch API the engine relies on is missing or changed in the installed torch."""


def _missing(feature: str, what: str) -> CompatError:
    """The error for ``feature`` when torch's private ``what`` is not there."""
    checked = ", ".join(CHECKED_TORCH)
    return CompatError(
        f"{feature} relies on torch's private {what}, which torch {torch.__version__} does not have "
        f"(checked on torch {checked}); install one of those versions, or adapt quark/torch/compat.py"
    )


def _private(owner: Any, name: str, feature: str, what: str | None = None) -> Any:
    """``owner.<name>``, else CompatError naming ``feature``."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(feature, what or name) from None


def make_fx_tracing() -> bool:
    """Whether ``make_fx`` is tracing now (its proxy dispatch mode is on): FX cannot trace a compiled function, so the
    quantizers' kernels run their eager bodies there. A C lookup, cheap on every kernel call. Checked on torch 2.11,
    2.13."""
    get_mode = _private(torch._C, "_get_dispatch_mode", "kernels under make_fx", "torch._C._get_dispatch_mode")
    keys = _private(torch._C, "_TorchDispatchModeKey", "kernels under make_fx", "torch._C._TorchDispatchModeKey")
    return get_mode(keys.PROXY) is not None


def rnn_kernel(name: str) -> Callable[..., Any]:
    """Torch's fused recurrent kernel ``torch._VF.<name>`` (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu`` and their
    ``*_cell`` forms), which the quantized LSTM/GRU/RNN twins call one layer at a time on fake-quantized weights, as
    ``nn.LSTM`` & co. call it for all layers. Checked on torch 2.11, 2.13."""
    vf = _private(torch, "_VF", "QuantLSTM/QuantGRU/QuantRNN", "torch._VF")
    return _private(vf, name, "QuantLSTM/QuantGRU/QuantRNN", f"torch._VF.{name}")


def rnn_flat_weight_names(module: nn.Module) -> list[str]:
    """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``'s ``_flat_weights_names``: its weight and bias names in the fused
    kernel's order (``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ...). Checked on torch 2.11, 2.13."""
    return list(
        _private(module, "_flat_weights_names", f"quantizing {type(module).__name__}", "RNNBase._flat_weights_names")
    )


def module_twin(module: nn.Module, cls: type[M], drop: Iterable[str] = ()) -> M:
    """A ``cls`` instance sharing ``module``'s Parameters, buffers, children, hooks and attributes, built without
    ``__init__`` by copying its ``__dict__`` (torch's private per-instance state): the registries
    ``_parameters``, ``_buffers``, ``_modules`` and ``_non_persistent_buffers_set`` are the twin's own (registering
    on one leaves the other as it was), the objects inside them are the same. Children and attributes named in
    ``drop`` are left out. Used to swap a float layer for its quantized twin and back. Checked on torch 2.11, 2.13."""
    state = dict(module.__dict__)
    for key in _REGISTRIES:
        if key not in state:
            raise _missing(f"swapping {type(module).__name__} for {cls.__name__}", f"nn.Module.{key}")
        state[key] = type(state[key])(state[key])
    for key in drop:
        state["_modules"].pop(key, None)
        state.pop(key, None)
    twin = cls.__new__(cls)
    twin.__dict__.update(state)
    return twin


def parameter_registry(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module._parameters``, the live name -> Parameter dict (writing into it replaces a Parameter without
    ``register_parameter``, which ``parameters_on_meta`` patches). Checked on torch 2.11, 2.13."""
    return _private(module, "_parameters", f"replacing Parameters of {type(module).__name__}", "nn.Module._parameters")


def buffer_registry(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module._buffers``, the live name -> buffer dict (writing into it replaces a buffer and keeps it persistent
    or not, as it was). Checked on torch 2.11, 2.13."""
    return _private(module, "_buffers", f"replacing buffers of {type(module).__name__}", "nn.Module._buffers")


def forward_pre_hooks(module: nn.Module) -> dict[int, Callable[..., Any]]:
    """``module._forward_pre_hooks``, the live id -> hook dict: where the old-style ``torch.nn.utils.weight_norm`` /
    ``spectral_norm`` hooks sit (torch has no public way to list or remove a module's hooks). Checked on torch 2.11,
    2.13."""
    return _private(module, "_forward_pre_hooks", "weight_norm / spectral_norm layers", "nn.Module._forward_pre_hooks")


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor._version``: autograd's counter of in-place writes (writes through ``.data`` leave it as it was);
    cheap change detection for learned quantizer scales. Checked on torch 2.11, 2.13."""
    return int(_private(tensor, "_version", "checking learned scales", "Tensor._version"))


def fake_quantize_learnable_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    grad_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_scale, grad_zero_point) of per-tensor learnable fake quantization (LSQ's straight-through
    estimator, round half to even) from torch's fused private kernel
    ``torch.ops.aten._fake_quantize_learnable_per_tensor_affine_backward``. Checked on torch 2.11, 2.13."""
    name = "_fake_quantize_learnable_per_tensor_affine_backward"
    op = _private(torch.ops.aten, name, "TQT's per-tensor backward", f"torch.ops.aten.{name}")
    return op(grad, x, scale, zero_point, qmin, qmax, grad_factor)


@functools.cache
def _recompile_limit_name() -> str:
    """The name of dynamo's per-frame recompile limit in this torch (``cache_size_limit`` before torch 2.7)."""
    config = _private(torch, "_dynamo", "compiled kernels", "torch._dynamo").config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            return name
    raise _missing("compiled kernels", "torch._dynamo.config.recompile_limit")


def dynamo_recompile_limit(value: int | None = None) -> int:
    """``torch._dynamo.config.recompile_limit`` (set directly, not by ``config.patch``, which costs 3x as much per
    call): returns the value before, and sets ``value`` when given. Checked on torch 2.11, 2.13."""
    config = torch._dynamo.config
    name = _recompile_limit_name()
    before = getattr(config, name)
    if value is not None:
        setattr(config, name, value)
    return before


def inplace_overload(op: Any) -> Any | None:
    """The in-place form of the aten ``OpOverload`` ``op`` (``aten.sigmoid.default`` -> ``aten.sigmoid_.default``),
    None when aten has none or ``op`` is not an OpOverload; reads ``torch._ops.OpOverload`` and its ``_schema`` /
    ``_overloadname``. Checked on torch 2.11, 2.13."""
    overload_class = _private(
        _private(torch, "_ops", "graph mode rules", "torch._ops"), "OpOverload", "graph mode rules"
    )
    if not isinstance(op, overload_class):
        return None
    schema = _private(op, "_schema", "graph mode rules", "OpOverload._schema")
    packet = getattr(torch.ops.aten, schema.name.split("::")[1] + "_", None)
    overload = _private(op, "_overloadname", "graph mode rules", "OpOverload._overloadname")
    return getattr(packet, overload, None) if packet is not None else None


def ddp_ignore_states(module: nn.Module, names: Iterable[str]) -> list[str]:
    """Add ``names`` (state_dict keys) to the parameters and buffers DDP neither broadcasts nor reduces, through
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (set before the module is wrapped);
    returns the whole ignore list. Checked on torch 2.11, 2.13."""
    from torch.nn.parallel import DistributedDataParallel

    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    ignored += [n for n in names if n not in ignored]
    setter = _private(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", "QuantCallback under DDP")
    setter(module, ignored)
    return ignored
