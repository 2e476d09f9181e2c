"""Training learned rotations (SpinQuant) on the calibration batches with the quantized model's loss.

``train_rotation``: every model weight frozen (``requires_grad`` restored after), only the rotations trained, by
``CayleySGD`` for ``steps`` steps over the calibration batches (cycled). The loss of a batch is the quantized model's
KL divergence from the float model's output distribution on it (full vocabulary, temperature 1, mean over tokens;
the float outputs computed once, before training, with the quantizers off), or the mean squared error for outputs
that are not logits (last dimension not the vocabulary). Quantizers are on: static ones start over at every step
(statistics reset, qparams recomputed from what the step's forward sees, so the weights' qparams are those of the
current rotated weight), dynamic ones work as configured; symmetric absmax scales pass their gradient
(``scale_grad``), as SpinQuant's quantizers do. When the mean loss over the batches is not lower after
training than before, the rotations go back to their start (a warning says so). After training every quantizer is back to no statistics and
no qparams (calibration starts afresh) with its switches as they were.

Under ``torch.distributed`` (initialised, several ranks) the rotations' gradients are averaged across ranks before
each step, and the losses that decide whether the trained rotations are kept are averaged too, so every rank takes
the same steps from the same start and ends with the same rotations.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.algorithm.rotation.cayley import CayleySGD
from quark.torch.algorithm.rotation.learned import (
    LearnedRotations,
    attach_learned_rotations,
    detach_learned_rotations,
    fold_learned,
)
from quark.torch.algorithm.rotation.plan import RotationPlan
from quark.torch.algorithm.rotation.scale_grad import add_scale_gradient
from quark.torch.quantization.algo_registry import AlgorithmContext
from quark.torch.quantization.config.config import RotationConfig
from quark.torch.quantization.fake_quant.base import FakeQuantizeBase
from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.state import paused_quantizers

__all__ = ["RotationTraining", "learn_rotations", "train_rotation", "rotation_loss", "output_tensor"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RotationTraining:
    """What a training run did: the mean loss over the calibration batches before and after, the steps taken, and
    whether the trained rotations were kept (False: the loss did not decrease, the start was put back)."""

    loss_before: float
    loss_after: float
    steps: int
    kept: bool = True


def output_tensor(output: Any) -> torch.Tensor:
    """The tensor of a model's output: itself, its ``logits``, or the first tensor of a tuple / list / dict."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    raise ValueError(f"rotation training: no tensor in the model's output of type {type(output).__name__}")


def rotation_loss(quantized: torch.Tensor, reference: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """KL(float || quantized) of the distributions over the last dimension (temperature 1, mean over the other
    positions) when its size is ``vocab``; otherwise the mean squared error."""
    if vocab is not None and quantized.shape[-1] == vocab:
        logq = F.log_softmax(quantized.float(), dim=-1)
        logp = F.log_softmax(reference.float(), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1).mean()
    return F.mse_loss(quantized.float(), reference.float())


def _vocab(model: nn.Module, learned: LearnedRotations) -> int | None:
    """The number of rows of the plan's largest embedding (the token embedding), None without embeddings."""
    modules = dict(model.named_modules())
    sizes = [modules[n].num_embeddings for n in learned.plan.embeddings if isinstance(modules[n], nn.Embedding)]
    return max(sizes) if sizes else None


def _quantizers(model: nn.Module) -> list[FakeQuantizeBase]:
    return [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]


def _restart(quantizers: list[FakeQuantizeBase]) -> None:
    """Static quantizers back to no statistics and no qparams, observer on (the next forward gives them)."""
    for q in quantizers:
        if q.is_dynamic:
            continue
        observer = getattr(q, "observer", None)
        if observer is not None:
            observer.reset_state()
        if hasattr(q, "forget_qparams"):
            q.forget_qparams()
        q.set_flag("observer_enabled", 1)


@contextlib.contextmanager
def _training_state(model: nn.Module, learned: LearnedRotations) -> Iterator[list[FakeQuantizeBase]]:
    """Weights frozen and rotations trainable, quantizers on; afterwards ``requires_grad`` and the quantizers'
    switches as they were and every quantizer without statistics or qparams (also on error)."""
    grads = [(p, p.requires_grad) for p in model.parameters()]
    quantizers = _quantizers(model)
    with paused_quantizers(model, observers=False, fake_quant=False), contextlib.ExitStack() as stack:
        stack.enter_context(no_kv_cache(model))
        try:
            for p, _ in grads:
                p.requires_grad_(False)
            for _, r in learned.named_parameters():
                r.requires_grad_(True)
            for q in quantizers:
                q.set_flag("fake_quant_enabled", 1)
                stack.callback(q.register_forward_hook(add_scale_gradient).remove)
            yield quantizers
        finally:
            for p, flag in grads:
                p.requires_grad_(flag)
            for _, r in learned.named_parameters():
                r.requires_grad_(False)
            _restart(quantizers)
            for q in quantizers:
                if hasattr(q, "forget_qparams"):
                    q.forget_qparams()


def _average_gradients(learned: LearnedRotations) -> None:
    """Average the rotations' gradients across ranks (when torch.distributed runs with several)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    for _, r in learned.named_parameters():
        if r.grad is None:
            r.grad = torch.zeros_like(r)
        dist.all_reduce(r.grad, op=dist.ReduceOp.SUM)
        r.grad.div_(dist.get_world_size())


def _plain(batch: Any) -> Any:
    """``batch`` with its tensors cloned outside inference mode (a calibration under ``torch.inference_mode`` gives
    inference tensors, which autograd cannot save for backward)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone() if batch.is_inference() else batch
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_plain(b) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, _plain(v)) for k, v in batch.items())
    return batch


