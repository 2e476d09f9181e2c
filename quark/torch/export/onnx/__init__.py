"""ONNX export as a QuantizeLinear / DequantizeLinear graph, from the frozen model.

int8 / uint8 quantizers per tensor or per channel become torch's fused fake-quant ops, which the TorchScript exporter
writes as Q/DQ pairs (``fold_weight_quantization`` then stores the weights as integers). What that exporter cannot
write is traced as private placeholder nodes that ``lower_placeholders`` replaces by standard ONNX: int4 / uint4
weights (per tensor, channel or group) and int8 / uint8 weights per group as codes of type INT4 / UINT4 / INT8 /
UINT8 read by DequantizeLinear (``block_size`` for groups; opset 21), fp8 weights as FLOAT8 codes read by
DequantizeLinear, and fp8 activations as QuantizeLinear (to FLOAT8) + DequantizeLinear (opset 19; 21 by default).

The package by concern: ``specs`` (what Q/DQ expresses, the opset checks), ``modules`` (quantizers' export forms as
torch modules), ``export_copy`` (``qdq_model``), ``graph`` (ONNX graph rewrites, weight folding), ``lowering``
(placeholders to standard ONNX), ``ort_rewrites`` (onnxruntime's rewrites warned about) and ``writer``
(``export_onnx``). Every name is re-exported here, where it was imported from before the split."""

from quark.torch.export.onnx.export_copy import qdq_model
from quark.torch.export.onnx.graph import Constants, fold_weight_quantization
from quark.torch.export.onnx.lowering import lower_placeholders
from quark.torch.export.onnx.modules import QDQ, Float8QDQ, StoredWeight, dequantize_linear
from quark.torch.export.onnx.ort_rewrites import ORT_EXACT_OPTIONS, warn_onnxruntime_rewrites
from quark.torch.export.onnx.specs import FILENAME, check_onnx_exportable, check_spec
from quark.torch.export.onnx.writer import export_onnx

__all__ = [
    "FILENAME",
    "ORT_EXACT_OPTIONS",
    "QDQ",
    "Constants",
    "Float8QDQ",
    "StoredWeight",
    "check_onnx_exportable",
    "check_spec",
    "dequantize_linear",
    "export_onnx",
    "fold_weight_quantization",
    "lower_placeholders",
    "qdq_model",
    "warn_onnxruntime_rewrites",
]
