"""quark.torch: the public face of the engine.

Top level API: ``ModelQuantizer`` (prepare -> [SmoothQuant, AWQ] -> calibrate -> [GPTQ] -> freeze). Building blocks live under
``quark.torch.quantization`` (config, formats, observers, fake quantization, quantized layers).
"""

import quark.torch.algorithm  # noqa: F401 - registers GPTQ / AWQ / SmoothQuant with ModelQuantizer
from quark.torch.export import export_onnx, export_safetensors, import_model_from_safetensors
from quark.torch.quantization.api import LayerPlan, ModelQuantizer

__all__ = ["ModelQuantizer", "LayerPlan", "export_safetensors", "import_model_from_safetensors", "export_onnx"]
