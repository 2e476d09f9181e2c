"""RotationConfig's handler (stage ``before_calibration``) and its check.

On the prepared model's float function (quantizers off): fuse the norms into their readers, fold R1 (a Hadamard
matrix, or a random one with ``random_r1``) into the residual stream's embeddings / readers / writers, R2 per head into
v_proj / o_proj (``r2``), and give every down_proj an online Hadamard on its input (``r4``). Then the model is run on
up to ``EQUIVALENCE_BATCHES`` calibration batches before and after, and the outputs compared by
``quark.torch.quantization.equivalence`` (its rule and tolerance); on a mismatch, EquivalenceError names the step and
the model is put back as it was (values, ties, buffers and hooks).

Random rotations draw from ``torch.Generator().manual_seed(torch.initial_seed())``: the seed of
``torch.manual_seed`` / Lightning's ``seed_everything``, without consuming the global random stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.rotation.blocks import add_online_r4, r4_input_size, rotation_block, rotation_generator
from quark.torch.algorithm.rotation.hadamard import block_hadamard_matrix
from quark.torch.algorithm.rotation.plan import RotationPlan, fuse_norms, rotation_plan
from quark.torch.algorithm.rotation.rotate import (
    fold_r1,
    fold_r2,
    online_rotation_modules,
    remove_online_rotation,
)
from quark.torch.algorithm.rotation.training import learn_rotations
from quark.torch.quantization.algo_registry import AlgorithmContext
from quark.torch.quantization.config.config import RotationConfig
from quark.torch.quantization.equivalence import check_equivalent, restored_on_error
from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.state import paused_quantizers

__all__ = ["run_rotation", "check_rotation", "apply_rotations", "EQUIVALENCE_BATCHES"]

#: calibration batches the whole transform is checked on
EQUIVALENCE_BATCHES = 4


def _refuse_unsupported(config: RotationConfig) -> None:
    """NotImplementedError naming the field for what the fixed rotations do not do."""
    for field, value in (
        ("r3", config.r3),
        ("online_r1_rotation", config.online_r1_rotation),
        ("train_smooth", config.train_smooth),
    ):
        if value:
            raise NotImplementedError(
                f"RotationConfig.{field}=True is not supported (fixed rotations: r1 folded offline, r2 folded, r4 "
                "online on down_proj); set it to False"
            )


def _sizes(model: nn.Module, plan: RotationPlan, config: RotationConfig) -> dict[str, tuple[int, int]]:
    """(size, block) of each rotation the config asks for, checked (ValueError naming the layer)."""
    modules = dict(model.named_modules())
    sizes = {}
    if config.r1:
        sizes["r1"] = (plan.hidden_size, rotation_block(plan.hidden_size, config, "the residual stream (R1)"))
    if config.r2 and plan.heads:
        head_dim = plan.heads[0].head_dim
        sizes["r2"] = (head_dim, rotation_block(head_dim, config, f"the heads of {plan.heads[0].v_proj} (R2)"))
    if config.r4:
        for name in plan.down_projs:
            size = r4_input_size(modules[name])
            sizes[name] = (size, rotation_block(size, config, f"{name}'s input (R4)"))
    return sizes


def check_rotation(model: nn.Module, config: RotationConfig) -> None:
    """Everything checkable before a weight changes: the refused fields, the plan (family, norms), the sizes."""
    _refuse_unsupported(config)
    _sizes(model, rotation_plan(model, config), config)


def _generator(config: RotationConfig) -> torch.Generator | None:
    """The generator of random R1 / R2 (``rotation_generator``), None without random rotations."""
    return rotation_generator() if config.random_r1 or config.random_r2 else None


def apply_rotations(model: nn.Module, plan: RotationPlan, config: RotationConfig) -> None:
    """The transform itself, unchecked: fuse norms, R1, R2, R4 as ``config`` asks."""
    sizes = _sizes(model, plan, config)
    generator = _generator(config)
    fuse_norms(model, plan)
    if config.r1:
        size, block = sizes["r1"]
        fold_r1(model, plan, block_hadamard_matrix(size, block, generator=generator if config.random_r1 else None))
    if "r2" in sizes:
        size, block = sizes["r2"]
        fold_r2(model, plan, block_hadamard_matrix(size, block, generator=generator if config.random_r2 else None))
    if config.r4:
        add_online_r4(model, plan, config)


@contextlib.contextmanager
def _undone_on_error(model: nn.Module) -> Iterator[None]:
    """Around ``apply_rotations``: on error, every parameter and buffer back to its value, tied weights tied again
    (HF ``tie_word_embeddings`` too) and the online rotations added removed."""
    params = {
        n: (m, m.weight) for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), nn.Parameter)
    }
    configs = [(c, c.tie_word_embeddings) for c in _hf_configs(model)]
    before = {n for n, _ in online_rotation_modules(model)}
    try:
        with restored_on_error(model):
            yield
    except BaseException:
        for module, weight in params.values():
            module.weight = weight
        for cfg, tie in configs:
            cfg.tie_word_embeddings = tie
        for name, module in list(online_rotation_modules(model)):
            if name not in before:
                remove_online_rotation(module)
        raise


def _hf_configs(model: nn.Module) -> list[Any]:
    """The distinct HF configs with ``tie_word_embeddings`` of ``model``'s modules."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


@torch.no_grad()
def _outputs(model: nn.Module, context: AlgorithmContext) -> list[Any]:
    """The model's float outputs on the first ``EQUIVALENCE_BATCHES`` calibration batches."""
    with paused_quantizers(model, fake_quant=True), no_kv_cache(model):
        return [context.run(model, batch) for batch in context.batches[:EQUIVALENCE_BATCHES]]


def run_rotation(model: nn.Module, config: RotationConfig, context: AlgorithmContext | None) -> None:
    """RotationConfig's handler: rotate ``model`` in place, checked on the calibration batches (see the module)."""
    _refuse_unsupported(config)
    if context is None or not context.batches:
        raise ValueError("RotationConfig (rotation) needs calibration batches to check the transform on")
    plan = rotation_plan(model, config)
    before = _outputs(model, context)
    with _undone_on_error(model):
        if config.trainable:  # learned rotations (SpinQuant): attached, trained, folded
            learn_rotations(model, plan, config, context)
        else:
            apply_rotations(model, plan, config)
        after = _outputs(model, context)
        steps = "+".join(
            s for s, on in (("norm fusion", True), ("R1", config.r1), ("R2", config.r2), ("R4", config.r4)) if on
        )
        check_equivalent(f"rotation ({steps})", type(model).__name__, before, after)
