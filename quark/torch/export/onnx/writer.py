"""``export_onnx``: amd-quark's entry point, writing a model's export copy with torch's TorchScript exporter, then
folding, lowering and checking the file."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.files import write_atomically
from quark.torch.export.onnx.export_copy import qdq_model
from quark.torch.export.onnx.graph import fold_weight_quantization
from quark.torch.export.onnx.lowering import lower_placeholders
from quark.torch.export.onnx.modules import Float8QDQ, StoredWeight
from quark.torch.export.onnx.ort_rewrites import warn_onnxruntime_rewrites
from quark.torch.export.onnx.specs import FILENAME, export_opset, has_4bit
from quark.torch.extras import import_extra

_TORCHSCRIPT_MAX_OPSET = 20  # the newest opset torch's TorchScript exporter writes; later ones by onnx's converter
_HALF = (torch.float16, torch.bfloat16)
_SDPA_GQA_ARG = 7  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class _SdpaWithoutGqa(torch.overrides.TorchFunctionMode):
    """Grouped-query attention (``scaled_dot_product_attention(..., enable_gqa=True)``, as Hugging Face's LLaMA,
    Mistral or Qwen2 call it with fewer key/value heads) written as the key/value heads repeated for their query heads,
    torch's own definition of it: the TorchScript ONNX exporter has no conversion for ``enable_gqa``."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            args = list(args)  # type: ignore[assignment]
            gqa = args.pop(_SDPA_GQA_ARG) if len(args) > _SDPA_GQA_ARG else kwargs.pop("enable_gqa", False)  # type: ignore[attr-defined]
            if gqa:
                query, key, value = args[:3]
                repeat = query.size(-3) // key.size(-3)
                args[1:3] = [key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)]  # type: ignore[index]
        return func(*args, **kwargs)


def _in_float32(export: nn.Module, args: tuple[Any, ...]) -> tuple[nn.Module, tuple[Any, ...]]:
    """A float16 / bfloat16 model (or input) as a float32 graph, with a warning: ONNX's QuantizeLinear takes a float32
    input in onnxruntime, and the export's dequantized weights are float32. The integer codes and scales are the
    same; the graph computes in float32."""
    tensors = [*export.parameters(), *export.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
    half = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype in _HALF})
    if not half:
        return export, args
    warnings.warn(
        f"export_onnx: the model or its example input is {' / '.join(half)}; the ONNX graph is written in float32 "
        "(onnxruntime's QuantizeLinear takes float32): the same integer codes and scales, float32 inputs, outputs "
        "and arithmetic between the Q/DQ pairs",
        stacklevel=3,
    )
    cast = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a for a in args)
    return export.float(), cast


class _FirstOutput(nn.Module):
    """A Hugging Face model as its first output (``logits`` of a causal LM, a classifier's scores): the TorchScript
    exporter takes tensors, not a ``ModelOutput`` holding a ``DynamicCache``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.model(*args)
        return out[0] if isinstance(out, tuple | dict) or hasattr(out, "to_tuple") else out


def export_onnx(
    model: nn.Module,
    output_dir: str | Path,
    input_args: Any,
    opset_version: int | None = None,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    verbose: bool = False,
    do_constant_folding: bool = True,
    operator_export_type: Any = None,
    uint4_int4_flag: bool = False,
    dynamo: bool = False,
    *,
    filename: str = FILENAME,
    dynamic_batch: bool = True,
) -> Path:
    """Write ``model`` (prepared and calibrated, or frozen; not modified) as an ONNX QDQ graph,
    ``<output_dir>/quark_model.onnx`` as amd-quark names it; returns the path.

    The positional parameters are amd-quark 0.13's, so its calls run unchanged. ``input_args`` is an example input
    tensor (or a tuple of them). ``opset_version`` None means 17, raised to what the quantizers need: 21 with int4 /
    uint4 or per-group weights or fp8 activations, 19 with fp8 weights only; a lower explicit one is refused naming
    the layer. ``input_names`` /
    ``output_names`` name the graph's inputs and outputs (default ``input`` / ``input_i``, ``output``). The batch
    dimension is dynamic by default. 4-bit weights are always written as INT4 / UINT4; amd-quark's
    ``uint4_int4_flag=True`` (it declares a 4-bit model) is accepted and checked: ValueError when no quantizer is
    int4 / uint4. ``dynamo=True`` is refused with the reason, and ``operator_export_type`` must stay the default ONNX
    one. The write is atomic (a temporary file renamed)."""
    if dynamo:
        raise ValueError(
            "export_onnx: dynamo=True is not supported; the Q/DQ folding here works on the TorchScript exporter's graph"
        )
    if operator_export_type not in (None, torch.onnx.OperatorExportTypes.ONNX):
        raise ValueError(f"export_onnx: operator_export_type={operator_export_type!r}; only OperatorExportTypes.ONNX")
    import_extra("onnx", "export", "ONNX export")  # the exporter needs it
    opset = export_opset(opset_version, model)
    if uint4_int4_flag and not has_4bit(model):
        raise ValueError(
            "export_onnx: uint4_int4_flag=True declares an int4/uint4 model, but no quantizer is int4 or uint4 "
            "(4-bit weights are written as INT4/UINT4 without the flag; leave it False for this model)"
        )
    export = qdq_model(model)
    placeholders = any(isinstance(m, StoredWeight | Float8QDQ) for m in export.modules())
    args = input_args if isinstance(input_args, tuple) else (input_args,)
    export, args = _in_float32(export, args)
    if type(export).__module__.startswith("transformers."):
        export = _FirstOutput(
            export
        )  # a Hugging Face model returns a ModelOutput (and a KV cache): the graph its logits
    names = list(input_names) if input_names else [f"input_{i}" if len(args) > 1 else "input" for i in range(len(args))]
    outputs = list(output_names) if output_names else ["output"]
    axes = {n: {0: "batch"} for n in [*names, *outputs]} if dynamic_batch else None

    def write(tmp: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter writes Q/DQ for these ops
            with _SdpaWithoutGqa():
                torch.onnx.export(
                    export,
                    args,
                    tmp,
                    dynamo=False,
                    opset_version=min(opset, _TORCHSCRIPT_MAX_OPSET),
                    input_names=names,
                    output_names=outputs,
                    dynamic_axes=axes,
                    verbose=verbose,
                    do_constant_folding=do_constant_folding,
                )
        fold_weight_quantization(tmp)
        if placeholders or opset > _TORCHSCRIPT_MAX_OPSET:
            lower_placeholders(tmp, opset)
        warn_onnxruntime_rewrites(tmp, Path(output_dir) / filename)

    return write_atomically(output_dir, filename, write)
