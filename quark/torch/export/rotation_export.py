"""A rotated model's online rotations in amd-quark 0.13's export layout, shared by the export writers.

amd-quark gives an online rotation (``QParamsLinearWithRotation``) to the layers its rotation entry names in
``online_config.online_rotation_layers`` (else to every ``down_proj`` under ``r4``), and reads their
``input_rotation`` as one ``[rotation_size, rotation_size]`` block: int8 +-1 signs, or float with ``trainable=True``
(applied as stored). Without ``trainable`` and with ``rotation_size`` None it ignores the stored signs and builds its own Hadamard matrix of the layer's input size: the same as ours for a
power of two (Sylvester's), another one otherwise, so such an export gets a warning.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.config import Config
from quark.torch.quantization.config.rotation_fields import OnlineRotationConfig
from quark.torch.quantization.hf import linear_weight
from quark.torch.quantization.online_rotation import (
    ROTATION_BUFFER,
    encode_input_rotation,
    online_rotation_modules,
    rotation_block,
)

__all__ = ["exported_rotations", "stored_tensor", "stored_config_dict"]


def _trainable(config: Config | None) -> bool:
    """Whether ``config`` holds a rotation with ``trainable=True`` (amd-quark then reads a float block)."""
    algos = getattr(config, "algo_configs", None) or []
    return any(getattr(a, "name", None) == "rotation" and getattr(a, "trainable", False) for a in algos)


def stored_tensor(key: str, value: torch.Tensor, config: Config | None) -> torch.Tensor:
    """The tensor the writers store under ``key``: an ``input_rotation`` in its stored form for ``config``'s rotation
    (``encode_input_rotation``: int8 signs, or a float block with ``trainable=True``), anything else as it is."""
    if key.endswith("." + ROTATION_BUFFER) or key == ROTATION_BUFFER:
        return encode_input_rotation(value, as_signs=not _trainable(config))
    return value


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _amd_quark_mismatch(name: str, module: nn.Module, rotation_size: int | None, trainable: bool) -> str | None:
    """Why amd-quark 0.13 would apply another rotation than ``module``'s online one; None when it applies the same."""
    rotation = getattr(module, ROTATION_BUFFER)
    if rotation.is_meta:  # a skeleton's (no values to check)
        return None
    size, block = linear_weight(module).shape[1], rotation_block(rotation)
    expected = size if rotation_size is None else rotation_size
    if block != expected:
        return f"{name}: blocks of {block} but amd-quark makes them of rotation_size={rotation_size} ({expected})"
    if trainable:  # amd-quark applies the stored float block
        return None
    if encode_input_rotation(rotation).dtype != torch.int8:
        return f"{name}: not a fixed Hadamard rotation (amd-quark reads int8 +-1 signs)"
    if block == size and not _is_pow2(size):
        return (
            f"{name}: a full-size rotation of {size} inputs, not a power of two: amd-quark builds its own Hadamard "
            "matrix of that size, which is not this one"
        )
    return None


def exported_rotations(config: Config, model: nn.Module) -> list[Any] | None:
    """The rotation entries of ``config`` as the export records them: ``online_config.online_rotation_layers`` set
    to the layers of ``model`` holding an ``input_rotation`` (where amd-quark 0.13 puts its online rotations). Warns
    when amd-quark 0.13 would not apply the same rotations (its logits would then differ from the model's)."""
    rotations = [a for a in config.algo_configs if getattr(a, "name", None) == "rotation"]
    if not rotations:
        return None
    online = dict(online_rotation_modules(model))
    if not online:
        return rotations
    out = []
    for rotation in rotations:
        previous = rotation.online_config
        shared = previous.shared_parallel if previous is not None else False
        layers = OnlineRotationConfig(
            shared_parallel=shared,
            online_rotation_layers=sorted(online),
            use_input_prescale=previous.use_input_prescale if previous is not None else False,
        )
        out.append(dataclasses.replace(rotation, online_config=layers))
    problems = [
        p for n, m in online.items() if (p := _amd_quark_mismatch(n, m, rotations[0].rotation_size, _trainable(config)))
    ]
    if problems:
        warnings.warn(
            f"amd-quark 0.13 will not apply this export's online rotations as this model does (its logits will "
            f"differ): {'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}. This project's own import "
            "reads them exactly; for amd-quark, use a power-of-two size or set RotationConfig.rotation_size to a "
            "power of two dividing it",
            stacklevel=3,
        )
    return out


def stored_config_dict(config: Config) -> dict[str, Any]:
    """``config.to_dict()`` with each rotation entry as amd-quark 0.13 reads it (``RotationConfig.to_amd_quark_dict``:
    without this project's training settings, which its constructor refuses)."""
    out = config.to_dict()
    algos = out.get("algo_config")
    if isinstance(algos, list):
        out["algo_config"] = [
            a.to_amd_quark_dict() if getattr(a, "name", None) == "rotation" else d
            for a, d in zip(config.algo_configs, algos, strict=True)
        ]
    return out
