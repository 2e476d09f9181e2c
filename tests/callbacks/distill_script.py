"""Two-rank runs (gloo, CPU) of QuantCallback(distill=...) for test_distill_ddp.py: ``python distill_script.py OUT``.

Each rank trains a tiny CharLM on its OWN token windows (no distributed sampler) for a few steps and writes its full
parameters and last logged losses to ``OUT/<mode>_rank<r>.pt``. Modes: DDP with the copy and the self teacher,
FSDP2 (ModelParallelStrategy, ``fully_shard`` per decoder layer + root) with the self teacher, and FSDP2 with the
copy teacher, which must be refused in setup (the error text is written instead).
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.char_lm import CharLM
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

VOCAB, SEQ, STEPS = 32, 16, 3
CONFIG = {"global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT}}
MODES = ("ddp_copy", "ddp_self", "fsdp_self", "fsdp_copy")


class LM(CharLM):
    """CharLM at a constant AdamW rate, shardable by FSDP2 (configure_model)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def rank_loader(rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, VOCAB, (4 * STEPS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (4 * STEPS, SEQ), generator=g)
    y[:, :2] = -100
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(mode: str, out: str) -> None:
    torch.manual_seed(0)
    model = LM(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=SEQ)
    strategy = "ddp" if mode.startswith("ddp") else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    teacher = mode.split("_")[1]
    cb = QuantCallback(Config.from_dict(CONFIG), distill={"teacher": teacher, "weight": 0.5}, log_sqnr=False)
    trainer = Trainer(
        strategy=strategy,
        callbacks=[cb],
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=out,
    )
    result: dict[str, object] = {}
    try:
        trainer.fit(model, rank_loader(int(os.environ.get("LOCAL_RANK", "0"))))
        result["params"] = {k: full(v) for k, v in model.named_parameters()}
        result["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    except ValueError as err:
        result["error"] = str(err)
    result["world_size"] = trainer.world_size
    torch.save(result, os.path.join(out, f"{mode}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    for each in MODES:
        run(each, sys.argv[1])
