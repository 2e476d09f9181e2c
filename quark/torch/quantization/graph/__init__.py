"""Graph mode (``Config(quant_mode=QuantizationMode.fx_graph_mode)``): the model captured by ``torch.export``,
quantizers placed on the whole graph (activations once per tensor, add/mul/cat/pool outputs, conv + BatchNorm +
ReLU as one unit), BatchNorm folding (simulated in QAT), cross-layer equalization. Reuses the formats, observers,
fake-quant modules and quantized twins of eager mode."""

from quark.torch.quantization.graph.capture import EAGER_FALLBACK, GraphModeError, capture, is_graph_module, normalize
from quark.torch.quantization.graph.modules import (
    QuantActivation,
    QuantConvBn1d,
    QuantConvBn2d,
    QuantConvBn3d,
    QuantFunctionalWeight,
    SharedFakeQuantize,
    fold_conv_bn,
    freeze_bn_stats,
)
from quark.torch.quantization.graph.passes import (
    equalize_graph,
    find_cle_pairs,
    fold_and_equalize,
    fold_batch_norms,
    is_folded_state,
)
from quark.torch.quantization.graph.prepare import QUANTIZERS, prepare_graph

__all__ = [
    "GraphModeError",
    "EAGER_FALLBACK",
    "capture",
    "is_graph_module",
    "normalize",
    "prepare_graph",
    "QUANTIZERS",
    "fold_batch_norms",
    "equalize_graph",
    "find_cle_pairs",
    "fold_and_equalize",
    "is_folded_state",
    "freeze_bn_stats",
    "fold_conv_bn",
    "QuantActivation",
    "QuantFunctionalWeight",
    "SharedFakeQuantize",
    "QuantConvBn1d",
    "QuantConvBn2d",
    "QuantConvBn3d",
]
