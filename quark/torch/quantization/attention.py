"""KV-cache and attention quantization with amd-quark 0.13's semantics: ``kv_cache_quant_config`` before or after
RoPE (``kv_cache_post_rope``) and ``softmax_quant_spec``, on Hugging Face attention modules found by their structure.

- **Pre-RoPE** (the default): resolution gives every layer a ``kv_cache_quant_config`` pattern matches that entry
  (``resolve.kv_cache_entry``, amd-quark's ``setup_kv_cache_config``); the output quantizer of ``k_proj`` /
  ``v_proj`` quantizes the keys and values the projection computes. Nothing else is needed.
- **Post-RoPE** (``kv_cache_post_rope=True``): the same twins keep their output quantizer (so checkpoints and the
  export names ``k_proj.output_scale`` / ``v_proj.output_scale`` are those of pre-RoPE, as in amd-quark) but do not
  apply it (``QuantLinear.output_applied_elsewhere``): their attention applies it to the key and value states it
  hands to transformers' attention function, after RoPE. With a cache those include the past states, already on the
  grid of a static scale (quantizing them again leaves them as they are).
- **Softmax** (``softmax_quant_spec``): each attention module gets a ``QuantAttentionProbs`` child that quantizes the
  output of the softmax inside the eager attention function (``attn_implementation="eager"`` only: the fused kernels
  compute the probabilities where nothing can reach them).

How the attention is reached: transformers 5 attention modules call
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)(self, query, key,
value, mask, ...)``. ``get_interface`` of that interface (the object the attention's forward reads from its own
module: this engine never imports transformers) is wrapped once: every function it hands out, whatever the
implementation and the default the caller passes, runs behind a wrapper that applies the quantizers of an attention
this engine prepared and otherwise only calls the function, so it stays for the process. The softmax is reached by
replacing ``torch.nn.functional.softmax`` during that one call (amd-quark does it for the whole forward of the
attention): do not run two such models in threads of one process at once. Calibration runs without a KV cache
(``hf.no_kv_cache``), so the wrapper sees every key and value the model computes.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.config.config import Config
from quark.torch.quantization.hf import is_hf_conv1d
from quark.torch.quantization.nn.modules.quant_attention import (
    ATTENTION_PROBS,
    QuantAttentionProbs,
    attention_probs,
)
from quark.torch.quantization.nn.modules.quant_modules import QuantLinear, QuantMixin
from quark.torch.quantization.resolve import float_type, kv_cache_entry, submodule

__all__ = [
    "KV_PROJECTIONS",
    "attention_globals",
    "check_attention_config",
    "hf_attention_modules",
    "kv_cache_layers",
    "prepare_attention",
    "remove_attention_quantizers",
]

#: child names of an attention's key and value projections, as amd-quark's post-RoPE cache matches them
KV_PROJECTIONS = {"k_proj": "keys", "v_proj": "values"}
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_WRAPPED = "_quark_attention_wrapper"


# ----------------------------------------------------------------------------------------------- finding attention
def attention_globals(module: nn.Module) -> dict[str, Any] | None:
    """The module globals of the forward of ``module`` when it is a Hugging Face attention (its forward reads
    transformers' ``ALL_ATTENTION_FUNCTIONS`` and it has a ``config._attn_implementation``), else None."""
    function = inspect.unwrap(type(module).forward)
    code = getattr(function, "__code__", None)
    namespace = getattr(function, "__globals__", {})
    if code is None or _INTERFACE not in code.co_names or _INTERFACE not in namespace:
        return None
    return namespace if hasattr(getattr(module, "config", None), "_attn_implementation") else None


def hf_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every Hugging Face attention module of ``model`` (see ``attention_globals``)."""
    return [(name, m) for name, m in model.named_modules() if attention_globals(m) is not None]


def _quantizable_names(model: nn.Module) -> list[str]:
    """Names of the layers resolution can quantize, or has quantized (a prepared model's twins)."""
    return [
        name
        for name, m in model.named_modules()
        if (isinstance(m, QuantMixin) and not isinstance(m, QuantAttentionProbs)) or float_type(m) is not None
    ]


def kv_cache_layers(model: nn.Module, config: Config) -> list[str]:
    """Names of the layers a ``kv_cache_quant_config`` entry matches (the keys / values are their outputs)."""
    return [name for name in _quantizable_names(model) if kv_cache_entry(config, name) is not None]


# ----------------------------------------------------------------------------------------------- checks
def check_attention_config(model: nn.Module, config: Config) -> None:
    """The KV-cache and softmax fields against ``model``, before anything is changed: every kv and kv_cache_group
    pattern matches a layer, post-RoPE layers are the k_proj / v_proj Linears of Hugging Face attention modules, and
    softmax quantization finds eager attention modules. Raises a ValueError naming the field, the layer and the fix."""
    if config.kv_cache_quant_config:
        names = _quantizable_names(model)
        for pattern in config.kv_cache_quant_config:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                close = [n for n in names if any(p in n for p in KV_PROJECTIONS)][:6]
                raise ValueError(
                    f"Config.kv_cache_quant_config[{pattern!r}] matches no quantizable layer of the model (a typo?); "
                    f"layers with {list(KV_PROJECTIONS)} in their names: {close}"
                )
        kv_names = kv_cache_layers(model, config)
        for pattern in config.kv_cache_group:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in kv_names):
                raise ValueError(
                    f"Config.kv_cache_group pattern {pattern!r} matches none of the KV-cache layers {kv_names[:6]}; "
                    "its patterns pair layers of kv_cache_quant_config (['*k_proj', '*v_proj'])"
                )
        if config.kv_cache_post_rope:
            for name in kv_names:
                _check_post_rope_layer(model, name)
    if config.softmax_quant_spec is not None:
        _check_softmax_attention(model)


def _check_post_rope_layer(model: nn.Module, name: str) -> None:
    """A post-RoPE KV-cache layer is the k_proj / v_proj ``nn.Linear`` of a Hugging Face attention module."""
    parent_name, _, attr = name.rpartition(".")
    parent, layer = submodule(model, parent_name), submodule(model, name)
    fix = "or quantize the projection outputs before RoPE (kv_cache_post_rope=False)"
    if attr not in KV_PROJECTIONS:
        raise ValueError(
            f"Config.kv_cache_post_rope=True: the KV-cache layer '{name}' is not a key or value projection; after "
            f"RoPE the keys and values are reached through the attention's children named {list(KV_PROJECTIONS)} "
            f"(amd-quark's rule), so a fused or differently named projection has no post-RoPE counterpart; {fix}"
        )
    if attention_globals(parent) is None:
        raise ValueError(
            f"Config.kv_cache_post_rope=True: '{parent_name or '<model>'}' ({type(parent).__name__}), the parent of the "
            f"KV-cache layer '{name}', is not a Hugging Face attention module (transformers 5: its forward calls "
            f"ALL_ATTENTION_FUNCTIONS), so its keys and values after RoPE cannot be reached; {fix}"
        )
    if not isinstance(layer, nn.Linear) or is_hf_conv1d(layer):
        raise ValueError(
            f"Config.kv_cache_post_rope=True: the KV-cache layer '{name}' is a {type(layer).__name__}, not an "
            f"nn.Linear; {fix}"
        )


def _check_softmax_attention(model: nn.Module) -> None:
    """Softmax quantization needs Hugging Face attention modules running the eager attention function."""
    attentions = hf_attention_modules(model)
    if not attentions:
        raise ValueError(
            "Config.softmax_quant_spec quantizes the attention probabilities inside Hugging Face attention modules "
            f"(transformers 5: their forward calls ALL_ATTENTION_FUNCTIONS); {type(model).__name__} has none"
        )
    for name, module in attentions:
        impl = module.config._attn_implementation
        if impl != "eager":
            raise ValueError(
                f"Config.softmax_quant_spec: the attention '{name}' runs attn_implementation={impl!r}, whose kernel "
                "computes the probabilities where they cannot be quantized; switch the model to the eager attention: "
                "from_pretrained(..., attn_implementation='eager') / from_config(config, attn_implementation='eager'), "
                "or model.set_attn_implementation('eager') before quantizing"
            )


# ----------------------------------------------------------------------------------------------- preparation
def prepare_attention(model: nn.Module, config: Config) -> None:
    """After the layer swap (``check_attention_config`` passed): post-RoPE k/v twins hand their output quantizer to
    their attention, every Hugging Face attention gets a probabilities twin for ``softmax_quant_spec``, and the
    attention interface they read is wrapped (``_install``). Idempotent."""
    if config.kv_cache_post_rope:
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear) and m._output_quantizer is not None and kv_cache_entry(config, name):
                m.output_applied_elsewhere = True
                _install(submodule(model, name.rpartition(".")[0]))
    if config.softmax_quant_spec is not None:
        for name, m in hf_attention_modules(model):
            if attention_probs(m) is None:
                if hasattr(m, ATTENTION_PROBS):
                    raise ValueError(f"attention '{name}' already has an attribute '{ATTENTION_PROBS}'")
                device = next((p.device for p in m.parameters()), None)
                probs = QuantAttentionProbs.create(config.softmax_quant_spec, device)
                for _, q in probs.quantizer_slots():
                    q.where = f"attention '{name}' (probabilities)"
                m.add_module(ATTENTION_PROBS, probs)
            _install(m)


