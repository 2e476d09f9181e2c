"""PTQ larger than memory: a Hugging Face checkpoint quantized one decoder layer at a time, from its safetensors shards
into amd-quark's export directory (``stream_quantize``). See docs/quantize.md, "Larger than memory"."""

from quark.torch.streaming.checkpoint import HFCheckpoint
from quark.torch.streaming.ptq import check_stream, stream_quantize
from quark.torch.streaming.writer import DEFAULT_SHARD_BYTES, ShardedExport, check_output_dir

__all__ = [
    "stream_quantize",
    "check_stream",
    "HFCheckpoint",
    "ShardedExport",
    "check_output_dir",
    "DEFAULT_SHARD_BYTES",
]
