"""QuantCallback: quantization-aware training or post-training quantization for any LightningModule.

The module is prepared by the engine in ``setup`` (before checkpoint restore, optimizers and DDP wrapping), so the
quantization state is part of the module's state_dict, learnable thresholds are parameters the user's
``configure_optimizers`` sees, and nothing is monkeypatched: layers are swapped for quantized twins that share
their Parameters.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import math
import os
import pickle
import re
import typing
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from callbacks.checkpoint_io import ensure_atomic_checkpoints
from callbacks.compat import fit_dataloaders_argument, stage_dataloaders
from callbacks.mixed_precision import MixedPrecision, write_config_yaml, write_sensitivity_csv
from callbacks.mixed_precision import choose as choose_mixed
from callbacks.quantizer_lr import follow_schedule, split_quantizer_groups
from quark.torch import ModelQuantizer
from quark.torch.algorithm.sensitivity import average_bits, mixed_precision_config
from quark.torch.compat import ddp_ignore_states
from quark.torch.export import export_formats, export_model, get_format
from quark.torch.extensions.brevitas import Config as BrevitasConfig
from quark.torch.extensions.brevitas import to_quark_config
from quark.torch.quantization import graph
from quark.torch.quantization.api import (
    activation_axes_to_check,
    check_activation_shapes,
    format_plans,
    run_batch,
    uncalibrated_layers,
)
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.distributed import flags_across_ranks, sync_learnable, sync_observers, sync_quantizers
from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.report import activation_sqnr, model_size_bits, weight_sqnr
from quark.torch.quantization.resolve import config_from_stored
from quark.torch.quantization.state import paused_quantizers, preserve_modes
from quark.torch.quantization.tensor_quantize import (
    FakeQuantizeBase,
    LSQFakeQuantize,
    TQTFakeQuantize,
)

MODES = ("qat", "ptq")
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
CALIB_FORWARD_EXAMPLE = "QuantCallback(..., calib_forward=lambda model, batch: model(batch[0], batch[1]))"
# Written into the state_dict of every checkpoint of a quantized model: a plain ``Model.load_from_checkpoint`` (no
# callback, float layers) then fails on this key first, and the key says what to use. The callback's load pre-hook and
# ``load_quantized_checkpoint`` drop it.
QUANTIZED_CHECKPOINT_KEY = "QUANTIZED checkpoint: load it with callbacks.quant.load_quantized_checkpoint(model, path)"


def _to_config(config: Any) -> Config:
    """A quark Config from a Config, a Brevitas-style Config, a dict or an OmegaConf DictConfig of the same shape."""
    if isinstance(config, Config):
        return config
    if isinstance(config, BrevitasConfig):
        return to_quark_config(config)
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            config = OmegaConf.to_container(config, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(config, dict):
        raise ValueError(f"`config` must be a quark Config, a dict or a DictConfig, got {type(config).__name__}")
    return Config.from_dict(config)


def _is_learnable(q: FakeQuantizeBase) -> bool:
    return isinstance(q, TQTFakeQuantize | LSQFakeQuantize)


def _ready(q: FakeQuantizeBase) -> bool:
    """Whether a quantizer has what it needs to quantize (qparams, or a learned threshold)."""
    initialized = getattr(q, "initialized", None)
    return q.is_dynamic or initialized is None or bool(initialized)


def _device_of(quantizers: list[FakeQuantizeBase]) -> torch.device:
    """Where the quantizers' buffers are (their collectives run there); CPU for none."""
    return quantizers[0].observer_enabled.device if quantizers else torch.device("cpu")


def _layers_of(module: nn.Module, quantizers: list[FakeQuantizeBase]) -> list[str]:
    """Names of the layers that hold ``quantizers``, sorted."""
    ids = {id(q) for q in quantizers}
    return sorted(
        name
        for name, m in module.named_modules()
        if isinstance(m, QuantMixin) and any(id(q) in ids for _, q in m.quantizers())
    )


def _pause_quantizers(module: nn.Module) -> contextlib.AbstractContextManager[list[FakeQuantizeBase]]:
    """Observers off; quantizers without qparams yet off (they run in float); all flags restored after."""
    return paused_quantizers(module, fake_quant=lambda q: not _ready(q))


def _keep_out_of_ddp_broadcast(module: nn.Module) -> None:
    """Exclude the quantizers' buffers from DDP's buffer broadcast (set before the strategy wraps the module).

    DDP copies rank 0's buffers to every rank before each forward: running observer statistics of the other ranks
    would be overwritten batch after batch, so their reduction when the qparams are fixed would miss those ranks'
    data. Quantization state is kept identical by ``sync_observers`` / ``sync_learnable`` instead; learnable
    thresholds stay Parameters whose gradients DDP reduces.
    """
    names = [
        f"{name}.{buffer}" if name else buffer
        for name, m in module.named_modules()
        if isinstance(m, FakeQuantizeBase)
        for buffer, _ in m.named_buffers()
    ]
    ddp_ignore_states(module, names)


def _quantizer_keys(module: nn.Module, prefix: str = "") -> dict[str, FakeQuantizeBase]:
    """state_dict key -> quantizer, for every buffer and Parameter of the quantizers of ``module``."""
    return {
        f"{prefix}{name}.{key}": m
        for name, m in module.named_modules()
        if isinstance(m, FakeQuantizeBase)
        for key in m.state_dict()
    }


