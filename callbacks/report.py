"""QuantCallback's report to the loggers: per-layer SQNR, model size, and the FP32 / quantized metric pair."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from callbacks.calibration_data import as_model_input, as_trained
from callbacks.quantizer_state import pause_quantizers
from quark.torch.quantization.api import run_batch
from quark.torch.quantization.hf import no_kv_cache
from quark.torch.quantization.report import activation_sqnr, model_size_bits, weight_sqnr
from quark.torch.quantization.state import preserve_modes


class QuantReport:
    """Mixin of QuantCallback: what it logs (SQNR per layer, model size, the monitored metric FP32 vs quantized)."""

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
        with pause_quantizers(pl_module):  # no statistic changes; quantizers without qparams yet are skipped
            with self._whole_weights(trainer, pl_module):  # FSDP2: weights read outside a forward are gathered
                metrics = {f"quant/sqnr_weight/{k}": v for k, v in weight_sqnr(pl_module).items()}
                # a quantizer no forward has reached yet (no qparams) is off while paused: its layer counts as float
                quantized_bits, float_bits = model_size_bits(pl_module)
            if batch is not None:
                with preserve_modes(pl_module, mode=False):  # per module: a frozen BatchNorm stays in eval
                    batch = trainer.strategy.batch_to_device(as_trained(trainer, batch))
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
