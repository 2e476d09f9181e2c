"""The Brevitas-style quantization config of the reference docs (bit widths, int or float quant types, stats or MSE
parameters): ``config`` defines it, ``to_quark_config`` runs it on this engine; ``api`` runs it on Brevitas."""

from quark.torch.extensions.brevitas.config import (
    Backend,
    Config,
    ParamType,
    QLayerConfig,
    QTensorConfig,
    QuantizationConfig,
    QuantizationSpec,
    QuantType,
    to_quark_config,
)

__all__ = [
    "Backend",
    "Config",
    "ParamType",
    "QLayerConfig",
    "QTensorConfig",
    "QuantizationConfig",
    "QuantizationSpec",
    "QuantType",
    "to_quark_config",
]
