"""The Brevitas backend: a Brevitas-quantized copy of the model (layerwise: QuantLinear / QuantConv1d / QuantConv2d
with input and weight quantizers of the configured widths), calibrated on data, exportable as ONNX QCDQ.

Needs the optional extra: ``pip install 'quark-lightning[brevitas]'``. Without Brevitas, ``to_quark_config`` runs the
same Config on this engine."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.extensions.brevitas.config import Config, ParamType, QuantizationSpec, QuantType
from quark.torch.extras import import_extra
from quark.torch.quantization.config.type import QSchemeType, ScaleType


def _brevitas() -> Any:
    feature = (
        "the Brevitas backend (or run the same Config on this engine: quark.torch.extensions.brevitas.to_quark_config)"
    )
    return import_extra("brevitas.nn", "brevitas", feature)


def _quantizer(spec: QuantizationSpec, role: str) -> tuple[Any, dict[str, Any]]:
    """The Brevitas quantizer class for a spec and the keyword overrides (bit widths, exact min-max statistics)."""
    import brevitas.quant as bq

    weight = role == "weight"
    per_channel = spec.qscheme == QSchemeType.per_channel
    mse = spec.param_type == ParamType.mse
    pof2 = spec.scale_type == ScaleType.pof2
    if spec.quant_type == QuantType.float_quant:
        fmt = {(4, 3): "Fp8e4m3", (5, 2): "Fp8e5m2"}.get((spec.exponent_bit_width, spec.mantissa_bit_width), "Fp8e4m3")  # type: ignore[arg-type]
        name = f"{fmt}{'Weight' if weight else 'Act'}Per{'Channel' if per_channel and weight else 'Tensor'}Float{'MSE' if mse else ''}"
        extra: dict[str, Any] = {
            "exponent_bit_width": spec.exponent_bit_width,
            "mantissa_bit_width": spec.mantissa_bit_width,
            "bit_width": spec.bit_width,
        }
        return getattr(bq, name), extra
    if weight:
        if not spec.symmetric:
            name = "ShiftedUint8WeightPerChannelFloat" if per_channel else "ShiftedUint8WeightPerTensorFloat"
        elif pof2:
            name = f"Int8WeightPer{'Channel' if per_channel else 'Tensor'}FixedPoint{'MSE' if mse else ''}"
        else:
            name = f"Int8WeightPer{'Channel' if per_channel else 'Tensor'}Float{'MSE' if mse else ''}"
        return getattr(bq, name), {"bit_width": spec.bit_width, "narrow_range": False}
    if per_channel:
        raise ValueError(f"{role}: the Brevitas backend quantizes activations per tensor; use qscheme=per_tensor")
    if not spec.symmetric:
        name = "ShiftedUint8ActPerTensorFloat" + ("MSE" if mse else "")
    elif pof2:
        name = "Int8ActPerTensorFixedPoint" + ("MSE" if mse else "")
    else:
        name = "Int8ActPerTensorFloat" + ("MSE" if mse else "")
    extra = {"bit_width": spec.bit_width}
    if not mse:  # statistics: the observed extremes (Brevitas's default is the 99.999th percentile)
        extra["high_percentile_q"] = 100.0
        if not spec.symmetric:
            extra["low_percentile_q"] = 0.0
    return getattr(bq, name), extra


class ModelQuantizer:
    """``ModelQuantizer(config).quantize_model(model, dataloader)``: a Brevitas-quantized copy of ``model``."""

    def __init__(self, config: Config | dict[str, Any]) -> None:
        self.config = config if isinstance(config, Config) else Config.from_dict(config)
        if self.config.pre_quant_opt_config or self.config.algo_config:
            raise ValueError(
                "the Brevitas backend runs no pre_quant_opt_config / algo_config; use this engine (to_quark_config)"
            )

    def quantize_model(
        self, model: nn.Module, dataloader: Iterable[Any] | None = None, max_batches: int | None = None
    ) -> nn.Module:
        """A copy of ``model`` with Brevitas layers (same weights), calibrated on ``dataloader`` when activations are
        quantized; the input model is not modified."""
        qnn = _brevitas()
        from brevitas.graph.calibrate import calibration_mode

        specs = self.config.global_quant_config
        if specs.output_tensors is not None or specs.bias is not None:
            raise ValueError(
                "the layerwise Brevitas backend quantizes input_tensors and weight; output_tensors / bias are not supported"
            )
        quantized = copy.deepcopy(model)
        swapped = 0
        for module in list(quantized.modules()):
            for child_name, child in list(module.named_children()):
                twin = self._twin(qnn, child, specs)
                if twin is not None:
                    setattr(module, child_name, twin)
                    swapped += 1
        if not swapped:
            raise ValueError(f"{type(model).__name__} has no Linear / Conv1d / Conv2d layer to quantize")
        if specs.input_tensors is not None:
            if dataloader is None:
                raise ValueError("static activation quantization needs calibration data: pass a dataloader")
            quantized.eval()
            with torch.no_grad(), calibration_mode(quantized):
                for i, batch in enumerate(dataloader):
                    if max_batches is not None and i >= max_batches:
                        break
                    quantized(batch[0] if isinstance(batch, tuple | list) else batch)
        return quantized.eval()

    @staticmethod
    def _twin(qnn: Any, layer: nn.Module, specs: Any) -> nn.Module | None:
        kwargs: dict[str, Any] = {"return_quant_tensor": False}
        for role, key in (("weight", "weight"), ("input_tensors", "input")):
            spec = getattr(specs, role)
            if spec is None:
                kwargs[f"{key}_quant"] = None
                continue
            quantizer, extra = _quantizer(spec, role)
            kwargs[f"{key}_quant"] = quantizer
            kwargs.update({f"{key}_{k}": v for k, v in extra.items()})
        if type(layer) is nn.Linear:
            twin = qnn.QuantLinear(layer.in_features, layer.out_features, bias=layer.bias is not None, **kwargs)
        elif type(layer) in (nn.Conv1d, nn.Conv2d):
            cls = qnn.QuantConv1d if type(layer) is nn.Conv1d else qnn.QuantConv2d
            twin = cls(
                layer.in_channels,
                layer.out_channels,
                layer.kernel_size,
                stride=layer.stride,
                padding=layer.padding,
                dilation=layer.dilation,
                groups=layer.groups,
                bias=layer.bias is not None,
                **kwargs,
            )
        else:
            return None
        twin.load_state_dict(layer.state_dict(), strict=False)
        return twin.to(layer.weight.device)


def export_onnx_qcdq(model: nn.Module, path: str | Path, example_input: torch.Tensor) -> Path:
    """Brevitas's ONNX QCDQ export (QuantizeLinear -> Clip -> DequantizeLinear) of a model from ``quantize_model``."""
    _brevitas()
    from brevitas.export import export_onnx_qcdq as export

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    export(
        model, args=example_input, export_path=str(path), dynamo=False
    )  # the TorchScript exporter writes the QCDQ ops
    return path
