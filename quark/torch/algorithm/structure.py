"""Where the algorithms act in a model: its decoder stack, and per decoder layer which linears share an input and
which op feeds them. Given explicitly in the algorithm configs, or derived from common decoder layouts (LLaMA-style
names: ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``;
OPT-style: ``self_attn_layer_norm``, ``fc1``/``fc2``, ``final_layer_norm``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class ScalingGroup:
    """Linears that read the same input, and the op whose output that input is (its scale can be folded into it).

    ``prev_op``, ``layers`` and ``inp`` are names relative to the decoder layer, as in Quark's ``scaling_layers``;
    ``module2inspect`` (optional) is the module whose output AWQ compares (default: the layers themselves).
    """

    prev_op: str
    layers: list[str]
    inp: str
    module2inspect: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


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


def _looks_like_decoder_layer(module: nn.Module) -> bool:
    names = {n for n, _ in module.named_children()}
    return bool(names & {"self_attn", "attention", "attn"}) and bool(names & {"mlp", "feed_forward", "fc1", "ffn"})


_LLAMA = [
    ScalingGroup("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "self_attn.q_proj", "self_attn"),
    ScalingGroup("self_attn.v_proj", ["self_attn.o_proj"], "self_attn.o_proj"),
    ScalingGroup("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp.gate_proj", "mlp"),
    ScalingGroup("mlp.up_proj", ["mlp.down_proj"], "mlp.down_proj"),
]
_OPT = [
    ScalingGroup("self_attn_layer_norm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "self_attn.q_proj", "self_attn"),
    ScalingGroup("self_attn.v_proj", ["self_attn.out_proj"], "self_attn.out_proj"),
    ScalingGroup("final_layer_norm", ["fc1"], "fc1"),
    ScalingGroup("fc1", ["fc2"], "fc2"),
]


def derive_scaling_groups(layer: nn.Module) -> list[ScalingGroup]:
    """The scaling groups of one decoder layer for a known layout; ValueError listing its modules otherwise.

    A linear -> linear pair (v_proj -> o_proj) is kept only when the shapes allow folding a per-channel scale (the
    producer's output features are the consumer's input features: not the case with grouped-query attention)."""
    modules = dict(layer.named_modules())
    for layout in (_LLAMA, _OPT):
        if all(g.prev_op in modules and all(n in modules for n in g.layers) for g in layout if "." not in g.prev_op):
            groups = []
            for g in layout:
                if g.prev_op not in modules or not all(n in modules for n in g.layers):
                    continue
                prev = modules[g.prev_op]
                if isinstance(prev, nn.Linear) and any(getattr(modules[n], "in_features", None) != prev.out_features for n in g.layers):
                    continue
                groups.append(g)
            return groups
    raise ValueError(
        "cannot derive scaling_layers for decoder layer "
        f"{type(layer).__name__}: no LLaMA-style (input_layernorm, self_attn.q/k/v/o_proj, post_attention_layernorm, "
        "mlp.gate/up/down_proj) or OPT-style (self_attn_layer_norm, fc1, fc2, final_layer_norm) layout; its modules: "
        f"{[n for n, _ in layer.named_modules() if n]}. Give scaling_layers explicitly."
    )


def scaling_groups(layer: nn.Module, explicit: list[dict] | None) -> list[ScalingGroup]:
    """``explicit`` (Quark's ``scaling_layers`` dicts) checked against the layer, else derived."""
    if explicit is None:
        return derive_scaling_groups(layer)
    modules = dict(layer.named_modules())
    groups = []
    for i, entry in enumerate(explicit):
        names = [entry["prev_op"], *entry["layers"], entry.get("inp") or entry["layers"][0]]
        if entry.get("module2inspect"):
            names.append(entry["module2inspect"])
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(
                f"scaling_layers[{i}] names {missing}, not modules of the decoder layer; its modules: "
                f"{[n for n, _ in layer.named_modules() if n]}"
            )
        groups.append(ScalingGroup(entry["prev_op"], list(entry["layers"]), entry.get("inp") or entry["layers"][0], entry.get("module2inspect")))
    return groups
