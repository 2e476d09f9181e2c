"""Export of quantized models: real-quantized safetensors (and their re-import), ONNX QDQ graphs."""

from quark.torch.export.onnx import check_onnx_exportable, export_onnx
from quark.torch.export.quark_format import check_quark_exportable
from quark.torch.export.safetensors import export_safetensors, import_model_from_safetensors, size_report

__all__ = ["export_safetensors", "import_model_from_safetensors", "export_onnx", "size_report", "export_model", "EXPORT_FORMATS", "check_onnx_exportable",
           "check_quark_exportable"]


EXPORT_FORMATS = ("safetensors", "onnx")


def export_model(model, output_dir, formats, example_input=None) -> dict:  # noqa: ANN001 - torch types documented
    """Export ``model`` in each of ``formats`` (safetensors, onnx) into ``output_dir``.

    Returns ``{format: {"path": ..., **size_report}}``; ONNX needs ``example_input``. Unknown formats raise before
    anything is written."""
    unknown = [f for f in formats if f not in EXPORT_FORMATS]
    if unknown:
        raise ValueError(f"export formats {unknown} are not known; allowed: {list(EXPORT_FORMATS)}")
    if "onnx" in formats and example_input is None:
        raise ValueError("ONNX export needs an example input")
    out = {}
    for fmt in formats:
        path = export_safetensors(model, output_dir, custom_mode=None) if fmt == "safetensors" else export_onnx(model, output_dir, example_input)
        out[fmt] = {"path": str(path), **size_report(path, model)}
    return out
