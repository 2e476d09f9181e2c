"""Lightning front end of the engine."""

from callbacks.quant import QuantCallback, load_quantized_checkpoint

__all__ = ["QuantCallback", "load_quantized_checkpoint"]
