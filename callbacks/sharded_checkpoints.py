"""One file from a sharded checkpoint: Lightning's ``ModelParallelStrategy`` (FSDP2) saves a directory written by
``torch.distributed.checkpoint`` (each rank's shards, plus Lightning's ``meta.pt``); ``consolidate_checkpoint`` turns it
into a Lightning checkpoint file that ``load_quantized_checkpoint`` loads into a model in one process.

Lightning's own ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` expects the ``model`` key of
``FSDPStrategy`` checkpoints; ModelParallelStrategy stores ``state_dict``, which this reads.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from callbacks.checkpoint_io import save_checkpoint_file
from callbacks.quant_checkpoints import read_checkpoint

__all__ = ["consolidate_checkpoint", "is_sharded_checkpoint"]

#: the file Lightning writes beside the shards (callbacks' and loops' states, hyper-parameters, ...)
LIGHTNING_META = "meta.pt"


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory written by ``torch.distributed.checkpoint`` (it holds ``.metadata``)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def consolidate_checkpoint(folder: str | os.PathLike[str], output: str | os.PathLike[str]) -> str:
    """Gather the sharded checkpoint ``folder`` into the single Lightning checkpoint file ``output`` (weights, every
    qparam and quantizer state, optimizer states, and Lightning's ``meta.pt``: the callbacks' states). One process,
    no process group; the whole model is in memory once. Returns ``output``.

    Raises:
        ValueError: ``folder`` is not a sharded checkpoint directory.
        FileExistsError: ``output`` exists (it is never overwritten).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, output = Path(folder), Path(output)
    if not is_sharded_checkpoint(folder):
        raise ValueError(
            f"consolidate_checkpoint: {folder} is not a sharded checkpoint (a directory written by "
            "torch.distributed.checkpoint, with a .metadata file); a .ckpt file loads as it is"
        )
    if output.exists():
        raise FileExistsError(f"consolidate_checkpoint: {output} exists; choose a new path (it is never overwritten)")
    with tempfile.TemporaryDirectory(prefix=".consolidate-", dir=output.parent) as tmp:
        flat = os.path.join(tmp, "flat.pt")
        dcp_to_torch_save(folder, flat)
        checkpoint = read_checkpoint(flat, name=str(folder))
    meta = folder / LIGHTNING_META
    if meta.is_file():
        checkpoint.update(read_checkpoint(str(meta)))
    optimizers = sorted(
        (k for k in checkpoint if k.startswith("optimizer_") and k[10:].isdigit()), key=lambda k: int(k[10:])
    )
    if optimizers:
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in optimizers]
    save_checkpoint_file(checkpoint, output)
    return str(output)
