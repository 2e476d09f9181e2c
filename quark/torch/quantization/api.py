"""ModelQuantizer: resolve the Config per layer and role, swap layers for their quantized twins, calibrate, freeze.

Resolution (which QuantizationConfig a layer gets, ``exclude``) lives in ``resolve``, what stays float and why in
``coverage``, how calibration batches are fed in ``batches``; the names users import from here are re-exported.
Everything that can be checked is checked before the model is touched, and a failure midway restores it.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from quark.torch.quantization import graph
from quark.torch.quantization.algo_registry import (
    AlgorithmContext,
    algorithm_entry,
    algorithm_stage,
    check_algorithms,
    run_stage,
)
from quark.torch.quantization.attention import check_attention_config, prepare_attention, remove_attention_quantizers
from quark.torch.quantization.batches import (
    check_calibration_data,
    feed_calibration,
    model_device,
    needs_data,
    plan_needs_data,
    run_batch,
    to_device,
)
from quark.torch.quantization.config.config import Config, QuantizationConfig
from quark.torch.quantization.config.type import QuantizationMode
from quark.torch.quantization.coverage import (
    FloatLayer,
    float_layers,
    format_float_layers,
    functional_float,
    report_coverage,
    uncalibrated_layers,
    warn_float_layers,
)
from quark.torch.quantization.distributed import refuse_sharded
from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.nn.modules.quant_modules import (
    PREPARE_HOOKS,
    QUANT_MODULE_MAP,
    QuantMixin,
    bakeable,
    iter_quantizers,
    refresh_computed_tensors,
    shared_tensors,
    slot_label,
    slot_tensor,
)
from quark.torch.quantization.resolve import (
    LayerPlan,
    activation_axes_to_check,
    check_activation_shapes,
    check_layer,
    custom_forward_layers,
    float_type,
    format_plans,
    layer_types,
    owners,
    parent_of,
    qparams_source,
    resolve_layer,
    submodule,
    type_names,
    unmatched_names,
)
from quark.torch.quantization.state import QuantState, ensure_quant_state, preserve_modes, quant_state
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize, FakeQuantizeBase

logger = logging.getLogger(__name__)

__all__ = [
    "ModelQuantizer",
    "LayerPlan",
    "activation_axes_to_check",
    "check_activation_shapes",
    "unmatched_names",
    "run_batch",
    "format_plans",
    "qparams_source",
    "uncalibrated_layers",
]

ROLES = QuantizationConfig.ROLES
SUPPORTED_TYPE_NAMES = sorted(c.__name__ for c in QUANT_MODULE_MAP)


class ModelQuantizer:
    """Quantize a float model with a Quark ``Config``.

    Example::

        quantizer = ModelQuantizer(config)
        model = quantizer.quantize_model(model, calib_dataloader)   # prepare + calibrate, in place
        model = ModelQuantizer.freeze(model)                         # fixed qparams, no observers

    Training-time callers use the halves: ``prepare(model)`` then ``calibrate(model, data)`` (or QAT).
    """

    def __init__(self, config: Config | dict[str, Any]) -> None:
        if isinstance(config, dict):
            config = Config.from_dict(config)
        if not isinstance(config, Config):
            raise ValueError(f"ModelQuantizer needs a Config (or its dict), got {type(config).__name__}")
        self.graph_mode = config.quant_mode == QuantizationMode.fx_graph_mode
        unknown = [k for k in config.layer_type_quant_config if k not in SUPPORTED_TYPE_NAMES]
        if unknown and not self.graph_mode:  # graph mode also matches the class names of the model's own modules
            raise ValueError(
                f"Config.layer_type_quant_config names unsupported layer type(s) {unknown}; supported: {SUPPORTED_TYPE_NAMES}"
            )
        self.config = config
        self._warned: set[str] = set()  # each unmatched-entry warning once per quantizer (resolve, then prepare)

    # -- planning
    def resolve(self, model: nn.Module, warn: bool = True) -> list[LayerPlan]:
        """Per-layer plans, in module order, without changing the model; warns about names that match nothing
        and about subclasses of supported layers that define their own forward (those stay float). Graph mode:
        one plan per compute op of the captured graph."""
        if self.graph_mode:
            return self._graph_plans(model)
        names = [n for n, _ in model.named_modules()]
        owned = owners(model)
        plans = []
        for name, module in model.named_modules():
            plan = resolve_layer(self.config, name, module, owned.get(name))
            if plan is not None:
                check_layer(plan, module)
                plans.append(plan)
        check_attention_config(model, self.config)  # KV cache and softmax: patterns, placements, eager attention
        if warn:
            self._warn_unmatched(model, names)
            custom = custom_forward_layers(model)
            if custom:
                warnings.warn(
                    f"layers that subclass a supported type but define their own forward stay float: {custom}",
                    stacklevel=2,
                )
        return plans

    def absent_layer_types(self, model: nn.Module) -> list[str]:
        """The keys of ``layer_type_quant_config`` that name no class of the model's modules (they configure nothing)."""
        present = {t for m in model.modules() for t in type_names(m)}
        return [k for k in self.config.layer_type_quant_config if k not in present]

    def _warn_unmatched(self, model: nn.Module, names: list[str]) -> None:
        messages = [
            f"Config.{field_name} entries match no layer of the model (typo?): {dead}"
            for field_name, dead in unmatched_names(self.config, names).items()
        ]
        unused = self.absent_layer_types(model)
        if unused:
            messages.append(
                f"Config.layer_type_quant_config entries name layer types the model does not have, so they configure "
                f"nothing: {unused}; the model's quantizable layer types: {layer_types(model)}"
            )
        for message in messages:
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, stacklevel=3)

    def _graph_plans(self, model: nn.Module) -> list[LayerPlan]:
        return [
            LayerPlan(u.name or "<top>", u.type_name or u.op, u.qconfig, u.source)
            for u in self._graph_state(model).graph_units or []
            if u.qconfig is not None
        ]

    def _graph_state(self, model: nn.Module) -> QuantState:
        """The graph-mode record of ``model``: its own once prepared, else that of a preparation of it (not kept)."""
        state = quant_state(model)
        if state is None or state.graph_units is None:
            state = ensure_quant_state(graph.prepare_graph(self._require_graph(model), self.config))
        return state

    def _require_graph(self, model: nn.Module) -> Any:
        if not graph.is_graph_module(model):
            raise graph.GraphModeError(
                f"quant_mode=fx_graph_mode works on a captured graph, got {type(model).__name__}: capture it first with "
                "quark.torch.quantization.graph.capture(model, example_inputs) (torch.export.export(model, args).module() "
                "works too), or pass it with a dataloader to quantize_model, which captures it on the first batch"
            )
        return model

    def float_layers(self, model: nn.Module) -> list[FloatLayer]:
        """Modules holding Parameters that stay float, each with the reason (excluded, unsupported type, ...); on a
        calibrated model also the Parameters a forward used functionally, outside any quantizer."""
        if self.graph_mode:
            return list(self._graph_state(model).graph_float_layers or [])
        plans = self.resolve(model, warn=False)
        state = quant_state(model)
        uses = state.functional_uses if state is not None else {}
        out = []
        for f in float_layers(self.config, model, {p.name for p in plans}):
            if f.reason.startswith("no quantized twin") and f.name in uses:
                f = FloatLayer(
                    f.name,
                    f.layer_type,
                    f"no quantized twin for {f.layer_type}: Parameter {', '.join(uses[f.name])} used functionally",
                )
            out.append(f)
        return out + functional_float(model, uses)

    def summary(self, model: nn.Module) -> str:
        """A readable table of what resolution decides: layer, type, role -> dtype/qscheme/observer (source), then
        the layers that stay float and why."""
        plans = self.resolve(model)
        floats = format_float_layers(self.float_layers(model))
        return format_plans(plans) + (f"\n\n{floats}" if floats else "")

    # -- the two halves
    def prepare(self, model: nn.Module, name_prefix: str = "") -> nn.Module:
        """Swap every configured layer for its quantized twin (same Parameters), in place. Idempotent.

        Graph mode: returns a new, quantized graph module (same Parameter objects; conv + BatchNorm units simulate
        the folding for QAT); the captured graph passed in is left as it was. ``name_prefix``: what the graph's module
        names are under in the Config (``"net."`` for a captured ``self.net`` of a LightningModule)."""
        refuse_sharded(
            model,
            "ModelQuantizer.prepare",
            "Prepare before fully_shard (QuantCallback does it in setup, before configure_model).",
        )
        if self.graph_mode:
            prepared = graph.prepare_graph(self._require_graph(model), self.config, name_prefix)
            warn_float_layers(self._graph_state(prepared).graph_float_layers or [], stacklevel=3)
            return prepared
        return self._prepare(model, self.resolve(model))

    def _prepare(self, model: nn.Module, plans: list[LayerPlan]) -> nn.Module:
        floats = float_layers(self.config, model, {p.name for p in plans})
        swapped: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            for plan in plans:
                parent, attr = parent_of(model, plan.name)
                original = getattr(parent, attr)
                twin = QUANT_MODULE_MAP[float_type(original)].from_float(original, plan.qconfig)  # type: ignore[index]
                for slot, q in twin.quantizer_slots():
                    q.where = f"layer '{plan.name}' ({plan.layer_type}, {slot_label(slot)})"
                setattr(parent, attr, twin)
                swapped.append((parent, attr, original))
        except BaseException:
            _restore(swapped)
            raise
        model.quant_config = self.config
        prepare_attention(model, self.config)
        for hook in PREPARE_HOOKS:
            hook(model)
        logger.info("prepared %d layer(s) for quantization", len(plans))
        warn_float_layers(floats, stacklevel=4)
        return model

    def calibrate(
        self,
        model: nn.Module,
        dataloader: Iterable[Any] | None = None,
        forward_loop: Callable[[nn.Module], Any] | None = None,
        max_batches: int | None = None,
    ) -> nn.Module:
        """Run the observers of a prepared model on calibration data (eval mode, no_grad), then fix static qparams.

        Weights and biases are observed directly; activations see ``dataloader``'s batches (or ``forward_loop(model)``).
        Weight-only and fully dynamic configs need no data. The model's train/eval mode is restored.
        """
        if self.graph_mode:  # PTQ: fold BatchNorm, then equalize, on the float function, before any statistic
            graph.fold_and_equalize(model, self.config)
        quantizers = [q for _, q in iter_quantizers(model)]
        data_needed = needs_data(model)
        if data_needed:
            check_calibration_data(dataloader, forward_loop)
        batches = self._algorithm_batches(dataloader, forward_loop, max_batches)
        with no_kv_cache(model):  # the forwards here are statistics, not generation: a KV cache would only grow
            self._calibrate(model, quantizers, data_needed, batches, dataloader, forward_loop, max_batches)
        return model

    def _calibrate(
        self,
        model: nn.Module,
        quantizers: list[FakeQuantizeBase],
        data_needed: bool,
        batches: list[Any] | None,
        dataloader: Iterable[Any] | None,
        forward_loop: Callable[[nn.Module], Any] | None,
        max_batches: int | None,
    ) -> None:
        with preserve_modes(model, mode=False):  # per module: a frozen BatchNorm stays in eval
            self._observe(model, quantizers, data_needed, batches, dataloader, max_batches, forward_loop)
            if batches is not None:  # GPTQ: on the calibrated model, it sets the weights and their qparams
                run_stage("after_calibration", model, self._algorithms(), self._algorithm_context(model, batches))

    def _observe(
        self,
        model: nn.Module,
        quantizers: list[FakeQuantizeBase],
        data_needed: bool,
        batches: list[Any] | None,
        dataloader: Iterable[Any] | None,
        max_batches: int | None,
        forward_loop: Callable[[nn.Module], Any] | None,
    ) -> None:
        """The calibration forwards (observers on, fake quant off), then every quantizer quantizing (and static
        ones no longer observing), also on error."""
        try:
            if batches is not None:  # SmoothQuant / AWQ rescale the float weights: before any statistic is taken
                for q in quantizers:
                    q.enable_observer(False)
                    q.disable_fake_quant()
                check_algorithms(model, self._algorithms())
                run_stage("before_calibration", model, self._algorithms(), self._algorithm_context(model, batches))
                dataloader, max_batches = batches, None
            for q in quantizers:
                q.enable_observer()
                q.disable_fake_quant()
            with torch.no_grad():
                observe_params(model)
                if data_needed:
                    seen, record = feed_calibration(model, dataloader, forward_loop, max_batches)
                    if dataloader is not None and seen == 0:
                        raise ValueError(
                            "the calibration dataloader yielded no batch; static activation quantization needs data"
                        )
                    report_coverage(model, record)
        finally:
            for q in quantizers:
                q.enable_observer(q.is_dynamic)  # dynamic quantizers keep observing every call
                q.enable_fake_quant()

    def _algorithms(self) -> list[Any]:
        """The Config's algorithm configs in the order they run: ``pre_quant_opt_config``, then ``algo_config``."""
        return self.config.pre_quant_opt_configs + self.config.algo_configs

    @staticmethod
    def _algorithm_context(model: nn.Module, batches: list[Any]) -> AlgorithmContext:
        """The batches the algorithms pass over and how one runs on ``model``'s device."""
        device = model_device(model)
        return AlgorithmContext(batches, lambda m, b: run_batch(m, b, device))

    def _algorithm_batches(
        self, dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None, max_batches: int | None
    ) -> list[Any] | None:
        """The calibration batches as a list when the Config has algorithms (they pass over them several times)."""
        algos = [
            a for a in self.config.algo_configs + self.config.pre_quant_opt_configs if algorithm_stage(a) != "graph"
        ]
        if not algos:
            return None
        names = [a.name for a in algos]  # type: ignore[attr-defined]
        for algo in algos:  # their handlers are registered (ValueError otherwise)
            algorithm_entry(algo, need_handler=True)
        if dataloader is None:
            raise ValueError(
                f"{names} need calibration batches: pass a dataloader (a forward_loop cannot be replayed per layer)"
            )
        batches = list(itertools.islice(dataloader, max_batches))
        if not batches:
            raise ValueError(f"{names}: the calibration dataloader yielded no batch")
        return batches

    def quantize_model(
        self,
        model: nn.Module,
        dataloader: Iterable[Any] | None = None,
        forward_loop: Callable[[nn.Module], Any] | None = None,
        max_batches: int | None = None,
    ) -> nn.Module:
        """Prepare and calibrate ``model`` in place and return it. On failure the model is left as it was.

        Graph mode: returns the quantized graph module (a plain ``nn.Module`` is first captured with the first
        calibration batch as example input); the model passed in is not changed."""
        if self.graph_mode:
            return self._quantize_graph(model, dataloader, forward_loop, max_batches)
        plans = self.resolve(model)
        if any(plan_needs_data(p) for p in plans):
            check_calibration_data(dataloader, forward_loop)
        originals = {p.name: submodule(model, p.name) for p in plans}
        had_config = hasattr(model, "quant_config")
        # algorithms change weights (and norms) in place: keep their values to put back on failure
        saved = (
            [(t, t.detach().clone()) for t in itertools.chain(model.parameters(), model.buffers())]
            if self.config.algo_configs or self.config.pre_quant_opt_configs
            else []
        )
        try:
            self._prepare(model, plans)
            self.calibrate(model, dataloader, forward_loop, max_batches)
        except BaseException:
            remove_attention_quantizers(model)
            for name, module in originals.items():
                parent, attr = parent_of(model, name)
                setattr(parent, attr, module)
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)
            if not had_config and "quant_config" in model.__dict__:
                del model.quant_config
            raise
        return model

    def _quantize_graph(
        self,
        model: nn.Module,
        dataloader: Iterable[Any] | None,
        forward_loop: Callable[[nn.Module], Any] | None,
        max_batches: int | None,
    ) -> nn.Module:
        if not graph.is_graph_module(model):
            if dataloader is None:
                self._require_graph(model)
            first = next(iter(dataloader), None)  # type: ignore[arg-type]
            if first is None:
                raise ValueError("the calibration dataloader yielded no batch; graph capture needs an example input")
            example = to_device(first[0] if isinstance(first, list | tuple) else first, model_device(model))
            if isinstance(example, dict):  # called as model(**batch) (Hugging Face models): captured with keywords
                model = graph.capture(model, (), example)
            else:
                model = graph.capture(model, example)
        return self.calibrate(self.prepare(model), dataloader, forward_loop, max_batches)  # it checks the data

    @staticmethod
    def freeze(model: nn.Module, bake_weights: bool = False) -> nn.Module:
        """Fix every quantizer for inference (observers leave the forward path) and return the model.

        ``bake_weights=True`` also writes the quantized weights into the float weight tensors (in place) and puts a
        ``BakedFakeQuantize`` in their slots, which passes the weight through, so inference does not re-quantize them
        on every call; it keeps the spec and qparams, so the exports store the same codes and scales as an unbaked
        frozen model. Two kinds of weights keep their frozen quantizer: one computed at each forward (weight_norm's:
        there is no stored tensor to write) and one another module holds too (an lm_head tied to the input
        embeddings, which need its float values). Conv + BatchNorm units of graph mode become plain convs with the
        folded weights first.
        """
        refuse_sharded(
            model,
            "ModelQuantizer.freeze",
            "It replaces the quantizers FSDP2 holds shards of: consolidate the checkpoint (callbacks."
            "consolidate_checkpoint) and freeze the model load_quantized_checkpoint loads in one process.",
        )
        graph.fold_batch_norms(model)
        unreached = uncalibrated_layers(model)  # checked before anything is changed
        if unreached:
            warnings.warn(
                f"layer(s) that no calibration or training forward reached run in float from now on (their activation "
                f"quantizers have no qparams; size reports count them as float): {sorted(unreached)}. Calibrate with "
                "data that reaches them to quantize them.",
                stacklevel=2,
            )
        shared = shared_tensors(model)
        for name, module in model.named_modules():
            if not isinstance(module, QuantMixin):
                continue
            if name in unreached:
                for slot, _ in list(module.quantizer_slots()):
                    module.set_quantizer(slot, None)
                module.unreached = True
                continue
            for slot, q in list(module.quantizer_slots()):
                frozen = q.to_frozen()
                if not q.is_dynamic:
                    frozen.enable_observer(False)  # block formats and casts: nothing left to record
                if bake_weights and bakeable(module, slot, shared):
                    tensor = slot_tensor(module, slot)
                    with torch.no_grad():
                        tensor.copy_(frozen(tensor))
                    frozen = BakedFakeQuantize.of(frozen)
                module.set_quantizer(slot, frozen)
        return model


# ----------------------------------------------------------------------------------------------- helpers
def _restore(swapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put the original layers back after a failed swap, last swapped first."""
    for parent, attr, original in reversed(swapped):
        setattr(parent, attr, original)


def observe_params(model: nn.Module) -> None:
    """Weights and biases are observed once, directly (no data needed)."""
    refresh_computed_tensors(model)
    for m in model.modules():
        if isinstance(m, QuantMixin):
            for slot, q in m.quantizer_slots():
                tensor = slot_tensor(m, slot)
                if isinstance(tensor, torch.Tensor):
                    observer = getattr(q, "observer", None)
                    if observer is not None:
                        observer.reset_state()  # statistics of the current values only, not of earlier ones
                    q(tensor)
                    if not q.is_dynamic:
                        q.disable_observer()
