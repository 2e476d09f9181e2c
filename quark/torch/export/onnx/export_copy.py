"""The export copy of a model (``qdq_model``): a frozen deep copy whose quantizers are replaced by their export forms
(stored weight codes, fp8 placeholders, torch's fused fake quantization)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from quark.torch.compat import EXPORT_GUARDS_ATTR
from quark.torch.export.codec import stored_quantizer
from quark.torch.export.onnx.modules import QDQ, Float8QDQ, StoredWeight
from quark.torch.export.onnx.specs import (
    FLOAT8_TYPES,
    INT8_RANGES,
    check_spec,
    functional_weights,
    named_quantizer_slots,
    slot_tensor,
)
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.type import QSchemeType, RoundType
from quark.torch.quantization.nn.modules.quant_modules import refresh_computed_tensors, store_computed_tensors


def _qdq(quantizer: nn.Module, where: str) -> QDQ:
    spec = quantizer.spec  # type: ignore[attr-defined]
    if quantizer.round_method != RoundType.half_even:  # type: ignore[attr-defined] # a baked weight's is half_even
        warnings.warn(
            f"{where}: round_method={spec.round_method.name}; ONNX QuantizeLinear rounds half to even", stacklevel=4
        )
    scale, zero_point = quantizer.calculate_qparams()  # type: ignore[attr-defined]
    qmin, qmax = INT8_RANGES[spec.dtype]
    axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
    return QDQ(scale, zero_point, qmin, qmax, axis)


def _export_quantizer(quantizer: nn.Module, where: str, tensor: torch.Tensor | None, name: str) -> nn.Module:
    """The export form of one frozen quantizer: the codes of a weight that torch's fake-quant ops cannot express
    (StoredWeight; also a weight rounded other than half to even, which QuantizeLinear would round differently), an
    fp8 activation placeholder (Float8QDQ), else torch's fused fake quantization (QDQ)."""
    spec = quantizer.spec  # type: ignore[attr-defined]
    check_spec(spec, where, None if tensor is None else tensor.ndim)
    nearest = quantizer.round_method == RoundType.half_even  # type: ignore[attr-defined]
    if tensor is not None and (spec.dtype not in INT8_RANGES or spec.qscheme == QSchemeType.per_group or not nearest):
        return StoredWeight(quantizer, tensor, where, name)
    if spec.dtype in FLOAT8_TYPES:
        return Float8QDQ(quantizer.calculate_qparams()[0], spec.dtype.name, name)  # type: ignore[operator]
    return _qdq(quantizer, where)


class _NoGuards(nn.Module):
    """Stands in for a captured graph's ``_guards_fn`` (torch.export's input-shape asserts) in the export copy: traced,
    each assert is a tensor turned into a Python bool (a TracerWarning per guard), and the ONNX graph holds no guard."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


def qdq_model(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` whose quantizers are in their export form; ValueError naming the first unsupported one."""
    refresh_computed_tensors(model)  # old-style weight_norm's weight: a non-leaf tensor that deepcopy refuses
    with warnings.catch_warnings():  # torch's own pickling of a captured graph's pytree specs (torch >= 2.10)
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        export = copy.deepcopy(model)
    store_computed_tensors(export)  # weight_norm's weight: stored as the model computes it now, not recomputed
    export = ModelQuantizer.freeze(export).eval()
    functional = functional_weights(export)
    for layer, slot, q, where, name in named_quantizer_slots(export):
        tensor = slot_tensor(layer, slot, functional)
        q = (
            stored_quantizer(tensor, q) if tensor is not None else q if bool(q.fake_quant_enabled) else None
        )  # fake quant off: float
        layer.set_quantizer(slot, None if q is None else _export_quantizer(q, where, tensor, name))
    guarded = [m for m in export.modules() if isinstance(getattr(m, EXPORT_GUARDS_ATTR, None), nn.Module)]
    for module in guarded:
        setattr(module, EXPORT_GUARDS_ATTR, _NoGuards())
    return export
