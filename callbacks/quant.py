"""QuantCallback: quantization-aware training or post-training quantization for any LightningModule.

The module is prepared by the engine in ``setup`` (before checkpoint restore, optimizers and DDP wrapping), so the
quantization state is part of the module's state_dict, learnable thresholds are parameters the user's
``configure_optimizers`` sees, and nothing is monkeypatched: layers are swapped for quantized twins that share
their Parameters.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from callbacks.calibration_data import CALIB_FORWARD_EXAMPLE, CalibrationData, as_model_input
from callbacks.checkpoint_io import ensure_atomic_checkpoints
from callbacks.distill import Distillation, QuantDistillation
from callbacks.graph_capture import GraphCapture
from callbacks.mixed_precision import MixedPrecision
from callbacks.quant_checkpoints import (
    QUANTIZED_CHECKPOINT_KEY,
    FloatCheckpointStart,
    FoldForCheckpoint,
    fill_float_checkpoint,
    load_quantized_checkpoint,
    read_checkpoint,
)
from callbacks.quantizer_lr import follow_schedule
from callbacks.quantizer_state import is_ready, keep_out_of_ddp_broadcast, pause_quantizers, read_late_checks
from callbacks.report import QuantReport
from callbacks.schedule import QuantSchedule
from callbacks.setup_checks import SetupChecks
from callbacks.sharded import ShardedTraining, uses_fsdp2
from quark.torch import ModelQuantizer
from quark.torch.export import export_formats, export_model, get_format
from quark.torch.extensions.brevitas import Config as BrevitasConfig
from quark.torch.extensions.brevitas import to_quark_config
from quark.torch.quantization.api import format_plans
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.distributed import sync_learnable
from quark.torch.quantization.formats import plan_run_end, plan_step_end, plan_step_start
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.state import ensure_quant_state, quant_state
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = [
    "CALIB_FORWARD_EXAMPLE",
    "MODES",
    "QUANTIZED_CHECKPOINT_KEY",
    "QuantCallback",
    "as_model_input",
    "load_quantized_checkpoint",
    "read_checkpoint",
]

MODES = ("qat", "ptq")


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


class QuantCallback(
    QuantSchedule,
    QuantReport,
    ShardedTraining,
    FloatCheckpointStart,
    GraphCapture,
    CalibrationData,
    QuantDistillation,
    SetupChecks,
    Callback,
):
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
        distill: QAT: a ``Distillation`` (or its dict): the step's loss becomes ``(1 - weight) * task + weight *
            distill`` against a float teacher (``callbacks/distill.py``; docs/lightning.md, "Distillation").

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
        distill: Distillation | dict[str, Any] | None = None,
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
        self._init_distill(distill, mode)
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
        #: QAT after the warm-up: (the module last scanned, whether it has TQT / LSQ quantizers); None: scan next batch
        self._learnable_seen: tuple[weakref.ReferenceType[nn.Module], bool] | None = None
        self._learnable_synced = False
        #: (module, epoch, module-tree generation, what the per-batch schedule sets): ``_quantizers_now``'s walk
        self._quantizer_walk: tuple[Any, Any, int, Any] | None = None
        self._pending: list[FakeQuantizeBase] = []  # QAT: quantizers still observing after the warm-up (unreached)
        self._batches_seen = 0  # QAT: training batches run so far (observer_steps counts these)
        self._fit_steps: float = math.inf  # QAT: the optimizer steps of the running fit (the compile plan's length)
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
        self._check_sharding(trainer)  # FSDP2: what it cannot run is refused before the module is sharded
        if not uses_fsdp2(trainer):  # FSDP2 writes sharded directories itself, without a CheckpointIO
            ensure_atomic_checkpoints(trainer, "QuantCallback")  # quantized.ckpt is complete or absent
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
            keep_out_of_ddp_broadcast(pl_module)
            # the table of the plans made before the swap (a prepared model resolves to nothing), once per callback
            if not self._table_logged:
                rank_zero_info(f"QuantCallback ({self.mode}): quantizing {len(plans)} layer(s)\n{format_plans(plans)}")
                self._table_logged = True
        state = ensure_quant_state(pl_module)
        if not state.load_hooks:  # a float checkpoint restores into the quantized model
            if self.quantizer.graph_mode:  # a checkpoint written after PTQ folded BatchNorm: fold before loading
                pl_module.register_load_state_dict_pre_hook(FoldForCheckpoint(self.config))
            pl_module.register_load_state_dict_pre_hook(fill_float_checkpoint)
            state.load_hooks = True
        if self.mode == "ptq" and (stage == TrainerFn.FITTING or (swap and not self.calibrated)):
            # train (and validate during fit) in float, every fit: its end calibrates the weights it leaves
            self._set_all(pl_module, observe=False, fake_quant=False)
            if stage == TrainerFn.FITTING:
                self.calibrated = False
                self._calibrated_for = None
        if stage == TrainerFn.FITTING:
            self._setup_distill(trainer, pl_module)

    # ------------------------------------------------------------------------------------------- QAT
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Optimizers exist now (their states are restored after this, on resume): give the learned quantizer
        parameters their own learning rate when ``quantizer_lr`` is set. First, before any training step: the
        ``calib_dataloader``'s first batch (there, finite) and the activation specs' axes against one batch."""
        first = self._check_calibration_data()
        self._check_activation_axes(trainer, pl_module, first)
        if self.quantizer_lr is None:  # only accepted with mode="qat"
            return
        self._split_quantizer_lr(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._take_float_start(pl_module)
        self._quantizer_walk = None  # a fit walks its module afresh
        if self.mode == "qat":
            self._update_observers(trainer, pl_module)
            self._start_distill(trainer, pl_module)
            self._fit_steps = trainer.estimated_stepping_batches  # optimizer steps of the whole fit (inf: unbounded)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._quantizer_walk = None  # the schedule's walk holds the quantizers: not past the training it served
        read_late_checks(pl_module)  # the last steps' TQT / LSQ checks (read late on CUDA)
        if self.mode == "qat":
            plan_run_end()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.mode == "qat":
            plan_run_end()  # a fit that raised tells the compile policy nothing more

    def _batches_left(self, trainer: Trainer, batch_idx: int) -> int | None:
        """Training batches this fit still runs after batch ``batch_idx`` (None: not known), for auto compile mode's
        run plan: a fit too short for a compile to pay back runs its format kernels eagerly
        (``formats.plan_step_end``)."""
        total = self._fit_steps
        if not math.isfinite(total) or total < 0:  # unbounded, or max_steps=-1 over a loader of unknown length
            return None
        if not trainer.lightning_module.automatic_optimization and len(trainer.optimizers) > 1:
            return None  # each optimizer's step counts in global_step: not a count of batches
        accumulate = max(int(trainer.accumulate_grad_batches), 1)
        in_window = (batch_idx + 1) % accumulate  # batches of an accumulation window whose optimizer step is to come
        return max((int(total) - trainer.global_step) * accumulate - in_window, 0)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.mode != "qat":
            return
        plan_step_start()
        self._update_observers(trainer, pl_module, batch)
        self._note_sharded_init(trainer, pl_module)
        if self._lr_splits:
            follow_schedule(self._lr_splits, self.quantizer_lr)  # type: ignore[arg-type]
        self._freeze_batchnorm(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.mode != "qat":
            return
        plan_step_end(self._batches_left(trainer, batch_idx))
        self._batches_seen += 1
        if self._pending:
            self._fix_pending()
        if not self._learnable_synced:
            sync_learnable(pl_module)  # each rank initialised its thresholds from its own first batch
            self._learnable_synced = True

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
            unobserved = [q.where for _, q in iter_quantizers(pl_module) if not q.is_dynamic and not is_ready(q)]
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
        self._paused.enter_context(pause_quantizers(pl_module))

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
        if self.export_formats:
            with self._whole_weights(trainer, pl_module) as writer:  # FSDP2: every rank gathers, rank zero writes
                if writer:
                    self._export(trainer, pl_module)

    def _export(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = self.export_dir or os.path.join(trainer.default_root_dir, "export")
        example = None
        if any(get_format(f).needs_example for f in self.export_formats):
            batch = next(iter(self._calibration_data(trainer, pl_module)))
            example = batch[0] if isinstance(batch, tuple | list) else batch
            if not isinstance(example, torch.Tensor):
                raise ValueError("ONNX export needs tensor batches (or (input, target) tuples) for its example input")
        with pause_quantizers(pl_module):  # exporting never changes a statistic
            self.exported = export_model(pl_module, folder, self.export_formats, example)
        written = ", ".join(f"{fmt}: {info['path']}" for fmt, info in self.exported.items())
        rank_zero_info(f"QuantCallback: exported {written}")

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
            **self._distill_state(),
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
        self._load_distill_state(state_dict)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Mark the state_dict as a quantized model's (see ``QUANTIZED_CHECKPOINT_KEY``); no bad learned value saved."""
        read_late_checks(pl_module)
        if isinstance(checkpoint.get("state_dict"), dict) and any(True for _ in iter_quantizers(pl_module)):
            checkpoint["state_dict"][QUANTIZED_CHECKPOINT_KEY] = torch.zeros(0)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Runs after the module's state_dict was restored, before ``load_state_dict`` of this callback."""
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if isinstance(state, dict) and "batches_seen" not in state:
            self._batches_seen = int(checkpoint.get("global_step", 0))  # written before batches were counted
        if (record := quant_state(pl_module)) is not None and record.float_start:
            self._check_float_optimizer_state(trainer, pl_module, checkpoint)
            self._take_float_start(pl_module)
        elif isinstance(state, dict) and state.get("calibrated"):
            self._calibrated_for = weakref.ref(pl_module)  # the qparams of that calibration were restored

    # ------------------------------------------------------------------------------------------- helpers
    def _set_all(self, pl_module: LightningModule, observe: bool, fake_quant: bool) -> None:
        for _, q in iter_quantizers(pl_module):
            q.enable_observer(observe)
            q.enable_fake_quant(fake_quant)
