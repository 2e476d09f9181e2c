"""Run the Config's algorithms on a model: SmoothQuant and AWQ on the float model (they rescale weights and fold the
inverse into the previous op), GPTQ on the prepared and calibrated model (it writes the quantized weights and their
qparams into the weight quantizers).

Models with a decoder stack are processed one decoder layer at a time: every layer's inputs are captured per
calibration batch (its own keyword arguments: Gemma2/3's sliding or full attention masks, Gemma3's local or global
rotary embeddings), each layer is processed and its outputs become the next layer's hidden states, so only one
layer's hidden states are held at a time (``capture.layer_by_layer``). GPTQ also runs on models without a decoder
stack (layer by layer, in forward order). Within a decoder layer, GPTQ's passes stop once the group being collected
has its inputs, layers that read one input share its Hessian and factorization (see ``_gptq_layer``). Fused MoE
experts are quantized per expert and projection, each from the Hessian of the tokens routed to it (the twin's
Linear-equivalent parts, ``gptq_plan``): every expert's gate and up from one pass, then every expert's down; a
projection whose expert received too few tokens keeps round-to-nearest (``GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE``,
named in one warning).

SmoothQuant and AWQ's scaling must keep what each decoder layer computes: each checks its layer's output on the
captured inputs against the one before (``quark.torch.quantization.equivalence``); on EquivalenceError (or any other
error) every decoder layer processed so far gets its parameters and buffers back (``_per_decoder_layer``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.awq import awq_layer
from quark.torch.algorithm.capture import LayerInputs, RunFn, collect_inputs, forward_order, layer_by_layer
from quark.torch.algorithm.gptq import (
    HessianAccumulator,
    InverseHessian,
    check_gptq_spec,
    gptq_quantize,
    layer_input_rows,
    prepare_accumulated,
)
from quark.torch.algorithm.gptq_plan import (
    COMMON_INPUT,
    expert_min_tokens,
    gptq_groups,
    gptq_targets,
    linear_spec,
    share_key,
    tied_weights,
    warn_rtn_experts,
)
from quark.torch.algorithm.smoothquant import smooth_layer
from quark.torch.algorithm.structure import MODEL_FAMILIES, find_decoder_layers
from quark.torch.algorithm.structure import check_embedding_layers as check_embedding_layers  # its old home
from quark.torch.quantization.algo_registry import AlgorithmContext, check_algorithms, run_stage
from quark.torch.quantization.config.config import AWQConfig, Config, GPTQConfig, QuantizationSpec, SmoothQuantConfig
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.equivalence import restored_on_error
from quark.torch.quantization.hf import is_hf_conv1d, is_linear, linear_weight, no_kv_cache, transpose_weight_spec
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.linear_parts import LinearPart, named_modules_with_parts
from quark.torch.quantization.state import paused_quantizers
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- float-model passes
def apply_pre_quant_and_awq(
    model: nn.Module,
    config: Config,
    batches: list[Any],
    run: RunFn,
    weight_spec_of: Callable[[str], QuantizationSpec | None],
) -> None:
    """SmoothQuant(s) of ``pre_quant_opt_config``, then ``algo_config``'s SmoothQuant(s) and AWQ(s) in its order
    (amd-quark 0.13 places SmoothQuantConfig there), on the float ``model`` (weights change in place): the
    ``before_calibration`` stage of the algorithm registry."""
    algos = config.pre_quant_opt_configs + config.algo_configs
    check_algorithms(model, algos)
    run_stage("before_calibration", model, algos, AlgorithmContext(batches, run, weight_spec_of))


def weight_specs(model: nn.Module) -> dict[str, QuantizationSpec]:
    """The weight spec of each weight-quantized layer and Linear-equivalent part of a twin (an MoE expert's
    projection, ``linear_parts``), as for the weight seen [out, in] (a Conv1D's quantizer holds the transposed
    spec)."""
    return {
        n: transpose_weight_spec(m._weight_quantizer.spec) if is_hf_conv1d(m) else m._weight_quantizer.spec
        for n, m in named_modules_with_parts(model)
        if isinstance(m, QuantMixin | LinearPart) and m._weight_quantizer is not None
    }


def _with_data(context: AlgorithmContext | None, algo: Any) -> AlgorithmContext:
    """The handler's calibration context; a stage that gives none (e.g. graph mode's) is refused by name."""
    if context is None:
        raise ValueError(
            f"{type(algo).__name__} ({algo.name}) needs calibration batches; it was run at a stage without data"
        )
    return context


def run_smoothquant(model: nn.Module, algo: SmoothQuantConfig, context: AlgorithmContext | None) -> None:
    """SmoothQuant's handler: smooth each decoder layer of the float ``model``."""
    context = _with_data(context, algo)
    with no_kv_cache(model):
        _per_decoder_layer(
            model,
            algo.model_decoder_layers,
            context.batches,
            context.run,
            "SmoothQuant",
            lambda prefix, layer, inputs: smooth_layer(layer, inputs, algo, prefix),
        )


