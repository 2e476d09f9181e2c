"""amd-quark 0.13's safetensors API: ``export_safetensors`` and ``import_model_from_safetensors``, with its
signatures. Each reaches one of two layouts: amd-quark's Hugging Face directory (``quark_format``, the default,
``custom_mode="quark"``) or this project's single file (``single_file``, ``custom_mode=None``).

``import_model_from_safetensors`` rebuilds the quantized model from a float instance of the same architecture; its
outputs equal the exported (fake-quantized) model's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from quark.torch.export.codec import activation_key
from quark.torch.export.quark_format import CONFIG_FILE, WEIGHTS_FILE, export_quark_dir, import_quark_dir, is_quark_dir
from quark.torch.export.single_file import FILENAME, read_single_file, write_single_file
from quark.torch.export.skeleton import hf_skeleton

__all__ = ["export_safetensors", "import_model_from_safetensors", "activation_key", "FILENAME"]


def export_safetensors(
    model: nn.Module,
    output_dir: str | Path,
    custom_mode: str | None = "quark",
    weight_format: str = "real_quantized",
    pack_method: str = "reorder",
    *,
    filename: str = FILENAME,
) -> Path:
    """Write the quantized ``model`` (prepared and calibrated, or frozen) as real-quantized safetensors; amd-quark
    0.13's signature. Returns the path of the safetensors file.

    ``custom_mode="quark"`` (the default, as in amd-quark) writes amd-quark's directory: ``config.json`` with the
    ``quantization_config`` + ``model.safetensors`` in its key names, dtypes and ``pack_method`` packing, which
    amd-quark and vLLM load; formats amd-quark lacks follow the same rules (see ``quark.torch.export.quark_format``),
    and a format no rule covers is refused before anything is written. ``custom_mode=None`` writes this project's
    single file ``filename`` (below), which stores every format and slot of the engine.

    Every weight-like tensor of a quantized layer (each slot: ``weight``, ``bias``, an LSTM's ``weight_ih_l0``, an
    attention's ``in_proj_weight``) is stored under its own name as codes with ``_scale`` / ``_zero_point``, or as
    float when it has no quantizer; static activation quantizers' scales and zero points are stored under the slot's
    name (``input_scale``, ``output_zero_point``, ``key_input_scale``); everything else as in the state_dict. The
    write is atomic (a temporary file renamed).

    What is stored is what the model computes: a quantizer with fake quant switched off (``disable_fake_quant()``)
    leaves its tensor as it is, so such a weight is stored as its codes when it lies on the quantizer's grid, else in
    float (the single file) or refused with a ValueError naming the layer (amd-quark's directory, whose config.json
    cannot say so); a switched-off activation quantizer is stored as unquantized (single file) or refused (directory).
    """
    if custom_mode is None:
        return write_single_file(model, output_dir, filename)
    if custom_mode != "quark":
        raise ValueError(
            f"export_safetensors: custom_mode={custom_mode!r}; allowed: 'quark' or None (this project's format)"
        )
    return export_quark_dir(model, output_dir, weight_format, pack_method) / WEIGHTS_FILE


def import_model_from_safetensors(
    model: nn.Module | None,
    model_dir: str | Path,
    multi_device: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str = "eager",
    device: str | torch.device | None = None,
    multi_gpu: bool | str | None = False,
    *,
    filename: str = FILENAME,
) -> nn.Module:
    """Rebuild the quantized model from a float ``model`` of the same architecture and an exported directory:
    amd-quark 0.13's directory (config.json with a quark ``quantization_config``) or this project's single file;
    amd-quark 0.13's signature.

    ``model=None`` builds the Hugging Face model ``config.json`` describes as a skeleton (Parameters on the meta
    device, see ``skeleton.hf_skeleton``; ``trust_remote_code`` and ``attn_implementation`` go to transformers). A
    ``model`` whose Parameters are on meta is filled the same way. ``device`` places the result (None: where the
    model's tensors are, the CPU for a skeleton; amd-quark's default is "cuda"). Every tensor of the file is checked
    first against the stored Config and ``model``: on any mismatch a ValueError names the tensor and ``model`` is
    left as it was. Returns the model prepared with the stored Config, in eval mode: weights set to their dequantized
    codes, each with a pass-through ``BakedFakeQuantize`` holding its spec and qparams (the values are on the grid;
    a weight another module shares, such as an lm_head tied to float input embeddings, holds those float values and
    keeps a frozen quantizer; one two quantized layers share stays tied where their quantized values are equal and is
    untied, with a warning, where they differ: ``quark.torch.export.tied``), every static activation quantizer frozen with the stored qparams; a tensor stored as
    the exported model ran it unquantized (fake quant switched off, not on its grid) has no quantizer."""
    if multi_device or multi_gpu:
        raise ValueError(
            "import_model_from_safetensors: multi_device / multi_gpu loading is not supported here; "
            "pass device= (one device) and shard the returned model yourself"
        )
    if model is None:
        if not (Path(model_dir) / CONFIG_FILE).is_file():
            raise FileNotFoundError(
                f"model=None needs {Path(model_dir) / CONFIG_FILE} (a Hugging Face config) to build the model"
            )
        model = hf_skeleton(model_dir, trust_remote_code, attn_implementation)
    if filename == FILENAME and is_quark_dir(
        model_dir
    ):  # amd-quark 0.13's directory (or ours with custom_mode="quark")
        imported = import_quark_dir(model, model_dir, device)
    else:
        imported = read_single_file(model, Path(model_dir) / filename, device)
    return imported if device is None else imported.to(device)
