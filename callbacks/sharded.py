"""QuantCallback under Lightning's ``ModelParallelStrategy`` (FSDP2: the module calls ``fully_shard`` in
``configure_model``, after the callback's ``setup`` has swapped in the quantized twins).

What FSDP2 changes, and what this mixin does about it:

- A forward sees each sharded layer's gathered weight, so weight observers and TQT / LSQ initialisation read the
  whole weight, identical on every rank. Observer buffers are not sharded (each rank keeps its copy; they are
  reduced across ranks when qparams are fixed, as under DDP).
- TQT thresholds and LSQ scales are Parameters of the layers ``fully_shard`` wraps, so FSDP2 shards them as it
  shards the weights: one logical tensor for all ranks (identical by construction), gradients averaged by the
  reduce-scatter, optimizer state sharded. Their initialisation happens inside the first forward, on the gathered
  copy that FSDP2 frees afterwards; ``write_initial_values`` writes it into the shards before backward.
- Reading weights outside a forward (export, the SQNR / size report) happens inside ``gathered_parameters`` on
  every rank (rank zero writes the export).
- Refused in ``setup``, before the module is sharded: graph mode, PTQ algorithms and mixed precision (they read and
  rewrite whole weights, or swap layers, outside a forward), ONNX export, and ``FSDPStrategy`` (FSDP1 flattens the
  Parameters, untested here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from torch import nn

from callbacks.quantizer_state import is_ready
from quark.torch.quantization.distributed import gathered_parameters, has_sharded_parameters, write_initial_values


def uses_fsdp2(trainer: Trainer) -> bool:
    """Whether the trainer runs Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` / tensor parallel)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(trainer.strategy, ModelParallelStrategy)


def uses_fsdp1(trainer: Trainer) -> bool:
    """Whether the trainer runs Lightning's ``FSDPStrategy`` (FSDP1, flat parameters)."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(trainer.strategy, FSDPStrategy)


def _tensor_parallel_size(trainer: Trainer) -> int:
    """The size of the strategy's ``tensor_parallel`` mesh dimension (1 when there is none, or no mesh yet)."""
    try:
        mesh = trainer.strategy.device_mesh  # set up before the callbacks' setup
        return int(mesh["tensor_parallel"].size())
    except (RuntimeError, KeyError, AttributeError):
        return 1


class ShardedTraining:
    """Mixin of QuantCallback: the checks and steps FSDP2 (``ModelParallelStrategy``) needs."""

    _fsdp_init_pending = False  # a sharded TQT / LSQ quantizer is not initialised yet (same on every rank)

    def _check_sharding(self, trainer: Trainer) -> None:
        """Refuse, before anything is sharded, what does not work on FSDP2-sharded weights (naming the option)."""
        if uses_fsdp1(trainer):
            raise ValueError(
                "QuantCallback does not support FSDPStrategy (FSDP1: flat parameters the quantized twins cannot "
                "address). Use Lightning's ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) and "
                "call torch.distributed.fsdp.fully_shard in your LightningModule's configure_model (FSDP2)."
            )
        if not uses_fsdp2(trainer):
            return
        refused = []
        if _tensor_parallel_size(trainer) > 1:
            refused.append(
                "tensor_parallel_size > 1 (tensor-parallel layers hand the quantizers DTensor shards in forward; "
                "use data_parallel_size=N, tensor_parallel_size=1)"
            )
        if self.quantizer.graph_mode:  # type: ignore[attr-defined]
            refused.append("quant_mode=graph_mode (captures and rewrites the module; use eager mode)")
        algorithms = [a.name for a in self.config.algo_configs + self.config.pre_quant_opt_configs]  # type: ignore[attr-defined]
        if algorithms:
            refused.append(f"algorithms {algorithms} (they read and rewrite whole weights; run them after training)")
        if self.mixed_precision is not None:  # type: ignore[attr-defined]
            refused.append("mixed_precision (measures layers one by one and swaps them after the model is sharded)")
        if "onnx" in self.export_formats:  # type: ignore[attr-defined]
            refused.append(
                "export=['onnx'] (traces a forward; export 'quark' or 'safetensors', then ONNX from one process)"
            )
        if refused:
            raise ValueError(
                f"QuantCallback under ModelParallelStrategy (FSDP2) does not support: {'; '.join(refused)}. "
                "Train with QAT under FSDP2, then run these on the consolidated checkpoint in one process "
                "(docs/lightning.md, FSDP2)."
            )

    def _note_sharded_init(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before a training batch under FSDP2: whether its forward may initialise a TQT / LSQ quantizer (the same
        answer on every rank: after ``write_initial_values`` every rank holds the same ``initialized`` flags). Not
        whether its Parameter is a shard now: the root module keeps its gathered Parameters after an evaluation
        forward."""
        self._fsdp_init_pending = uses_fsdp2(trainer) and any(
            not is_ready(q)
            for q in self._quantizers_now(trainer, pl_module)[0]  # (the TQT / LSQ ones)
        )

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        """FSDP2: the thresholds / scales the forward initialised go into their shards before backward gathers them."""
        if self._fsdp_init_pending:
            write_initial_values(pl_module)
            self._fsdp_init_pending = False

    @contextlib.contextmanager
    def _whole_weights(self, trainer: Trainer, pl_module: nn.Module) -> Iterator[bool]:
        """Every rank: the module's full weights for reading outside a forward (FSDP2), then the ranks wait for each
        other. Yields whether this rank is the one that writes (rank zero)."""
        if not has_sharded_parameters(pl_module):
            yield trainer.is_global_zero
            return
        with gathered_parameters(pl_module):
            yield trainer.is_global_zero
        trainer.strategy.barrier("QuantCallback.gathered")