def run_awq(model: nn.Module, algo: AWQConfig, context: AlgorithmContext | None) -> None:
    """AWQ's handler: search and apply the scales of each decoder layer of the float ``model``."""
    context = _with_data(context, algo)
    spec_of = context.weight_spec_of or weight_specs(model).get
    with no_kv_cache(model):
        _per_decoder_layer(
            model,
            algo.model_decoder_layers,
            context.batches,
            context.run,
            "AWQ",
            lambda prefix, layer, inputs: awq_layer(layer, inputs, algo, prefix, spec_of),
        )


def run_gptq(model: nn.Module, algo: GPTQConfig, context: AlgorithmContext | None) -> None:
    """GPTQ's handler: on the prepared, calibrated ``model``."""
    context = _with_data(context, algo)
    apply_gptq(model, algo, context.batches, context.run)


def _per_decoder_layer(
    model: nn.Module,
    path: str | None,
    batches: list[Any],
    run: RunFn,
    what: str,
    process: Callable[[str, nn.Module, LayerInputs], None],
) -> None:
    found = find_decoder_layers(model, path)
    if found is None:
        raise ValueError(
            f"{what} needs a stack of transformer layers (a ModuleList of decoder or encoder layers of a known model "
            f"family: {[f.name for f in MODEL_FAMILIES]}, or with attention and MLP blocks); none found in "
            f"{type(model).__name__}, whose ModuleLists are {_module_lists(model)}. Give model_decoder_layers (e.g. "
            "'model.layers') and scaling_layers, or add a ModelFamily to quark.torch.algorithm.structure.MODEL_FAMILIES."
        )
    name, layers = found
    with ExitStack() as restore:  # an error in layer i puts layers 0 .. i back as they were
        for i, inputs in layer_by_layer(model, layers, batches, run):
            layer = layers[i]
            restore.enter_context(restored_on_error(layer))
            process(f"{name}.{i}", layer, inputs)
            logger.info("%s: decoder layer %d/%d done", what, i + 1, len(layers))


def _module_lists(model: nn.Module) -> dict[str, str]:
    """Each ModuleList of ``model`` and the type of its first item (what the error for a model no family fits shows)."""
    return {
        n: f"{len(m)} x {type(m[0]).__name__}"
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m)
    }


# ----------------------------------------------------------------------------------------------- GPTQ
@torch.no_grad()
def apply_gptq(model: nn.Module, algo: GPTQConfig, batches: list[Any], run: RunFn) -> dict[str, float]:
    """GPTQ on every weight-quantized Linear/Conv2d of a prepared, calibrated model. Returns the loss per layer."""
    targets = checked_gptq_targets(model)
    losses: dict[str, float] = {}
    kept: dict[str, int] = {}  # expert projections left at round-to-nearest: their routed tokens
    found = find_decoder_layers(model, algo.model_decoder_layers)
    # float activations, no statistics: the weights themselves become GPTQ's values (their flags restored after)
    with paused_quantizers(model, fake_quant=True), no_kv_cache(model):
        if found is None:
            gptq_layerwise(model, targets, algo, batches, run, losses, kept)
        else:
            _gptq_decoder(model, found, targets, algo, batches, run, losses, kept)
    warn_rtn_experts(kept, algo)
    return losses


