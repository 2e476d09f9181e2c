"""The rotation plan's data (``RotationPlan``, ``HeadSite``) and the checks both ways of building it share: a norm is
an RMS norm (``check_rms_norm``), an attention's head size (``head_dim_of``). Re-exported by ``plan``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quark.torch.algorithm.structure import norm_offset

__all__ = ["HeadSite", "RotationPlan", "check_rms_norm", "head_dim_of"]


@dataclass(frozen=True)
class HeadSite:
    """R2 of one decoder layer: ``v_proj``'s rows and ``o_proj``'s columns rotated per head of ``head_dim``."""

    v_proj: str
    o_proj: str
    head_dim: int


@dataclass(frozen=True)
class RotationPlan:
    """Every site of the rotations in one model (full module names from ``model.named_modules()``).

    Attributes:
        hidden_size: The residual stream's width (R1 is ``[hidden_size, hidden_size]``).
        embeddings: ``nn.Embedding`` names whose rows enter the residual stream: ``W_E <- W_E @ R1``.
        readers: Linear names reading the residual (through a norm): ``W <- W @ R1``.
        writers: Linear names writing into the residual: ``W <- R1.T @ W``, ``b <- R1.T @ b``.
        norms: (norm name, the readers it feeds): fused into them before rotating.
        heads: v_proj rows / o_proj columns rotated per head (R2).
        down_projs: Linears given an online Hadamard on their input (R4).
        family: The family the plan was derived from ("explicit" for amd-quark's ``scaling_layers``).
    """

    hidden_size: int
    embeddings: tuple[str, ...]
    readers: tuple[str, ...]
    writers: tuple[str, ...]
    norms: tuple[tuple[str, tuple[str, ...]], ...]
    heads: tuple[HeadSite, ...]
    down_projs: tuple[str, ...]
    family: str = "llama"


def check_rms_norm(name: str, module: nn.Module, family: str) -> float:
    """The ``norm_offset`` (0: ``x * w``, 1: ``x * (1 + w)``) of an RMS norm; ValueError naming ``name`` and
    ``family`` for a norm with a bias, with mean subtraction (LayerNorm) or of no known form.

    Probed on a fixed input of large values (the norm's eps negligible): the output must be ``x / rms(x) * (o + w)``.
    """
    allowed = "an RMS norm x / rms(x) * w or x / rms(x) * (1 + w), without bias"
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        raise ValueError(
            f"rotation: norm {name} ({type(module).__name__}, family {family!r}) has a bias; supported: {allowed}"
        )
    offset = norm_offset(module)
    weight = getattr(module, "weight", None)
    if offset is None or not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"rotation: norm {name} ({type(module).__name__}, family {family!r}) is of no known form; supported: {allowed}"
        )
    x = 100.0 * torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        got = module(x.to(weight.dtype).to(weight.device)).double().cpu()
    expected = x * x.pow(2).mean(-1, keepdim=True).rsqrt() * (offset + weight.detach().double().cpu())
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max())):
        raise ValueError(
            f"rotation: norm {name} ({type(module).__name__}, family {family!r}) is not an RMS norm (it subtracts the "
            f"mean, as LayerNorm does, or scales otherwise); supported: {allowed}"
        )
    return offset


def head_dim_of(name: str, attn: nn.Module) -> int:
    """The attention's head size: its ``head_dim`` attribute, or from its HF config."""
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:
        cfg = getattr(attn, "config", None)
        head_dim = getattr(cfg, "head_dim", None) or (
            cfg.hidden_size // cfg.num_attention_heads if cfg is not None else None
        )
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"rotation: cannot tell the head size of {name} ({type(attn).__name__}); r2 needs head_dim")
    return head_dim
