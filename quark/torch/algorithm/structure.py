"""Where the algorithms act in a model: its decoder stack, and per decoder layer which linears share an input and
which op feeds them. Given explicitly in the algorithm configs (``model_decoder_layers``, ``scaling_layers``: they
win), or derived from ``MODEL_FAMILIES``, a table of layer layouts kept as data (LLaMA/Mistral/Qwen2, Gemma,
Gemma2/3, Phi, Phi-3, GPT-NeoX, mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE), OPT, GPT-2, Falcon,
BERT/RoBERTa, DistilBERT). Encoder stacks count as layer stacks. A fused producer (Phi-3's ``qkv_proj``) feeds a group
through some of its rows only: the group says which (``fused_rows.FusedRows``). A name with ``{e}`` stands for every
expert's (``expand_experts``): fused MoE experts are seen through their twin's Linear-equivalent parts.

A family is its module names, where its norms sit (Gemma2/3: a norm after the attention output, another before the
MLP) and the form of its norms: ``normalised(x) * (offset + weight)``, offset 0 for LayerNorm/RMSNorm/LLaMA, 1 for
Gemma's (``norm_offset``); a scale folds into such a norm as ``(offset + w) / s - offset``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.fused_rows import FusedRows, producer_rows
from quark.torch.quantization.hf import is_linear, linear_weight
from quark.torch.quantization.nn.modules.linear_parts import LinearPart, named_modules_with_parts
from quark.torch.quantization.observer import ObserverBase
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase


@dataclass
class ScalingGroup:
    """Linears that read the same input, and the op whose output that input is (its scale can be folded into it).

    ``prev_op``, ``layers`` and ``inp`` are names relative to the decoder layer, as in Quark's ``scaling_layers``;
    ``module2inspect`` (optional) is the module whose output AWQ compares (default: the layers themselves);
    ``rows`` (optional): the rows of a fused ``prev_op`` that feed the layers (default: all its rows, one per channel).
    """

    prev_op: str
    layers: list[str]
    inp: str
    module2inspect: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
    rows: FusedRows | None = None


def find_decoder_layers(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The decoder stack: ``path`` (e.g. ``"model.layers"``, a suffix of the full name is enough) or the first
    ModuleList whose children each hold an attention and an MLP block; None when the model has none."""
    if path is not None:
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and (name == path or name.endswith("." + path)):
                return name, module
        lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        raise ValueError(f"model_decoder_layers={path!r} names no ModuleList of the model; its ModuleLists: {lists}")
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(_looks_like_decoder_layer(m) for m in module):
            return name, module
    return None


def check_embedding_layers(model: nn.Module, algo: Any) -> None:
    """``embedding_layers`` must name modules of the model (full names or suffixes such as ``embed_tokens``).

    Our capture runs the model's own forward up to the first decoder layer, so the embeddings need no special
    handling; the names are still checked, so a config written for another model is caught."""
    names = [n for n, _ in model.named_modules() if n]
    missing = [e for e in algo.embedding_layers or [] if not any(n == e or n.endswith("." + e) for n in names)]
    if missing:
        raise ValueError(f"{type(algo).__name__}.embedding_layers {missing} name no module of {type(model).__name__}")


def _looks_like_decoder_layer(module: nn.Module) -> bool:
    """A layer of a known family, or one with an attention and an MLP child by their usual names."""
    if model_family(module) is not None:
        return True
    names = {n for n, _ in module.named_children()}
    attention = names & {"self_attn", "attention", "attn", "self_attention"}
    return bool(attention) and bool(names & {"mlp", "feed_forward", "fc1", "ffn", "intermediate"})


#: norms whose forward computes ``normalised(x) * (1 + weight)`` (transformers' Gemma family and its kin), by class
#: name; the form of any other norm is found by probing it (``norm_offset``)
UNIT_OFFSET_NORMS = frozenset(
    {
        "GemmaRMSNorm",
        "Gemma2RMSNorm",
        "Gemma3RMSNorm",
        "RecurrentGemmaRMSNorm",
        "VaultGemmaRMSNorm",
        "T5GemmaRMSNorm",
        "Qwen3NextRMSNorm",
    }
)