def _fill_float_checkpoint(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook of a model prepared by QuantCallback: drops the quantized-checkpoint marker, and a state_dict of
    the float model (no quantizer key at all) gets the quantizers' current state, so that the float weights load
    strictly and the quantizers start fresh (the callback then calibrates, or runs its QAT observers)."""
    state_dict.pop(prefix + QUANTIZED_CHECKPOINT_KEY, None)
    quant_keys = _quantizer_keys(module, prefix)
    if not quant_keys or any(k in state_dict for k in quant_keys):
        return
    if not any(k.startswith(prefix) for k in state_dict):
        return  # nothing of this model: strict loading reports it
    current = module.state_dict(prefix=prefix)
    for key in quant_keys:
        state_dict[key] = current[key].detach().clone()
    module._quant_float_start = True  # read (once) by the callback


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"Tensor{list(batch.shape)}"
    if isinstance(batch, dict):
        return "dict(" + ", ".join(f"{k}={_describe(v)}" for k, v in batch.items()) + ")"
    if isinstance(batch, list | tuple):
        return f"{type(batch).__name__} of {len(batch)}: (" + ", ".join(_describe(v) for v in batch) + ")"
    return type(batch).__name__


def _as_trained(trainer: Trainer, batch: Any) -> Any:
    """``batch`` as the Trainer's loops hand it to the module: floating tensors cast by the precision plugin
    (float64 under ``precision="64-true"``, bfloat16 under ``"bf16-true"``; unchanged under mixed precision)."""
    return trainer.precision_plugin.convert_input(batch)


def _non_finite(batch: Any, path: str = "batch") -> str | None:
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
        found = _non_finite(value, f"{path}[{key!r}]")
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
            f"QuantCallback cannot feed a calibration batch ({_describe(batch)}) to {type(module).__name__}: it defines "
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
        f"QuantCallback cannot feed a calibration batch ({_describe(batch)}) to {type(module).__name__}.forward"
        f"{signature}: by default a tensor batch is fed as forward(batch), a tuple/list as forward(batch[0]) or "
        "forward(*batch), a dict as forward(**batch). Say how to run one batch with calib_forward=, for example "
        f"{CALIB_FORWARD_EXAMPLE}"
    )


class QuantCallback(Callback):
    r"""Quantize the LightningModule with a quark ``Config``: QAT during ``fit`` or PTQ calibration epochs.

    Example::

        trainer = Trainer(callbacks=[QuantCallback(config, mode="qat", observer_steps=200)])
        trainer.fit(model, datamodule=dm)           # QAT: validation metrics are the quantized model's

        trainer = Trainer(callbacks=[QuantCallback(config, mode="ptq", calib_batches=32)])
        trainer.test(model, datamodule=dm)          # PTQ of a trained model: calibrates, then tests quantized

    Args:
        config: a quark ``Config`` (or a dict / DictConfig of the same shape), or a Brevitas-style ``Config`` of
            ``quark.torch.extensions.brevitas`` (run on this engine).
        mode: ``"qat"`` (fake quantization while training) or ``"ptq"`` (train float, then calibrate).
        observer_steps: QAT: training batches during which observers run (then qparams are fixed); batches, not
            optimizer steps (gradient accumulation, several optimizers). TQT / LSQ quantizers initialise from the
            first batch whatever this is.
        freeze_bn_epoch: QAT: from this epoch on, BatchNorm layers use and keep their running statistics.
        quantizer_lr: QAT: the learning rate of TQT thresholds and LSQ scales (None: they train in the groups your
            ``configure_optimizers`` put them in). They move to one group of their own per optimizer, without weight
            decay, following the schedule of the group they came from. Thresholds barely move at a weight learning
            rate; whether a larger one helps depends on the model (README: measured both ways).
        calib_batches: PTQ: calibration batches per calibration epoch (None: the whole dataloader).
        calib_epochs: PTQ: passes over the calibration data.
        calib_dataloader: PTQ: calibration data; by default the train dataloader of the datamodule (set up for
            ``"fit"`` first when the running stage is another one) or of the module.
        calib_forward: how to feed one calibration batch, ``calib_forward(module, batch)``; by default the module
            is called on the batch (tensor), on its first element ((input, target) tuples), on all its elements when
            ``forward`` needs them (``forward(inputs, target)``) or with ``**batch`` (dicts).
        monitor: a logged metric whose FP32 and quantized values are logged side by side when both are known.
        log_sqnr: log per-layer SQNR (dB) of weights and of activations on one batch, and the model size in bits.
        progress_bar: show a progress bar during calibration (rank zero, and only when the Trainer has one:
            ``Trainer(enable_progress_bar=False)`` hides it too).
        save_quantized: PTQ: after calibration at the end of ``fit``, write ``quantized.ckpt`` (the full quantization
            state) next to the ModelCheckpoint files (or in ``default_root_dir``); its path is ``quantized_checkpoint``.
        export: formats written at the end of ``fit`` (PTQ: after calibration; QAT: with the qparams fixed), by
            ``quark.torch.export.export_model``: ``"quark"`` (amd-quark's Hugging Face directory ``quark/``, of the
            module's ``export_module`` when it names one), ``"safetensors"`` (this project's single file) and/or
            ``"onnx"`` (QDQ graph; example input: the first calibration batch). Paths and sizes land in ``exported``.
        export_dir: where they go (default ``<default_root_dir>/export``).
        mixed_precision: PTQ: a ``MixedPrecision`` (or its dict: ``candidates``, ``target_bits``, ``method``,
            ``metric``, ``batches``). The model trains float; when it is calibrated, each layer's sensitivity to each
            candidate is measured on calibration batches (one layer quantized at a time), formats are allocated under
            the ``target_bits`` budget (average weight bits per parameter, scales counted), and the model is quantized
            with the resulting Config (``config``'s other fields kept; rank zero's choice on every rank). The choice
            lands in ``mixed_choice``, the Config in ``config``, and ``sensitivity.csv`` + ``mixed_precision.yaml``
            in the log directory; ``quantized.ckpt`` stores that Config, so ``load_quantized_checkpoint`` rebuilds it.

    Raises:
        ValueError: a bad argument (named, with the allowed values), or, in ``setup``, a config matching no layer,
            or a ``ModelPruning`` placed before this callback, or, in ``on_fit_start`` (before any training step), an
            empty ``calib_dataloader`` or one whose first batch is not finite (PTQ), or an activation spec whose
            ``ch_axis`` does not fit that layer's tensor in a dry forward of one batch (naming layer, role, shape).

    Checkpoints: the quantization state is part of the module's state_dict. A float checkpoint (no quantizer state)
    is a valid start: ``test/validate/predict(ckpt_path=float.ckpt)`` in PTQ loads the weights then calibrates,
    ``fit(ckpt_path=float.ckpt)`` in QAT starts QAT from them. A quantized checkpoint loads into a fresh model with
    ``load_quantized_checkpoint`` (a plain ``Model.load_from_checkpoint`` fails with a message saying so). Every
    checkpoint of the Trainer is complete under its final name or absent: with Lightning's default CheckpointIO,
    ``setup`` installs ``AtomicCheckpointIO`` (one info line); a CheckpointIO plugin of yours is kept as it is.

    With ``ModelPruning``, put this callback first (``callbacks=[QuantCallback(...), ModelPruning(...)]``):
    ModelPruning collects the layers to prune in its own ``setup``, so it must see the quantized twins; the other
    order is refused in ``setup`` with that advice.
    """

    def __init__(
        self,
        config: Config | dict[str, Any] | Any,
        mode: str = "qat",
        *,
        observer_steps: int = 100,
        freeze_bn_epoch: int | None = None,
        quantizer_lr: float | None = None,
        calib_batches: int | None = None,
        calib_epochs: int = 1,
        calib_dataloader: Iterable[Any] | None = None,
        calib_forward: Callable[[LightningModule, Any], Any] | None = None,
        monitor: str | None = None,
        log_sqnr: bool = True,
        progress_bar: bool = True,
        save_quantized: bool = True,
        export: Iterable[str] = (),
        export_dir: str | None = None,
        mixed_precision: MixedPrecision | dict[str, Any] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode={mode!r}` is not supported; choose one of {list(MODES)}")
        for name, value, minimum in (("observer_steps", observer_steps, 1), ("calib_epochs", calib_epochs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}={value!r}` must be an int >= {minimum}")
        for name, value, minimum in (("freeze_bn_epoch", freeze_bn_epoch, 0), ("calib_batches", calib_batches, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"`{name}={value!r}` must be None or an int >= {minimum}")
        if quantizer_lr is not None:
            if (
                isinstance(quantizer_lr, bool)
                or not isinstance(quantizer_lr, int | float)
                or not 0 < quantizer_lr < math.inf
            ):
                raise ValueError(f"`quantizer_lr={quantizer_lr!r}` must be None or a finite float > 0")
            if mode != "qat":
                raise ValueError(
                    f"`quantizer_lr` trains TQT thresholds / LSQ scales: it needs mode='qat', got mode={mode!r}"
                )
        self.quantizer_lr = None if quantizer_lr is None else float(quantizer_lr)
        self._lr_splits: list[Any] = []
        self._restored_lr0: list[float | None] = []
        if calib_forward is not None and not callable(calib_forward):
            raise ValueError("`calib_forward` must be callable as calib_forward(module, batch)")
        self.export_formats = [export] if isinstance(export, str) else list(export)
        unknown = [f for f in self.export_formats if f not in export_formats()]
        if unknown:
            raise ValueError(f"`export={unknown}` is not known; allowed: {list(export_formats())}")
        self.export_dir = export_dir
        self.exported: dict[str, dict[str, Any]] = {}
        self.config = _to_config(config)
        algorithms = [a.name for a in self.config.algo_configs + self.config.pre_quant_opt_configs]  # type: ignore[attr-defined]
        if algorithms and mode != "ptq":
            raise ValueError(
                f"{algorithms} run on calibration data after training: use mode='ptq' (they run when calibration "
                "does, at the end of fit or before validate/test of an uncalibrated model)"
            )
        self.quantizer = ModelQuantizer(self.config)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            mixed_precision = MixedPrecision(**dict(mixed_precision))
        if mixed_precision is not None and mode != "ptq":
            raise ValueError(
                f"`mixed_precision` chooses formats from calibration data after training: use mode='ptq', got mode={mode!r}"
            )
        if mixed_precision is not None and self.quantizer.graph_mode:
            raise ValueError(
                "`mixed_precision` works on the module's own layers (quant_mode=eager_mode), not graph mode"
            )
        self.mixed_precision = mixed_precision
        self.mixed_choice: dict[str, str] | None = None
        self.mode = mode
        self.observer_steps = observer_steps
        self.freeze_bn_epoch = freeze_bn_epoch
        self.calib_batches = calib_batches
        self.calib_epochs = calib_epochs
        self.calib_dataloader = calib_dataloader
        self.calib_forward = calib_forward
        self.monitor = monitor
        self.log_sqnr = log_sqnr
        self.progress_bar = progress_bar
        self.save_quantized = save_quantized
        self.quantized_checkpoint: str | None = None
        self.calibrated = False
        self.fp32_metric: float | None = None
        self._paused = contextlib.ExitStack()  # the quantizer pause of a running evaluation (_pause / _resume)
        self._observing = mode == "qat"
        self._learnable_synced = False
        self._pending: list[FakeQuantizeBase] = []  # QAT: quantizers still observing after the warm-up (unreached)
        self._batches_seen = 0  # QAT: training batches run so far (observer_steps counts these)
        self._counting_for: weakref.ReferenceType[Trainer] | None = None  # the trainer whose batches those are
        self._calibrated_for: weakref.ReferenceType[nn.Module] | None = None  # PTQ: the module calibrate() last ran on
        self._datamodule_fit_ready = False  # the datamodule has run setup("fit") in this trainer run
        self._table_logged = False
        self._warned_unobserved = False
        self._warned_report_feed = False
        self._graph_inputs: dict[str, dict[str, Any]] = {}  # graph mode: the captured children's calls (_call_spec)

    # ------------------------------------------------------------------------------------------- setup
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Swap the configured layers (once: a second fit or test reuses them)."""
        ensure_atomic_checkpoints(
            trainer, "QuantCallback"
        )  # quantized.ckpt is complete or absent (not a user's plugin)
        self._datamodule_fit_ready = stage == TrainerFn.FITTING  # Lightning just ran datamodule.setup(stage)
        if stage == TrainerFn.FITTING and (self._counting_for is None or self._counting_for() is not trainer):
            self._batches_seen = 0  # a new trainer counts from its first batch (a checkpoint restores the count)
            self._counting_for = weakref.ref(trainer)
        swap = not any(isinstance(m, QuantMixin) for m in pl_module.modules())
        if swap and self._mixed_pending(pl_module):
            swap = False  # trains float; the layers are swapped once the formats are chosen (in calibrate)
        elif swap and self.quantizer.graph_mode:
            self._prepare_graphs(trainer, pl_module)
        elif swap:
            plans = self.quantizer.resolve(pl_module)
            if not plans:
                layers = [f"{n} ({type(m).__name__})" for n, m in pl_module.named_modules() if n]
                raise ValueError(
                    f"QuantCallback: the config matches no layer of {type(pl_module).__name__}. Its layers: {layers}. "
                    "Check global_quant_config / layer_type_quant_config / layer_quant_config / exclude."
                )
            self._check_callback_order(trainer)
            self.quantizer.prepare(pl_module)
            self._check_learnable_shapes(trainer, pl_module)
            _keep_out_of_ddp_broadcast(pl_module)
            # the table of the plans made before the swap (a prepared model resolves to nothing), once per callback
            if not self._table_logged:
                rank_zero_info(f"QuantCallback ({self.mode}): quantizing {len(plans)} layer(s)\n{format_plans(plans)}")
                self._table_logged = True
        if not getattr(pl_module, "_quant_load_hook", False):  # a float checkpoint restores into the quantized model
            if self.quantizer.graph_mode:  # a checkpoint written after PTQ folded BatchNorm: fold before loading
                pl_module.register_load_state_dict_pre_hook(_FoldForCheckpoint(self.config))
            pl_module.register_load_state_dict_pre_hook(_fill_float_checkpoint)
            pl_module._quant_load_hook = True
        if self.mode == "ptq" and (stage == TrainerFn.FITTING or (swap and not self.calibrated)):
            # train (and validate during fit) in float, every fit: its end calibrates the weights it leaves
            self._set_all(pl_module, observe=False, fake_quant=False)
            if stage == TrainerFn.FITTING:
                self.calibrated = False
                self._calibrated_for = None

    def _prepare_graphs(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Graph mode: capture each child of the module that holds Parameters and that one forward calls once (on
        ``example_input_array`` or the first batch), and put its quantized graph in its place; the LightningModule,
        its steps, logging and checkpointing stay as they are (state_dict keys keep the child's name)."""
        calls = self._record_child_calls(trainer, pl_module)
        prepared, skipped = [], []
        for name, child in list(pl_module.named_children()):
            if next(child.parameters(), None) is None:
                continue
            if len(calls.get(name, [])) != 1:
                skipped.append(f"{name} (called {len(calls.get(name, []))} times by one forward)")
                continue
            args, kwargs = calls[name][0]
            gm = graph.capture(child, args, kwargs)
            setattr(pl_module, name, self.quantizer.prepare(gm, name_prefix=f"{name}."))
            self._graph_inputs[name] = _call_spec(args, kwargs)
            prepared.append(name)
        if not prepared:
            raise ValueError(
                f"QuantCallback (fx_graph_mode): no child module of {type(pl_module).__name__} holding Parameters is called "
                f"exactly once by its forward ({skipped}); graph mode captures such children. {graph.EAGER_FALLBACK}."
            )
        if skipped:
            rank_zero_warn(f"QuantCallback (fx_graph_mode): these children stay float: {skipped}")
        plans = [p for name in prepared for p in self.quantizer.resolve(getattr(pl_module, name))]
        pl_module.quant_config = self.config  # the exporters read the Config of the module they write, as in eager mode
        _keep_out_of_ddp_broadcast(pl_module)
        if not self._table_logged:
            rank_zero_info(
                f"QuantCallback ({self.mode}, graph mode: {prepared}): quantizing {len(plans)} op(s)\n{format_plans(plans)}"
            )
            self._table_logged = True

    def _record_child_calls(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """The arguments each direct child receives in one forward of ``pl_module`` (eval, no_grad)."""
        example = getattr(pl_module, "example_input_array", None)
        batch = None if example is not None else self._example_batch(trainer, pl_module)
        calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}

        def record(name: str) -> Callable[..., None]:
            return lambda module, args, kwargs: calls.setdefault(name, []).append((args, kwargs))

        hooks = [
            child.register_forward_pre_hook(record(name), with_kwargs=True)
            for name, child in pl_module.named_children()
        ]
        try:
            with preserve_modes(pl_module, mode=False), torch.no_grad():
                if example is not None:
                    if isinstance(example, dict):
                        pl_module(**example)
                    else:
                        pl_module(*(example if isinstance(example, tuple) else (example,)))
                elif self.calib_forward is not None:
                    self.calib_forward(pl_module, batch)
                else:
                    run_batch(pl_module, as_model_input(pl_module, batch))
        finally:
            for h in hooks:
                h.remove()
        return calls

    def _example_batch(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        """The first batch of the running stage's dataloader (the ones given to fit/test/...), else of the
        calibration data (datamodule or module train_dataloader)."""
        loaders = stage_dataloaders(trainer, trainer.state.fn) if self.calib_dataloader is None else None
        if loaders is not None:
            first = loaders[0] if isinstance(loaders, list | tuple) else loaders
            return next(iter(first))
        return next(iter(self._calibration_data(trainer, pl_module)))

    @staticmethod
    def _check_learnable_shapes(trainer: Trainer, pl_module: LightningModule) -> None:
        """Under DDP, learnable scales must have their final shape before the module is wrapped (DDP lays out its
        gradient buckets once): a per-channel TQT / LSQ activation on an axis the layer does not fix is refused here."""
        if trainer.world_size <= 1:
            return
        lazy = [q.where for _, q in iter_quantizers(pl_module) if _is_learnable(q) and not q.channels_known]
        if lazy:
            raise ValueError(
                f"QuantCallback under {type(trainer.strategy).__name__} ({trainer.world_size} processes): per-channel "
                f"TQT thresholds / LSQ scales of {lazy} would take their shape from the first batch, after DDP has "
                "laid out its gradient "
                "buckets. Quantize activations per channel along the layer's feature axis (ch_axis=-1 for a Linear "
                "input or output, ch_axis=1 for a convolution's), or per tensor."
            )

    def _check_callback_order(self, trainer: Trainer) -> None:
        """ModelPruning collects the layers to prune in its own ``setup``: if it runs before this one, it holds the
        float layers that the swap takes out of the model (and its pruning hooks would fire on their twins)."""
        from lightning.pytorch.callbacks import ModelPruning

        callbacks = list(trainer.callbacks)
        before = callbacks[: callbacks.index(self)] if self in callbacks else []
        if any(isinstance(c, ModelPruning) for c in before):
            raise ValueError(
                "QuantCallback must come before ModelPruning in Trainer(callbacks=[...]): ModelPruning collects the "
                "layers to prune in its setup, which runs first, and QuantCallback then replaces those layers with "
                "quantized twins. Use callbacks=[QuantCallback(...), ModelPruning(...)]."
            )

    # ------------------------------------------------------------------------------------------- QAT
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Optimizers exist now (their states are restored after this, on resume): give the learned quantizer
        parameters their own learning rate when ``quantizer_lr`` is set. First, before any training step: the
        ``calib_dataloader``'s first batch (there, finite) and the activation specs' axes against one batch."""
        first = self._check_calibration_data()
        self._check_activation_axes(trainer, pl_module, first)
        if self.quantizer_lr is None:  # only accepted with mode="qat"
            return
        params = [p for _, q in iter_quantizers(pl_module) if _is_learnable(q) for p in q.parameters()]
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._lr_splits = split_quantizer_groups(trainer.optimizers, params, self.quantizer_lr, schedulers)
        for split, lr0 in zip(self._lr_splits, self._restored_lr0, strict=False):
            split.source_lr0 = lr0  # resume: the schedule factor is relative to the first run's start
        if params and not self._lr_splits:
            rank_zero_warn(
                f"QuantCallback(quantizer_lr={self.quantizer_lr}): no optimizer holds the {len(params)} learned "
                "quantizer parameter(s), so they do not train; build the optimizer from self.parameters()."
            )

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
        bad = _non_finite(first)
        if bad:
            raise ValueError(
                f"QuantCallback: the first batch of calib_dataloader holds non-finite values in {bad}; the calibration "
                "statistics (scales) would be NaN. Clean the data (torch.nan_to_num, dropping bad samples) or give "
                "another calib_dataloader."
            )
        return first

    def _check_activation_axes(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Activation specs with an axis (per_channel / per_group ``ch_axis``, per_block) against one batch, before
        any training step: a dry forward (eval, no_grad, quantizers off) of the example batch fed as calibration
        feeds it (``batch``: the calibration data's first, else the example batch); ValueError naming the layer,
        role, axis and shape. Only when such a spec exists."""
        if not activation_axes_to_check(pl_module):
            return
        if batch is None:
            batch = self._example_batch(trainer, pl_module)
        batch = trainer.strategy.batch_to_device(_as_trained(trainer, batch))
        calib_forward = self.calib_forward
        if calib_forward is None:
            try:
                batch = as_model_input(pl_module, batch)
            except ValueError:
                if self.mode == "ptq":
                    raise  # calibration would fail the same way, after training
                return  # QAT: the training steps feed the module; no forward of ours to check with
            calib_forward = run_batch
        check_activation_shapes(pl_module, lambda m: calib_forward(m, batch))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_float_start(pl_module)
        if self.mode == "qat":
            self._update_observers(trainer, pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.mode != "qat":
            return
        self._update_observers(trainer, pl_module, batch)
        if self._lr_splits:
            follow_schedule(self._lr_splits, self.quantizer_lr)  # type: ignore[arg-type]
        if self.freeze_bn_epoch is not None and trainer.current_epoch >= self.freeze_bn_epoch:
            for m in pl_module.modules():
                if isinstance(m, _BN_TYPES) and m.training:
                    m.eval()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.mode != "qat":
            return
        self._batches_seen += 1
        if self._pending:
            self._fix_pending()
        if not self._learnable_synced:
            sync_learnable(pl_module)  # each rank initialised its thresholds from its own first batch
            self._learnable_synced = True

    def _update_observers(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Observers run for the first ``observer_steps`` training batches (weights: their current values), then are
        fixed. Batches, not optimizer steps: with gradient accumulation or several optimizers they differ."""
        observing = self._batches_seen < self.observer_steps
        if observing:
            self._pending = []  # a new warm-up (a later fit) observes everything again
        for role, q in iter_quantizers(pl_module):
            if q.is_dynamic:
                continue
            if _is_learnable(q):
                q.enable_observer(not _ready(q))  # TQT / LSQ: initialise on the first batch, then learn
            elif observing:
                if role in ("weight", "bias") and getattr(q, "observer", None) is not None:
                    q.observer.reset_state()  # weights move every step: their range is the current one
                q.enable_observer(True)
        if self._observing and not observing:
            self._fix_observers(trainer, pl_module, batch)
        self._observing = observing

    def _fix_observers(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Reduce the statistics across ranks, fix the qparams (observers off) and log the report. Quantizers without
        qparams on some rank (an MoE expert the router has not chosen yet) keep observing, on every rank alike: the
        first batch that reaches one on any rank calibrates it, and its qparams are fixed after it (``_fix_pending``)."""
        sync_observers(pl_module)  # statistics are the union of the ranks'
        candidates = [q for _, q in iter_quantizers(pl_module) if not q.is_dynamic and not _is_learnable(q)]
        ready = flags_across_ranks([_ready(q) for q in candidates], "all", _device_of(candidates))
        self._pending = []
        for q, ok in zip(candidates, ready, strict=True):
            if ok:
                q.disable_observer()
            else:
                q.forget_qparams()  # a rank's qparams from an earlier warm-up batch: every rank starts alike
                q.enable_observer(True)
                self._pending.append(q)
        self._observing = False
        rank_zero_info(f"QuantCallback: observers fixed after {self._batches_seen} training batch(es)")
        if self._pending:
            layers = _layers_of(pl_module, self._pending)
            rank_zero_warn(
                f"QuantCallback: {len(layers)} layer(s) no training batch reached in the {self._batches_seen} observer "
                f"batch(es): {layers}. Their observers stay on: the first batch that reaches one calibrates it, then "
                "its qparams are fixed. Layers never reached run in float after ModelQuantizer.freeze and are exported "
                "in float."
            )
        self._log_report(trainer, pl_module, batch if self.log_sqnr else None)

    def _fix_pending(self) -> None:
        """Fix the qparams of the quantizers a batch has reached (on any rank) since the warm-up ended, with the
        statistics reduced across ranks; the same list on every rank, so the collectives line up."""
        reached = flags_across_ranks([_ready(q) for q in self._pending], "any", _device_of(self._pending))
        done = [q for q, r in zip(self._pending, reached, strict=True) if r]
        if not done:
            return
        sync_quantizers(done)  # ranks that saw no data for them take the others' statistics and qparams
        for q in done:
            q.disable_observer()
        self._pending = [q for q, r in zip(self._pending, reached, strict=True) if not r]
        rank_zero_info(
            f"QuantCallback: observers fixed after batch {self._batches_seen} for {sorted({q.where for q in done})}"
        )

    # ------------------------------------------------------------------------------------------- evaluation stages
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause(pl_module)

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._before_eval(trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._after_eval(trainer)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before_eval(trainer, pl_module)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._after_eval(trainer)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before_eval(trainer, pl_module)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    def _before_eval(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_float_start(pl_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.mode == "ptq" and not fitting and self._needs_calibration(pl_module):
            self.calibrate(trainer, pl_module)
        if self.mode == "qat" and not fitting and not self._warned_unobserved:
            unobserved = [q.where for _, q in iter_quantizers(pl_module) if not q.is_dynamic and not _ready(q)]
            if unobserved:
                self._warned_unobserved = True
                rank_zero_warn(
                    f"QuantCallback(mode='qat'): {trainer.state.fn.value}() before the observers have run (fit trains "
                    f"them): {len(unobserved)} quantizer(s) have no qparams yet and run in float ({unobserved[0]}, ...), "
                    "so these metrics are not the quantized model's. Run trainer.fit first, or load a QAT checkpoint."
                )
        self._pause(pl_module)

    def _after_eval(self, trainer: Trainer) -> None:
        self._resume()
        self._log_metric_pair(trainer)

    def _pause(self, pl_module: LightningModule) -> None:
        """Observers off (evaluation never changes a statistic); quantizers without qparams yet run in float."""
        self._resume()  # a pause still open (an evaluation that raised) is closed first: flags as they were
        self._paused.enter_context(_pause_quantizers(pl_module))

    def _resume(self) -> None:
        self._paused.close()

    # ------------------------------------------------------------------------------------------- PTQ
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.mode == "ptq":
            if self.monitor is not None and self.monitor in trainer.callback_metrics:
                self.fp32_metric = float(trainer.callback_metrics[self.monitor])
            self.calibrate(trainer, pl_module)
            if self.save_quantized:
                checkpoint = trainer.checkpoint_callback
                folder = getattr(checkpoint, "dirpath", None) or trainer.default_root_dir
                self.quantized_checkpoint = os.path.join(folder, "quantized.ckpt")
                trainer.save_checkpoint(self.quantized_checkpoint)
                rank_zero_info(f"QuantCallback: quantized checkpoint written to {self.quantized_checkpoint}")
        elif self._observing and self._batches_seen > 0:
            # fit ended before observer_steps: fix the qparams now, the same on every rank (a later fit that is still
            # within observer_steps observes again)
            self._fix_observers(trainer, pl_module, self._first_batch(trainer, pl_module))
        else:
            self._log_report(trainer, pl_module, self._first_batch(trainer, pl_module))
        if self.export_formats and trainer.is_global_zero:
            self._export(trainer, pl_module)

    def _export(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = self.export_dir or os.path.join(trainer.default_root_dir, "export")
        example = None
        if any(get_format(f).needs_example for f in self.export_formats):
            batch = next(iter(self._calibration_data(trainer, pl_module)))
            example = batch[0] if isinstance(batch, tuple | list) else batch
            if not isinstance(example, torch.Tensor):
                raise ValueError("ONNX export needs tensor batches (or (input, target) tuples) for its example input")
        with _pause_quantizers(pl_module):  # exporting never changes a statistic
            self.exported = export_model(pl_module, folder, self.export_formats, example)
        written = ", ".join(f"{fmt}: {info['path']}" for fmt, info in self.exported.items())
        rank_zero_info(f"QuantCallback: exported {written}")

    def _model_calibrated(self, pl_module: LightningModule) -> bool:
        quantizers = [q for _, q in iter_quantizers(pl_module)]
        return (
            bool(quantizers)
            and all(_ready(q) for q in quantizers)
            and all(bool(q.fake_quant_enabled) for q in quantizers)
        )

    def _needs_calibration(self, pl_module: LightningModule) -> bool:
        """PTQ before evaluation: not when this callback calibrated (or restored the calibration of) this very module
        (a quantizer that no forward reaches stays without qparams: calibrating again would not change that), nor
        when every quantizer has its qparams and is on (a model calibrated elsewhere)."""
        if self.calibrated and self._calibrated_for is not None and self._calibrated_for() is pl_module:
            return False
        return not self._model_calibrated(pl_module)

    def calibrate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Calibration epochs: observers see the calibration batches (eval, no_grad), then the qparams are fixed
        (reduced across ranks) and fake quantization is switched on. With ``mixed_precision``, the formats are chosen
        and the layers swapped first."""
        if self._mixed_pending(pl_module):
            self._choose_mixed(trainer, pl_module)
        data = self._calibration_data(trainer, pl_module)
        total = None
        if self.calib_batches is not None:
            total = self.calib_batches * self.calib_epochs
        elif hasattr(data, "__len__"):
            total = len(data) * self.calib_epochs  # type: ignore[arg-type]
        batches: Iterable[Any] = itertools.chain.from_iterable(
            itertools.islice(data, self.calib_batches) for _ in range(self.calib_epochs)
        )
        if self.progress_bar and trainer.is_global_zero and trainer.progress_bar_callback is not None:
            from tqdm.auto import tqdm

            batches = tqdm(batches, total=total, desc="Calibrating", leave=False)
        for _, q in iter_quantizers(pl_module):  # the qparams describe these calibration batches only
            observer = getattr(q, "observer", None)
            if observer is not None and not q.is_dynamic and not _is_learnable(q):
                observer.reset_state()
        forward_loop = None
        if self.calib_forward is not None:

            def forward_loop(model: nn.Module, batches: Iterable[Any] = batches) -> None:  # noqa: E306
                for batch in batches:
                    self.calib_forward(model, trainer.strategy.batch_to_device(_as_trained(trainer, batch)))  # type: ignore[misc]

            self.quantizer.calibrate(pl_module, forward_loop=forward_loop)
        else:  # in the module's dtype, as its training batches (precision="64-true" / "bf16-true")
            self.quantizer.calibrate(
                pl_module, (as_model_input(pl_module, _as_trained(trainer, batch)) for batch in batches)
            )
        sync_observers(pl_module)
        self.calibrated = True
        self._calibrated_for = weakref.ref(pl_module)
        rank_zero_info("QuantCallback: calibration done; qparams fixed")
        self._log_report(trainer, pl_module, self._first_batch(trainer, pl_module))

    def _mixed_pending(self, pl_module: LightningModule) -> bool:
        return self.mixed_precision is not None and not any(isinstance(m, QuantMixin) for m in pl_module.modules())

    def _choose_mixed(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Sensitivity on the float module, allocation under the budget (rank zero's on every rank), then the swap."""
        search = self.mixed_precision
        assert search is not None
        data = self._calibration_data(trainer, pl_module)
        batches = [
            trainer.strategy.batch_to_device(_as_trained(trainer, b)) for b in itertools.islice(data, search.batches)
        ]
        if not batches:
            raise ValueError("QuantCallback(mixed_precision=...): the calibration data yielded no batch")
        if self.calib_forward is not None:
            run = self.calib_forward
        else:
            batches = [as_model_input(pl_module, b) for b in batches]
            run = run_batch
        config, choice, sensitivities = choose_mixed(pl_module, self.config, search, batches, run)  # type: ignore[arg-type]
        choice = trainer.strategy.broadcast(choice, src=0)
        config = mixed_precision_config(self.config, choice, search.resolved)
        self.config, self.quantizer, self.mixed_choice = config, ModelQuantizer(config), choice
        plans = self.quantizer.resolve(pl_module)
        self.quantizer.prepare(pl_module)
        _keep_out_of_ddp_broadcast(pl_module)
        bits = average_bits(choice, sensitivities)
        rank_zero_info(
            f"QuantCallback: mixed precision at {bits:.3f} weight bits per parameter, scales counted\n{format_plans(plans)}"
        )
        if trainer.is_global_zero:
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            write_sensitivity_csv(folder / "sensitivity.csv", sensitivities, choice)
            write_config_yaml(folder / "mixed_precision.yaml", config, sensitivities, choice)
        self._log(trainer, {"quant/mixed_avg_bits": bits})

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

    # ------------------------------------------------------------------------------------------- metrics
    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _log_metric_pair(self, trainer: Trainer) -> None:
        if self.monitor is None or self.fp32_metric is None or self.monitor not in trainer.callback_metrics:
            return
        quantized = float(trainer.callback_metrics[self.monitor])
        self._log(
            trainer, {f"quant/{self.monitor}_fp32": self.fp32_metric, f"quant/{self.monitor}_quantized": quantized}
        )

    @torch.no_grad()
    def _log_report(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """Per-layer SQNR of weights (and of activations on one batch) and the model size, to every logger."""
        if not self.log_sqnr or not trainer.loggers:
            return
        with _pause_quantizers(pl_module):  # no statistic changes; quantizers without qparams yet are skipped
            metrics = {f"quant/sqnr_weight/{k}": v for k, v in weight_sqnr(pl_module).items()}
            if batch is not None:
                with preserve_modes(pl_module, mode=False):  # per module: a frozen BatchNorm stays in eval
                    batch = trainer.strategy.batch_to_device(_as_trained(trainer, batch))
                    run = (
                        (lambda m: self.calib_forward(m, batch))
                        if self.calib_forward
                        else self._report_feed(pl_module, batch)
                    )
                    if run is not None:
                        with no_kv_cache(pl_module):  # a measurement, not generation: as calibration's forwards
                            metrics.update(
                                {f"quant/sqnr_act/{k}": v for k, v in activation_sqnr(pl_module, run).items()}
                            )
            # while paused: a quantizer no forward has reached yet (no qparams) is off, so its layer counts as float
            quantized_bits, float_bits = model_size_bits(pl_module)
        metrics.update({"quant/model_size_bits": float(quantized_bits), "quant/fp32_size_bits": float(float_bits)})
        self._log(trainer, metrics)

    def _report_feed(self, pl_module: LightningModule, batch: Any) -> Callable[[nn.Module], Any] | None:
        """The default feed of the report's batch, or None (warned once) when the module's forward cannot take it."""
        try:
            feedable = as_model_input(pl_module, batch)
        except ValueError as err:
            if not self._warned_report_feed:
                self._warned_report_feed = True
                rank_zero_warn(f"QuantCallback: activation SQNR not reported. {err}")
            return None
        return lambda m: run_batch(m, feedable)

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "config": self.config.to_dict(),
            "calibrated": self.calibrated,
            "fp32_metric": self.fp32_metric,
            "batches_seen": self._batches_seen,
            "graph_inputs": self._graph_inputs,
            "quantizer_lr0": [split.source_lr0 for split in self._lr_splits],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("mode") != self.mode:
            rank_zero_warn(
                f"QuantCallback: the checkpoint was written in mode={state_dict.get('mode')!r}, resuming in {self.mode!r}"
            )
        self.calibrated = bool(state_dict.get("calibrated", False))
        self.fp32_metric = state_dict.get("fp32_metric")
        if "batches_seen" in state_dict:
            self._batches_seen = int(state_dict["batches_seen"])
        self._restored_lr0 = list(state_dict.get("quantizer_lr0") or [])  # applied in on_fit_start, after the split

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Mark the state_dict as a quantized model's (see ``QUANTIZED_CHECKPOINT_KEY``)."""
        if isinstance(checkpoint.get("state_dict"), dict) and any(True for _ in iter_quantizers(pl_module)):
            checkpoint["state_dict"][QUANTIZED_CHECKPOINT_KEY] = torch.zeros(0)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Runs after the module's state_dict was restored, before ``load_state_dict`` of this callback."""
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if isinstance(state, dict) and "batches_seen" not in state:
            self._batches_seen = int(checkpoint.get("global_step", 0))  # written before batches were counted
        if getattr(pl_module, "_quant_float_start", False):
            self._check_float_optimizer_state(trainer, pl_module, checkpoint)
            self._take_float_start(pl_module)
        elif isinstance(state, dict) and state.get("calibrated"):
            self._calibrated_for = weakref.ref(pl_module)  # the qparams of that calibration were restored

    def _check_float_optimizer_state(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """QAT from a float checkpoint with learnable quantizers: the float optimizer state has no entry for their
        thresholds, so an optimizer over ``self.parameters()`` cannot take it; say so before torch's size mismatch."""
        if self.mode != "qat" or trainer.state.fn != TrainerFn.FITTING or not checkpoint.get("optimizer_states"):
            return
        quantizer_params = {id(p) for _, q in iter_quantizers(pl_module) for p in q.parameters()}
        learnable = [q.where for _, q in iter_quantizers(pl_module) if _is_learnable(q)]
        float_params = [p for p in pl_module.parameters() if id(p) not in quantizer_params]
        saved = sum(len(g["params"]) for opt in checkpoint["optimizer_states"] for g in opt.get("param_groups", []))
        if learnable and quantizer_params and saved == len(float_params):
            raise ValueError(
                f"QuantCallback(mode='qat'): the float checkpoint's optimizer state covers the {saved} float "
                f"parameters, but QAT adds {len(quantizer_params)} learnable quantizer parameter(s) ({learnable[0]}, ...), "
                "so it cannot be restored into the new optimizer. Start QAT from the float weights alone: "
                "model.load_state_dict(torch.load(path, weights_only=True)['state_dict']) and trainer.fit(model) "
                "without ckpt_path (or use an observer-based config, whose optimizer state matches)."
            )

    def _take_float_start(self, pl_module: LightningModule) -> None:
        """After a float checkpoint was loaded into the quantized module (see ``_fill_float_checkpoint``): the
        quantizers start over: PTQ calibrates before evaluating (or at the end of fit), QAT observes from its first
        batch."""
        if not pl_module.__dict__.pop("_quant_float_start", False):
            return
        self.calibrated = False
        self._calibrated_for = None
        for _, q in iter_quantizers(pl_module):
            if q.is_dynamic:
                continue
            observer = getattr(q, "observer", None)
            if observer is not None:
                observer.reset_state()
            initialized = getattr(q, "initialized", None)
            if _is_learnable(q) and isinstance(initialized, torch.Tensor):
                initialized.zero_()  # thresholds initialise again from the first batch
        if self.mode == "ptq":
            self._set_all(pl_module, observe=False, fake_quant=False)
        else:
            self._batches_seen = 0
            self._observing = True
            self._learnable_synced = False
        rank_zero_info(
            "QuantCallback: float checkpoint loaded (no quantizer state): "
            + ("calibrating before evaluation" if self.mode == "ptq" else "QAT starts from these weights")
        )

    # ------------------------------------------------------------------------------------------- helpers
    def _set_all(self, pl_module: LightningModule, observe: bool, fake_quant: bool) -> None:
        for _, q in iter_quantizers(pl_module):
            q.enable_observer(observe)
            q.enable_fake_quant(fake_quant)


def _checkpoint_safe_globals() -> list[Any]:
    """What a Lightning checkpoint holds besides tensors and plain containers when a model's hyper-parameters are
    omegaconf containers (a Hydra-built model given a DictConfig/ListConfig, or ``save_hyperparameters(cfg)``): data
    classes whose unpickling only fills in attributes. Anything else (a class, a function) is refused."""
    try:
        from omegaconf import DictConfig, ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        from omegaconf.nodes import AnyNode
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return []
    return [
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        AnyNode,
        typing.Any,
        dict,
        list,
        int,
        collections.defaultdict,
    ]


_IF_TRUSTED = (
    "Checkpoints written by QuantCallback hold only tensors and plain containers; a checkpoint you wrote yourself "
    "loads once saved that way (e.g. torch.save({'state_dict': module.state_dict()}, path))."
)
_TORCH_ADVICE = ("weights only load failed", "weights_only", "please file an issue", "check the documentation")


def _refused_object(message: str) -> str | None:
    """What a weights-only load refused to create, from torch's message (any wording: a GLOBAL, or an object)."""
    found = re.search(r"\bGLOBAL (\S+?)\.?(?:\s|$)", message) or re.search(r"but got (.+?)\.?$", message, re.MULTILINE)
    return found.group(1) if found else None


def _unpickler_detail(message: str) -> str:
    """The weights-only unpickler's own reason, without torch's advice around it (which suggests
    ``weights_only=False``: running the file's code)."""
    for line in message.splitlines():
        line = re.sub(r"^.*WeightsUnpickler error:\s*", "", line).strip()
        if line and not any(advice in line.lower() for advice in _TORCH_ADVICE):
            return line
    return "refused by torch.load(weights_only=True)"


def read_checkpoint(
    path: str, map_location: Any = "cpu", name: str | None = None, if_trusted: str = _IF_TRUSTED
) -> Any:
    """``torch.load(path, weights_only=True)`` of a user's file (plus the omegaconf containers Lightning stores as
    hyper-parameters): no code in it runs. A file it refuses, or cannot read, is a ValueError naming it (``name``,
    default the path) and what it tried to create, with ``if_trusted`` (how to write a loadable file); no message
    suggests loading it unsafely."""
    name = name or str(path)
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; before: plain data only
    try:
        with allow(_checkpoint_safe_globals()) if allow else contextlib.nullcontext():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = _refused_object(str(err))
        if refused is None:
            raise ValueError(
                f"{name} is not a checkpoint torch.load can read ({_unpickler_detail(str(err))})"
            ) from None
        raise ValueError(
            f"{name} was refused: it holds objects other than tensors and plain containers (it tried to load "
            f"{refused}); unpickling those can run code, so the file is read with torch.load(weights_only=True) only "
            f"and nothing in it was run. {if_trusted}"
        ) from None
    except (RuntimeError, EOFError) as err:  # a truncated or corrupted file
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{name} is not a checkpoint torch.load can read ({detail})") from None


def _call_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What recapturing a child needs of the call it was captured from (``self.net(x)``, ``self.model(input_ids=...,
    use_cache=False)``), in a form ``torch.load(weights_only=True)`` reads: positional and keyword arguments, tensors
    as shape and dtype, plain constants as they are."""
    return {"args": [_value_spec(a) for a in args], "kwargs": {k: _value_spec(v) for k, v in kwargs.items()}}


def _value_spec(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, bool | int | float | str):
        return {"value": value}
    return {"unsupported": type(value).__name__}


def _example_value(spec: Any, where: str, device: torch.device) -> Any:
    """An argument like the recorded one: a tensor of its shape and dtype (ones for integer and bool tensors: a valid
    token id, an attention mask that masks nothing; zeros for floats), or the recorded constant."""
    if isinstance(spec, list | tuple):  # written before keywords were recorded: [shape, dtype] of a positional tensor
        spec = {"shape": spec[0], "dtype": spec[1]}
    if not isinstance(spec, dict) or not ({"shape", "value"} & set(spec)):
        kind = spec.get("unsupported") if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(
            f"{where}: the recorded argument is a {kind}, which cannot be recreated to recapture the graph"
        )
    if "value" in spec:
        return spec["value"]
    dtype = getattr(torch, spec["dtype"])
    fill = torch.zeros if dtype.is_floating_point or dtype.is_complex else torch.ones
    return fill(spec["shape"], dtype=dtype, device=device)


def _prepare_graphs_like(model: nn.Module, quantizer: ModelQuantizer, inputs: dict[str, Any], path: str) -> None:
    """Graph mode: capture the children the callback captured, called as they were (positional and keyword
    arguments), on tensors of the recorded shapes and dtypes."""
    if not inputs:
        raise ValueError(
            f"{path} is a graph-mode checkpoint without the captured children's input shapes (written by an older version?)"
        )
    for name, spec in inputs.items():
        child = getattr(model, name)
        device = next((p.device for p in child.parameters()), torch.device("cpu"))
        if isinstance(spec, list):  # written before keywords were recorded: the positional tensors only
            spec = {"args": spec, "kwargs": {}}
        where = f"{path}: graph input of '{name}'"
        args = tuple(_example_value(a, f"{where} {i}", device) for i, a in enumerate(spec.get("args", [])))
        kwargs = {k: _example_value(v, f"{where} '{k}'", device) for k, v in spec.get("kwargs", {}).items()}
        setattr(model, name, quantizer.prepare(graph.capture(child, args, kwargs), name_prefix=f"{name}."))


class _FoldForCheckpoint:
    """Load pre-hook (graph mode): a state_dict saved after PTQ folded the BatchNorms loads into a model whose conv +
    BatchNorm units are not folded yet by folding them first (the folded values then come from the file)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if graph.is_folded_state(module, state_dict, prefix):
            graph.fold_and_equalize(module, self.config, structure_only=True)


def load_quantized_checkpoint(
    model: nn.Module, checkpoint_path: str, map_location: Any = "cpu", freeze: bool = True
) -> nn.Module:
    """Load a checkpoint written with QuantCallback into a fresh (float) ``model`` for inference, without a Trainer.

    The file is read with ``torch.load(weights_only=True)`` (a file holding other objects is refused with a
    ValueError). The Config stored by the callback prepares ``model``, the weights and every qparam load with
    ``strict=True``, and (``freeze=True``) the quantizers are frozen. Returns the model in eval mode.
    """
    checkpoint = read_checkpoint(checkpoint_path, map_location)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{checkpoint_path} is not a Lightning checkpoint (no state_dict)")
    states = [v for k, v in (checkpoint.get("callbacks") or {}).items() if str(k).startswith("QuantCallback")]
    if not states:
        raise ValueError(
            f"{checkpoint_path} holds no QuantCallback state; was it written by a Trainer with QuantCallback?"
        )
    quantizer = ModelQuantizer(config_from_stored(states[0]["config"]))
    state = {k: v for k, v in checkpoint["state_dict"].items() if k != QUANTIZED_CHECKPOINT_KEY}
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        if quantizer.graph_mode:
            _prepare_graphs_like(model, quantizer, states[0].get("graph_inputs") or {}, checkpoint_path)
        else:
            quantizer.prepare(model)
    if quantizer.graph_mode and graph.is_folded_state(model, state):
        graph.fold_and_equalize(model, quantizer.config, structure_only=True)
    missing: dict[str, list[str]] = {}
    for key, q in _quantizer_keys(model).items():
        if key not in state:
            missing.setdefault(q.where, []).append(key.rsplit(".", 1)[-1])
    if missing:
        listed = "; ".join(f"{where}: {', '.join(keys)}" for where, keys in missing.items())
        raise ValueError(
            f"{checkpoint_path} has no quantizer state for {listed}. Was it written for this model with the Config "
            "it stores (the same layers quantized)?"
        )
    model.load_state_dict(state, strict=True)
    for _, q in iter_quantizers(model):
        if not q.is_dynamic:
            q.disable_observer()
    try:
        unreached = uncalibrated_layers(model)
    except ValueError as err:
        raise ValueError(f"{checkpoint_path}: {err}") from err
    if freeze:
        ModelQuantizer.freeze(model)  # the unreached layers run in float, named in a warning
    elif unreached:
        rank_zero_warn(
            f"{checkpoint_path}: layer(s) that no calibration or training batch reached have no activation qparams and "
            f"raise if a forward reaches them (freeze=True runs them in float): {sorted(unreached)}"
        )
    return model.eval()
