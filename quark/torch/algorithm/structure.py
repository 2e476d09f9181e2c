"""Where the algorithms act in a model: its decoder stack, and per decoder layer which linears share an input and
which op feeds them. Given explicitly in the algorithm configs (``model_decoder_layers``, ``scaling_layers``: they
win), or derived from ``MODEL_FAMILIES``, a table of layer layouts kept as data (LLaMA/Mistral/Qwen2, Phi, OPT,
GPT-2, Falcon, BERT/RoBERTa, DistilBERT). Encoder stacks count as layer stacks."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from quark.torch.quantization.hf import is_linear, linear_weight


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
    """A layer of a known family, or one with an attention and an MLP child by their usual names."""
    if model_family(module) is not None:
        return True
    names = {n for n, _ in module.named_children()}
    attention = names & {"self_attn", "attention", "attn", "self_attention"}
    return bool(attention) and bool(names & {"mlp", "feed_forward", "fc1", "ffn", "intermediate"})


@dataclass(frozen=True)
class ModelFamily:
    """One layout of a transformer layer: the module names (relative to the layer) that identify it, and its
    scaling groups. Kept as data in ``MODEL_FAMILIES``: supporting another family is one more entry."""

    name: str
    signature: tuple[str, ...]
    groups: tuple[ScalingGroup, ...]

    def fits(self, modules: dict[str, nn.Module]) -> bool:
        return all(n in modules for n in self.signature)


def _g(prev_op: str, layers: list[str], module2inspect: str | None = None) -> ScalingGroup:
    return ScalingGroup(prev_op, layers, layers[0], module2inspect)


_QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
#: the transformer layer layouts the algorithms know, most specific first (the first entry that fits a layer wins)
MODEL_FAMILIES: list[ModelFamily] = [
    ModelFamily(  # LLaMA, Mistral, Qwen2, Gemma: pre-norm attention, gated MLP
        "llama",
        ("input_layernorm", *_QKV, "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        (_g("input_layernorm", _QKV, "self_attn"), _g("self_attn.v_proj", ["self_attn.o_proj"]),
         _g("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp"), _g("mlp.up_proj", ["mlp.down_proj"])),
    ),
    ModelFamily(  # Phi-1/1.5/2: one norm feeds attention and MLP in parallel
        "phi",
        ("input_layernorm", *_QKV, "self_attn.dense", "mlp.fc1", "mlp.fc2"),
        (_g("input_layernorm", [*_QKV, "mlp.fc1"]), _g("self_attn.v_proj", ["self_attn.dense"])),
    ),
    ModelFamily(  # OPT (pre-norm, do_layer_norm_before=True: all sizes but 350m, whose scaling_layers must be given)
        "opt",
        ("self_attn_layer_norm", *_QKV, "self_attn.out_proj", "final_layer_norm", "fc1", "fc2"),
        (_g("self_attn_layer_norm", _QKV, "self_attn"), _g("self_attn.v_proj", ["self_attn.out_proj"]),
         _g("final_layer_norm", ["fc1"]), _g("fc1", ["fc2"])),
    ),
    ModelFamily(  # GPT-2 (transformers' Conv1D layers; c_attn is q, k and v fused, so nothing folds into c_proj)
        "gpt2",
        ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"),
        (_g("ln_1", ["attn.c_attn"], "attn"), _g("ln_2", ["mlp.c_fc"], "mlp")),
    ),
    ModelFamily(  # Falcon with new_decoder_architecture: separate norms for the parallel attention and MLP
        "falcon-new",
        ("ln_attn", "ln_mlp", "self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        (_g("ln_attn", ["self_attention.query_key_value"]), _g("ln_mlp", ["mlp.dense_h_to_4h"])),
    ),
    ModelFamily(  # Falcon with sequential attention and MLP
        "falcon-sequential",
        ("input_layernorm", "post_attention_layernorm", "self_attention.query_key_value", "self_attention.dense",
         "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        (_g("input_layernorm", ["self_attention.query_key_value"]), _g("post_attention_layernorm", ["mlp.dense_h_to_4h"])),
    ),
    ModelFamily(  # Falcon-7B style: one norm feeds attention and MLP in parallel
        "falcon",
        ("input_layernorm", "self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        (_g("input_layernorm", ["self_attention.query_key_value", "mlp.dense_h_to_4h"]),),
    ),
    # Post-norm encoders: a norm's output is also the residual stream, so no scale folds into a norm; only v -> o.
    ModelFamily(  # BERT, RoBERTa, XLM-R encoders
        "bert",
        ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
         "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"),
        (_g("attention.self.value", ["attention.output.dense"]),),
    ),
    ModelFamily(  # DistilBERT
        "distilbert",
        ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2"),
        (_g("attention.v_lin", ["attention.out_lin"]),),
    ),
]  # fmt: skip


def model_family(layer: nn.Module) -> ModelFamily | None:
    """The first entry of ``MODEL_FAMILIES`` whose modules ``layer`` has, else None."""
    modules = dict(layer.named_modules())
    return next((f for f in MODEL_FAMILIES if f.fits(modules)), None)


def derive_scaling_groups(layer: nn.Module) -> list[ScalingGroup]:
    """The scaling groups of one layer from its entry in ``MODEL_FAMILIES``; ValueError listing its modules otherwise.

    A linear -> linear pair (v_proj -> o_proj) is kept only when the shapes allow folding a per-channel scale (the
    producer's output features are the consumer's input features: not the case with grouped-query attention)."""
    family = model_family(layer)
    if family is None:
        raise ValueError(
            f"cannot derive scaling_layers for layer {type(layer).__name__}: it fits none of the known model families "
            f"{[f.name for f in MODEL_FAMILIES]} (quark.torch.algorithm.structure.MODEL_FAMILIES); its modules: "
            f"{[n for n, _ in layer.named_modules() if n]}. Give scaling_layers explicitly, or add a ModelFamily."
        )
    modules = dict(layer.named_modules())
    groups = []
    for g in family.groups:
        prev = modules[g.prev_op]
        if is_linear(prev) and any(linear_weight(modules[n]).shape[1] != linear_weight(prev).shape[0] for n in g.layers):
            continue
        groups.append(g)
    return groups


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