def remove_attention_quantizers(model: nn.Module) -> None:
    """Undo ``prepare_attention`` on the attention modules (a failed quantization puts the model back)."""
    for m in list(model.modules()):
        if attention_probs(m) is not None:
            delattr(m, ATTENTION_PROBS)


def _install(module: nn.Module) -> None:
    """Wrap what the attention interface ``module`` reads hands out (once per interface): its ``get_interface``
    returns, for every implementation and default, that function behind ``_wrapper``."""
    namespace = attention_globals(module)
    if namespace is None:  # checked before: a post-RoPE parent or a found attention is always one
        raise ValueError(f"{type(module).__name__} is not a Hugging Face attention module")
    interface = namespace[_INTERFACE]
    if getattr(interface, _WRAPPED, False):
        return
    original = interface.get_interface

    def get_interface(attn_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return _wrapper(original(attn_implementation, default))

    interface.get_interface = get_interface
    setattr(interface, _WRAPPED, True)


def _wrapper(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (the attention function ``get_interface`` chose) with the quantizers of a prepared attention
    applied; for any other module, ``function`` alone."""

    def quark_attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        key, value = _post_rope(module, key, value)
        probs = attention_probs(module)
        if probs is None:
            return function(module, query, key, value, *args, **kwargs)
        with _quantized_softmax(probs) as calls:
            out = function(module, query, key, value, *args, **kwargs)
        if not calls:
            raise RuntimeError(
                f"{type(module).__name__}: its attention function ({getattr(function, '__name__', function)}) "
                "computed no torch.nn.functional.softmax, so Config.softmax_quant_spec cannot quantize its "
                "probabilities; run the model with attn_implementation='eager' (model.set_attn_implementation('eager'))"
            )
        return out

    return quark_attention


def _post_rope(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value states through the output quantizers their projections hand over (post-RoPE)."""
    states = {"k_proj": key, "v_proj": value}
    for attr in KV_PROJECTIONS:
        layer = getattr(module, attr, None)
        if isinstance(layer, QuantLinear) and layer.output_applied_elsewhere and layer._output_quantizer is not None:
            states[attr] = layer._output_quantizer(states[attr])
    return states["k_proj"], states["v_proj"]


@contextmanager
def _quantized_softmax(probs: QuantAttentionProbs) -> Iterator[list[int]]:
    """Inside the block ``torch.nn.functional.softmax`` returns its result in the input's dtype through ``probs``
    (amd-quark's ``q_softmax``); yields a list with one entry per call."""
    original = F.softmax
    calls: list[int] = []

    def softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> torch.Tensor:
        calls.append(1)
        return probs(original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype).to(input.dtype))

    F.softmax = softmax
    try:
        yield calls
    finally:
        F.softmax = original
