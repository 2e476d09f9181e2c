"""Calibration data of QuantCallback: where its batches come from, how one is fed to the module, checks on them."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from callbacks.compat import fit_dataloaders_argument, stage_dataloaders

CALIB_FORWARD_EXAMPLE = "QuantCallback(..., calib_forward=lambda model, batch: model(batch[0], batch[1]))"


def describe_batch(batch: Any) -> str:
    """A short description of a batch's structure and shapes, for error messages."""
    if isinstance(batch, torch.Tensor):
        return f"Tensor{list(batch.shape)}"
    if isinstance(batch, dict):
        return "dict(" + ", ".join(f"{k}={describe_batch(v)}" for k, v in batch.items()) + ")"
    if isinstance(batch, list | tuple):
        return f"{type(batch).__name__} of {len(batch)}: (" + ", ".join(describe_batch(v) for v in batch) + ")"
    return type(batch).__name__


def as_trained(trainer: Trainer, batch: Any) -> Any:
    """``batch`` as the Trainer's loops hand it to the module: floating tensors cast by the precision plugin
    (float64 under ``precision="64-true"``, bfloat16 under ``"bf16-true"``; unchanged under mixed precision)."""
    return trainer.precision_plugin.convert_input(batch)


def non_finite(batch: Any, path: str = "batch") -> str | None:
    """Where the first floating tensor of ``batch`` holding NaN or Inf is, with the counts; None when all finite."""
    if isinstance(batch, torch.Tensor):
        if batch.is_floating_point() or batch.is_complex():
            finite = torch.isfinite(batch)
            if not bool(finite.all()):
                nan = int(torch.isnan(batch).sum())
                return f"{path} (Tensor{list(batch.shape)}: {nan} NaN, {int((~finite).sum()) - nan} Inf)"
        return None
    items = batch.items() if isinstance(batch, dict) else enumerate(batch) if isinstance(batch, list | tuple) else ()
    for key, value in items:
        found = non_finite(value, f"{path}[{key!r}]")
        if found:
            return found
    return None


def _binds(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if signature is None:
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def as_model_input(module: nn.Module, batch: Any) -> Any:
    """``batch`` in a form the engine's default feed (tensor -> forward(x); (input, target...) -> forward(input);
    dict -> forward(**batch)) calls ``module.forward`` with correctly. A tuple/list whose first element alone does not
    fit the forward's signature while the whole batch does (``forward(inputs, target)`` with (inputs, target)
    batches) becomes a dict of its arguments by name. Anything else raises a ValueError naming ``calib_forward=``, as
    does a module without a forward of its own (a LightningModule whose steps call a wrapped model directly)."""
    if type(module).forward in (LightningModule.forward, nn.Module.forward):
        raise ValueError(
            f"QuantCallback cannot feed a calibration batch ({describe_batch(batch)}) to {type(module).__name__}: it defines "
            "no forward (its steps call the wrapped model themselves). Define forward, or say how to run one batch "
            f"with calib_forward=, for example {CALIB_FORWARD_EXAMPLE}"
        )
    try:
        signature: inspect.Signature | None = inspect.signature(module.forward)
    except (TypeError, ValueError):
        signature = None  # nothing to check against: the engine's default feed, as before
    if isinstance(batch, dict):
        if _binds(signature, (), batch):
            return batch
    elif isinstance(batch, list | tuple) and batch:
        if _binds(signature, (batch[0],), {}):
            return batch
        if signature is not None and _binds(signature, tuple(batch), {}):
            bound = signature.bind(*batch)
            kinds = {signature.parameters[name].kind for name in bound.arguments}
            if kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}:
                return dict(bound.arguments)
    elif not isinstance(batch, list | tuple) and _binds(signature, (batch,), {}):
        return batch
    raise ValueError(
        f"QuantCallback cannot feed a calibration batch ({describe_batch(batch)}) to {type(module).__name__}.forward"
        f"{signature}: by default a tensor batch is fed as forward(batch), a tuple/list as forward(batch[0]) or "
        "forward(*batch), a dict as forward(**batch). Say how to run one batch with calib_forward=, for example "
        f"{CALIB_FORWARD_EXAMPLE}"
    )


