"""amd-quark 0.13's export of the KV cache and the attention probabilities: the tensor names
(``<attention>.prob_output_scale`` for a ``QuantAttentionProbs``) and the k/v scale merge of ``kv_cache_group`` with
``min_kv_scale`` (its ``ModelPostProcessor._merge_kv_scale``), and the checks of those tensors before an import.

The merge: ``kv_cache_group = ["*k_proj", "*v_proj"]`` pairs every module matching the first pattern with the module
named alike by the others (``k_proj`` replaced by ``v_proj``, amd-quark's ``find_patterns_groups``). When every member
has a static, per-tensor output quantizer with zero point 0, and the global config quantizes no outputs, each
member's ``output_scale`` is written as ``max(max of the members' scales, min_kv_scale)`` (a warning when
``min_kv_scale`` is the larger). The model is left as it is: a re-import computes with the merged scales.
"""

from __future__ import annotations

import fnmatch
import warnings
from pathlib import Path

import torch
from torch import nn

from quark.torch.export.validation import Checker
from quark.torch.quantization.attention import hf_attention_modules
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.nn.modules.quant_attention import (
    ATTENTION_PROBS,
    PROB_SCALE_SUFFIX,
    QuantAttentionProbs,
)
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin

__all__ = [
    "activation_prefix",
    "check_prob_scales",
    "kv_scale_groups",
    "merge_kv_scales",
    "skips_zero_point",
]


def activation_prefix(name: str, module: QuantMixin) -> str:
    """What amd-quark's activation tensor names of ``module`` (named ``name``) start with, before ``input_scale`` /
    ``output_scale``: ``<name>.``, and for an attention's probabilities ``<attention>.prob_`` (so the scale is
    ``<attention>.prob_output_scale``)."""
    if isinstance(module, QuantAttentionProbs):
        return f"{name.removesuffix('.' + ATTENTION_PROBS)}.{PROB_SCALE_SUFFIX.removesuffix('output_scale')}"
    return f"{name}." if name else ""


def skips_zero_point(module: QuantMixin, zero_point: torch.Tensor, where: str) -> bool:
    """Whether amd-quark's layout stores no zero point for ``module``'s activations: the probabilities' quantizer
    (amd-quark writes its scale only), whose zero point must then be 0 (a ValueError otherwise)."""
    if not isinstance(module, QuantAttentionProbs):
        return False
    if bool((zero_point != 0).any()):
        raise ValueError(
            f"{where}: the attention probabilities have zero point {zero_point.tolist()}, but amd-quark stores their "
            "scale only (prob_output_scale); use fp8, int8, or uint8 with symmetric=False (probabilities >= 0 give "
            "zero point 0)"
        )
    return True


def kv_scale_groups(names: list[str], group: list[str]) -> list[list[str]]:
    """amd-quark's ``find_patterns_groups([group], names)``: for each name matching ``group[0]``, that name and the
    names that replacing ``group[0]``'s text (its ``*`` removed) by each other pattern's gives, where they exist."""
    if not group:
        return []
    known = set(names)
    word = group[0].replace("*", "")
    out = []
    for name in names:
        if fnmatch.fnmatch(name, group[0]):
            others = [name.replace(word, other.replace("*", "")) for other in group[1:]]
            out.append([name, *[o for o in others if o in known]])
    return out


def _mergeable(module: nn.Module) -> bool:
    """A KV layer whose output scale joins the merge: a static, per-tensor output quantizer with zero point 0."""
    q = getattr(module, "_output_quantizer", None)
    if not isinstance(module, QuantMixin) or q is None or q.is_dynamic or q.spec.qscheme != QSchemeType.per_tensor:
        return False
    _, zero_point = q.calculate_qparams()
    return not bool((zero_point != 0).any())


def merge_kv_scales(model: nn.Module, config: Config, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite the ``output_scale`` tensors of each ``kv_cache_group`` of ``model`` in ``tensors`` with the group's
    scale, max(members, min_kv_scale), as amd-quark's export does (see the module docstring)."""
    if not config.kv_cache_quant_config or config.global_quant_config.output_tensors is not None:
        return
    modules = dict(model.named_modules())
    for members in kv_scale_groups(list(modules), config.kv_cache_group):
        keys = [f"{m}.output_scale" for m in members]
        if not all(_mergeable(modules[m]) and k in tensors for m, k in zip(members, keys, strict=True)):
            continue
        kv = torch.stack([tensors[k] for k in keys]).max(dim=0).values
        floor = torch.tensor(config.min_kv_scale, dtype=kv.dtype)
        if bool(floor > kv):
            parent = members[0].rpartition(".")[0]
            warnings.warn(
                f"KV-cache scale of '{parent}' ({float(kv):.6g}) raised to min_kv_scale={config.min_kv_scale:g} "
                f"for {members}",
                stacklevel=3,
            )
        for key in keys:
            tensors[key] = torch.maximum(kv, floor).clone()


def check_prob_scales(model: nn.Module, config: Config, tensors: dict[str, torch.Tensor], path: Path) -> set[str]:
    """Before an import: ``<attention>.prob_output_scale`` of every attention a static ``softmax_quant_spec`` gives
    probabilities' quantizers to, one finite float > 0 each (a ValueError naming the tensor otherwise). Returns the
    keys (read, so no longer extra)."""
    spec = config.softmax_quant_spec
    if spec is None or spec.is_dynamic:
        return set()
    check = Checker(str(path), tensors)
    for name, _ in hf_attention_modules(model):
        key = f"{name}.{PROB_SCALE_SUFFIX}"
        scale = check.get(key, (torch.float32, torch.float16, torch.bfloat16), None, "the probabilities' scale")
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            check.fail(key, "a finite scale > 0", f"{float(scale.reshape(-1)[0])}")
    return check.expected
