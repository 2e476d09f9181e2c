"""Quantization-aware distillation for QuantCallback: the float model teaches its fake-quantized self.

``QuantCallback(config, mode="qat", distill=Distillation(...))`` keeps the user's ``training_step``: during ``fit``
the module's ``training_step`` is wrapped (an instance attribute, removed in ``teardown``), the student's first
forward of the step is captured by a forward hook (its inputs, its logits: the output tensor, its ``.logits`` or its
``["logits"]``; hidden states from hooks on ``hidden_layers``), the teacher runs on the same inputs, and the step
returns ``(1 - weight) * task + weight * distill`` for Lightning to backpropagate.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from callbacks.sharded import uses_fsdp2
from quark.torch.quantization.state import paused_quantizers
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = ["IGNORE_INDEX", "LOSSES", "MASKS", "TEACHERS", "Distillation", "QuantDistillation", "distill_loss"]

LOSSES = ("kl", "jsd")
TEACHERS = ("copy", "self")
MASKS = ("auto", None)
IGNORE_INDEX = -100


@dataclass
class Distillation:
    """What the quantized student learns from its float teacher.

    Args:
        loss: ``"kl"``: KL(teacher || student) of the softened distributions, times ``temperature**2`` (Hinton);
            ``"jsd"``: the Jensen-Shannon divergence (mean KL of both to their mixture), also times ``temperature**2``.
        temperature: > 0; logits are divided by it before the softmax.
        weight: in [0, 1]; the step's loss is ``(1 - weight) * task + weight * distill`` (1: distillation only).
        hidden_layers: module names (``named_modules`` of the LightningModule) whose outputs (the tensor, or the
            first element of a tuple) get an MSE student vs teacher, averaged over the layers.
        hidden_weight: >= 0; ``distill = logits_loss + hidden_weight * hidden_mse``.
        mask: which positions count: ``"auto"`` (``(x, y)`` batches: ``y != -100``; dict batches: ``labels != -100``
            in the Hugging Face causal convention, logit t predicting label t + 1, else ``attention_mask``; else all),
            ``None`` (all), or a callable ``mask(batch) -> bool tensor`` of the logits' shape without the last axis.
        teacher: ``"copy"``: a frozen copy of the module taken at the start of training (after checkpoint / float
            weights are loaded), quantizers off, eval mode; one more model in memory, saved in the callback's
            checkpoint state so a resumed run distils from the same teacher. ``"self"``: the module itself run with
            every quantizer off, in eval mode and without gradients, at the current weights: no extra memory, but
            the teacher moves as the weights train.
    """

    loss: str = "kl"
    temperature: float = 1.0
    weight: float = 1.0
    hidden_layers: tuple[str, ...] = field(default_factory=tuple)
    hidden_weight: float = 1.0
    mask: str | None | Callable[[Any], torch.Tensor] = "auto"
    teacher: str = "copy"

    def __post_init__(self) -> None:
        """Check every field; ValueError naming it and what is allowed."""
        if self.loss not in LOSSES:
            raise ValueError(f"Distillation.loss={self.loss!r} is not allowed; allowed: {list(LOSSES)}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"Distillation.teacher={self.teacher!r} is not allowed; allowed: {list(TEACHERS)}")
        _check_number("temperature", self.temperature, 0.0, math.inf, low_open=True)
        _check_number("weight", self.weight, 0.0, 1.0, low_open=False)
        _check_number("hidden_weight", self.hidden_weight, 0.0, math.inf, low_open=False)
        if isinstance(self.hidden_layers, str) or not all(isinstance(n, str) and n for n in self.hidden_layers):
            raise ValueError(
                f"Distillation.hidden_layers={self.hidden_layers!r} must be a list of module names (non-empty strings)"
            )
        self.hidden_layers = tuple(self.hidden_layers)
        if not callable(self.mask) and self.mask not in MASKS:
            raise ValueError(
                f"Distillation.mask={self.mask!r} is not allowed; allowed: 'auto', None or a callable mask(batch)"
            )


def _check_number(name: str, value: Any, low: float, high: float, *, low_open: bool) -> None:
    """ValueError unless ``value`` is a real number in the range (``low`` excluded when ``low_open``)."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise ValueError(f"Distillation.{name}={value!r} must be a number in {bounds}")


