"""One front end for every export: a registry of formats by name, each with its writer, its check before anything is
written (or trained), its importer where one exists and a one-line description. ``export_model`` dispatches through
it; the Lightning callback's ``export=`` and the app's ``export=[...]`` call the same function.

Built-in formats (in ``output_dir``):

- ``safetensors``: this project's single file ``model.safetensors`` (every format and slot of the engine).
- ``onnx``: ``quark_model.onnx``, a QDQ graph (needs an example input).
- ``quark``: amd-quark 0.13's Hugging Face directory ``quark/`` (config.json with its ``quantization_config`` +
  ``model.safetensors``), which amd-quark and vLLM load; the default interchange. A model with an ``export_module``
  attribute (the name of a submodule, e.g. the Hugging Face model inside a LightningModule) is written from that
  submodule, with the Config's layer names made relative to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from quark.torch.export.onnx import check_onnx_exportable, export_onnx
from quark.torch.export.quark_format import WEIGHTS_FILE, check_quark_exportable, export_quark_dir
from quark.torch.export.safetensors import import_model_from_safetensors
from quark.torch.export.single_file import FILENAME, read_single_file, write_single_file
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.distributed import refuse_sharded

__all__ = [
    "ExportFormat",
    "register_format",
    "export_formats",
    "get_format",
    "check_formats",
    "check_exportable",
    "export_model",
    "import_model",
    "size_report",
    "export_root",
    "rooted_config",
    "QUARK_SUBDIR",
]

#: the folder of ``output_dir`` the ``quark`` format writes (its model.safetensors would clash with the single file)
QUARK_SUBDIR = "quark"

Writer = Callable[[nn.Module, Path, Any], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class ExportFormat:
    """One export format: ``write(model, output_dir, example_input)`` returns its report (``path`` and sizes);
    ``check(model)`` raises a ValueError before anything is written; ``read(model, output_dir)`` re-imports."""

    name: str
    description: str
    write: Writer
    check: Callable[[nn.Module], Any] | None = None
    read: Callable[[nn.Module | None, Path], nn.Module] | None = None
    needs_example: bool = False
    #: the modules of the ``export`` extra it writes with (an install without them is told before training)
    modules: tuple[str, ...] = ()


_FORMATS: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat) -> ExportFormat:
    """Add ``fmt`` under its name (a name already taken is a ValueError: formats are registered once)."""
    if fmt.name in _FORMATS:
        raise ValueError(f"export format '{fmt.name}' is already registered")
    _FORMATS[fmt.name] = fmt
    return fmt


def export_formats() -> tuple[str, ...]:
    """The names of the registered formats, in registration order."""
    return tuple(_FORMATS)


def check_formats(formats: Iterable[str], label: str = "export formats") -> list[str]:
    """``formats`` as a list, or a ValueError naming the unknown ones and the allowed ones (nothing written)."""
    formats = [formats] if isinstance(formats, str) else list(formats)
    unknown = [f for f in formats if f not in _FORMATS]
    if unknown:
        raise ValueError(f"{label} {unknown} are not known; allowed: {list(_FORMATS)}")
    return formats


def get_format(name: str) -> ExportFormat:
    """The registered format ``name`` (ValueError naming the allowed ones otherwise)."""
    check_formats([name], "export format")
    return _FORMATS[name]


def check_exportable(model: nn.Module, formats: Iterable[str]) -> None:
    """Each format's own check of ``model`` (e.g. a quantizer amd-quark's layout cannot hold), before any write."""
    for name in check_formats(formats):
        fmt = _FORMATS[name]
        if fmt.check is not None:
            fmt.check(model)


def export_model(
    model: nn.Module, output_dir: str | Path, formats: Iterable[str], example_input: Any = None
) -> dict[str, Any]:
    """Export ``model`` in each of ``formats`` into ``output_dir``; returns ``{format: {"path": ..., **size_report}}``.

    Unknown formats, a missing example input (ONNX) and each format's check raise before anything is written."""
    refuse_sharded(
        model,
        "export_model",
        "Export inside quark.torch.quantization.distributed.gathered_parameters(model) on every rank (rank 0 "
        "writing), as QuantCallback(export=...) does, or export the consolidated checkpoint in one process.",
    )
    formats = check_formats(formats)
    needing = [f for f in formats if _FORMATS[f].needs_example]
    if needing and example_input is None:
        raise ValueError(f"export formats {needing} need an example input (example_input=...); ONNX export needs one")
    check_exportable(model, formats)
    return {f: _FORMATS[f].write(model, Path(output_dir), example_input) for f in formats}


def import_model(model: nn.Module | None, output_dir: str | Path, fmt: str) -> nn.Module:
    """Re-import what ``export_model(..., [fmt])`` wrote into ``output_dir`` (ValueError: a format with no importer)."""
    spec = get_format(fmt)
    if spec.read is None:
        readable = [n for n, f in _FORMATS.items() if f.read is not None]
        raise ValueError(f"export format '{fmt}' has no importer; importable formats: {readable}")
    return spec.read(model, Path(output_dir))


def size_report(path: str | Path, model: nn.Module) -> dict[str, float]:
    """Bytes of an exported file against the FP32 state of ``model``'s parameters, and bits per parameter."""
    file_bytes = Path(path).stat().st_size
    params = [p for n, p in model.named_parameters() if "_quantizer" not in n]
    count = sum(p.numel() for p in params)
    fp32_bytes = 4 * count
    return {
        "file_bytes": file_bytes,
        "fp32_bytes": fp32_bytes,
        "ratio": file_bytes / fp32_bytes if fp32_bytes else 0.0,
        "bits_per_parameter": 8 * file_bytes / count if count else 0.0,
    }


# ----------------------------------------------------------------------------------------------- rooting (quark)
def export_root(model: nn.Module) -> tuple[nn.Module, str]:
    """The module the ``quark`` format writes and its name: ``model.export_module`` (the name of a submodule, e.g. a
    Hugging Face model whose config.json the directory gets), else ``model`` itself."""
    name = getattr(model, "export_module", None) or ""
    return (model.get_submodule(name) if name else model), name


def rooted_config(config: Config, prefix: str) -> Config:
    """``config`` with its layer names (exclude, layer_quant_config) relative to the submodule ``prefix``: names
    under it lose the prefix, patterns that start with a wildcard stay, names of other modules are dropped. Of the
    algorithms only a rotation is kept (its online part, ``input_rotation``, is recorded in amd-quark's layout)."""
    if not prefix:
        return config

    def rel(name: str) -> str | None:
        if name.startswith(prefix + "."):
            return name[len(prefix) + 1 :]
        return name if name[:1] in "*?[" else None

    exclude = [r for r in (rel(n) for n in config.exclude) if r is not None]
    layers = {r: qc for n, qc in config.layer_quant_config.items() if (r := rel(n)) is not None}
    rotations = [a for a in config.algo_configs if a.name == "rotation"] or None  # type: ignore[attr-defined]
    return dataclasses.replace(
        config, exclude=exclude, layer_quant_config=layers, algo_config=rotations, pre_quant_opt_config=None
    )


_MISSING = object()


@contextmanager
def _rooted(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(root, prefix) of ``export_root``, the root holding ``rooted_config`` of ``model``'s Config while inside (the
    exporters read the Config of the module they write); the root's own attribute is restored after."""
    root, prefix = export_root(model)
    if root is model:
        yield root, prefix
        return
    saved = vars(root).get("quant_config", _MISSING)
    root.quant_config = rooted_config(model.quant_config, prefix)
    try:
        yield root, prefix
    finally:
        if saved is _MISSING:
            del root.quant_config
        else:
            root.quant_config = saved


# ----------------------------------------------------------------------------------------------- built-in formats
def _write_single_file(model: nn.Module, output_dir: Path, example_input: Any) -> dict[str, Any]:
    path = write_single_file(model, output_dir)
    return {"path": str(path), **size_report(path, model)}


def _write_onnx(model: nn.Module, output_dir: Path, example_input: Any) -> dict[str, Any]:
    path = export_onnx(model, output_dir, example_input)
    return {"path": str(path), **size_report(path, model)}


def _write_quark(model: nn.Module, output_dir: Path, example_input: Any) -> dict[str, Any]:
    directory = output_dir / QUARK_SUBDIR
    with _rooted(model) as (root, prefix):
        weights = export_quark_dir(root, directory) / WEIGHTS_FILE
    return {"path": str(directory), "weights": str(weights), "module": prefix or None, **size_report(weights, root)}


def _check_quark(model: nn.Module) -> None:
    with _rooted(model) as (root, _):
        check_quark_exportable(root)


def _import_single(model: nn.Module | None, output_dir: Path) -> nn.Module:
    if model is None:
        raise ValueError("the single file holds no model description: pass the float model to import into")
    return read_single_file(model, output_dir / FILENAME)


def _read_quark(model: nn.Module | None, output_dir: Path) -> nn.Module:
    directory = output_dir / QUARK_SUBDIR
    if model is None:
        return import_model_from_safetensors(None, directory)
    root, _ = export_root(model)
    import_model_from_safetensors(root, directory)
    return model


register_format(
    ExportFormat(
        "safetensors",
        "this project's single file model.safetensors (every format and slot)",
        _write_single_file,
        None,
        _import_single,
        modules=("safetensors",),
    )
)
register_format(
    ExportFormat(
        "onnx",
        "quark_model.onnx, a QDQ graph for ONNX Runtime (needs an example input)",
        _write_onnx,
        check_onnx_exportable,
        None,
        needs_example=True,
        modules=("onnx",),
    )
)
register_format(
    ExportFormat(
        "quark",
        "amd-quark's Hugging Face directory quark/ (config.json + model.safetensors), which amd-quark and vLLM load",
        _write_quark,
        _check_quark,
        _read_quark,
        modules=("safetensors",),
    )
)
