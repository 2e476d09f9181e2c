"""Learned rotations (SpinQuant): R1 and one R2 per layer as Parameters, attached to the plan's weights as
``torch.nn.utils.parametrize`` parametrizations, trained (``training.train_rotation``), then folded.

Attached on top of fused norms: embeddings ``W_E @ R1``, readers ``W @ R1``, writers ``R1^T @ W`` (bias
``R1^T @ b``), and per head v_proj's rows ``R2^T @ W_v[h]`` (bias likewise) and o_proj's columns ``W_o[:, h] @ R2``
(the conventions of ``rotate.fold_r1`` / ``rotate.fold_r2``). Every access of a weight computes it from its original
and the current rotation, so the quantized twin's weight quantizer sees the rotated weight on every forward and the
gradient of the loss reaches the rotations. The online R4 of the down projections stays a fixed Hadamard matrix.

``fold_learned``: the parametrizations are removed, the original Parameters put back (the same objects) and the
final rotations folded into them in place in float64 by ``fold_r1`` / ``fold_r2``; nothing of the training is left
(the state_dict has the keys a fixed rotation leaves).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn.utils import parametrize

from quark.torch.algorithm.rotation.blocks import add_online_r4, rotation_block, rotation_generator
from quark.torch.algorithm.rotation.hadamard import block_hadamard_matrix
from quark.torch.algorithm.rotation.plan import RotationPlan, fuse_norms
from quark.torch.algorithm.rotation.rotate import fold_r1, fold_r2
from quark.torch.quantization.config.config import RotationConfig
from quark.torch.quantization.hf import linear_weight

__all__ = ["LearnedRotations", "attach_learned_rotations", "fold_learned", "detach_learned_rotations"]


class _Right(nn.Module):
    """``W -> W @ R`` (embeddings and readers of the residual stream)."""

    def __init__(self, rotation: nn.Parameter) -> None:
        super().__init__()
        self.rotation = rotation

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """The rotated tensor."""
        return w @ self.rotation.to(w.dtype)


class _LeftT(nn.Module):
    """``W -> R^T @ W`` (writers' weights); a bias ``b -> R^T @ b``."""

    def __init__(self, rotation: nn.Parameter) -> None:
        super().__init__()
        self.rotation = rotation

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """The rotated tensor."""
        return self.rotation.to(w.dtype).T @ w


class _HeadRows(nn.Module):
    """v_proj's weight [heads * d, in] (or bias [heads * d]): each head's rows ``R2^T @ W[h]``."""

    def __init__(self, rotation: nn.Parameter) -> None:
        super().__init__()
        self.rotation = rotation

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """The rotated tensor."""
        r = self.rotation.to(w.dtype)
        d = r.shape[0]
        if w.dim() == 1:
            return (w.reshape(-1, d) @ r).reshape(w.shape)
        return (r.T @ w.reshape(-1, d, w.shape[1])).reshape(w.shape)


class _HeadCols(nn.Module):
    """o_proj's weight [out, heads * d]: each head's columns ``W[:, h] @ R2``."""

    def __init__(self, rotation: nn.Parameter) -> None:
        super().__init__()
        self.rotation = rotation

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """The rotated tensor."""
        r = self.rotation.to(w.dtype)
        return (w.reshape(w.shape[0], -1, r.shape[0]) @ r).reshape(w.shape)


@dataclass
class LearnedRotations:
    """The rotations being learned and where they are attached.

    Attributes:
        plan: The rotation plan they follow.
        r1: The shared residual rotation [hidden, hidden] (None without ``r1``).
        r2: v_proj name -> that layer's head rotation [head_dim, head_dim] (empty without ``r2``).
        sites: (module, tensor name) of every parametrized tensor.
    """

    plan: RotationPlan
    r1: nn.Parameter | None = None
    r2: dict[str, nn.Parameter] = field(default_factory=dict)
    sites: list[tuple[nn.Module, str]] = field(default_factory=list)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, Parameter) of every rotation: ``R1`` and ``R2[<v_proj>]``."""
        named = [("R1", self.r1)] if self.r1 is not None else []
        return named + [(f"R2[{name}]", r) for name, r in self.r2.items()]


def _start(size: int, config: RotationConfig, random: bool, generator: torch.Generator) -> nn.Parameter:
    """A float32 rotation Parameter starting at the (random, with ``random``) block Hadamard matrix."""
    block = rotation_block(size, config, f"a learned rotation of size {size}")
    with torch.inference_mode(False):  # a calibration under inference mode: the Parameter must take gradients
        matrix = block_hadamard_matrix(size, block, generator=generator if random else None)
        return nn.Parameter(matrix.to(torch.float32).clone())


def _attach(sites: list[tuple[nn.Module, str]], module: nn.Module, name: str, p: nn.Module) -> None:
    """Register ``p`` on ``module.<name>`` (unsafe: the shape is kept, checked once here) and record the site."""
    before = getattr(module, name).shape
    parametrize.register_parametrization(module, name, p, unsafe=True)
    if getattr(module, name).shape != before:
        raise ValueError(f"rotation: the learned rotation changes the shape of {name} of {type(module).__name__}")
    sites.append((module, name))


def _weight_name(module: nn.Module) -> str:
    """The name under which ``linear_weight`` finds the module's weight (``weight`` for every supported layer)."""
    if parametrize.is_parametrized(module, "weight"):
        return "weight"  # o_proj: R2 on top of R1
    weight = linear_weight(module)
    for name, param in module.named_parameters(recurse=False):
        if param is weight:
            return name
    raise ValueError(f"rotation: {type(module).__name__} holds its weight outside its own Parameters")