def norm_offset(module: nn.Module) -> float | None:
    """The ``offset`` of a norm whose output is ``normalised(x) * (offset + weight) (+ bias)``: 1.0 for the classes of
    ``UNIT_OFFSET_NORMS``, else found by running the module with its weight at 0, 1 and 2 (bias 0) on a fixed input
    (what a scale is folded by must not depend on a name alone); None when it is neither form or not such a norm."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or is_linear(module):
        return None
    if type(module).__name__ in UNIT_OFFSET_NORMS:
        return 1.0
    if weight.is_meta:
        return None
    return _probe_offset(module, weight)


@torch.no_grad()
def _probe_offset(module: nn.Module, weight: torch.Tensor) -> float | None:
    """``norm_offset`` by experiment, with the bias at 0: weight 1 adds the normalised input to the output at weight 0,
    weight 2 adds it twice (linear in the weight), and at weight 0 a plain norm gives 0, a ``(1 + w)`` norm the
    normalised input once. The parameters are put back bit for bit."""
    bias = getattr(module, "bias", None)
    tensors = [t for t in (weight, bias) if isinstance(t, torch.Tensor)]
    saved = [t.detach().clone() for t in tensors]
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    outputs = []
    try:
        for t in tensors:
            t.zero_()
        for value in (0, 1, 2):
            weight.fill_(value)
            outputs.append(module(x).float())
    except (RuntimeError, TypeError, ValueError):  # not a module of one tensor argument
        return None
    finally:
        for t, value in zip(tensors, saved, strict=True):
            t.copy_(value)
    at_zero, normalised = outputs[0], outputs[1] - outputs[0]
    scale = float(normalised.abs().max())
    if not scale > 0 or at_zero.shape != x.shape or not _near(outputs[2] - at_zero, 2 * normalised, scale):
        return None
    return next((offset for offset in (0.0, 1.0) if _near(at_zero, offset * normalised, scale)), None)


def _near(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    """Equal to 1% of ``scale`` (the probe's outputs are rounded in the module's dtype, bfloat16 included)."""
    return float((a - b).abs().max()) <= 1e-2 * scale


@dataclass(frozen=True)
class ModelFamily:
    """One layout of a transformer layer: the module names (relative to the layer) that identify it, names it must
    not have (``absent``: a norm placed elsewhere), the ``norm_offset`` its norms have (their form), and its scaling
    groups. Kept as data in ``MODEL_FAMILIES``: supporting another family is one more entry."""

    name: str
    signature: tuple[str, ...]
    groups: tuple[ScalingGroup, ...]
    norm_offset: float = 0.0
    absent: tuple[str, ...] = ()

    def fits(self, modules: dict[str, nn.Module], offsets: dict[str, float | None] | None = None) -> bool:
        """Whether a layer of these ``modules`` has this layout and norms of this form (``offsets``: a cache of
        ``norm_offset`` by module name, shared between the families tried on one layer)."""
        if not all(n in modules for n in self.signature) or any(n in modules for n in self.absent):
            return False
        offsets = {} if offsets is None else offsets
        for g in self.groups:
            if EXPERT in g.prev_op:  # an expert's projection: a Linear (expand_experts)
                continue
            prev = modules[g.prev_op]
            if is_linear(prev):
                continue
            if g.prev_op not in offsets:
                offsets[g.prev_op] = norm_offset(prev)
            if offsets[g.prev_op] != self.norm_offset:
                return False
        return True


#: in a scaling group's module names: every expert of the layer (``expand_experts``)
EXPERT = "{e}"


def expand_experts(group: ScalingGroup, modules: dict[str, nn.Module]) -> list[ScalingGroup]:
    """``group`` with its ``{e}`` names (``EXPERT``) made concrete for the experts the layer has (``modules``: by
    name, the parts of twins included, ``linear_parts.named_modules_with_parts``): one group per expert when
    ``prev_op`` names one (an expert's up -> down), else one group whose layers list every expert's (a norm -> every
    expert's gate and up, with the other layers it names). ``[group]`` without ``{e}``; ``[]`` when no expert has
    every name (fused experts left float have no parts: a fold into some consumers of an input only would change
    the function). ValueError for ``{e}`` in ``inp`` or ``module2inspect`` only."""
    names = [group.prev_op, *group.layers, group.inp, group.module2inspect or ""]
    templates = [n for n in names if EXPERT in n]
    if not templates:
        return [group]
    experts = sorted(set.intersection(*(_experts_of(t, modules) for t in templates)))
    if EXPERT in group.prev_op:
        return [
            ScalingGroup(
                group.prev_op.replace(EXPERT, str(e)),
                [n.replace(EXPERT, str(e)) for n in group.layers],
                group.inp.replace(EXPERT, str(e)),
                group.module2inspect.replace(EXPERT, str(e)) if group.module2inspect else None,
                rows=group.rows,
            )
            for e in experts
        ]
    if EXPERT in group.inp or EXPERT in (group.module2inspect or ""):
        raise ValueError(
            f"scaling group {group.prev_op} -> {group.layers}: {EXPERT} in inp / module2inspect needs it in prev_op "
            "too (one group per expert); a group into every expert's layers reads an input they all share"
        )
    if not experts:
        return []
    layers = [n for n in group.layers if EXPERT not in n]
    layers += [n.replace(EXPERT, str(e)) for e in experts for n in group.layers if EXPERT in n]
    return [ScalingGroup(group.prev_op, layers, group.inp, group.module2inspect, rows=group.rows)]


def _experts_of(template: str, modules: dict[str, nn.Module]) -> set[int]:
    """The expert indices for which ``template`` names a module."""
    pattern = re.compile(re.escape(template).replace(re.escape(EXPERT), r"(\d+)"))
    return {int(m.group(1)) for m in map(pattern.fullmatch, modules) if m is not None}


def _g(
    prev_op: str, layers: list[str], module2inspect: str | None = None, rows: FusedRows | None = None
) -> ScalingGroup:
    return ScalingGroup(prev_op, layers, layers[0], module2inspect, rows=rows)


_QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
_GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LLAMA = ("input_layernorm", *_QKV, "self_attn.o_proj", "post_attention_layernorm", *_GATED_MLP)
_LLAMA_GROUPS = (
    _g("input_layernorm", _QKV, "self_attn"),
    _g("self_attn.v_proj", ["self_attn.o_proj"]),
    _g("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp"),
    _g("mlp.up_proj", ["mlp.down_proj"]),
)
#: Phi-3: q, k and v in one Linear (``[q | k | v]``, v last: the kv heads' rows), gate and up in one (``[gate | up]``)
_PHI3 = (
    "input_layernorm",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)
_PHI3_GROUPS = (
    _g("input_layernorm", ["self_attn.qkv_proj"], "self_attn"),
    _g("self_attn.qkv_proj", ["self_attn.o_proj"], rows=FusedRows(("all", "kv", "kv"), 2, "self_attn.head_dim")),
    _g("post_attention_layernorm", ["mlp.gate_up_proj"], "mlp"),
    _g("mlp.gate_up_proj", ["mlp.down_proj"], rows=FusedRows(("all", "all"), 1)),
)
#: GPT-NeoX / Pythia: LayerNorms with bias, q, k and v fused and interleaved per head (``[q_h | k_h | v_h]``), a gelu
#: MLP (nothing folds into its output projection); with use_parallel_residual both norms read the residual stream, each
#: feeding only its block, so both folds hold either way
_NEOX = (
    "input_layernorm",
    "post_attention_layernorm",
    "attention.query_key_value",
    "attention.dense",
    "mlp.dense_h_to_4h",
    "mlp.dense_4h_to_h",
)
_NEOX_GROUPS = (
    _g("input_layernorm", ["attention.query_key_value"], "attention"),
    _g(
        "attention.query_key_value",
        ["attention.dense"],
        rows=FusedRows(("all", "all", "all"), 2, "attention.head_size", per_head=True),
    ),
    _g("post_attention_layernorm", ["mlp.dense_h_to_4h"], "mlp"),
)
#: mixture-of-experts layers (transformers 5: the experts fused in one module of 3-D Parameters, a router ``mlp.gate``
#: computing ``F.linear(x, weight)``): the attention side as LLaMA's; each expert's up -> down (``{e}``: every expert;
#: the experts twin shows each expert's projections as Linears ``mlp.experts.{e}.up_proj`` ..., weights that are
#: blocks of the stacked Parameters, inputs the tokens routed to it); and post_attention_layernorm -> every consumer
#: of its output: the router's weight columns (float: it keeps the routing exactly) and every expert's gate and up.
#: Without the twin (experts excluded) the groups naming experts are left out. A shared expert (Qwen2-MoE) is a plain
#: gated MLP of Linears behind a one-row Linear gate: both read the norm too.
_MOE = ("input_layernorm", *_QKV, "self_attn.o_proj", "post_attention_layernorm", "mlp.gate", "mlp.experts")
_EXPERTS_IN = ["mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"]
_MOE_GROUPS = (
    _g("input_layernorm", _QKV, "self_attn"),
    _g("self_attn.v_proj", ["self_attn.o_proj"]),
    _g("post_attention_layernorm", ["mlp.gate", *_EXPERTS_IN], "mlp"),
    _g("mlp.experts.{e}.up_proj", ["mlp.experts.{e}.down_proj"]),
)
_SHARED_EXPERT = ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert_gate"]
_QWEN2_MOE_GROUPS = (
    *_MOE_GROUPS[:2],
    _g("post_attention_layernorm", ["mlp.gate", *_EXPERTS_IN, *_SHARED_EXPERT], "mlp"),
    _MOE_GROUPS[3],
    _g("mlp.shared_expert.up_proj", ["mlp.shared_expert.down_proj"]),
)
#: norms around both blocks (Gemma2/3): post_attention_layernorm normalises the attention OUTPUT (it feeds the residual
#: stream, nothing folds into it) and pre_feedforward_layernorm feeds the MLP
_SANDWICH = (*_LLAMA, "pre_feedforward_layernorm", "post_feedforward_layernorm")
_SANDWICH_GROUPS = (
    _g("input_layernorm", _QKV, "self_attn"),
    _g("self_attn.v_proj", ["self_attn.o_proj"]),
    _g("pre_feedforward_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp"),
    _g("mlp.up_proj", ["mlp.down_proj"]),
)
#: the transformer layer layouts the algorithms know, most specific first (the first entry that fits a layer wins)
MODEL_FAMILIES: list[ModelFamily] = [
    ModelFamily("gemma2", _SANDWICH, _SANDWICH_GROUPS, norm_offset=1.0),  # Gemma2, Gemma3: (1 + w) norms
    ModelFamily("gemma", _LLAMA, _LLAMA_GROUPS, norm_offset=1.0, absent=("pre_feedforward_layernorm",)),
    # LLaMA, Mistral, Qwen2: pre-norm attention, gated MLP, norms x * w
    ModelFamily("llama", _LLAMA, _LLAMA_GROUPS, absent=("pre_feedforward_layernorm",)),
    ModelFamily("phi3", _PHI3, _PHI3_GROUPS),  # Phi-3, Phi-3.5 (fused qkv_proj and gate_up_proj)
    ModelFamily("gpt-neox", _NEOX, _NEOX_GROUPS),  # GPT-NeoX, Pythia
    # Qwen2-MoE: routed experts and a shared expert
    ModelFamily("qwen2-moe", (*_MOE, *_SHARED_EXPERT, "mlp.shared_expert.down_proj"), _QWEN2_MOE_GROUPS),
    ModelFamily("moe", _MOE, _MOE_GROUPS),  # Mixtral, Qwen3-MoE, OLMoE and other routed experts without a shared one
    ModelFamily(  # Phi-1/1.5/2: one norm feeds attention and MLP in parallel
        "phi",
        ("input_layernorm", *_QKV, "self_attn.dense", "mlp.fc1", "mlp.fc2"),
        (_g("input_layernorm", [*_QKV, "mlp.fc1"]), _g("self_attn.v_proj", ["self_attn.dense"])),
    ),
    ModelFamily(  # OPT (pre-norm, do_layer_norm_before=True: all sizes but 350m, whose scaling_layers must be given)
        "opt",
        ("self_attn_layer_norm", *_QKV, "self_attn.out_proj", "final_layer_norm", "fc1", "fc2"),
        (
            _g("self_attn_layer_norm", _QKV, "self_attn"),
            _g("self_attn.v_proj", ["self_attn.out_proj"]),
            _g("final_layer_norm", ["fc1"]),
            _g("fc1", ["fc2"]),
        ),
    ),
    ModelFamily(  # GPT-2 (transformers' Conv1D layers; c_attn is q, k and v fused, so nothing folds into c_proj)
        "gpt2",
        ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"),
        (_g("ln_1", ["attn.c_attn"], "attn"), _g("ln_2", ["mlp.c_fc"], "mlp")),
    ),
    ModelFamily(  # Falcon with new_decoder_architecture: separate norms for the parallel attention and MLP
        "falcon-new",
        (
            "ln_attn",
            "ln_mlp",
            "self_attention.query_key_value",
            "self_attention.dense",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        ),
        (_g("ln_attn", ["self_attention.query_key_value"]), _g("ln_mlp", ["mlp.dense_h_to_4h"])),
    ),
    ModelFamily(  # Falcon with sequential attention and MLP
        "falcon-sequential",
        (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attention.query_key_value",
            "self_attention.dense",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        ),
        (
            _g("input_layernorm", ["self_attention.query_key_value"]),
            _g("post_attention_layernorm", ["mlp.dense_h_to_4h"]),
        ),
    ),
    ModelFamily(  # Falcon-7B style: one norm feeds attention and MLP in parallel
        "falcon",
        (
            "input_layernorm",
            "self_attention.query_key_value",
            "self_attention.dense",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        ),
        (_g("input_layernorm", ["self_attention.query_key_value", "mlp.dense_h_to_4h"]),),
    ),
    # Post-norm encoders: a norm's output is also the residual stream, so no scale folds into a norm; only v -> o.
    ModelFamily(  # BERT, RoBERTa, XLM-R encoders
        "bert",
        (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "attention.output.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        ),
        (_g("attention.self.value", ["attention.output.dense"]),),
    ),
    ModelFamily(  # DistilBERT
        "distilbert",
        (
            "attention.q_lin",
            "attention.k_lin",
            "attention.v_lin",
            "attention.out_lin",
            "sa_layer_norm",
            "ffn.lin1",
            "ffn.lin2",
        ),
        (_g("attention.v_lin", ["attention.out_lin"]),),
    ),
]


def model_family(layer: nn.Module) -> ModelFamily | None:
    """The first entry of ``MODEL_FAMILIES`` whose modules and norm form ``layer`` has, else None."""
    modules = dict(layer.named_modules())
    offsets: dict[str, float | None] = {}
    return next((f for f in MODEL_FAMILIES if f.fits(modules, offsets)), None)


def derive_scaling_groups(layer: nn.Module) -> list[ScalingGroup]:
    """The scaling groups of one layer from its entry in ``MODEL_FAMILIES``; ValueError listing its modules otherwise.

    A linear -> linear pair (v_proj -> o_proj) is kept only when the shapes allow folding a per-channel scale (the
    producer's output features are the consumer's input features: not the case with grouped-query attention), or
    when the group says which rows of a fused producer feed the consumer (``FusedRows``: those must fit its shapes,
    else ValueError)."""
    family = model_family(layer)
    if family is None:
        raise ValueError(
            f"cannot derive scaling_layers for layer {type(layer).__name__}: it fits none of the known model families "
            f"{[f.name for f in MODEL_FAMILIES]} (quark.torch.algorithm.structure.MODEL_FAMILIES: module names and "
            f"norm form); its modules: {own_modules(layer)}{_norm_forms(layer)}{_expert_parts(layer)}. Give "
            "scaling_layers explicitly, or add a ModelFamily."
        )
    modules = dict(named_modules_with_parts(layer))
    groups = []
    for g in (concrete for template in family.groups for concrete in expand_experts(template, modules)):
        prev = modules[g.prev_op]
        if g.rows is not None:
            producer_rows(g.rows, modules, g.prev_op, g.layers)  # the layout fits the shapes, else ValueError
        elif is_linear(prev) and any(
            linear_weight(modules[n]).shape[1] != linear_weight(prev).shape[0] for n in g.layers
        ):
            continue
        groups.append(g)
    return groups


def own_modules(layer: nn.Module) -> list[str]:
    """The names of ``layer``'s submodules but the quantizers and observers this library attaches to them."""
    ours = [n for n, m in layer.named_modules() if isinstance(m, FakeQuantizeBase | ObserverBase)]
    return [n for n, _ in layer.named_modules() if n and not any(n == o or n.startswith(o + ".") for o in ours)]


def _expert_parts(layer: nn.Module) -> str:
    """The Linear-equivalent parts of ``layer``'s twins (its experts' projections, which scaling_layers may name)
    as ``{e}`` patterns with the expert indices, for errors; empty without any."""
    names = [n for n, m in named_modules_with_parts(layer) if isinstance(m, LinearPart)]
    patterns = sorted({re.sub(r"\.\d+\.", f".{EXPERT}.", n) for n in names})
    experts = sorted({int(e) for n in names for e in re.findall(r"\.(\d+)\.", n)})
    return f"; its experts' projections, {EXPERT} in {experts}: {patterns}" if names else ""


def _norm_forms(layer: nn.Module) -> str:
    """The form of each norm-like module of ``layer`` (for the error of a layer no family fits)."""
    forms = {
        n: {0.0: "x*w", 1.0: "x*(1+w)", None: "unknown"}[norm_offset(m)]
        for n, m in layer.named_modules()
        if n and "norm" in type(m).__name__.lower()
    }
    return f"; its norms: {forms}" if forms else ""


def scaling_groups(layer: nn.Module, explicit: list[dict] | None) -> list[ScalingGroup]:
    """``explicit`` (Quark's ``scaling_layers`` dicts) checked against the layer, else derived. An explicit group with
    the ``prev_op`` and layers of a group of the layer's family takes that group's ``rows`` (Quark's Phi-3 map
    names ``qkv_proj -> o_proj``: only the v rows of qkv_proj feed o_proj)."""
    if explicit is None:
        return derive_scaling_groups(layer)
    modules = dict(named_modules_with_parts(layer))
    family = model_family(layer)
    known = {(g.prev_op, tuple(g.layers)): g.rows for g in family.groups} if family is not None else {}
    groups = []
    for i, entry in enumerate(explicit):
        group = ScalingGroup(
            entry["prev_op"],
            list(entry["layers"]),
            entry.get("inp") or entry["layers"][0],
            entry.get("module2inspect"),
            rows=known.get((entry["prev_op"], tuple(entry["layers"]))),
        )
        concrete = expand_experts(group, modules) or [group]  # no expert has every {e} name: named below
        for g in concrete:
            names = [g.prev_op, *g.layers, g.inp, *([g.module2inspect] if g.module2inspect else [])]
            missing = [n for n in names if n not in modules and not (EXPERT in n and _experts_of(n, modules))]
            if missing:
                raise ValueError(
                    f"scaling_layers[{i}] names {missing}, not modules of the decoder layer; its modules: "
                    f"{own_modules(layer)}{_expert_parts(layer)}"
                )
        groups.extend(concrete)
    return groups
