"""Two-rank DDP (gloo, CPU) runs of QuantCallback for test_quant_ddp.py: ``python ddp_script.py MODE OUT_DIR``.

Each rank trains and calibrates on its OWN data (``rank_data``; no distributed sampler), so the ranks' statistics
differ and only their reduction makes the qparams agree. Each rank writes what the test compares to
``OUT_DIR/<mode>_rank<r>.pt``. Modes:

- ``ptq``: float training, then min-max (fc1 input) and histogram (fc2 input) calibration on all of each rank's data.
- ``qat``: TQT weights; fc1 input min-max observed for ``observer_steps`` steps; fc2 input a TQT threshold that each
  rank initialises from its own first batch.
- ``qat_short``: QAT that ends before ``observer_steps``, then test: the qparams used by test must agree too.
- ``lsq``: QAT with LSQ per-channel weights and fc1 input (per feature), TQT fc2 input: the scales have their final
  shapes before DDP wraps the module (else backward fails laying out their gradients).
- ``moe``: QAT of a model with three experts, each rank routing its own way: expert 1 only on rank 0's first
  warm-up batch, expert 2 only on rank 1's step after the warm-up. The quantizers with no qparams on some rank when
  the warm-up ends stay observing on every rank alike (no rank waits in a collective the other skips), and expert 2
  is fixed on both ranks from rank 1's data.
- ``all``: the five in turn, in the same two processes.
"""

from __future__ import annotations

import os
import sys

import torch
from cb_helpers import BoringMLP, DataModule, QuantCallback, loader, make_data, qstate, seed, tqt_spec
from lightning.pytorch import Callback, Trainer

from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

N_PER_RANK = 32
BATCH = 8


def rank_data(rank: int):
    """Rank r's samples: different seeds and a shifted mean, so their ranges differ."""
    return make_data(N_PER_RANK, seed=100 + rank, shift=1.5 * rank)


HISTOGRAM_ACT = {**INT8_PER_TENSOR_ACT, "observer_cls": "PerTensorHistogramObserver"}
PTQ_CONFIG = {
    "global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT},
    "layer_quant_config": {"fc2": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": HISTOGRAM_ACT}},
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
LSQ_CONFIG = {
    "global_quant_config": {"weight": LSQ_WEIGHT},
    "layer_quant_config": {
        "fc1": {"weight": LSQ_WEIGHT, "input_tensors": {**LSQ_WEIGHT, "ch_axis": -1}},
        "fc2": {"weight": LSQ_WEIGHT, "input_tensors": tqt_spec()},
    },
}
QAT_CONFIG = {
    "global_quant_config": {"weight": tqt_spec(), "input_tensors": INT8_PER_TENSOR_ACT},
    "layer_quant_config": {"fc2": {"weight": tqt_spec(), "input_tensors": tqt_spec()}},
}


class RankData(DataModule):
    def train_dataloader(self):
        return loader(rank_data(self.trainer.global_rank), BATCH)


class Record(Callback):
    """Placed before and after QuantCallback: the fc2 input threshold around the first batch's sync, and the state
    at the start of the step where the observers were fixed."""

    def __init__(self, fixed_at: int) -> None:
        self.fixed_at = fixed_at
        self.first_threshold: torch.Tensor | None = None
        self.at_fix: dict[str, torch.Tensor] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_threshold is None:
            self.first_threshold = pl_module.fc2._input_quantizer.log_threshold.detach().clone()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.fixed_at:
            self.at_fix = qstate(pl_module)


class RankRouted(BoringMLP):
    """Three experts between fc1 and fc2, routed by rank and step as the ``moe`` mode says."""

    def __init__(self) -> None:
        super().__init__(lr=0.2)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        rank, step = self.trainer.global_rank if self._trainer else 0, self.global_step if self._trainer else 0
        routed = [True, rank == 0 and step == 0, rank == 1 and step == 3]
        out = sum((e(h) for e, on in zip(self.experts, routed, strict=True) if on), torch.zeros_like(h))
        return self.fc2(out)


MOE_WEIGHT = {**LSQ_WEIGHT, "qat_spec": None}
MOE_CONFIG = {"global_quant_config": {"weight": MOE_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
MODES = ("ptq", "qat", "qat_short", "lsq", "moe")


def main(mode: str, out: str) -> None:
    if mode == "all":  # one launch of the two processes for every mode: most of a run is starting them
        for each in MODES:
            main(each, out)
        return
    seed(0)
    model = RankRouted() if mode == "moe" else BoringMLP(lr=0.2)
    kwargs = dict(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_val_batches=1,
        limit_test_batches=1,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    result: dict[str, object] = {}
    if mode == "ptq":
        cb = QuantCallback(Config.from_dict(PTQ_CONFIG), mode="ptq", progress_bar=False, save_quantized=False)
        trainer = Trainer(callbacks=[cb], limit_train_batches=2, **kwargs)
        trainer.fit(model, datamodule=RankData())
    elif mode == "qat":
        before, after = Record(2), Record(2)
        cb = QuantCallback(Config.from_dict(QAT_CONFIG), mode="qat", observer_steps=2)
        trainer = Trainer(callbacks=[before, cb, after], limit_train_batches=4, **kwargs)
        trainer.fit(model, datamodule=RankData())
        result.update(threshold_before_sync=before.first_threshold, threshold_after_sync=after.first_threshold)
        result["at_fix"] = after.at_fix
    elif mode == "lsq":
        cb = QuantCallback(Config.from_dict(LSQ_CONFIG), mode="qat", observer_steps=1)
        trainer = Trainer(callbacks=[cb], limit_train_batches=3, **kwargs)
        trainer.fit(model, datamodule=RankData())
    elif mode == "qat_short":
        cb = QuantCallback(Config.from_dict(PTQ_CONFIG), mode="qat", observer_steps=100)
        trainer = Trainer(callbacks=[cb], limit_train_batches=2, **kwargs)
        trainer.fit(model, datamodule=RankData())
        trainer.test(model, datamodule=RankData(), verbose=False)
    elif mode == "moe":
        cb = QuantCallback(Config.from_dict(MOE_CONFIG), mode="qat", observer_steps=2)
        kwargs["strategy"] = "ddp_find_unused_parameters_true"  # a rank's unrouted experts get no gradient
        trainer = Trainer(callbacks=[cb], limit_train_batches=4, **kwargs)
        trainer.fit(model, datamodule=RankData())
        result["pending"] = sorted(q.where for q in cb._pending)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    result["qstate"] = qstate(model)
    result["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items() if "_quantizer" not in k}
    result["world_size"] = trainer.world_size
    torch.save(result, os.path.join(out, f"{mode}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