def _mean_across_ranks(value: float) -> float:
    """``value`` averaged across ranks (itself without several ranks): every rank takes the same keep/revert decision."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor) / dist.get_world_size()


def _quantized_loss(model: nn.Module, context: AlgorithmContext, batch: Any, ref: torch.Tensor, vocab: int | None):
    """The loss of one quantized forward on ``batch`` (static quantizers restarted first)."""
    _restart(_quantizers(model))
    return rotation_loss(output_tensor(context.run(model, batch)), ref, vocab)


def _mean_loss(model: nn.Module, context: AlgorithmContext, refs: list[torch.Tensor], vocab: int | None) -> float:
    with torch.no_grad():
        losses = [
            float(_quantized_loss(model, context, b, r, vocab)) for b, r in zip(context.batches, refs, strict=True)
        ]
    return _mean_across_ranks(sum(losses) / len(losses))


def train_rotation(
    model: nn.Module, learned: LearnedRotations, context: AlgorithmContext, steps: int, lr: float
) -> RotationTraining:
    """Train ``learned``'s rotations (see the module): ``steps`` CayleySGD steps of step size ``lr``.

    Args:
        model: The prepared model with the rotations attached (``attach_learned_rotations``).
        learned: The rotations.
        context: The calibration batches and how to run one.
        steps: Optimizer steps, one batch each (cycled).
        lr: CayleySGD's step size.

    Returns:
        The mean loss over the batches before and after training.

    Raises:
        ValueError: Without calibration batches or rotations.
    """
    if not context.batches:
        raise ValueError("RotationConfig (trainable=True) needs calibration batches to train the rotations on")
    named = learned.named_parameters()
    if not named:
        raise ValueError("RotationConfig (trainable=True): nothing to learn (r1 and r2 are both off)")
    with torch.inference_mode(False), torch.enable_grad():  # a calibration may run under inference mode
        context = replace(context, batches=[_plain(b) for b in context.batches])
        vocab = _vocab(model, learned)
        with torch.no_grad(), paused_quantizers(model, fake_quant=True), no_kv_cache(model):
            refs = [output_tensor(context.run(model, b)).detach() for b in context.batches]
        starts = [r.detach().clone() for _, r in named]
        return _train(model, learned, context, steps, lr, refs, vocab, starts)


def _train(model, learned, context, steps, lr, refs, vocab, starts) -> RotationTraining:  # noqa: ANN001, D103
    named = learned.named_parameters()
    with _training_state(model, learned):
        before = _mean_loss(model, context, refs, vocab)
        optimizer = CayleySGD(named, lr=lr)
        pairs = itertools.cycle(list(zip(context.batches, refs, strict=True)))
        for _, (batch, ref) in zip(range(steps), pairs, strict=False):
            optimizer.zero_grad(set_to_none=True)
            _quantized_loss(model, context, batch, ref, vocab).backward()
            _average_gradients(learned)
            optimizer.step()
        after = _mean_loss(model, context, refs, vocab)
        if not after < before:  # never worse than the start on the calibration batches: back to it
            with torch.no_grad():
                for (_, r), start in zip(named, starts, strict=True):
                    r.copy_(start)
            logger.warning(
                "rotation training: the quantized-vs-float loss did not decrease (%.6g -> %.6g after %d step(s)); "
                "the rotations are back at their Hadamard start (try a smaller train_lr or more train_steps)",
                before,
                after,
                steps,
            )
            return RotationTraining(before, after, steps, kept=False)
    logger.info("rotation training: quantized-vs-float loss %.6g -> %.6g after %d step(s)", before, after, steps)
    return RotationTraining(before, after, steps)


def learn_rotations(
    model: nn.Module, plan: RotationPlan, config: RotationConfig, context: AlgorithmContext
) -> RotationTraining:
    """RotationConfig(trainable=True)'s transform: attach the rotations at their Hadamard start, train them for
    ``config.train_steps`` steps of step size ``config.train_lr``, fold them. On error the parametrizations are
    removed (the caller restores the weights)."""
    with torch.inference_mode(False):  # a calibration under inference mode: what training saves must be plain tensors
        learned = attach_learned_rotations(model, plan, config)
        try:
            result = train_rotation(model, learned, context, config.train_steps, config.train_lr)
        except BaseException:
            detach_learned_rotations(learned)
            raise
        fold_learned(model, learned)
    return result
