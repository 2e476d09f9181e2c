"""Where the fixed and learned rotations act in a model: the rotation plan, and fusing the norms before rotating.

The residual stream ``h`` (a row vector) becomes ``h @ R1``; every weight that reads it (through a norm) or writes it
is changed so the model computes the same function: embeddings ``W_E <- W_E @ R1``, readers ``W <- W @ R1``, writers
``W <- R1.T @ W`` and ``b <- R1.T @ b``. The norms between commute with R1 once their weights are moved into their
readers (``fuse_norms``): an RMSNorm without weight is ``x / rms(x)``, and ``rms(x @ R1) == rms(x)``.

The plan comes from the model's family (``quark.torch.algorithm.structure.MODEL_FAMILIES``): LLaMA-like layers only
("llama": LLaMA, Mistral, Qwen2, CharTransformer; "gemma": the same with ``x * (1 + w)`` norms), whose norms are RMS
norms (no bias, no mean subtraction); or from amd-quark's explicit ``RotationConfig.scaling_layers``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quark.torch.algorithm.rotation.explicit import explicit_plan
from quark.torch.algorithm.rotation.sites import HeadSite, RotationPlan, check_rms_norm, head_dim_of
from quark.torch.algorithm.structure import find_decoder_layers, model_family, norm_offset
from quark.torch.quantization.hf import is_linear, linear_weight

if TYPE_CHECKING:
    from quark.torch.quantization.config.config import RotationConfig

__all__ = [
    "HeadSite",
    "RotationPlan",
    "SUPPORTED_FAMILIES",
    "rotation_plan",
    "fuse_norms",
    "untie_lm_head",
    "check_rms_norm",
]

logger = logging.getLogger(__name__)

#: the families whose layers the rotations know: their pre-norm layers read the residual stream through RMS norms
SUPPORTED_FAMILIES = ("llama", "gemma")
_ATTN_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_READERS = ("mlp.gate_proj", "mlp.up_proj")


def _decoder_stack(model: nn.Module, config: RotationConfig) -> tuple[str, nn.ModuleList]:
    """The decoder stack at ``config.model_decoder_layers`` (a suffix is enough), else the one found; ValueError."""
    try:
        found = find_decoder_layers(model, config.model_decoder_layers)
    except ValueError:
        found = find_decoder_layers(model)
    if found is None:
        raise ValueError(
            f"rotation: {type(model).__name__} has no decoder stack (model_decoder_layers="
            f"{config.model_decoder_layers!r} names none, and none was found); supported families: "
            f"{list(SUPPORTED_FAMILIES)}"
        )
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _outside(model: nn.Module, stack: str) -> tuple[list[str], list[str]]:
    """The ``nn.Embedding`` names and the Linear names outside the decoder stack (quantizers' modules excluded)."""
    embeddings, linears = [], []
    for name, module in model.named_modules():
        if name == stack or name.startswith(stack + "."):
            continue
        if isinstance(module, nn.Embedding):
            embeddings.append(name)
        elif is_linear(module):
            linears.append(name)
    return embeddings, linears


def rotation_plan(model: nn.Module, config: RotationConfig) -> RotationPlan:
    """The rotation sites of ``model`` (its weights untouched): from ``config.scaling_layers`` when given, else from
    its family (LLaMA-like layers, ``SUPPORTED_FAMILIES``).

    Raises:
        ValueError: For a model without a decoder stack, a layer of another family, a norm that is no RMS norm, or
            names of ``scaling_layers`` that are no modules; naming the layer and family and what is supported.
    """
    stack_name, stack = _decoder_stack(model, config)
    if config.scaling_layers is not None:
        return explicit_plan(model, config, stack_name, stack)
    modules = dict(model.named_modules())
    readers, writers, norms, heads, downs = [], [], [], [], []
    family_name = "llama"
    for i, layer in enumerate(stack):
        prefix = f"{stack_name}.{i}"
        family = model_family(layer)
        if family is None or family.name not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"rotation: decoder layer {prefix} ({type(layer).__name__}) is of family "
                f"{family.name if family else None!r}; rotations support the LLaMA-like families "
                f"{list(SUPPORTED_FAMILIES)} (LLaMA, Mistral, Qwen2, Gemma: pre-norm layers with RMS norms), or give "
                "RotationConfig.scaling_layers"
            )
        family_name = family.name
        for norm, group in (("input_layernorm", _ATTN_READERS), ("post_attention_layernorm", _MLP_READERS)):
            check_rms_norm(f"{prefix}.{norm}", modules[f"{prefix}.{norm}"], family.name)
            names = tuple(f"{prefix}.{n}" for n in group)
            readers.extend(names)
            norms.append((f"{prefix}.{norm}", names))
        writers.extend([f"{prefix}.{config.o_proj}", f"{prefix}.mlp.down_proj"])
        attn = modules[f"{prefix}.{config.self_attn}"]
        heads.append(HeadSite(f"{prefix}.{config.v_proj}", f"{prefix}.{config.o_proj}", head_dim_of(prefix, attn)))
        downs.append(f"{prefix}.mlp.down_proj")
    hidden = linear_weight(modules[readers[0]]).shape[1]
    embeddings, linears = _outside(model, stack_name)
    final_norm = _final_norm(model, stack_name, family_name)
    heads_out = [n for n in linears if linear_weight(modules[n]).shape[1] == hidden]
    if final_norm is not None and heads_out:
        readers.extend(heads_out)
        norms.append((final_norm, tuple(heads_out)))
    _check_embeddings(modules, embeddings, hidden)
    return RotationPlan(
        hidden, tuple(embeddings), tuple(readers), tuple(writers), tuple(norms), tuple(heads), tuple(downs), family_name
    )


