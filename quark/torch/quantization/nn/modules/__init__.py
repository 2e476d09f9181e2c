"""Quantized twins of the float layers."""

from quark.torch.quantization.nn.modules.quant_modules import (
    QUANT_MODULE_MAP,
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantEmbedding,
    QuantEmbeddingBag,
    QuantLinear,
    QuantMixin,
    iter_quantizers,
)

__all__ = [
    "QUANT_MODULE_MAP",
    "QuantMixin",
    "QuantLinear",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantConvTranspose1d",
    "QuantConvTranspose2d",
    "QuantEmbedding",
    "QuantEmbeddingBag",
    "iter_quantizers",
]
