"""What quantization does to a model: per-layer SQNR of weights and activations, and model size in bits."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.formats import bits_per_element
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin, slot_tensor, slot_tensor_name
from quark.torch.quantization.state import paused_quantizers
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize, FakeQuantizeBase

__all__ = ["sqnr_db", "weight_sqnr", "activation_sqnr", "model_size_bits", "observers_paused"]


def sqnr_db(signal: torch.Tensor, quantized: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum x^2 / sum (x - q)^2); inf when exact."""
    x = signal.detach().double()
    noise = float(((x - quantized.detach().double()) ** 2).sum())
    power = float((x**2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(power / noise) if power > 0 else -math.inf


def observers_paused(model: nn.Module) -> contextlib.AbstractContextManager[list[FakeQuantizeBase]]:
    """Observers off inside the block (statistics untouched), each quantizer's flags restored after: kept for code
    written against it, ``paused_quantizers(model)`` (quark.torch.quantization.state) is the one implementation."""
    return paused_quantizers(model)


@torch.no_grad()
def weight_sqnr(model: nn.Module) -> dict[str, float]:
    """SQNR (dB) of every quantized weight against its fake-quantized value, keyed by layer name (a layer with
    several weights, such as an LSTM or an attention's projections: ``layer.weight_ih_l0``). Left out: baked weights
    (``freeze(bake_weights=True)``: their float values are gone) and layers calibration found no forward reaching
    (they never run quantized; ``model_size_bits`` counts them as float too)."""
    out = {}
    with paused_quantizers(model):
        for name, m in model.named_modules():
            if not isinstance(m, QuantMixin) or m.unreached:
                continue
            for slot, q in m.quantizer_slots():
                if slot.role == "weight" and bool(q.fake_quant_enabled) and not isinstance(q, BakedFakeQuantize):
                    tensor = slot_tensor(m, slot)
                    key = name if slot.tensor == "weight" else f"{name}.{slot_tensor_name(slot)}"
                    out[key] = sqnr_db(tensor, q(tensor))  # type: ignore[arg-type]
    return out


@torch.no_grad()
def activation_sqnr(model: nn.Module, run: Callable[[nn.Module], Any]) -> dict[str, float]:
    """SQNR (dB) of every quantized layer's input against its fake-quantized value, on what ``run(model)`` feeds."""
    out: dict[str, float] = {}
    handles = []

    def hook(name: str, module: QuantMixin, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            out[name] = sqnr_db(args[0], module._input_quantizer(args[0]))  # type: ignore[misc]

    for name, m in model.named_modules():
        if isinstance(m, QuantMixin) and m._input_quantizer is not None and bool(m._input_quantizer.fake_quant_enabled):
            handles.append(m.register_forward_pre_hook(lambda mod, args, n=name: hook(n, mod, args)))
    try:
        with paused_quantizers(model):
            run(model)
    finally:
        for h in handles:
            h.remove()
    return out


def model_size_bits(model: nn.Module) -> tuple[int, int]:
    """(bits of the quantized model, bits of the same parameters in their float dtypes).

    Quantized weights and biases count their format's bits per element (block formats include their shared
    scales; per-channel/group scales of integer formats are not counted, nor are the scales and thresholds TQT and
    LSQ learn as Parameters of their quantizers: they are not part of the float model); every other parameter its
    dtype's bits, and so do the weights of layers that no calibration forward reached (they are not run quantized).
    A parameter shared by several modules counts the widest of its uses: a float use (an input embedding tied to a
    quantized ``lm_head``) needs the float tensor, so it is not reported as quantized.
    """
    qparams = {id(p) for m in model.modules() if isinstance(m, FakeQuantizeBase) for p in m.parameters()}
    bits: dict[int, float] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        quantized = {}
        if isinstance(m, QuantMixin) and not m.unreached:
            for name, q in m.param_quantizers():
                if bool(q.fake_quant_enabled):
                    quantized[name] = bits_per_element(q.spec.dtype, q.spec.mx_element_dtype, q.spec.group_size)
        for name, p in m.named_parameters(recurse=False):
            use = quantized.get(name, p.element_size() * 8)
            bits[id(p)] = max(bits.get(id(p), 0.0), use)
    total_q = total_f = 0
    for p in model.parameters():
        if id(p) in qparams:
            continue
        total_f += p.numel() * p.element_size() * 8
        total_q += int(round(p.numel() * bits[id(p)]))
    return total_q, total_f
