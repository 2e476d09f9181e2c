"""QAT of the KV cache and the attention probabilities through ``QuantCallback``: learnable LSQ / TQT scales of the
keys, values (post-RoPE: applied by the attention) and probabilities get gradients and move with the optimizer, and
a checkpoint reloads into a fresh module with the trained model's logits (post-RoPE placement and the probabilities'
twins rebuilt from the stored config)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from callbacks import QuantCallback, load_quantized_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

VOCAB, SEQ = 128, 12


def learned(method: str) -> dict[str, Any]:
    spec = {
        "dtype": "int8",
        "qscheme": "per_tensor",
        "symmetric": True,
        "is_dynamic": False,
        "round_method": "half_even",
    }
    return {**spec, "observer_cls": "PerTensorMinMaxObserver", "scale_type": "float", "qat_spec": {"method": method}}


CONFIG = {
    "global_quant_config": {"weight": {**learned("lsq"), "qat_spec": None}},  # min-max weights
    "kv_cache_quant_config": {
        "*k_proj": {"output_tensors": learned("lsq")},
        "*v_proj": {"output_tensors": learned("tqt")},
    },
    "kv_cache_group": ["*k_proj", "*v_proj"],
    "kv_cache_post_rope": True,
    "softmax_quant_spec": learned("lsq"),
    "exclude": ["*lm_head"],
}


class LitLlama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.model(input_ids=input_ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)  # steps of ~lr: every learned scale moves


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (16, SEQ), generator=g)), batch_size=4)


def learned_scales(lit: LitLlama) -> dict[str, torch.Tensor]:
    attn = lit.model.model.layers[0].self_attn
    quantizers = {"k": attn.k_proj._output_quantizer, "v": attn.v_proj._output_quantizer}
    quantizers["probs"] = attn.attn_probs._output_quantizer
    return {name: next(iter(q.parameters())) for name, q in quantizers.items()}


def test_a_qat_step_trains_the_learnable_kv_and_probability_scales_and_the_checkpoint_reloads(tmp_path) -> None:
    lit = LitLlama()
    first: dict[str, torch.Tensor] = {}
    grads: dict[str, bool] = {}

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:  # after the first step: learned parameters initialised from the first batch
                first.update({k: v.detach().clone() for k, v in learned_scales(pl_module).items()})

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads.update(
                {k: v.grad is not None and bool(v.grad.abs().sum() > 0) for k, v in learned_scales(pl_module).items()}
            )

    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[QuantCallback(CONFIG, mode="qat", observer_steps=1), Probe(), checkpoint],
    )
    trainer.fit(lit, train_dataloaders=loader())
    attn = lit.model.model.layers[0].self_attn
    assert attn.k_proj.output_applied_elsewhere and attn.v_proj.output_applied_elsewhere
    assert grads == {"k": True, "v": True, "probs": True}
    after = learned_scales(lit)
    assert sorted(first) == ["k", "probs", "v"]
    for name, value in first.items():
        assert not torch.equal(after[name].detach(), value), name

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    lit.eval()
    with torch.no_grad():
        expected = lit.model(input_ids=ids).logits
    reloaded = load_quantized_checkpoint(LitLlama(), checkpoint.last_model_path)
    with torch.no_grad():
        assert torch.equal(reloaded.model(input_ids=ids).logits, expected)
    attn = reloaded.model.model.layers[1].self_attn
    assert attn.k_proj.output_applied_elsewhere and hasattr(attn, "attn_probs")
