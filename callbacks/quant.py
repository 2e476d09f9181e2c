"""QuantCallback: quantization-aware training or post-training quantization for any LightningModule.

The module is prepared by the engine in ``setup`` (before checkpoint restore, optimizers and DDP wrapping), so the
quantization state is part of the module's state_dict, learnable thresholds are parameters the user's
``configure_optimizers`` sees, and nothing is monkeypatched: layers are swapped for quantized twins that share
their Parameters.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from quark.torch import ModelQuantizer
from quark.torch.export import EXPORT_FORMATS, export_model
from quark.torch.extensions.brevitas import Config as BrevitasConfig
from quark.torch.extensions.brevitas import to_quark_config
from quark.torch.quantization.api import format_plans
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.distributed import sync_learnable, sync_observers
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.report import activation_sqnr, model_size_bits, weight_sqnr
from quark.torch.quantization.tensor_quantize import (
    FakeQuantizeBase,
    LSQFakeQuantize,
    ScaledFakeQuantize,
    TQTFakeQuantize,
)

MODES = ("qat", "ptq")
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


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


def _pause_quantizers(module: nn.Module) -> list[tuple[FakeQuantizeBase, bool, bool]]:
    """Observers off; quantizers without qparams yet off (they run in float). Returns the flags to restore."""
    paused = [(q, bool(q.observer_enabled), bool(q.fake_quant_enabled)) for _, q in iter_quantizers(module)]
    for q, _, _ in paused:
        if not q.is_dynamic:
            q.disable_observer()
        if not _ready(q):
            q.disable_fake_quant()
    return paused


def _restore_quantizers(paused: list[tuple[FakeQuantizeBase, bool, bool]]) -> None:
    for q, observe, fake_quant in paused:
        q.enable_observer(observe)
        q.enable_fake_quant(fake_quant)


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
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored + [n for n in names if n not in ignored])


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
        observer_steps: QAT: training steps during which observers run (then qparams are fixed). TQT / LSQ
            quantizers initialise from the first batch whatever this is.
        freeze_bn_epoch: QAT: from this epoch on, BatchNorm layers use and keep their running statistics.
        calib_batches: PTQ: calibration batches per calibration epoch (None: the whole dataloader).
        calib_epochs: PTQ: passes over the calibration data.
        calib_dataloader: PTQ: calibration data; by default the train dataloader of the datamodule or module.
        calib_forward: how to feed one calibration batch, ``calib_forward(module, batch)``; by default the module
            is called on the batch (tensor), on its first element ((input, target) tuples) or with ``**batch`` (dicts).
        monitor: a logged metric whose FP32 and quantized values are logged side by side when both are known.
        log_sqnr: log per-layer SQNR (dB) of weights and of activations on one batch, and the model size in bits.
        progress_bar: show a progress bar during calibration (rank zero).
        save_quantized: PTQ: after calibration at the end of ``fit``, write ``quantized.ckpt`` (the full quantization
            state) next to the ModelCheckpoint files (or in ``default_root_dir``); its path is ``quantized_checkpoint``.
        export: formats written at the end of ``fit`` (PTQ: after calibration; QAT: with the qparams fixed):
            ``"safetensors"`` (real-quantized weights) and/or ``"onnx"`` (QDQ graph; example input: the first
            calibration batch). Paths and sizes land in ``exported``.
        export_dir: where they go (default ``<default_root_dir>/export``).

    Raises:
        ValueError: a bad argument (named, with the allowed values), or, in ``setup``, a config matching no layer,
            or a ``ModelPruning`` placed before this callback.

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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"`mode={mode!r}` is not supported; choose one of {list(MODES)}")
        for name, value, minimum in (("observer_steps", observer_steps, 1), ("calib_epochs", calib_epochs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}={value!r}` must be an int >= {minimum}")
        for name, value, minimum in (("freeze_bn_epoch", freeze_bn_epoch, 0), ("calib_batches", calib_batches, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"`{name}={value!r}` must be None or an int >= {minimum}")
        if calib_forward is not None and not callable(calib_forward):
            raise ValueError("`calib_forward` must be callable as calib_forward(module, batch)")
        self.export_formats = [export] if isinstance(export, str) else list(export)
        unknown = [f for f in self.export_formats if f not in EXPORT_FORMATS]
        if unknown:
            raise ValueError(f"`export={unknown}` is not known; allowed: {list(EXPORT_FORMATS)}")
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
        self._paused: list[tuple[FakeQuantizeBase, bool, bool]] = []
        self._observing = mode == "qat"
        self._learnable_synced = False

    # ------------------------------------------------------------------------------------------- setup
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Swap the configured layers (once: a second fit or test reuses them)."""
        swap = not any(isinstance(m, QuantMixin) for m in pl_module.modules())
        if swap:
            plans = self.quantizer.resolve(pl_module)
            if not plans:
                layers = [f"{n} ({type(m).__name__})" for n, m in pl_module.named_modules() if n]
                raise ValueError(
                    f"QuantCallback: the config matches no layer of {type(pl_module).__name__}. Its layers: {layers}. "
                    "Check global_quant_config / layer_type_quant_config / layer_quant_config / exclude."
                )
            self._check_callback_order(trainer)
            self.quantizer.prepare(pl_module)
            _keep_out_of_ddp_broadcast(pl_module)
            # the table of the plans made before the swap (a prepared model resolves to nothing)
            rank_zero_info(f"QuantCallback ({self.mode}): quantizing {len(plans)} layer(s)\n{format_plans(plans)}")
        if self.mode == "ptq" and (stage == TrainerFn.FITTING or (swap and not self.calibrated)):
            # train (and validate during fit) in float, every fit: its end calibrates the weights it leaves
            self._set_all(pl_module, observe=False, fake_quant=False)
            if stage == TrainerFn.FITTING:
                self.calibrated = False

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
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.mode == "qat":
            self._update_observers(trainer, pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.mode != "qat":
            return
        self._update_observers(trainer, pl_module, batch)
        if self.freeze_bn_epoch is not None and trainer.current_epoch >= self.freeze_bn_epoch:
            for m in pl_module.modules():
                if isinstance(m, _BN_TYPES) and m.training:
                    m.eval()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.mode == "qat" and not self._learnable_synced:
            sync_learnable(pl_module)  # each rank initialised its thresholds from its own first batch
            self._learnable_synced = True

    def _update_observers(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Observers run for the first ``observer_steps`` steps (weights: their current values), then are fixed."""
        observing = trainer.global_step < self.observer_steps
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
        """Reduce the statistics across ranks, fix the qparams (observers off) and log the report."""
        sync_observers(pl_module)
        for _, q in iter_quantizers(pl_module):
            if not q.is_dynamic and not _is_learnable(q):
                q.disable_observer()
        self._observing = False
        rank_zero_info(f"QuantCallback: observers fixed after {trainer.global_step} step(s)")
        self._log_report(trainer, pl_module, batch if self.log_sqnr else None)

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
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.mode == "ptq" and not fitting and not self._model_calibrated(pl_module):
            self.calibrate(trainer, pl_module)
        self._pause(pl_module)

    def _after_eval(self, trainer: Trainer) -> None:
        self._resume()
        self._log_metric_pair(trainer)

    def _pause(self, pl_module: LightningModule) -> None:
        """Observers off (evaluation never changes a statistic); quantizers without qparams yet run in float."""
        self._paused = _pause_quantizers(pl_module)

    def _resume(self) -> None:
        _restore_quantizers(self._paused)
        self._paused = []

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
        elif self._observing and trainer.global_step > 0:
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
        if "onnx" in self.export_formats:
            batch = next(iter(self._calibration_data(trainer, pl_module)))
            example = batch[0] if isinstance(batch, tuple | list) else batch
            if not isinstance(example, torch.Tensor):
                raise ValueError("ONNX export needs tensor batches (or (input, target) tuples) for its example input")
        paused = _pause_quantizers(pl_module)  # exporting never changes a statistic
        try:
            self.exported = export_model(pl_module, folder, self.export_formats, example)
        finally:
            _restore_quantizers(paused)
        written = ", ".join(f"{fmt}: {info['path']}" for fmt, info in self.exported.items())
        rank_zero_info(f"QuantCallback: exported {written}")

    def _model_calibrated(self, pl_module: LightningModule) -> bool:
        quantizers = [q for _, q in iter_quantizers(pl_module)]
        return bool(quantizers) and all(_ready(q) for q in quantizers) and all(bool(q.fake_quant_enabled) for q in quantizers)

    def calibrate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Calibration epochs: observers see the calibration batches (eval, no_grad), then the qparams are fixed
        (reduced across ranks) and fake quantization is switched on."""
        data = self._calibration_data(trainer, pl_module)
        total = None
        if self.calib_batches is not None:
            total = self.calib_batches * self.calib_epochs
        elif hasattr(data, "__len__"):
            total = len(data) * self.calib_epochs  # type: ignore[arg-type]
        batches: Iterable[Any] = itertools.chain.from_iterable(
            itertools.islice(data, self.calib_batches) for _ in range(self.calib_epochs)
        )
        if self.progress_bar and trainer.is_global_zero:
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
                    self.calib_forward(model, trainer.strategy.batch_to_device(batch))  # type: ignore[misc]
            self.quantizer.calibrate(pl_module, forward_loop=forward_loop)
        else:
            self.quantizer.calibrate(pl_module, batches)
        sync_observers(pl_module)
        self.calibrated = True
        rank_zero_info("QuantCallback: calibration done; qparams fixed")
        self._log_report(trainer, pl_module, self._first_batch(trainer, pl_module))

    def _calibration_data(self, trainer: Trainer, pl_module: LightningModule) -> Iterable[Any]:
        if self.calib_dataloader is not None:
            return self.calib_dataloader
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        try:
            return source.train_dataloader()  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001 - any failure means: no train data available here
            raise ValueError(
                "QuantCallback(mode='ptq') needs calibration data: give `calib_dataloader=` or a datamodule / module "
                f"with train_dataloader() ({type(err).__name__}: {err})"
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
        self._log(trainer, {f"quant/{self.monitor}_fp32": self.fp32_metric, f"quant/{self.monitor}_quantized": quantized})

    @torch.no_grad()
    def _log_report(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """Per-layer SQNR of weights (and of activations on one batch) and the model size, to every logger."""
        if not self.log_sqnr or not trainer.loggers:
            return
        paused = _pause_quantizers(pl_module)  # no statistic changes; quantizers without qparams yet are skipped
        try:
            metrics = {f"quant/sqnr_weight/{k}": v for k, v in weight_sqnr(pl_module).items()}
            if batch is not None:
                from quark.torch.quantization.api import run_batch

                modes = [(m, m.training) for m in pl_module.modules()]  # per module: a frozen BatchNorm stays in eval
                pl_module.eval()
                try:
                    batch = trainer.strategy.batch_to_device(batch)
                    run = (lambda m: self.calib_forward(m, batch)) if self.calib_forward else (lambda m: run_batch(m, batch))
                    metrics.update({f"quant/sqnr_act/{k}": v for k, v in activation_sqnr(pl_module, run).items()})
                finally:
                    for m, training in modes:
                        m.training = training
        finally:
            _restore_quantizers(paused)
        quantized_bits, float_bits = model_size_bits(pl_module)
        metrics.update({"quant/model_size_bits": float(quantized_bits), "quant/fp32_size_bits": float(float_bits)})
        self._log(trainer, metrics)

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "config": self.config.to_dict(), "calibrated": self.calibrated, "fp32_metric": self.fp32_metric}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("mode") != self.mode:
            rank_zero_warn(f"QuantCallback: the checkpoint was written in mode={state_dict.get('mode')!r}, resuming in {self.mode!r}")
        self.calibrated = bool(state_dict.get("calibrated", False))
        self.fp32_metric = state_dict.get("fp32_metric")

    # ------------------------------------------------------------------------------------------- helpers
    def _set_all(self, pl_module: LightningModule, observe: bool, fake_quant: bool) -> None:
        for _, q in iter_quantizers(pl_module):
            q.enable_observer(observe)
            q.enable_fake_quant(fake_quant)


def load_quantized_checkpoint(model: nn.Module, checkpoint_path: str, map_location: Any = "cpu", freeze: bool = True) -> nn.Module:
    """Load a checkpoint written with QuantCallback into a fresh (float) ``model`` for inference, without a Trainer.

    The Config stored by the callback prepares ``model``, the weights and every qparam load with ``strict=True``,
    and (``freeze=True``) the quantizers are frozen. Returns the model in eval mode.
    """
    checkpoint = torch.load(checkpoint_path, map_location=map_location, weights_only=False)
    states = [v for k, v in checkpoint.get("callbacks", {}).items() if str(k).startswith("QuantCallback")]
    if not states:
        raise ValueError(f"{checkpoint_path} holds no QuantCallback state; was it written by a Trainer with QuantCallback?")
    quantizer = ModelQuantizer(Config.from_dict(states[0]["config"]))
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        quantizer.prepare(model)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    for _, q in iter_quantizers(model):
        if not q.is_dynamic:
            q.disable_observer()
        if isinstance(q, ScaledFakeQuantize) and not _ready(q):
            raise ValueError(f"{checkpoint_path}: a quantizer of {type(q).__name__} was never calibrated")
    if freeze:
        ModelQuantizer.freeze(model)
    return model.eval()