class CalibrationData:
    """Mixin of QuantCallback: its calibration data (``calib_dataloader``, else the train data) and first batches."""

    def _example_batch(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        """The first batch of the running stage's dataloader (the ones given to fit/test/...), else of the
        calibration data (datamodule or module train_dataloader)."""
        loaders = stage_dataloaders(trainer, trainer.state.fn) if self.calib_dataloader is None else None
        if loaders is not None:
            first = loaders[0] if isinstance(loaders, list | tuple) else loaders
            return next(iter(first))
        return next(iter(self._calibration_data(trainer, pl_module)))

    def _check_calibration_data(self) -> Any:
        """PTQ: a ``calib_dataloader`` given to the callback yields a first batch, and its floating tensors are
        finite (a peek at one batch; a one-shot iterator keeps it). ValueError before fitting, not after it. Returns
        that batch (None without ``calib_dataloader``, and in QAT, where it only feeds the report)."""
        data = self.calib_dataloader
        if data is None or self.mode != "ptq":
            return None
        with contextlib.suppress(TypeError):  # no len(): the peek tells
            if len(data) == 0:  # type: ignore[arg-type]
                raise ValueError(
                    "QuantCallback: calib_dataloader is empty (len 0); calibration needs at least one batch"
                )
        iterator = iter(data)
        try:
            first = next(iterator)
        except StopIteration:
            raise ValueError(
                "QuantCallback: calib_dataloader yielded no batch; calibration needs at least one"
            ) from None
        if iterator is data:  # a one-shot iterator: the batch peeked at is still calibrated on
            self.calib_dataloader = itertools.chain([first], iterator)
        bad = non_finite(first)
        if bad:
            raise ValueError(
                f"QuantCallback: the first batch of calib_dataloader holds non-finite values in {bad}; the calibration "
                "statistics (scales) would be NaN. Clean the data (torch.nan_to_num, dropping bad samples) or give "
                "another calib_dataloader."
            )
        return first

    def _calibration_data(self, trainer: Trainer, pl_module: LightningModule) -> Iterable[Any]:
        """``calib_dataloader``, else the train dataloader of the datamodule (set up for "fit" first, as Lightning's
        data connector would before asking it, when the running stage is another one), else the one given to
        ``trainer.fit(model, train_dataloaders=...)``, else the module's."""
        if self.calib_dataloader is not None:
            return self.calib_dataloader
        datamodule = trainer.datamodule
        given = fit_dataloaders_argument(trainer) if datamodule is None else None
        if isinstance(given, Iterable) and not isinstance(given, list | tuple | dict):  # a collection: which one?
            return given  # the loader given as trainer.fit(model, train_dataloaders=loader)
        source: Any = datamodule if datamodule is not None else pl_module
        what = f"{'datamodule' if datamodule is not None else 'module'} {type(source).__name__}"
        if not is_overridden("train_dataloader", source):
            raise ValueError(
                f"QuantCallback(mode='{self.mode}') needs calibration data: the {what} has no train_dataloader(). "
                "Give `calib_dataloader=` (any iterable of batches), define train_dataloader(), or pass "
                "train_dataloaders= to trainer.fit."
            )
        if datamodule is not None and not self._datamodule_fit_ready:
            # prepare_data (rank zero) ran for this stage already; setup is per stage: "fit" builds the train split
            datamodule.setup(TrainerFn.FITTING.value)
            self._datamodule_fit_ready = True
        try:
            return source.train_dataloader()
        except Exception as err:
            raise ValueError(
                f"QuantCallback(mode='{self.mode}') calibrates on the train data of the {what}, but its "
                f"train_dataloader() raised {type(err).__name__}: {err}. Fix it, or give `calib_dataloader=`."
            ) from err

    def _first_batch(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        if not self.log_sqnr:
            return None
        try:
            return next(iter(self._calibration_data(trainer, pl_module)))
        except (ValueError, StopIteration):
            return None
