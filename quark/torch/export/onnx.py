"""ONNX export as a QuantizeLinear / DequantizeLinear graph (int8 / uint8, per tensor or per channel), from the
frozen model: each quantizer becomes torch's fused fake-quant op, which the exporter writes as a Q/DQ pair."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.files import write_atomically
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import QUANTIZER_ROLES

FILENAME = "model.onnx"
_RANGES = {Dtype.int8: (-128, 127), Dtype.uint8: (0, 255)}


class QDQ(nn.Module):
    """One quantizer as torch's fused fake quantization (exported as QuantizeLinear + DequantizeLinear)."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, axis: int | None) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().float().reshape(-1) if axis is not None else scale.detach().float().reshape(()))
        self.register_buffer("zero_point", zero_point.detach().to(torch.int32).reshape(-1 if axis is not None else ()))
        self.qmin, self.qmax, self.axis = qmin, qmax, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis is None:
            return torch.fake_quantize_per_tensor_affine(x, float(self.scale), int(self.zero_point), self.qmin, self.qmax)
        return torch.fake_quantize_per_channel_affine(x, self.scale, self.zero_point, self.axis, self.qmin, self.qmax)


def check_spec(spec: Any, where: str) -> None:
    """ValueError unless ``spec`` is a static int8/uint8 per-tensor or per-channel format (what Q/DQ expresses)."""
    if spec.dtype not in _RANGES or spec.is_dynamic or spec.qscheme not in (QSchemeType.per_tensor, QSchemeType.per_channel):
        raise ValueError(
            f"{where}: ONNX QDQ export supports static int8/uint8 quantizers per tensor or per channel; got "
            f"{spec.dtype.name}, {spec.qscheme.name if spec.qscheme else None}{', dynamic' if spec.is_dynamic else ''}"
        )


def check_onnx_exportable(model: nn.Module) -> None:
    """Before any work: every quantizer of the prepared ``model`` must be expressible as Q/DQ (names the first that is not)."""
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            for role, q in m.quantizers():
                check_spec(q.spec, f"layer '{name}' ({role})")


def _qdq(quantizer: nn.Module, where: str) -> QDQ:
    spec = quantizer.spec  # type: ignore[attr-defined]
    check_spec(spec, where)
    if spec.round_method not in (RoundType.half_even, None):
        warnings.warn(f"{where}: round_method={spec.round_method.name}; ONNX QuantizeLinear rounds half to even", stacklevel=3)
    scale, zero_point = quantizer.calculate_qparams()  # type: ignore[attr-defined]
    qmin, qmax = _RANGES[spec.dtype]
    axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
    return QDQ(scale, zero_point, qmin, qmax, axis)


def qdq_model(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` whose quantizers are QDQ modules; ValueError naming the first unsupported one."""
    export = ModelQuantizer.freeze(copy.deepcopy(model)).eval()
    for name, m in export.named_modules():
        if isinstance(m, QuantMixin):
            for role, q in list(m.quantizers()):
                if not bool(q.fake_quant_enabled):
                    m.register_module(QUANTIZER_ROLES[role], None)
                    continue
                m.register_module(QUANTIZER_ROLES[role], _qdq(q, f"layer '{name}' ({role})"))
    return export


def export_onnx(
    model: nn.Module, output_dir: str | Path, input_args: Any, filename: str = FILENAME, opset_version: int = 17,
    dynamic_batch: bool = True,
) -> Path:  # fmt: skip
    """Write ``model`` (prepared and calibrated, or frozen; not modified) as an ONNX QDQ graph; returns the path.

    ``input_args``: an example input tensor (or a tuple of them). The batch dimension is dynamic by default. The
    write is atomic (a temporary file renamed)."""
    try:
        import onnx  # noqa: F401 - the exporter needs it
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("ONNX export needs `onnx`: pip install 'quark-lightning[export]'") from err
    export = qdq_model(model)
    args = input_args if isinstance(input_args, tuple) else (input_args,)
    names = [f"input_{i}" if len(args) > 1 else "input" for i in range(len(args))]
    axes = {n: {0: "batch"} for n in [*names, "output"]} if dynamic_batch else None

    def write(tmp: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter writes Q/DQ for these ops
            torch.onnx.export(export, args, tmp, dynamo=False, opset_version=opset_version, input_names=names,
                              output_names=["output"], dynamic_axes=axes)  # fmt: skip
        fold_weight_quantization(tmp)

    return write_atomically(output_dir, filename, write)


def fold_weight_quantization(path: str | Path) -> int:
    """Store weights as integers: every QuantizeLinear fed by a float initializer becomes an int8/uint8 initializer
    (codes ``clamp(round(w * (1/scale)) + zp)``, as the fake-quant model rounds) that its DequantizeLinear reads.
    Rewrites the file in place; returns how many weights were folded."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consts = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}

    def value(name: str) -> np.ndarray:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        return numpy_helper.to_array(consts[name].attribute[0].t)

    folded, removed = 0, []
    for node in list(graph.node):
        if node.op_type != "QuantizeLinear" or node.input[0] not in inits:
            continue
        w = value(node.input[0]).astype(np.float32)
        scale, zp = value(node.input[1]).astype(np.float32), value(node.input[2])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if scale.ndim == 1 and scale.size > 1:
            shape = [1] * w.ndim
            shape[axis] = -1
            scale, zp_b = scale.reshape(shape), zp.reshape(shape).astype(np.float32)
        else:
            zp_b = zp.astype(np.float32)
        info = np.iinfo(zp.dtype)
        codes = np.clip(np.rint(w * (np.float32(1.0) / scale)) + zp_b, info.min, info.max).astype(zp.dtype)
        name = node.input[0] + "_quantized"
        graph.initializer.append(numpy_helper.from_array(codes, name))
        for consumer in graph.node:
            for i, inp in enumerate(consumer.input):
                if inp == node.output[0]:
                    consumer.input[i] = name
        removed.append(node)
        folded += 1
    for node in removed:
        graph.node.remove(node)
    used = {i for n in graph.node for i in n.input}
    for init in list(graph.initializer):
        if init.name not in used and init.name.endswith("_quantized") is False and init.name in inits:
            graph.initializer.remove(init)
    onnx.save(model, str(path))
    return folded
