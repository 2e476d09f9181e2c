"""The checks QuantCallback makes in ``setup`` and ``on_fit_start``, before any training step: learnable scales whose
shape DDP / FSDP2 must know, the order beside ModelPruning, and the activation specs' axes against one batch."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer

from callbacks.calibration_data import as_model_input, as_trained
from callbacks.quantizer_state import is_learnable
from quark.torch.quantization.api import activation_axes_to_check, check_activation_shapes, run_batch
from quark.torch.quantization.nn.modules import iter_quantizers


class SetupChecks:
    """Mixin of QuantCallback: refusals that name the layer or the callback order before the first step."""

    @staticmethod
    def _check_learnable_shapes(trainer: Trainer, pl_module: LightningModule) -> None:
        """Under DDP, learnable scales must have their final shape before the module is wrapped (DDP lays out its
        gradient buckets once): a per-channel TQT / LSQ activation on an axis the layer does not fix is refused here."""
        if trainer.world_size <= 1:
            return
        lazy = [q.where for _, q in iter_quantizers(pl_module) if is_learnable(q) and not q.channels_known]
        if lazy:
            raise ValueError(
                f"QuantCallback under {type(trainer.strategy).__name__} ({trainer.world_size} processes): per-channel "
                f"TQT thresholds / LSQ scales of {lazy} would take their shape from the first batch, after DDP has "
                "laid out its gradient buckets (or FSDP2 has sharded them). Quantize activations per channel along the layer's feature axis (ch_axis=-1 for a Linear "
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

    def _check_activation_axes(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Activation specs with an axis (per_channel / per_group ``ch_axis``, per_block) against one batch, before
        any training step: a dry forward (eval, no_grad, quantizers off) of the example batch fed as calibration
        feeds it (``batch``: the calibration data's first, else the example batch); ValueError naming the layer,
        role, axis and shape. Only when such a spec exists."""
        if not activation_axes_to_check(pl_module):
            return
        if batch is None:
            batch = self._example_batch(trainer, pl_module)
        batch = trainer.strategy.batch_to_device(as_trained(trainer, batch))
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