def checked_gptq_targets(model: nn.Module) -> dict[str, nn.Module]:
    """The modules GPTQ quantizes (``gptq_targets``, less tied weights, with a warning), their specs checked."""
    targets = gptq_targets(model)
    if not targets:
        raise ValueError("GPTQ: no layer with a static integer/minifloat weight quantizer to quantize")
    for name, others in tied_weights(model, targets).items():
        logger.warning(
            "GPTQ: layer '%s' shares its weight with %s (tied embeddings): GPTQ would rewrite those too, so it keeps "
            "round-to-nearest quantization of its own weight",
            name,
            others,
        )
        del targets[name]
    for name, m in targets.items():
        spec = linear_spec(m)
        check_gptq_spec(spec, f"layer '{name}'")
        if m.weight.ndim > 2 and spec.qscheme == QSchemeType.per_group and spec.ch_axis != 1:
            raise ValueError(
                f"layer '{name}': GPTQ needs a convolution's weight groups along its input channels (ch_axis=1), got {spec.ch_axis}"
            )
    return targets


def _quantize_module(
    name: str,
    module: nn.Module,
    hessian: HessianAccumulator,
    algo: GPTQConfig,
    losses: dict[str, float],
    inverses: dict[int, InverseHessian] | None = None,
    kept: dict[str, int] | None = None,
) -> None:
    """GPTQ on one module for its Hessian; ``inverses`` holds the prepared inverse Hessian per accumulator, so
    modules that share an accumulator (the same input) factorize it once. An MoE expert's projection whose expert
    received too few tokens (``gptq_plan.expert_min_tokens``) keeps its round-to-nearest weights and gets no loss;
    ``kept`` gets its name and token count."""
    if hessian.count < expert_min_tokens(module, algo):
        if kept is not None:
            kept[name] = hessian.count
        return
    quantizer: ScaledFakeQuantize = module._weight_quantizer  # type: ignore[assignment]
    transposed = is_hf_conv1d(module)  # GPTQ works on [out, in]: a Conv1D's weight and spec transposed back
    weight, spec = linear_weight(module), linear_spec(module)
    w2d, h, order = weight.reshape(weight.shape[0], -1), None, None
    if weight.ndim > 2 and spec.qscheme == QSchemeType.per_group:
        # a convolution's quantizer groups input channels at each kernel position ([out, kh, kw, in/g, g]): GPTQ's
        # contiguous column groups are those when the columns go kernel position by kernel position, not [in, kh, kw]
        order = torch.arange(w2d.shape[1], device=w2d.device).reshape(weight.shape[1], -1).T.reshape(-1)
        w2d, h = w2d[:, order], hessian.hessian[order][:, order]  # type: ignore[index]
    inverse = None
    if inverses is not None and order is None:
        inverse = inverses.get(id(hessian))
        if inverse is None:  # the accumulator's Hessian is taken: modules sharing it reuse this inverse
            inverse = inverses[id(hessian)] = prepare_accumulated(
                hessian, damp_percent=algo.damp_percent, desc_act=algo.desc_act
            )
    elif order is None:
        h = hessian.hessian
    result = gptq_quantize(
        w2d,
        h,
        spec,
        damp_percent=algo.damp_percent,
        desc_act=algo.desc_act,
        static_groups=algo.static_groups,
        block_size=algo.block_size,
        inverse=inverse,
    )
    if order is None:
        quantizer.set_qparams(result.scale, result.zero_point)
        q = result.weight.reshape(weight.shape)
    else:  # back to [in, kh, kw] columns; qparams in the quantizer's [out, kh, kw, in/g] layout
        qparams_shape = (weight.shape[0], *weight.shape[2:], -1)
        quantizer.set_qparams(result.scale.reshape(qparams_shape), result.zero_point.reshape(qparams_shape))
        q = result.weight[:, torch.argsort(order)].reshape(weight.shape)
    quantizer.enable_fake_quant(True)
    stored = module.weight
    stored.data.copy_(quantizer(q.t() if transposed else q))  # on the quantizer's grid: its fake quant keeps it
    if _same_bits(quantizer(stored), stored):  # so the passes still to come may skip it (apply_gptq restores it)
        quantizer.disable_fake_quant()
    losses[name] = result.loss
    if result.damp != algo.damp_percent:
        logger.warning(
            "GPTQ: layer '%s' needed damp_percent=%g (Cholesky failed with %g)", name, result.damp, algo.damp_percent
        )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _gptq_decoder(
    model: nn.Module,
    found: tuple[str, nn.ModuleList],
    targets: dict[str, nn.Module],
    algo: GPTQConfig,
    batches: list[Any],
    run: RunFn,
    losses: dict[str, float],
    kept: dict[str, int],
) -> None:
    prefix, layers = found
    for i, inputs in layer_by_layer(model, layers, batches, run):
        gptq_decoder_layer(f"{prefix}.{i}", layers[i], targets, inputs, algo, losses, kept)
        logger.info("GPTQ: decoder layer %d/%d done", i + 1, len(layers))
    rest = {n: m for n, m in targets.items() if not n.startswith(prefix + ".")}
    if rest:  # e.g. lm_head: after the stack, one by one on the full model
        gptq_layerwise(model, rest, algo, batches, run, losses, kept)