def _attach_r1(model: nn.Module, learned: LearnedRotations, r1: nn.Parameter) -> None:
    """Parametrize the embeddings, readers and writers with ``r1`` (``learned.r1``)."""
    modules = dict(model.named_modules())
    for name in (*learned.plan.embeddings, *learned.plan.readers):
        module = modules[name]
        wname = "weight" if isinstance(module, nn.Embedding) else _weight_name(module)
        _attach(learned.sites, module, wname, _Right(r1))
    for name in learned.plan.writers:
        module = modules[name]
        _attach(learned.sites, module, _weight_name(module), _LeftT(r1))
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            _attach(learned.sites, module, "bias", _Right(r1))


def _attach_r2(model: nn.Module, learned: LearnedRotations, config: RotationConfig, gen: torch.Generator) -> None:
    """One R2 per layer: v_proj's rows (and bias) and o_proj's columns of each head."""
    modules = dict(model.named_modules())
    for site in learned.plan.heads:
        r2 = _start(site.head_dim, config, config.random_r2, gen)
        learned.r2[site.v_proj] = r2
        v, o = modules[site.v_proj], modules[site.o_proj]
        _attach(learned.sites, v, _weight_name(v), _HeadRows(r2))
        if isinstance(getattr(v, "bias", None), nn.Parameter):
            _attach(learned.sites, v, "bias", _HeadRows(r2))
        _attach(learned.sites, o, _weight_name(o), _HeadCols(r2))


def attach_learned_rotations(model: nn.Module, plan: RotationPlan, config: RotationConfig) -> LearnedRotations:
    """Fuse the norms, give the down projections their fixed online R4 (``r4``), and attach R1 / R2 (as ``config``
    asks) as parametrizations starting at the (random) Hadamard matrices. The float function is unchanged.

    Random starts draw from ``torch.Generator().manual_seed(torch.initial_seed())`` as the fixed rotations do.
    """
    generator = rotation_generator()
    fuse_norms(model, plan)
    if config.r4:
        add_online_r4(model, plan, config)
    learned = LearnedRotations(plan)
    try:
        if config.r1:
            learned.r1 = _start(plan.hidden_size, config, config.random_r1, generator)
            _attach_r1(model, learned, learned.r1)
        if config.r2 and plan.heads:
            _attach_r2(model, learned, config, generator)
    except BaseException:
        detach_learned_rotations(learned)
        raise
    return learned


def detach_learned_rotations(learned: LearnedRotations) -> None:
    """Remove every parametrization, the original tensors back as they were (the rotations dropped, not folded)."""
    for module, name in reversed(learned.sites):
        if parametrize.is_parametrized(module, name):
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)
    learned.sites.clear()


@torch.no_grad()
def fold_learned(model: nn.Module, learned: LearnedRotations) -> None:
    """Fold the learned rotations into the weights (float64 products, in the same Parameters) and remove the
    parametrizations and rotation Parameters."""
    r1 = None if learned.r1 is None else learned.r1.detach().clone()
    r2 = {name: r.detach().clone() for name, r in learned.r2.items()}
    detach_learned_rotations(learned)
    if r1 is not None:
        fold_r1(model, learned.plan, r1)
    for site in learned.plan.heads:
        if site.v_proj in r2:
            fold_r2(model, replace(learned.plan, heads=(site,)), r2[site.v_proj])
    learned.r1 = None
    learned.r2 = {}
