"""Mixed precision: how much each layer suffers from each candidate format, and a per-layer choice of formats that
minimises the predicted loss under a size budget in average weight bits per parameter.

Sensitivity (``measure_sensitivity``) is measured with one layer quantized at a time, the others float: by the
task metric when a metric function is given, else by the KL divergence or MSE of the model's outputs against the
float model's on calibration batches. ``hessian_sensitivity`` is the cheaper estimate of HAWQ-V2/V3: the average
Hessian trace of each layer's weight (Hutchinson's estimator, Rademacher probes) times the squared weight
quantization error of each format. ``allocate`` picks one candidate per layer (a multiple-choice knapsack solved
exactly by dynamic programming), and
``mixed_precision_config`` turns the choice into a ``Config`` whose ``layer_quant_config`` holds it.

Sizes count what a deployment stores: each element's bits plus the scales and zero points of its group, channel
or tensor (``weight_bits``)."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from quark.torch.algorithm.awq import rtn
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.batches import run_batch
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType, ScaleType
from quark.torch.quantization.formats import bits_per_element, format_of, is_scaled
from quark.torch.quantization.formats.table import IntFormat
from quark.torch.quantization.hf import linear_weight, no_kv_cache
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.resolve import parent_of
from quark.torch.quantization.state import paused_quantizers, preserve_modes
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = [
    "LayerSensitivity",
    "weight_bits",
    "measure_sensitivity",
    "hessian_trace",
    "hessian_sensitivity",
    "allocate",
    "mixed_precision_config",
    "average_bits",
    "METHODS",
    "model_output",
]

logger = logging.getLogger(__name__)
METHODS = ("kl", "mse")


@dataclass
class LayerSensitivity:
    """One layer's loss under each candidate (only this layer quantized) and the bits per weight parameter each
    candidate stores (scales included)."""

    layer: str
    numel: int
    loss: dict[str, float] = field(default_factory=dict)
    bits: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- sizes
_SCALE_BITS = {ScaleType.float16: 16, ScaleType.bfloat16: 16, ScaleType.pof2: 8, ScaleType.float8_e8m0fnu: 8}


def weight_bits(spec: QuantizationSpec | None, shape: Sequence[int]) -> float:
    """Bits per weight parameter stored with ``spec``: the element's bits, plus each scale (32 bits; 16 for float16 /
    bfloat16 scales, 8 for power-of-two ones) and zero point (the element's bits, asymmetric integers) spread over the
    elements it covers. Block formats (MX, MX6/9, BFP16) count their shared exponents in the element bits. None
    (float) is 32."""
    if spec is None:
        return 32.0
    element = bits_per_element(spec.dtype, spec.mx_element_dtype, spec.group_size)
    if not is_scaled(spec.dtype) or spec.is_dynamic:
        return float(element)
    numel = math.prod(shape) or 1
    if spec.qscheme == QSchemeType.per_tensor:
        scales = 1
    elif spec.qscheme == QSchemeType.per_channel:
        scales = shape[spec.ch_axis if spec.ch_axis is not None else 0]
    elif spec.qscheme == QSchemeType.per_group:
        scales = math.ceil(numel / (spec.group_size or numel))
    else:  # per_block [rows, cols] tiles of a 2-D weight
        rows, cols = spec.block_size or (shape[0], shape[-1])
        scales = math.ceil(shape[0] / rows) * math.ceil(numel / shape[0] / cols)
    scale_bits = _SCALE_BITS.get(spec.scale_type, 32)  # type: ignore[arg-type]
    fmt = format_of(spec.dtype)
    zero_bits = fmt.bits if isinstance(fmt, IntFormat) and not spec.symmetric else 0
    return float(element) + scales * (scale_bits + zero_bits) / numel


def average_bits(choice: dict[str, str], sensitivities: Iterable[LayerSensitivity]) -> float:
    """Average weight bits per parameter of a choice (candidate per layer) over the layers it covers."""
    table = {s.layer: s for s in sensitivities}
    total = sum(table[name].numel for name in choice)
    return sum(table[name].numel * table[name].bits[c] for name, c in choice.items()) / max(total, 1)


# ----------------------------------------------------------------------------------------------- measurement
def model_output(out: Any) -> torch.Tensor:
    """The tensor a model's output stands for: itself, ``.logits`` (Hugging Face), or the first tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, tuple | list):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    raise TypeError(f"cannot find the output tensor in a model output of type {type(out).__name__}")


def _divergence(out: torch.Tensor, ref: torch.Tensor, method: str) -> float:
    """Sum over the batch of KL(ref || out) of the softmax over the last dim, or of the squared error, per element."""
    out, ref = out.double(), ref.double()
    if method == "kl":
        return float(F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum")) / (
            ref.numel() / ref.shape[-1]
        )
    return float((out - ref).pow(2).mean())


def _weight_layers(model: nn.Module, config: Config, layers: Sequence[str] | None) -> list[str]:
    """The layers ``config`` quantizes that have a weight (those the choice is made for), or ``layers`` checked."""
    planned = [p.name for p in ModelQuantizer(config).resolve(model, warn=False) if p.qconfig.weight is not None]
    if layers is None:
        return planned
    unknown = [n for n in layers if n not in planned]
    if unknown:
        raise ValueError(
            f"layers {unknown} are not weight-quantized layers of the model under the candidates; they are: {planned}"
        )
    return list(layers)


@torch.no_grad()
def measure_sensitivity(
    model: nn.Module,
    candidates: dict[str, QuantizationConfig],
    batches: Sequence[Any],
    *,
    layers: Sequence[str] | None = None,
    metric: Callable[[nn.Module], float] | None = None,
    higher_is_better: bool = True,
    method: str = "kl",
    base_config: Config | None = None,
    run: Callable[[nn.Module, Any], Any] = run_batch,
) -> list[LayerSensitivity]:
    """Each layer's loss under each candidate with only that layer quantized, ``model`` left as it was.

    Per candidate, the model is quantized in place with it (``base_config``'s other fields, such as ``exclude``,
    kept; twins share the model's Parameters, so nothing is copied) and calibrated on ``batches``; then each layer in
    turn has its quantizers on and every other layer's off; then the float layers are put back.
    The loss is the metric's degradation against the float model (``metric(model)``; ``higher_is_better`` says its
    direction), else ``method``: "kl" (softmax over the outputs' last dim, for logits) or "mse", averaged over
    ``batches``. ``layers`` restricts the layers measured (default: every layer with a weight spec)."""
    if not candidates:
        raise ValueError("candidates is empty: give at least one QuantizationConfig by name")
    if method not in METHODS:
        raise ValueError(f"method={method!r}; allowed: {list(METHODS)}")
    if not batches:
        raise ValueError("measure_sensitivity needs at least one calibration batch")
    base = base_config or Config(global_quant_config=QuantizationConfig())
    configs = {name: _with_global(base, qc) for name, qc in candidates.items()}
    names = _weight_layers(model, next(iter(configs.values())), layers)
    with preserve_modes(model, mode=False), no_kv_cache(model):
        reference = metric(model) if metric is not None else [model_output(run(model, b)).detach() for b in batches]
        table = {n: LayerSensitivity(n, _weight_numel(model.get_submodule(n))) for n in names}
        for cname, config in configs.items():
            with _quantized_in_place(model, config, batches) as quantized:
                for n in names:
                    module = quantized.get_submodule(n)
                    table[n].bits[cname] = weight_bits(config_weight(module), linear_weight(module).shape)
                    with _only(quantized, n):
                        table[n].loss[cname] = _loss(
                            quantized, batches, reference, metric, higher_is_better, method, run
                        )
            logger.info("sensitivity: candidate %s measured on %d layer(s)", cname, len(names))
    return list(table.values())


@contextmanager
def _quantized_in_place(model: nn.Module, config: Config, batches: Sequence[Any]) -> Iterator[nn.Module]:
    """``model`` prepared and calibrated with ``config`` inside the block; its own layers (and ``quant_config``) put
    back after. Only quantizers are added, so the Parameters end as they started."""
    if any(isinstance(m, QuantMixin) for m in model.modules()):
        raise ValueError("measure_sensitivity needs the float model (it has quantized layers already)")
    originals = [
        (*parent_of(model, p.name), model.get_submodule(p.name))
        for p in ModelQuantizer(config).resolve(model, warn=False)
    ]
    had, previous = hasattr(model, "quant_config"), getattr(model, "quant_config", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the float-layer report, once per candidate: the caller's business
            quantized = ModelQuantizer(config).quantize_model(model, list(batches))
        quantized.eval()
        yield quantized
    finally:
        for parent, attr, original in originals:
            setattr(parent, attr, original)
        if had:
            model.quant_config = previous
        elif hasattr(model, "quant_config"):
            del model.quant_config


def _with_global(base: Config, qc: QuantizationConfig) -> Config:
    config = copy.deepcopy(base)
    config.global_quant_config = qc
    config.layer_quant_config, config.layer_type_quant_config = {}, {}
    return config


def config_weight(module: nn.Module) -> QuantizationSpec | None:
    """The configured weight spec of a quantized layer (as for its [out, in] weight: a Conv1D's own quantizer holds it
    transposed)."""
    qc = getattr(module, "quant_config", None)
    return None if qc is None else qc.weight


def _weight_numel(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    return int(weight.numel()) if isinstance(weight, torch.Tensor) else 0


def _only(model: nn.Module, name: str) -> contextlib.AbstractContextManager[list[FakeQuantizeBase]]:
    """Fake quantization on for one layer's quantizers only, inside the block (flags restored after)."""
    keep = {id(q) for _, q in iter_quantizers(model.get_submodule(name))}
    return paused_quantizers(model, observers=False, fake_quant=lambda q: id(q) not in keep)


def _loss(
    model: nn.Module,
    batches: Sequence[Any],
    reference: Any,
    metric: Callable[[nn.Module], float] | None,
    higher_is_better: bool,
    method: str,
    run: Callable[[nn.Module, Any], Any],
) -> float:
    if metric is not None:
        value = metric(model)
        return float(reference - value if higher_is_better else value - reference)
    return sum(
        _divergence(model_output(run(model, b)), r, method) for b, r in zip(batches, reference, strict=True)
    ) / len(batches)


# ----------------------------------------------------------------------------------------------- Hessian traces
def hessian_trace(
    model: nn.Module,
    layers: Sequence[str],
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    samples: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    """Average Hessian trace per weight element of each layer, ``Tr(H_l) / n_l``, of ``sum(loss_fn(model, batch))``
    (Hutchinson: ``E[v^T H v]`` over Rademacher ``v``, ``samples`` probes; HAWQ-V2's estimator). ``model`` unchanged."""
    if samples < 1:
        raise ValueError(f"samples={samples}; must be >= 1")
    weights = [linear_weight(model.get_submodule(n)) for n in layers]
    leaves = [model.get_submodule(n).weight for n in layers]
    flags = [w.requires_grad for w in leaves]
    generator = torch.Generator().manual_seed(seed)
    traces = [0.0] * len(layers)
    try:
        for w in leaves:
            w.requires_grad_(True)
        # the math attention kernel: the fused CPU/CUDA ones have no double backward (Hessian-vector products)
        with preserve_modes(model, mode=False), torch.enable_grad(), no_kv_cache(model), sdpa_kernel(SDPBackend.MATH):
            for batch in batches:
                loss = loss_fn(model, batch)
                grads = torch.autograd.grad(loss, leaves, create_graph=True)
                for s in range(samples):
                    probes = [torch.randint(0, 2, w.shape, generator=generator).to(w) * 2 - 1 for w in leaves]
                    hv = torch.autograd.grad(grads, leaves, grad_outputs=probes, retain_graph=s + 1 < samples)
                    for i, (v, h) in enumerate(zip(probes, hv, strict=True)):
                        traces[i] += float((v * h).sum()) / samples
    finally:
        for w, flag in zip(leaves, flags, strict=True):
            w.requires_grad_(flag)
    return {n: t / len(batches) / w.numel() for n, t, w in zip(layers, traces, weights, strict=True)}


@torch.no_grad()
def hessian_sensitivity(
    model: nn.Module,
    candidates: dict[str, QuantizationConfig],
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    layers: Sequence[str] | None = None,
    samples: int = 16,
    base_config: Config | None = None,
) -> list[LayerSensitivity]:
    """HAWQ's predicted loss of each layer under each candidate: ``Tr(H_l) / n_l * ||Q(W_l) - W_l||^2``, with the
    weight quantized round-to-nearest by the candidate's weight spec (its own observer). No calibration, one backward
    pass per probe: far cheaper than ``measure_sensitivity`` on large models, blind to activation quantization."""
    base = base_config or Config(global_quant_config=QuantizationConfig())
    first = _with_global(base, next(iter(candidates.values())))
    names = _weight_layers(model, first, layers)
    traces = hessian_trace(model, names, batches, loss_fn, samples=samples)
    out = []
    for n in names:
        w = linear_weight(model.get_submodule(n)).detach().float()
        entry = LayerSensitivity(n, w.numel())
        for cname, qc in candidates.items():
            spec = qc.weight
            error = float((rtn(w, spec) - w).pow(2).sum()) if spec is not None else 0.0
            entry.loss[cname] = traces[n] * error
            entry.bits[cname] = weight_bits(spec, w.shape)
        out.append(entry)
    return out


# ----------------------------------------------------------------------------------------------- allocation
def allocate(sensitivities: Sequence[LayerSensitivity], target_bits: float, resolution: int = 20000) -> dict[str, str]:
    """One candidate per layer, minimising the summed loss with the average weight bits per parameter (weighted by
    each layer's size) at most ``target_bits``.

    A multiple-choice knapsack, solved by dynamic programming over the budget cut into ``resolution`` units (each
    layer's size rounded to the nearest unit; the result is the best solution the table holds whose exact size fits,
    so it never exceeds the budget, and is optimal whenever sizes are whole units, as whole bits usually are).
    ValueError when even the cheapest candidates exceed the budget, naming that minimum."""
    if not sensitivities:
        raise ValueError("allocate needs the sensitivity of at least one layer")
    for s in sensitivities:
        if set(s.loss) != set(s.bits) or not s.loss:
            raise ValueError(
                f"layer '{s.layer}': loss and bits must name the same candidates, got {sorted(s.loss)} and {sorted(s.bits)}"
            )
    total = sum(s.numel for s in sensitivities)
    cheapest = sum(s.numel * min(s.bits.values()) for s in sensitivities) / total
    if cheapest > target_bits + 1e-9:
        raise ValueError(
            f"target_bits={target_bits} is below what the cheapest candidates store ({cheapest:.4f} bits per parameter)"
        )
    budget = target_bits * total
    unit = budget / resolution
    capacity = resolution + len(sensitivities)  # costs are rounded to the nearest unit: room for their rounding
    inf = float("inf")
    best = torch.full((capacity + 1,), inf, dtype=torch.float64)  # best[b]: least loss at rounded cost b
    best[0] = 0.0
    picks = []
    for s in sensitivities:
        names = list(s.loss)
        options = torch.full((len(names), capacity + 1), inf, dtype=torch.float64)
        for k, c in enumerate(names):
            cost = round(s.numel * s.bits[c] / unit)
            if cost <= capacity:
                options[k, cost:] = best[: capacity + 1 - cost] + s.loss[c]
        best, pick = options.min(dim=0)
        picks.append((s, names, pick))
    # the best end state whose true size fits (rounding can put a rounded-feasible one just over the budget)
    for b in torch.argsort(best).tolist():
        if not math.isfinite(float(best[b])):
            break
        choice: dict[str, str] = {}
        for s, names, pick in reversed(picks):
            c = names[int(pick[b])]
            choice[s.layer] = c
            b -= round(s.numel * s.bits[c] / unit)
        if sum(s.numel * s.bits[choice[s.layer]] for s in sensitivities) <= budget * (1 + 1e-12):
            return {s.layer: choice[s.layer] for s in sensitivities}
    raise ValueError(
        f"target_bits={target_bits}: no choice fits at resolution={resolution}; the cheapest candidates store {cheapest:.4f}"
    )


def mixed_precision_config(base: Config, choice: dict[str, str], candidates: dict[str, QuantizationConfig]) -> Config:
    """``base`` with ``layer_quant_config[layer] = candidates[choice[layer]]`` for every chosen layer (the global and
    type-level entries stay for the layers not chosen)."""
    unknown = sorted({c for c in choice.values() if c not in candidates})
    if unknown:
        raise ValueError(f"choice names candidates {unknown} not in {sorted(candidates)}")
    config = copy.deepcopy(base)
    config.layer_quant_config = {
        **config.layer_quant_config,
        **{n: copy.deepcopy(candidates[c]) for n, c in choice.items()},
    }
    return config
