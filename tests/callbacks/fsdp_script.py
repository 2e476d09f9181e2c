"""Two-rank FSDP2 runs (Lightning's ModelParallelStrategy, ``fully_shard`` per decoder layer + root, gloo on CPU) of
QuantCallback for test_quant_fsdp.py: ``python fsdp_script.py MODE OUT_DIR``.

Each rank trains on its half of the data, in order and writes what the tests compare to
``OUT_DIR/<mode>_rank<r>.pt``: the module's full state (gathered from the shards), and the learned quantizer values
after the first batch. Modes:

- ``tqt``: a tiny Hugging Face LLaMA, TQT weights (learned log2 thresholds, ``quantizer_lr``) and min-max int8
  activations fixed after 2 batches, the SQNR / size report to a CSV logger; 6 steps, a sharded checkpoint after step 3 (mid-epoch: the loader resumes);
  exports ``safetensors`` and ``quark`` at the end.
- ``resume``: the ``tqt`` run again from its first checkpoint (``ckpt_path=``, step 3) to step 6.
- ``lsq``: a plain nn.Module transformer, LSQ per-channel weights and per-tensor LSQ inputs, 4 steps.
- ``ptq``: the plain transformer trained 2 steps in float, then min-max calibration (2 batches per rank) at the end
  of fit, ``quantized.ckpt`` written (a directory of shards).
- ``all``: the four in turn, in the same two processes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from cb_helpers import ResumableLoader
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import TensorDataset

from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.distributed import gathered_parameters
from quark.torch.quantization.nn.modules import iter_quantizers
from quark.torch.quantization.tensor_quantize import LearnableFakeQuantize
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

VOCAB, SEQ, HIDDEN, STEPS, CKPT_STEP = 128, 16, 64, 6, 3
TQT = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "scale_type": "pof2",
    "round_method": "half_even",
    "is_dynamic": False,
    "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"},
}
LSQ_WEIGHT = {
    "dtype": "int8",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "observer_cls": "PerChannelMinMaxObserver",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
    "qat_spec": {"method": "lsq"},
}
LSQ_INPUT = {**LSQ_WEIGHT, "qscheme": "per_tensor", "ch_axis": None, "observer_cls": "PerTensorMinMaxObserver"}
TQT_CONFIG = {"global_quant_config": {"weight": TQT, "input_tensors": INT8_PER_TENSOR_ACT}}
LSQ_CONFIG = {"global_quant_config": {"weight": LSQ_WEIGHT, "input_tensors": LSQ_INPUT}}
PTQ_CONFIG = {"global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT}}


def llama() -> nn.Module:
    """A tiny random LLaMA (two decoder layers)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


class Block(nn.Module):
    """A pre-norm transformer block of plain Linears (causal attention + MLP)."""

    def __init__(self, d: int = HIDDEN, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding, two Blocks and a head: a plain nn.Module transformer language model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class LitLM(LightningModule):
    """A causal LM whose ``configure_model`` shards each decoder layer, then the root (FSDP2)."""

    def __init__(self, kind: str = "llama", lr: float = 3e-3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.lr = kind, lr
        self.model = llama() if kind == "llama" else TinyLM()

    def layers(self) -> nn.ModuleList:
        return self.model.model.layers if self.kind == "llama" else self.model.layers

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.layers():
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "llama":
            return self.model(input_ids=ids, labels=ids).loss
        logits = self.model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def token_data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g))


class RankHalf(LightningDataModule):
    """Rank r trains on its half of ``token_data`` in order, resumable mid-epoch (the same batches after a resume)."""

    def train_dataloader(self) -> ResumableLoader:
        ids = token_data().tensors[0]
        return ResumableLoader(TensorDataset(ids[self.trainer.global_rank :: 2]), batch_size=4)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state_dict with every sharded Parameter gathered (a collective: every rank calls it)."""
    with gathered_parameters(module):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def learned_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every TQT threshold / LSQ scale, gathered."""
    with gathered_parameters(module):
        return {
            q.where: q.learned_parameter.detach().clone()
            for _, q in iter_quantizers(module)
            if isinstance(q, LearnableFakeQuantize)
        }


class FirstBatch(Callback):
    """The learned quantizer values after the first training batch (after its optimizer step)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.values is None:
            self.values = learned_values(pl_module)


def refusals(model: nn.Module, out: str) -> dict[str, str]:
    """The errors of the engine's entry points that read or replace whole weights, called on the sharded model."""
    from quark.torch import ModelQuantizer
    from quark.torch.export import export_model

    calls = {
        "freeze": lambda: ModelQuantizer.freeze(model),
        "export_model": lambda: export_model(model, os.path.join(out, "never"), ["safetensors"]),
        "prepare": lambda: ModelQuantizer(Config.from_dict(TQT_CONFIG)).prepare(model),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as err:
            errors[name] = str(err)
    return errors


def trainer(out: str, callbacks: list[Callback], steps: int, checkpoint: bool = False, log: bool = False) -> Trainer:
    if checkpoint:
        callbacks = [
            *callbacks,
            ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=CKPT_STEP, save_top_k=-1),
        ]
    return Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        callbacks=callbacks,
        logger=CSVLogger(out, name="log", version=0) if log else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoint,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )


def main(mode: str, out: str) -> None:
    if mode == "all":  # one launch of the two processes for every mode: most of a run is starting them
        for each in ("tqt", "resume", "lsq", "ptq"):
            main(each, out)
        return
    data = RankHalf()
    first = FirstBatch()
    result: dict[str, Any] = {}
    if mode in ("tqt", "resume"):
        model = LitLM("llama")
        export = ["safetensors", "quark"] if mode == "tqt" else []
        cb = QuantCallback(
            Config.from_dict(TQT_CONFIG),
            mode="qat",
            observer_steps=2,
            quantizer_lr=0.05,
            export=export,
            export_dir=os.path.join(out, "export"),
        )
        folder = out if mode == "tqt" else os.path.join(out, "resumed")
        run = trainer(folder, [first, cb], STEPS, checkpoint=True, log=mode == "tqt")
        ckpt = os.path.join(out, "ckpt", f"epoch=0-step={CKPT_STEP}.ckpt") if mode == "resume" else None
        run.fit(model, datamodule=data, ckpt_path=ckpt)
    elif mode == "lsq":
        model = LitLM("plain")
        cb = QuantCallback(Config.from_dict(LSQ_CONFIG), mode="qat", observer_steps=1, quantizer_lr=2e-3)
        run = trainer(out, [first, cb], 4)
        run.fit(model, datamodule=data)
    elif mode == "ptq":
        model = LitLM("plain")
        cb = QuantCallback(
            Config.from_dict(PTQ_CONFIG),
            mode="ptq",
            calib_batches=2,
            calib_forward=lambda m, batch: m.model(batch[0]),
            progress_bar=False,
        )
        run = trainer(os.path.join(out, "ptq"), [cb], 2)
        run.fit(model, datamodule=data)
        result["quantized_checkpoint"] = cb.quantized_checkpoint
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if mode == "tqt":
        result["refusals"] = refusals(model, out)
    result["first"] = first.values
    result["final"] = learned_values(model)
    result["state"] = full_state(model)
    result["world_size"] = run.world_size
    torch.save(result, os.path.join(out, f"{mode}_rank{run.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
