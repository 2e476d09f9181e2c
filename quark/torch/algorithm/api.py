"""Run the Config's algorithms on a model: SmoothQuant and AWQ on the float model (they rescale weights and fold the
inverse into the previous op), GPTQ on the prepared and calibrated model (it writes the quantized weights and their
qparams into the weight quantizers).

Models with a decoder stack are processed one decoder layer at a time: the inputs of layer 0 are captured per
calibration batch (with their keyword arguments), each layer is processed and its outputs become the next layer's
inputs, so only one layer's inputs are held at a time. GPTQ also runs on models without a decoder stack (layer by
layer, in forward order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.awq import awq_layer
from quark.torch.algorithm.capture import (
    LayerInputs,
    capture_layer_inputs,
    collect_inputs,
    forward_order,
    run_layer,
    with_hidden,
)
from quark.torch.algorithm.gptq import HessianAccumulator, check_gptq_spec, gptq_quantize, layer_input_rows
from quark.torch.algorithm.smoothquant import smooth_layer
from quark.torch.algorithm.structure import find_decoder_layers
from quark.torch.quantization.config.config import AWQConfig, Config, GPTQConfig, QuantizationSpec, SmoothQuantConfig
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

logger = logging.getLogger(__name__)
RunFn = Callable[[nn.Module, Any], Any]


# ----------------------------------------------------------------------------------------------- float-model passes
def check_embedding_layers(model: nn.Module, algo: Any) -> None:
    """``embedding_layers`` must name modules of the model (full names or suffixes such as ``embed_tokens``).

    Our capture runs the model's own forward up to the first decoder layer, so the embeddings need no special
    handling; the names are still checked, so a config written for another model is caught."""
    names = [n for n, _ in model.named_modules() if n]
    missing = [e for e in algo.embedding_layers or [] if not any(n == e or n.endswith("." + e) for n in names)]
    if missing:
        raise ValueError(f"{type(algo).__name__}.embedding_layers {missing} name no module of {type(model).__name__}")


def apply_pre_quant_and_awq(model: nn.Module, config: Config, batches: list[Any], run: RunFn, weight_spec_of: Callable[[str], QuantizationSpec | None]) -> None:
    """SmoothQuant(s) of ``pre_quant_opt_config``, then ``algo_config``'s SmoothQuant(s) and AWQ(s) in its order
    (amd-quark 0.13 places SmoothQuantConfig there), on the float ``model`` (weights change in place)."""
    for algo in config.pre_quant_opt_configs + config.algo_configs:
        check_embedding_layers(model, algo)
    for algo in config.pre_quant_opt_configs + config.algo_configs:
        if isinstance(algo, SmoothQuantConfig):
            _per_decoder_layer(model, algo.model_decoder_layers, batches, run, "SmoothQuant",
                               lambda prefix, layer, inputs, a=algo: smooth_layer(layer, inputs, a))  # fmt: skip
        elif isinstance(algo, AWQConfig):
            _per_decoder_layer(model, algo.model_decoder_layers, batches, run, "AWQ",
                               lambda prefix, layer, inputs, a=algo: awq_layer(layer, inputs, a, prefix, weight_spec_of))  # fmt: skip


def _per_decoder_layer(model: nn.Module, path: str | None, batches: list[Any], run: RunFn, what: str,
                       process: Callable[[str, nn.Module, LayerInputs], None]) -> None:  # fmt: skip
    found = find_decoder_layers(model, path)
    if found is None:
        raise ValueError(
            f"{what} needs a decoder stack (a ModuleList of layers with attention and MLP blocks); none found in "
            f"{type(model).__name__}. Give model_decoder_layers (e.g. 'model.layers')."
        )
    name, layers = found
    inputs = capture_layer_inputs(model, layers[0], batches, run)
    for i, layer in enumerate(layers):
        process(f"{name}.{i}", layer, inputs)
        if i + 1 < len(layers):
            inputs = [with_hidden(x, h) for x, h in zip(inputs, run_layer(layer, inputs), strict=True)]
        logger.info("%s: decoder layer %d/%d done", what, i + 1, len(layers))


# ----------------------------------------------------------------------------------------------- GPTQ
def gptq_targets(model: nn.Module) -> dict[str, nn.Module]:
    """Quantized layers whose weight quantizer has scales GPTQ can set (integer / minifloat, static)."""
    return {
        name: m for name, m in model.named_modules()
        if isinstance(m, QuantMixin) and isinstance(getattr(m, "_weight_quantizer", None), ScaledFakeQuantize)
        and isinstance(m, nn.Linear | nn.Conv2d)
    }  # fmt: skip


@torch.no_grad()
def apply_gptq(model: nn.Module, algo: GPTQConfig, batches: list[Any], run: RunFn) -> dict[str, float]:
    """GPTQ on every weight-quantized Linear/Conv2d of a prepared, calibrated model. Returns the loss per layer."""
    targets = gptq_targets(model)
    if not targets:
        raise ValueError("GPTQ: no layer with a static integer/minifloat weight quantizer to quantize")
    for name, m in targets.items():
        check_gptq_spec(m._weight_quantizer.spec, f"layer '{name}'")
        spec = m._weight_quantizer.spec
        if m.weight.ndim > 2 and spec.qscheme == QSchemeType.per_group and spec.ch_axis != 1:
            raise ValueError(f"layer '{name}': GPTQ needs a convolution's weight groups along its input channels (ch_axis=1), got {spec.ch_axis}")
    flags = [(q, bool(q.observer_enabled), bool(q.fake_quant_enabled)) for _, q in iter_quantizers(model)]
    for q, _, _ in flags:  # float activations, no statistics: the weights themselves become GPTQ's values
        if not q.is_dynamic:
            q.enable_observer(False)
        q.disable_fake_quant()
    losses: dict[str, float] = {}
    try:
        found = find_decoder_layers(model, algo.model_decoder_layers)
        if found is None:
            _gptq_layerwise(model, targets, algo, batches, run, losses)
        else:
            _gptq_decoder(model, found, targets, algo, batches, run, losses)
    finally:
        for q, observe, fake_quant in flags:
            if not isinstance(q, ScaledFakeQuantize) or observe:
                q.enable_observer(observe)
            q.enable_fake_quant(fake_quant)
    return losses


def _quantize_module(name: str, module: nn.Module, hessian: HessianAccumulator, algo: GPTQConfig, losses: dict[str, float]) -> None:
    quantizer: ScaledFakeQuantize = module._weight_quantizer  # type: ignore[assignment]
    weight = module.weight
    w2d, h, order = weight.reshape(weight.shape[0], -1), hessian.hessian, None
    if weight.ndim > 2 and quantizer.spec.qscheme == QSchemeType.per_group:
        # a convolution's quantizer groups input channels at each kernel position ([out, kh, kw, in/g, g]): GPTQ's
        # contiguous column groups are those when the columns go kernel position by kernel position, not [in, kh, kw]
        order = torch.arange(w2d.shape[1], device=w2d.device).reshape(weight.shape[1], -1).T.reshape(-1)
        w2d, h = w2d[:, order], h[order][:, order]
    result = gptq_quantize(
        w2d, h, quantizer.spec,
        damp_percent=algo.damp_percent, desc_act=algo.desc_act, static_groups=algo.static_groups,
    )  # fmt: skip
    if order is None:
        quantizer.set_qparams(result.scale, result.zero_point)
        q = result.weight.reshape(weight.shape)
    else:  # back to [in, kh, kw] columns; qparams in the quantizer's [out, kh, kw, in/g] layout
        qparams_shape = (weight.shape[0], *weight.shape[2:], -1)
        quantizer.set_qparams(result.scale.reshape(qparams_shape), result.zero_point.reshape(qparams_shape))
        q = result.weight[:, torch.argsort(order)].reshape(weight.shape)
    quantizer.enable_fake_quant(True)
    weight.data.copy_(quantizer(q))  # on the quantizer's own grid: its fake quant leaves the weight as it is
    losses[name] = result.loss
    if result.damp != algo.damp_percent:
        logger.warning("GPTQ: layer '%s' needed damp_percent=%g (Cholesky failed with %g)", name, result.damp, algo.damp_percent)


def _gptq_decoder(model: nn.Module, found: tuple[str, nn.ModuleList], targets: dict[str, nn.Module], algo: GPTQConfig,
                  batches: list[Any], run: RunFn, losses: dict[str, float]) -> None:  # fmt: skip
    prefix, layers = found
    inputs = capture_layer_inputs(model, layers[0], batches, run)
    for i, layer in enumerate(layers):
        own = {n[len(f"{prefix}.{i}.") :]: m for n, m in targets.items() if n.startswith(f"{prefix}.{i}.")}
        order = list(algo.inside_layer_modules) if algo.inside_layer_modules else list(own)
        missing = [n for n in order if n not in own]
        if missing:
            raise ValueError(f"GPTQ inside_layer_modules {missing} are not weight-quantized modules of {prefix}.{i}; found: {list(own)}")
        remaining = order
        while remaining:
            group = _same_input_group(layer, {n: own[n] for n in remaining}, inputs[0]) if algo.true_sequential else remaining
            hessians = {n: HessianAccumulator(_columns(own[n]), own[n].weight.device) for n in group}
            with collect_inputs({n: own[n] for n in group}, lambda n, m, x, h=hessians: h[n].add(layer_input_rows(m, x))):
                run_layer(layer, inputs)
            for n in group:
                _quantize_module(f"{prefix}.{i}.{n}", own[n], hessians[n], algo, losses)
            remaining = [n for n in remaining if n not in group]
        if i + 1 < len(layers):
            inputs = [with_hidden(x, h) for x, h in zip(inputs, run_layer(layer, inputs), strict=True)]
        logger.info("GPTQ: decoder layer %d/%d done", i + 1, len(layers))
    rest = {n: m for n, m in targets.items() if not n.startswith(prefix + ".")}
    if rest:  # e.g. lm_head: after the stack, one by one on the full model
        _gptq_layerwise(model, rest, algo, batches, run, losses)


def _same_input_group(layer: nn.Module, modules: dict[str, nn.Module], sample: tuple[tuple[Any, ...], dict[str, Any]]) -> list[str]:
    """The first module (in order) and the others that receive the very same input tensor (q, k, v; gate, up):
    quantizing one of them does not change what the others see, so they share one pass."""
    seen: dict[str, torch.Tensor] = {}
    with collect_inputs(modules, lambda n, m, x: seen.setdefault(n, x)), torch.no_grad():
        layer(*sample[0], **sample[1])  # the tensors stay referenced in ``seen``: no address reuse
    first = next(iter(modules))
    if first not in seen:
        return [first]
    return [n for n in modules if n in seen and seen[n] is seen[first]]


def _columns(module: nn.Module) -> int:
    return module.weight[0].numel()


def _gptq_layerwise(model: nn.Module, targets: dict[str, nn.Module], algo: GPTQConfig, batches: list[Any], run: RunFn,
                    losses: dict[str, float]) -> None:  # fmt: skip
    """One layer at a time in forward order; each sees the outputs of the already quantized layers before it."""
    for name in forward_order(model, targets, batches[0], run):
        module = targets[name]
        hessian = HessianAccumulator(_columns(module), module.weight.device)
        with collect_inputs({name: module}, lambda n, m, x, h=hessian: h.add(layer_input_rows(m, x))):
            for batch in batches:
                run(model, batch)
        _quantize_module(name, module, hessian, algo, losses)
