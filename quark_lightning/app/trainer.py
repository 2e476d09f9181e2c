"""The building blocks of a run: its Trainers (loggers, checkpoints, atomic checkpoint files), the quantization phase
(PTQ calibration or QAT fine-tuning), a test's metrics, the SQNR / size report and the tokenizer saved beside an export.
``quark_lightning.app.run`` puts them in sequence."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from callbacks import AtomicCheckpointIO, QuantCallback
from quark.torch.export.files import write_files_atomically
from quark.torch.quantization.api import run_batch
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.report import activation_sqnr, model_size_bits, weight_sqnr
from quark.torch.quantization.state import preserve_modes
from quark_lightning.app.conf import QuantFlow


class ScaleLearningRates(Callback):
    """Multiply every optimizer's learning rates by ``factor`` when training starts (QAT fine-tunes trained weights)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor
                if "initial_lr" in group:  # schedulers restart from the scaled rate
                    group["initial_lr"] *= self.factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * self.factor for lr in scheduler.base_lrs]


def _loggers(cfg: DictConfig, out: Path, phase: str) -> list[Any]:
    loggers = []
    for node in (cfg.get("logger") or {}).values():
        if node is None:
            continue
        extra: dict[str, Any] = {"version": phase}
        if node.get("save_dir") is None:
            extra["save_dir"] = str(out)
        loggers.append(instantiate(node, **extra))
    return loggers


def build_trainer(
    cfg: DictConfig,
    out: Path,
    phase: str,
    checkpoint_name: str,
    callbacks: list[Callback] | None = None,
    **overrides: Any,
) -> Trainer:
    """The Trainer of one ``phase`` (fp32, ptq, qat): the config's, with its checkpoints, loggers and atomic files."""
    callbacks = list(callbacks or [])
    if cfg.trainer.get("enable_checkpointing", True) is not False:
        # no "=" in file names: they are passed back as ckpt_path=... overrides, where "=" would need quoting
        callbacks.append(
            ModelCheckpoint(dirpath=str(out / "checkpoints"), filename=checkpoint_name, auto_insert_metric_name=False)
        )
    kwargs: dict[str, Any] = {"callbacks": callbacks, "logger": _loggers(cfg, out, phase) or False, **overrides}
    if cfg.trainer.get("default_root_dir") is None:
        kwargs["default_root_dir"] = str(out)
    if not cfg.trainer.get("plugins"):  # checkpoints complete under their name or absent (a full disk, a kill)
        kwargs["plugins"] = [AtomicCheckpointIO()]
    return instantiate(cfg.trainer, **kwargs)


def quantize(
    cfg: DictConfig, flow: QuantFlow, config: Config, model: LightningModule, datamodule: Any, out: Path
) -> tuple[Trainer, LightningModule]:
    """PTQ: a Trainer whose QuantCallback calibrates before testing. QAT: fine-tune with fake quantization."""
    if flow.mode == "ptq":
        callback = QuantCallback(config, mode="ptq", calib_batches=flow.calib_batches, save_quantized=False)
        return build_trainer(cfg, out, "ptq", "ptq-epoch{epoch}", [callback]), model  # its test calibrates first
    callback = QuantCallback(
        config,
        mode="qat",
        observer_steps=flow.observer_steps,
        freeze_bn_epoch=flow.freeze_bn_epoch,
        quantizer_lr=flow.quantizer_lr,
        distill=flow.distill,
    )
    trainer = build_trainer(
        cfg,
        out,
        "qat",
        "qat-epoch{epoch}",
        [callback, ScaleLearningRates(flow.qat_lr_scale)],
        max_epochs=flow.qat_epochs,
    )
    trainer.fit(model, datamodule=datamodule)
    return trainer, model


def run_test(trainer: Trainer, model: LightningModule, datamodule: Any) -> dict[str, float]:
    """The test metrics of ``model`` on the data's test set, as floats."""
    (metrics,) = trainer.test(model, datamodule=datamodule, verbose=False)
    return {k: float(v) for k, v in metrics.items()}


@torch.no_grad()
def quant_report(model: LightningModule, datamodule: Any, trainer: Trainer) -> dict[str, Any]:
    """Per-layer SQNR (dB) of weights and of activations on the first test batch (cast as the ``trainer``'s
    precision casts batches: trainer.precision=64-true / bf16-true), and the model size."""
    batch = trainer.precision_plugin.convert_input(next(iter(datamodule.test_dataloader())))
    with preserve_modes(model, mode=False):  # per module: a frozen BatchNorm stays in eval
        act = activation_sqnr(model, lambda m: run_batch(m, batch, device=model.device))
    quantized_bits, float_bits = model_size_bits(model)
    return {
        "sqnr_db": {"weight": weight_sqnr(model), "activation": act},
        "size": {
            "fp32_bits": float_bits,
            "quantized_bits": quantized_bits,
            "fp32_bytes": math.ceil(float_bits / 8),
            "quantized_bytes": math.ceil(quantized_bits / 8),
            "compression": float_bits / quantized_bits if quantized_bits else None,
        },
    }


def save_tokenizer(datamodule: Any, directory: Path) -> None:
    """The data's tokenizer (when it has one) beside amd-quark's Hugging Face directory, each file written whole."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        write_files_atomically(directory, "tokenizer", lambda tmp: tokenizer.save_pretrained(tmp))


def first_input(datamodule: Any) -> torch.Tensor:
    """The model input of the first test batch (the example an export traces)."""
    batch = next(iter(datamodule.test_dataloader()))
    return batch[0] if isinstance(batch, tuple | list) else batch
