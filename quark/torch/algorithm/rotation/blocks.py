"""What the fixed and the learned rotations share: the Hadamard block of each rotated size, the seeded generator of
random starts, and the online R4 on every down projection."""

from __future__ import annotations

import torch
from torch import nn

from quark.torch.algorithm.rotation.hadamard import block_hadamard_matrix, can_build_hadamard
from quark.torch.algorithm.rotation.plan import RotationPlan
from quark.torch.algorithm.rotation.rotate import add_online_rotation
from quark.torch.quantization.config.config import RotationConfig
from quark.torch.quantization.hf import linear_weight


def rotation_block(size: int, config: RotationConfig, where: str) -> int:
    """The block size of a rotation of ``size`` (``rotation_size`` when given and smaller); ValueError naming
    ``where`` when it does not divide ``size`` or cannot be built."""
    block = size if config.rotation_size is None or config.rotation_size >= size else config.rotation_size
    if size % block:
        raise ValueError(
            f"RotationConfig.rotation_size={config.rotation_size} does not divide the size {size} of {where}; "
            "allowed: a divisor of every rotated size"
        )
    if not can_build_hadamard(block):
        hint = "" if config.rotation_size else "; set rotation_size to a buildable divisor"
        raise ValueError(f"rotation: no Hadamard matrix of size {block} for {where} can be built{hint}")
    return block


def rotation_generator() -> torch.Generator:
    """The generator of random R1 / R2 starts, seeded from ``torch.initial_seed()`` (``torch.manual_seed`` fixes it)."""
    return torch.Generator().manual_seed(torch.initial_seed())


def r4_input_size(module: nn.Module) -> int:
    """The input width of a down projection, the size of its online R4."""
    return linear_weight(module).shape[1]


def add_online_r4(model: nn.Module, plan: RotationPlan, config: RotationConfig) -> None:
    """The fixed online Hadamard R4 on the input of every down projection of ``plan`` (weights rotated to match)."""
    modules = dict(model.named_modules())
    for name in plan.down_projs:
        size = r4_input_size(modules[name])
        add_online_rotation(
            modules[name], block_hadamard_matrix(size, rotation_block(size, config, f"{name}'s input (R4)"))
        )
