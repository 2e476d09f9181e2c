"""QuantCallback in graph mode around a Hugging Face model called with keywords (issue 33): checkpoints of a child
called as ``self.net(input_ids=...)`` reload (the callback records the call's keywords, not only its positional
tensors), and a training step that passes ``labels=`` (the README's Hugging Face example) trains."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import fx
from torch.utils.data import DataLoader

from callbacks.quant import QuantCallback, load_quantized_checkpoint, read_checkpoint
from quark.torch.quantization.config.config import Config

transformers = pytest.importorskip("transformers")

warnings.filterwarnings("ignore", message=".*LeafSpec.*")
pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")  # embeddings, norms

VOCAB, SEQ = 64, 8
SYM8 = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "round_method": "half_even",
    "scale_type": "float",
    "is_dynamic": False,
}
GRAPH_W8A8 = {"global_quant_config": {"input_tensors": SYM8, "weight": SYM8}, "quant_mode": "fx_graph_mode"}


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


class CausalLM(LightningModule):
    """The README's Hugging Face example: the child is called with keywords, the training step passes labels."""

    def __init__(self, seed: int = 0, labels: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = llama()
        self.labels = labels  # False: the loss from the logits in the step (no labels= to the model)
        self.losses: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.net(input_ids=batch, labels=batch) if self.labels else self.net(input_ids=batch)
        # the model's causal LM loss of the graph's logits: next-token cross entropy
        expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
        if self.labels:
            torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
        self.losses.append(expected.detach())
        return expected

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_logit_mean", self(batch).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens(n: int = 16) -> DataLoader:
    return DataLoader(torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1)), batch_size=4)


def trainer(tmp_path: Any, callback: QuantCallback, **kwargs: Any) -> Trainer:
    return Trainer(
        callbacks=[callback],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def test_keyword_called_graph_checkpoint_reloads(tmp_path) -> None:  # noqa: ANN001
    """A QAT graph-mode checkpoint of ``self.net(input_ids=...)`` (before: stored ``graph_inputs: {'net': []}``, and
    recapturing with no argument failed with 'You must specify exactly one of input_ids or inputs_embeds') loads
    into a fresh module with ``load_quantized_checkpoint`` and tests through ``Trainer.test(ckpt_path=...)`` with
    the trained model's outputs, on batches of another size and length than the capture's."""
    model = CausalLM(labels=False)
    callback = QuantCallback(Config.from_dict(GRAPH_W8A8), mode="qat", observer_steps=2)
    fit = trainer(tmp_path, callback, max_steps=4, enable_checkpointing=False)
    fit.fit(model, train_dataloaders=tokens())
    assert isinstance(model.net, fx.GraphModule)
    path = str(tmp_path / "qat.ckpt")
    fit.save_checkpoint(path)
    ids = torch.randint(0, VOCAB, (3, SEQ + 4), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        expected = model(ids)
    fresh = load_quantized_checkpoint(CausalLM(seed=1), path)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), expected, rtol=0, atol=1e-6)

    state = next(v for k, v in read_checkpoint(path)["callbacks"].items() if k.startswith("QuantCallback"))
    assert set(state["graph_inputs"]["net"]["kwargs"]) == {"input_ids"}  # the keyword the child was called with

    tested = trainer(tmp_path, QuantCallback(Config.from_dict(GRAPH_W8A8), mode="qat")).test(
        CausalLM(seed=1), tokens(), ckpt_path=path
    )
    reference = trainer(tmp_path, QuantCallback(Config.from_dict(GRAPH_W8A8), mode="qat")).test(model, tokens())
    assert abs(tested[0]["test_logit_mean"] - reference[0]["test_logit_mean"]) < 1e-6


def test_labels_in_a_graph_mode_training_step(tmp_path) -> None:  # noqa: ANN001
    """The README's Hugging Face example in graph mode: ``training_step`` returns ``self.net(input_ids=batch,
    labels=batch).loss`` (before: TypeError 'unexpected keyword argument labels' from the graph). The loss is the
    causal LM loss of the quantized graph's logits (checked in the step) and training moves the weights."""
    model = CausalLM()
    before = model.net.lm_head.weight.detach().clone()
    callback = QuantCallback(Config.from_dict(GRAPH_W8A8), mode="qat", observer_steps=2)
    trainer(tmp_path, callback, max_steps=4, enable_checkpointing=False).fit(model, train_dataloaders=tokens())
    assert isinstance(model.net, fx.GraphModule) and len(model.losses) == 4
    assert all(torch.isfinite(loss) for loss in model.losses)
    assert not torch.equal(model.net.get_submodule("lm_head").weight, before)


def test_labels_without_a_known_loss_is_a_clear_error() -> None:
    """A graph of a Hugging Face model whose loss is not computed outside the graph (sequence classification) called
    with ``labels=`` raises a ValueError saying what to do (before: TypeError 'unexpected keyword argument')."""
    from quark.torch.quantization.graph import capture

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    ids = torch.randint(1, VOCAB, (2, SEQ))
    gm = capture(model, (), {"input_ids": ids})
    torch.testing.assert_close(gm(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(
        ValueError, match=r"takes no 'labels'.*ForSequenceClassification.*Compute the loss from the outputs"
    ):
        gm(input_ids=ids, labels=torch.tensor([0, 2]))
