"""quark.torch: the public face of the engine.

Top level API: ``ModelQuantizer`` (prepare -> calibrate -> freeze). Building blocks live under
``quark.torch.quantization`` (config, formats, observers, fake quantization, quantized layers).
"""

from quark.torch.quantization.api import LayerPlan, ModelQuantizer

__all__ = ["ModelQuantizer", "LayerPlan"]
