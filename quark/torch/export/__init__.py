"""Export of quantized models: real-quantized safetensors (and their re-import)."""

from quark.torch.export.safetensors import export_safetensors, import_model_from_safetensors

__all__ = ["export_safetensors", "import_model_from_safetensors"]