def gptq_decoder_layer(
    prefix: str,
    layer: nn.Module,
    targets: dict[str, nn.Module],
    inputs: LayerInputs,
    algo: GPTQConfig,
    losses: dict[str, float],
    kept: dict[str, int] | None = None,
) -> None:
    """GPTQ on the decoder layer named ``prefix`` for its captured ``inputs``: its modules among ``targets`` (full
    names), in ``inside_layer_modules``' order when given (a ValueError names those it does not have)."""
    own = {n[len(prefix) + 1 :]: m for n, m in targets.items() if n.startswith(prefix + ".")}
    order = list(algo.inside_layer_modules) if algo.inside_layer_modules else list(own)
    missing = [n for n in order if n not in own]
    if missing:
        raise ValueError(
            f"GPTQ inside_layer_modules {missing} are not weight-quantized modules of {prefix}; found: {list(own)}"
        )
    if order:
        _gptq_layer(prefix, layer, {n: own[n] for n in order}, inputs, algo, losses, kept)


class _GroupDone(Exception):
    """Raised by a collection hook once every module of the group has had its inputs for this batch."""


class _Collector:
    """The Hessians of one group of modules over a pass of the layer.

    With ``share``, the group's Linear modules that read the very same input tensor (q/k/v, gate/up: what
    ``true_sequential`` groups; an MoE expert's gate and up, each expert its own: ``_share_key``) share one
    accumulator, so ``X^T X`` is computed once per batch. ``valid`` turns False if a batch breaks that (a module
    called twice, or with another tensor than the others of its accumulator); the caller then collects again without
    sharing."""

    def __init__(self, modules: dict[str, nn.Module], share: bool) -> None:
        self.modules = modules
        classes: dict[Any, list[str]] = {}
        for n, m in modules.items():
            if share and is_linear(m):
                classes.setdefault(share_key(m), []).append(n)
        self.shared = {  # module name -> its sharing class
            n: key
            for key, names in classes.items()
            if len(names) > 1 and len({modules[n].weight.device for n in names}) == 1
            for n in names
        }
        common: dict[Any, HessianAccumulator] = {}
        for n, key in self.shared.items():
            if key not in common:
                common[key] = HessianAccumulator(_columns(modules[n]), modules[n].weight.device)
        self.accumulators = {
            n: common[self.shared[n]] if n in self.shared else HessianAccumulator(_columns(m), m.weight.device)
            for n, m in modules.items()
        }
        self.valid = True
        self._inputs: dict[Any, torch.Tensor] = {}
        self._calls: Counter[str] = Counter()

    def start_batch(self) -> None:
        self._check_batch()
        self._inputs, self._calls = {}, Counter()

    def add(self, name: str, module: nn.Module, x: torch.Tensor) -> None:
        if name not in self.modules:
            return
        key = self.shared.get(name)
        if key is None:
            self.accumulators[name].add(layer_input_rows(module, x))
            return
        self._calls[name] += 1
        first = self._inputs.get(key)
        if first is None:
            self._inputs[key] = x
            self.accumulators[name].add(layer_input_rows(module, x))
        elif x is not first:
            self.valid = False

    def finish(self) -> _Collector:
        self._check_batch()
        return self

    def _check_batch(self) -> None:
        """Each module of a sharing class called once in the batch; an expert's gate and up may both be skipped
        (no token routed to it)."""
        if not self._calls:
            return
        for key in set(self.shared.values()):
            counts = {self._calls[n] for n, k in self.shared.items() if k == key}
            if counts != {1} and not (counts == {0} and key != COMMON_INPUT):
                self.valid = False


