"""Lightning front end of the engine."""

from callbacks.checkpoint_io import AtomicCheckpointIO
from callbacks.mixed_precision import MixedPrecision
from callbacks.quant import QuantCallback, load_quantized_checkpoint
from callbacks.sharded_checkpoints import consolidate_checkpoint
from callbacks.streamed_ptq import StreamedPTQ

__all__ = [
    "QuantCallback",
    "MixedPrecision",
    "load_quantized_checkpoint",
    "consolidate_checkpoint",
    "AtomicCheckpointIO",
    "StreamedPTQ",
]
