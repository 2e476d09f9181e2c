"""StreamedPTQ: post-training quantization of a trained Hugging Face model one decoder layer at a time.

QuantCallback(mode="ptq") quantizes the module in memory: its twins, observers and the algorithms' state sit beside
the model. StreamedPTQ leaves the trained module float and, at the end of ``fit``, writes it as a sharded Hugging Face
checkpoint (``save_pretrained``) and quantizes that file to file (``quark.torch.streaming.stream_quantize``): what the
quantization adds to the trained model in memory is one decoder layer and the calibration activations. With
``checkpoint_dir`` it streams a checkpoint you already have (the trained weights saved elsewhere) instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from quark.torch.export.front_end import export_root
from quark.torch.quantization.config.config import Config
from quark.torch.streaming import DEFAULT_SHARD_BYTES, check_output_dir, check_stream, stream_quantize
from quark.torch.streaming.checks import check_config

__all__ = ["StreamedPTQ"]


class StreamedPTQ(Callback):
    """At the end of ``fit``: the trained Hugging Face model, saved sharded, quantized one decoder layer at a time
    into amd-quark's export directory.

    Example::

        trainer = Trainer(callbacks=[StreamedPTQ(w4_gptq_config, calib_batches=16)])
        trainer.fit(model, datamodule=dm)     # float training, then <default_root_dir>/export/quark
        trainer.callbacks[0].exported         # {"path": ..., "checkpoint": ...}

    Args:
        config: a quark ``Config`` (or its dict): weight-only or dynamic activations; RTN, GPTQ, AWQ, SmoothQuant.
        calib_batches: how many batches of the calibration data the algorithms see.
        calib_dataloader: the calibration data; by default the datamodule's train dataloader. Each batch as the
            Hugging Face model takes it (a tensor of token ids, an (ids, target) tuple, or a dict of keyword
            arguments).
        checkpoint_dir: a Hugging Face checkpoint directory to stream instead of the trained module (nothing is saved).
        save_dir: where the trained model is saved (default ``<default_root_dir>/float_hf``; a new or empty folder).
        export_dir: the export directory (default ``<default_root_dir>/export/quark``; a new or empty folder).
        max_shard_bytes: the shard size of the saved checkpoint and of the export.

    The Hugging Face model is the module's ``export_module`` (the name of a submodule, as QuantCallback's export
    reads it), else the module itself; it needs ``save_pretrained``. Only rank zero quantizes.

    Raises:
        ValueError: at construction, a Config that cannot stream or a bad argument; at ``setup``, a module without a
            Hugging Face model, or a save or export folder that is not new or empty (before any training step).
    """

    def __init__(
        self,
        config: Config | dict[str, Any],
        *,
        calib_batches: int = 16,
        calib_dataloader: Iterable[Any] | None = None,
        checkpoint_dir: str | None = None,
        save_dir: str | None = None,
        export_dir: str | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        self.config = Config.from_dict(config) if isinstance(config, dict) else config
        if not isinstance(self.config, Config):
            raise ValueError(f"`config` must be a quark Config or its dict, got {type(config).__name__}")
        if isinstance(calib_batches, bool) or not isinstance(calib_batches, int) or calib_batches < 1:
            raise ValueError(f"`calib_batches={calib_batches!r}` must be an int >= 1")
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"`max_shard_bytes={max_shard_bytes!r}` must be a positive int")
        check_config(self.config, [None])  # what cannot stream, before any training (batches are checked at the end)
        if checkpoint_dir is not None:
            check_stream(checkpoint_dir, self.config, [None])  # its files, tensors and family, now (on meta)
        self.calib_batches = calib_batches
        self.calib_dataloader = calib_dataloader
        self.checkpoint_dir = checkpoint_dir
        self.save_dir = save_dir
        self.export_dir = export_dir
        self.max_shard_bytes = max_shard_bytes
        self.exported: dict[str, str] = {}

    def _places(self, trainer: Trainer) -> tuple[str, str]:
        """(save folder, export folder)."""
        root = trainer.default_root_dir
        return (
            self.save_dir or os.path.join(root, "float_hf"),
            self.export_dir or os.path.join(root, "export", "quark"),
        )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Check the module holds a Hugging Face model and the folders are free, before any training."""
        if stage != "fit":
            return
        hf_model(pl_module)
        save, export = self._places(trainer)
        if trainer.is_global_zero:
            if self.checkpoint_dir is None:
                check_output_dir(save)
            check_output_dir(export)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Save (unless ``checkpoint_dir``), then stream the checkpoint into the export directory (rank zero)."""
        if not trainer.is_global_zero:
            return
        save, export = self._places(trainer)
        checkpoint = self.checkpoint_dir
        if checkpoint is None:
            model = hf_model(pl_module)
            check_output_dir(save)
            model.save_pretrained(save, max_shard_size=self.max_shard_bytes)
            checkpoint = save
        batches = list(itertools.islice(self._data(trainer), self.calib_batches))
        path = stream_quantize(checkpoint, self.config, batches, export, max_shard_bytes=self.max_shard_bytes)
        self.exported = {"path": str(path), "checkpoint": str(checkpoint)}
        rank_zero_info(f"StreamedPTQ: {checkpoint} quantized one decoder layer at a time into {path}")

    def _data(self, trainer: Trainer) -> Iterable[Any]:
        """The calibration batches: ``calib_dataloader``, else the datamodule's train dataloader."""
        if self.calib_dataloader is not None:
            return self.calib_dataloader
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None:
            raise ValueError("StreamedPTQ needs calibration data: pass calib_dataloader= or fit with a datamodule")
        return datamodule.train_dataloader()


def hf_model(pl_module: LightningModule) -> nn.Module:
    """The Hugging Face model of ``pl_module`` (``export_root``), which must have ``save_pretrained``.

    Raises:
        ValueError: naming the module and ``export_module``.
    """
    model, name = export_root(pl_module)
    if not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            f"StreamedPTQ streams a Hugging Face model: {type(pl_module).__name__}"
            f"{f'.{name}' if name else ''} ({type(model).__name__}) has no save_pretrained. Set export_module to the "
            "name of the submodule that is one (e.g. export_module = 'net'), or pass checkpoint_dir="
        )
    return model
