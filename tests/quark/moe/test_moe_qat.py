"""QAT of a tiny Mixtral and Qwen2-MoE through ``QuantCallback`` (a LightningModule wrapping the causal LM, as the
README's callback section has it): the experts' stacked Parameters train through their per-expert quantizers (their
gradient is the quantized forward's, not the float one's), a ModelCheckpoint reloads with
``load_quantized_checkpoint`` into a fresh wrapper with the trained logits bit for bit, and so does a Trainer resume;
freezing changes no output."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from moe_models import W8A8, build, eval_ids, experts_layers
from torch.utils.data import DataLoader, TensorDataset

from callbacks import QuantCallback, load_quantized_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.quantization.nn.modules import QuantFusedExperts
from quark.torch.quantization.state import paused_quantizers

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*stay float",
    "ignore:.*does not have many workers.*",
    "ignore:.*number of training batches.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*LeafSpec.*",
    "ignore:.*received no calibration token.*",
    "ignore:.*no training batch reached.*",
)


class LitMoE(LightningModule):
    def __init__(self, family: str, init_seed: int = 0) -> None:
        super().__init__()
        self.model = build(family, seed=init_seed).train()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, 128, (16, 16), generator=g)), batch_size=4, shuffle=False)


def trainer(root: Any, callbacks: list, **overrides: Any) -> Trainer:
    kwargs: dict[str, Any] = dict(
        default_root_dir=str(root),
        max_epochs=1,
        limit_train_batches=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
        deterministic=True,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    kwargs.update(overrides)
    return Trainer(callbacks=callbacks, **kwargs)


@torch.no_grad()
def logits(lit: LitMoE) -> torch.Tensor:
    training = lit.training
    lit.eval()
    try:
        return lit.model(input_ids=eval_ids()).logits
    finally:
        lit.train(training)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_qat_trains_the_experts_through_their_quantizers_and_reloads_bit_for_bit(tmp_path, family) -> None:
    torch.manual_seed(0)
    lit = LitMoE(family)
    before = {n: m.gate_up_proj.detach().clone() for n, m in experts_layers(lit.model).items()}
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    trainer(tmp_path, [QuantCallback(W8A8, mode="qat", observer_steps=2), ckpt]).fit(lit, train_dataloaders=loader())

    twins = experts_layers(lit.model)
    for name, twin in twins.items():
        assert isinstance(twin, QuantFusedExperts), name
        changed = (twin.gate_up_proj.detach() != before[name]).flatten(1).any(dim=1)
        assert bool(changed.all()), f"{name}: experts {(~changed).nonzero().flatten().tolist()} did not train"
        for _, q in twin.quantizers():
            assert bool(q.fake_quant_enabled) and not bool(q.observer_enabled) and bool(q.initialized), name

    # the gradient reaching the stacked Parameter is the quantized forward's
    batch = next(iter(loader()))[0]
    name, twin = next(iter(twins.items()))
    lit.zero_grad()
    lit.training_step((batch,), 0).backward()
    quantized_grad = twin.gate_up_proj.grad.clone()
    lit.zero_grad()
    with paused_quantizers(lit, fake_quant=True):
        lit.training_step((batch,), 0).backward()
    assert quantized_grad.abs().sum() > 0 and not torch.allclose(quantized_grad, twin.gate_up_proj.grad)

    expected = logits(lit)
    loaded = load_quantized_checkpoint(LitMoE(family, init_seed=1), ckpt.best_model_path)
    assert isinstance(loaded.model.get_submodule(name), QuantFusedExperts)
    assert torch.equal(logits(loaded), expected)
    frozen = ModelQuantizer.freeze(copy.deepcopy(lit))
    assert torch.equal(logits(frozen), expected)


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*", "ignore:.*dirpath has changed.*")
def test_qat_resumes_bit_for_bit(tmp_path) -> None:
    def run(root: Any, lit: LitMoE, ckpt_path: str | None = None) -> None:
        cb = QuantCallback(W8A8, mode="qat", observer_steps=3)
        ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_epochs=1, save_top_k=-1)
        trainer(root, [cb, ckpt], max_epochs=2, limit_train_batches=2).fit(
            lit, train_dataloaders=loader(), ckpt_path=ckpt_path
        )

    torch.manual_seed(0)
    trained = LitMoE("mixtral")
    run(tmp_path / "a", trained)
    first = sorted((tmp_path / "a" / "ckpt").glob("*.ckpt"))[0]
    torch.manual_seed(0)
    resumed = LitMoE("mixtral", init_seed=1)
    run(tmp_path / "b", resumed, ckpt_path=str(first))
    for (key, a), b in zip(resumed.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    assert torch.equal(logits(resumed), logits(trained))
