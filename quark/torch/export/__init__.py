"""Export of quantized models through one front end (``export_model``, a registry of formats by name: ``quark``,
amd-quark's Hugging Face directory; ``safetensors``, this project's single file; ``onnx``, a QDQ graph), and
amd-quark's own API (``export_safetensors``, ``import_model_from_safetensors``, ``export_onnx``)."""

from quark.torch.export.front_end import (
    QUARK_SUBDIR,
    ExportFormat,
    check_exportable,
    check_formats,
    export_formats,
    export_model,
    get_format,
    import_model,
    register_format,
    size_report,
)
from quark.torch.export.onnx import check_onnx_exportable, export_onnx
from quark.torch.export.quark_format import check_quark_exportable
from quark.torch.export.safetensors import export_safetensors, import_model_from_safetensors
from quark.torch.export.single_file import read_single_file, write_single_file

__all__ = [
    "export_safetensors",
    "import_model_from_safetensors",
    "export_onnx",
    "size_report",
    "export_model",
    "import_model",
    "EXPORT_FORMATS",
    "ExportFormat",
    "register_format",
    "export_formats",
    "get_format",
    "check_formats",
    "check_exportable",
    "QUARK_SUBDIR",
    "check_onnx_exportable",
    "check_quark_exportable",
    "write_single_file",
    "read_single_file",
]

#: the built-in formats' names (``export_formats()`` also lists the ones registered later)
EXPORT_FORMATS = export_formats()