def _gptq_layer(
    prefix: str,
    layer: nn.Module,
    modules: dict[str, nn.Module],
    inputs: LayerInputs,
    algo: GPTQConfig,
    losses: dict[str, float],
    kept: dict[str, int] | None = None,
) -> None:
    """GPTQ on ``modules`` (in quantization order) of one decoder layer, group by group.

    The first pass runs the whole layer on every batch, as every pass did before: it finds the groups (with
    ``true_sequential``, the first module still to do and the others that receive the very same input tensor, as
    q/k/v and gate/up: quantizing one of them does not change what the others see), counts every module's calls per
    batch and collects the first group's Hessians (one per shared input). Each later group gets a pass that stops once
    its modules have had as many calls as in the first pass: what runs after them cannot change their inputs, and
    state a layer keeps across calls (a KV cache, written on the first call) was written by the full first pass. A
    batch where one of them was not called runs in full. Modules quantized so far run without re-quantizing their
    weights (already on their grid, checked bit for bit). The result is that of one full pass per group.
    """
    first_inputs: dict[str, torch.Tensor] = {}
    pending: list[tuple[str, torch.Tensor]] = []  # batch 0's inputs, until the first group is known
    calls: list[Counter[str]] = []
    groups: list[list[str]] = []
    collector: _Collector | None = None

    def first_sink(name: str, module: nn.Module, x: torch.Tensor) -> None:
        calls[-1][name] += 1
        if collector is None:
            first_inputs.setdefault(name, x)
            pending.append((name, x))
        else:
            collector.add(name, module, x)

    with collect_inputs(modules, first_sink):
        for args, kwargs in inputs:
            if collector is not None:
                collector.start_batch()
            calls.append(Counter())
            layer(*args, **kwargs)
            if collector is None:
                groups = gptq_groups(modules, first_inputs, algo.true_sequential)
                collector = _Collector({n: modules[n] for n in groups[0]}, share=algo.true_sequential)
                for name, x in pending:
                    collector.add(name, modules[name], x)
                pending.clear()
                first_inputs.clear()
    if collector is None:
        raise ValueError(f"GPTQ: decoder layer '{prefix}' received no calibration batch; pass at least one batch")
    if not collector.finish().valid:
        collector = _group_pass(layer, {n: modules[n] for n in groups[0]}, inputs, calls, share=False)
    for g, group in enumerate(groups):
        if g:
            collector = _group_pass(layer, {n: modules[n] for n in group}, inputs, calls, share=algo.true_sequential)
        inverses: dict[int, InverseHessian] = {}
        for n in group:
            _quantize_module(f"{prefix}.{n}", modules[n], collector.accumulators[n], algo, losses, inverses, kept)


def _group_pass(
    layer: nn.Module, modules: dict[str, nn.Module], inputs: LayerInputs, calls: list[Counter[str]], share: bool
) -> _Collector:
    """One pass of the layer over every batch collecting the Hessians of ``modules``, each batch stopped once they
    have had their ``calls`` (from the layer's first, full pass)."""
    collector = _Collector(modules, share)
    seen: Counter[str] = Counter()
    stop_at: dict[str, int] = {}

    def sink(name: str, module: nn.Module, x: torch.Tensor) -> None:
        collector.add(name, module, x)
        seen[name] += 1
        if stop_at and all(seen[n] >= c for n, c in stop_at.items()):
            raise _GroupDone

    with collect_inputs(modules, sink):
        for (args, kwargs), expected in zip(inputs, calls, strict=True):
            collector.start_batch()
            seen.clear()
            stop_at = {n: expected[n] for n in modules} if all(expected[n] > 0 for n in modules) else {}
            try:
                layer(*args, **kwargs)
            except _GroupDone:
                pass
    if not collector.finish().valid:
        return _group_pass(layer, modules, inputs, calls, share=False)
    return collector


def _columns(module: nn.Module) -> int:
    return linear_weight(module)[0].numel()


def gptq_layerwise(
    model: nn.Module,
    targets: dict[str, nn.Module],
    algo: GPTQConfig,
    batches: list[Any],
    run: RunFn,
    losses: dict[str, float],
    kept: dict[str, int] | None = None,
) -> None:
    """One layer at a time in forward order; each sees the outputs of the already quantized layers before it."""
    for name in forward_order(model, targets, batches[0], run):
        module = targets[name]
        hessian = HessianAccumulator(_columns(module), module.weight.device)
        with collect_inputs({name: module}, lambda n, m, x, h=hessian: h.add(layer_input_rows(m, x))):
            for batch in batches:
                run(model, batch)
        _quantize_module(name, module, hessian, algo, losses, None, kept)
