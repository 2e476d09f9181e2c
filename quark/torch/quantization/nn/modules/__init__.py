"""Quantized twins of the float layers (importing this package registers the attention, recurrent, fused-experts and
MoE-router twins)."""

from quark.torch.quantization.nn.modules.quant_attention import QuantAttentionProbs
from quark.torch.quantization.nn.modules.quant_experts import QuantFusedExperts
from quark.torch.quantization.nn.modules.quant_mha import QuantMultiheadAttention
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
from quark.torch.quantization.nn.modules.quant_rnn import (
    QuantGRU,
    QuantGRUCell,
    QuantLSTM,
    QuantLSTMCell,
    QuantRNN,
    QuantRNNCell,
)
from quark.torch.quantization.nn.modules.quant_router import QuantMoERouter

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
    "QuantMultiheadAttention",
    "QuantFusedExperts",
    "QuantMoERouter",
    "QuantAttentionProbs",
    "QuantLSTM",
    "QuantGRU",
    "QuantRNN",
    "QuantLSTMCell",
    "QuantGRUCell",
    "QuantRNNCell",
    "iter_quantizers",
]