def _final_norm(model: nn.Module, stack_name: str, family: str) -> str | None:
    """The norm after the decoder stack: the stack's sibling named ``norm`` (LLaMA's ``model.norm``), checked."""
    parent = stack_name.rpartition(".")[0]
    name = _join(parent, "norm")
    module = dict(model.named_modules()).get(name)
    if module is None:
        return None
    check_rms_norm(name, module, family)
    return name


def _check_embeddings(modules: dict[str, nn.Module], embeddings: list[str], hidden: int) -> None:
    """Each embedding has rows of the residual's width."""
    for name in embeddings:
        if modules[name].weight.shape[1] != hidden:
            raise ValueError(
                f"rotation: embedding {name} has rows of width {modules[name].weight.shape[1]}, the residual stream "
                f"{hidden}: a projected embedding is not supported"
            )


def untie_lm_head(model: nn.Module, plan: RotationPlan) -> list[str]:
    """Give every reader that shares its weight with an embedding its own Parameter (an lm_head tied to the input
    embeddings: R1 changes them differently), and set an HF ``config.tie_word_embeddings`` to False. Returns the
    readers untied (logged)."""
    modules = dict(model.named_modules())
    embedding_weights = {id(modules[e].weight) for e in plan.embeddings}
    untied = []
    for name in plan.readers:
        module = modules[name]
        if id(module.weight) in embedding_weights:
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=module.weight.requires_grad)
            untied.append(name)
    if untied:
        for sub in model.modules():
            cfg = getattr(sub, "config", None)
            if getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False
        logger.info("rotation: untied %s from the input embeddings (R1 rotates them differently)", untied)
    return untied


@torch.no_grad()
def fuse_norms(model: nn.Module, plan: RotationPlan) -> None:
    """Each norm's weight (RMSNorm ``x * w``; Gemma's ``x * (1 + w)``) multiplied into the input columns of its
    readers, the norm left as identity scaling (w = 1, Gemma's w = 0); what the model computes is unchanged. An
    lm_head tied to the embeddings is untied first (``untie_lm_head``)."""
    untie_lm_head(model, plan)
    modules = dict(model.named_modules())
    for norm_name, readers in plan.norms:
        norm = modules[norm_name]
        offset = norm_offset(norm) or 0.0
        scale = (offset + norm.weight.detach().double()).cpu()
        for reader in readers:
            weight = linear_weight(modules[reader])
            weight.copy_((weight.double() * scale.to(weight.device)[None, :]).to(weight.dtype))
        norm.weight.fill_(1.0 - offset)


def plan_modules(model: nn.Module, plan: RotationPlan) -> dict[str, Any]:
    """The modules the plan names, by name (KeyError naming the first missing one)."""
    modules = dict(model.named_modules())
    names = [*plan.embeddings, *plan.readers, *plan.writers, *(n for n, _ in plan.norms), *plan.down_projs]
    names += [n for h in plan.heads for n in (h.v_proj, h.o_proj)]
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"rotation plan names {missing}, not modules of {type(model).__name__}")
    return {n: modules[n] for n in names}