def as_distillation(value: Distillation | Mapping[str, Any] | Any) -> Distillation:
    """A Distillation from itself, a dict or an OmegaConf DictConfig of its fields (unknown keys named)."""
    if isinstance(value, Distillation):
        return value
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(value, Mapping):
        raise ValueError(f"`distill` must be a Distillation or a dict of its fields, got {type(value).__name__}")
    known = Distillation.__dataclass_fields__
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ValueError(f"`distill` has unknown field(s) {unknown}; allowed: {list(known)}")
    return Distillation(**dict(value))


# ----------------------------------------------------------------------------------------------- the losses
def distill_loss(
    student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """Mean over the counted positions of KL(teacher || student) or JSD of the softened logits, times T**2.

    Args:
        student: logits [..., V] (gradients flow through these).
        teacher: logits of the same shape (no gradient expected).
        kind: ``"kl"`` or ``"jsd"``.
        temperature: the softmax temperature T.
        mask: bool [...] (True: the position counts) or None (all count).

    Returns:
        A scalar in float32 (0, still attached to ``student``, when no position counts).
    """
    if student.shape != teacher.shape:
        raise ValueError(f"distillation: student logits {tuple(student.shape)} vs teacher {tuple(teacher.shape)}")
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if kind == "kl":
        per = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif kind == "jsd":
        log_m = torch.logsumexp(torch.stack([log_s, log_t]), dim=0) - math.log(2.0)
        per = 0.5 * (log_t.exp() * (log_t - log_m)).sum(-1) + 0.5 * (log_s.exp() * (log_s - log_m)).sum(-1)
    else:
        raise ValueError(f"distillation loss {kind!r} is not allowed; allowed: {list(LOSSES)}")
    return masked_mean(per, mask) * temperature**2


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` [...] over the True positions of ``mask`` (all when None); 0 * sum when none is True."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.device, torch.bool)
    count = mask.sum()
    return (values * mask).sum() / count.clamp(min=1)


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error of two hidden states; per position over ``mask`` when its shape is theirs without the
    last axis, over every element otherwise."""
    if student.shape != teacher.shape:
        raise ValueError(f"distillation: hidden state {tuple(student.shape)} vs teacher {tuple(teacher.shape)}")
    sq = (student.float() - teacher.float()).pow(2)
    if mask is not None and mask.shape == sq.shape[:-1]:
        return masked_mean(sq.mean(-1), mask)
    return sq.mean()


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a forward output: the tensor, its ``.logits`` or its ``["logits"]``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise ValueError(
        f"distillation: the module's forward returned {type(output).__name__}; expected the logits tensor, an "
        "object with .logits or a dict with 'logits'"
    )


def hidden_of(name: str, output: Any) -> torch.Tensor:
    """A hidden state from a module's output: the tensor, or the first element of a tuple / list."""
    if isinstance(output, tuple | list) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"distillation: hidden layer {name!r} returned {type(output).__name__}, not a tensor")
    return output


def position_mask(spec: Any, batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
    """The positions that count (bool, ``logits.shape[:-1]``) from the ``mask`` field and the step's batch."""
    shape = logits.shape[:-1]
    if spec is None:
        return None
    if callable(spec):
        mask = spec(batch)
    else:
        mask = _auto_mask(batch, shape)
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != shape:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"distillation: the mask is {got}; it must be a bool tensor of the logits' shape {tuple(shape)}"
        )
    return mask.to(logits.device, torch.bool)


def _auto_mask(batch: Any, shape: torch.Size) -> torch.Tensor | None:
    """``mask="auto"``: targets != -100 of (x, y) batches; HF-shifted labels, else attention_mask, of dict ones."""
    if isinstance(batch, tuple | list) and len(batch) >= 2:
        y = batch[1]
        if isinstance(y, torch.Tensor) and y.shape == shape:
            return y != IGNORE_INDEX
        return None
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and labels.shape == shape:
            mask = torch.zeros(shape, dtype=torch.bool, device=labels.device)
            mask[..., :-1] = labels[..., 1:] != IGNORE_INDEX  # logit t predicts label t + 1
            return mask
        attention = batch.get("attention_mask")
        if isinstance(attention, torch.Tensor) and attention.shape == shape:
            return attention.bool()
    return None


# ----------------------------------------------------------------------------------------------- the mixin
class QuantDistillation:
    """QuantCallback's distillation: teacher, hooks, the wrapped ``training_step`` and their checkpoint state."""

    distill: Distillation | None

    def _init_distill(self, distill: Distillation | Mapping[str, Any] | None, mode: str) -> None:
        """Validate ``distill`` against ``mode`` (PTQ trains nothing: refused)."""
        self.distill = None if distill is None else as_distillation(distill)
        if self.distill is not None and mode != "qat":
            raise ValueError(f"`distill` trains the quantized model against a teacher: use mode='qat', got {mode!r}")
        self._teacher: nn.Module | None = None
        self._teacher_pending: dict[str, torch.Tensor] | None = None
        self._distill_hooks: list[Any] = []
        self._step: dict[str, Any] | None = None  # the running step's captures (None: not capturing)

    def _setup_distill(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuse what cannot distil, before any step: manual optimization, unknown hidden layers, a copy under FSDP2."""
        if self.distill is None:
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                "QuantCallback(distill=...) adds the distillation loss to what training_step returns, which Lightning "
                "backpropagates only with automatic optimization; this module sets automatic_optimization=False"
            )
        names = dict(pl_module.named_modules())
        unknown = [n for n in self.distill.hidden_layers if n not in names]
        if unknown:
            raise ValueError(
                f"Distillation.hidden_layers: {unknown} not in {type(pl_module).__name__}; its modules: "
                f"{[n for n in names if n][:50]}"
            )
        if self.distill.teacher == "copy" and uses_fsdp2(trainer):
            raise ValueError(
                "Distillation(teacher='copy') under FSDP2 (ModelParallelStrategy): a copy of the sharded module would "
                "hold DTensor shards outside the strategy's wrapping; use teacher='self' (the module itself with "
                "quantizers off: no extra memory)"
            )

    def _start_distill(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At training start (weights loaded): the copy teacher, the hooks and the wrapped ``training_step``."""
        if self.distill is None:
            return
        self._remove_distill(pl_module)
        if self.distill.teacher == "copy":
            self._teacher = _frozen_copy(pl_module, trainer, self)
            if self._teacher_pending is not None:
                self._teacher.load_state_dict(self._teacher_pending)
                self._teacher_pending = None
                rank_zero_info("QuantCallback: distillation teacher restored from the checkpoint")
        self._distill_hooks.append(pl_module.register_forward_hook(self._capture_output, with_kwargs=True))
        for name in self.distill.hidden_layers:
            module = pl_module.get_submodule(name)
            self._distill_hooks.append(module.register_forward_hook(self._hidden_hook(name)))
        original = pl_module.training_step
        pl_module.training_step = self._wrap_step(trainer, pl_module, original)  # type: ignore[method-assign]

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the hooks and the wrapped ``training_step`` (the teacher is kept for ``state_dict``)."""
        self._remove_distill(pl_module)

    def _remove_distill(self, pl_module: LightningModule) -> None:
        """Undo ``_start_distill``'s hooks and wrapper."""
        for handle in self._distill_hooks:
            handle.remove()
        self._distill_hooks = []
        if getattr(pl_module.__dict__.get("training_step"), "_quant_distill", False):
            del pl_module.__dict__["training_step"]
        self._step = None

    # --- captures
    def _capture_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The student's first forward of the step: its inputs and output."""
        step = self._step
        if step is not None and step["phase"] == "student" and "output" not in step:
            step["args"], step["kwargs"], step["output"] = args, kwargs, output

    def _hidden_hook(self, name: str) -> Callable[..., None]:
        """A forward hook storing the first output of ``name`` per phase (student, or the self teacher)."""

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            step = self._step
            if step is not None:
                step[step["phase"]].setdefault(name, hidden_of(name, output))

        return hook

    # --- the step
    def _wrap_step(self, trainer: Trainer, pl_module: LightningModule, original: Callable[..., Any]) -> Callable:
        """``training_step`` returning the combined loss (logged with its parts)."""

        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._step = {"phase": "student", "student": {}, "teacher": {}}
            try:
                out = original(*args, **kwargs)
                if out is None:
                    return None
                if "output" not in self._step:
                    raise ValueError(
                        "QuantCallback(distill=...): training_step did not call the module (self(...)), so no "
                        "logits were captured; call self(inputs) in training_step"
                    )
                task = out["loss"] if isinstance(out, Mapping) else out
                batch = args[0] if args else kwargs.get("batch")
                total, parts = self._combine(pl_module, task, batch)
            finally:
                self._step = None
            pl_module.log("distill_loss", parts["distill"], on_step=True, prog_bar=True)
            pl_module.log("task_loss", parts["task"], on_step=True)
            pl_module.log("total_loss", total.detach(), on_step=True)
            return {**out, "loss": total} if isinstance(out, Mapping) else total

        training_step._quant_distill = True  # type: ignore[attr-defined]
        return training_step

    def _combine(
        self, pl_module: LightningModule, task: torch.Tensor, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(1 - w) * task + w * (logits loss + hidden_weight * hidden MSE), with the detached parts."""
        cfg, step = self.distill, self._step
        assert cfg is not None and step is not None
        student = logits_of(step["output"])
        teacher_out, teacher_hidden = self._run_teacher(pl_module, step["args"], step["kwargs"])
        mask = position_mask(cfg.mask, batch, student)
        distill = distill_loss(student, logits_of(teacher_out).detach(), cfg.loss, cfg.temperature, mask)
        if cfg.hidden_layers:
            mses = [hidden_mse(step["student"][n], teacher_hidden[n].detach(), mask) for n in cfg.hidden_layers]
            distill = distill + cfg.hidden_weight * torch.stack(mses).mean()
        total = (1.0 - cfg.weight) * task + cfg.weight * distill
        return total, {"distill": distill.detach(), "task": task.detach()}

    def _run_teacher(self, pl_module: LightningModule, args: tuple, kwargs: dict) -> tuple[Any, dict]:
        """The teacher's output and hidden states on the student's forward inputs (no grad, eval, float)."""
        step = self._step
        assert step is not None and self.distill is not None
        with torch.no_grad():
            if self._teacher is not None:
                captured: dict[str, torch.Tensor] = {}
                handles = [
                    self._teacher.get_submodule(n).register_forward_hook(
                        lambda m, a, o, n=n: captured.setdefault(n, hidden_of(n, o))
                    )
                    for n in self.distill.hidden_layers
                ]
                try:
                    return self._teacher(*args, **kwargs), captured
                finally:
                    for h in handles:
                        h.remove()
            step["phase"] = "teacher"
            modes = {m: m.training for m in pl_module.modules()}
            pl_module.eval()
            try:
                with paused_quantizers(pl_module, fake_quant=True):
                    return pl_module(*args, **kwargs), step["teacher"]
            finally:
                for m, training in modes.items():
                    m.training = training
                step["phase"] = "student"

    # --- checkpoint state
    def _distill_state(self) -> dict[str, Any]:
        """The copy teacher's weights (a resumed run distils from the same teacher)."""
        if self._teacher is None:
            return {}
        return {"distill_teacher": {k: v.detach().cpu() for k, v in self._teacher.state_dict().items()}}

    def _load_distill_state(self, state: Mapping[str, Any]) -> None:
        """Keep the saved teacher for ``_start_distill`` (the module is not at hand here)."""
        teacher = state.get("distill_teacher")
        if teacher is not None and self.distill is not None and self.distill.teacher == "copy":
            self._teacher_pending = dict(teacher)


def _frozen_copy(pl_module: LightningModule, trainer: Trainer, owner: Any) -> nn.Module:
    """A deep copy of the module (not of its trainer or this callback), quantizers off, eval, no gradients."""
    memo: dict[int, Any] = {id(trainer): None, id(owner): owner}
    teacher = copy.deepcopy(pl_module, memo)
    for q in teacher.modules():
        if isinstance(q, FakeQuantizeBase):
            q.enable_observer(False)
            q.enable_fake_quant(False)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher
