"""StreamedPTQ: after ``fit``, the trained Hugging Face model saved sharded and quantized one decoder layer at a time.

The reference is the in-memory path on the same trained weights: ``from_pretrained`` of the saved directory,
``ModelQuantizer.quantize_model`` on the same calibration batches, ``export_quark_dir``; every tensor must be equal
bit for bit. The trained weights must differ from the initial ones (the callback saved what fit trained)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cb_helpers import make_trainer, seed
from lightning.pytorch import LightningModule
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import StreamedPTQ
from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:.*stay float")]

VOCAB, SEQ = 64, 12
W4 = {
    "dtype": "uint4",
    "qscheme": "per_group",
    "group_size": 16,
    "ch_axis": 1,
    "symmetric": False,
    "observer_cls": "PerGroupMinMaxObserver",
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
GPTQ = {"global_quant_config": {"weight": W4}, "algo_config": {"name": "gptq"}}


class TinyLM(LightningModule):
    """A LightningModule around a LLaMA, the model under ``net`` (``export_module``), as experiment=hf_lm has it."""

    export_module = "net"

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        self.net = transformers.LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (16, SEQ + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)


def read(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_the_trained_model_is_streamed_and_equals_the_in_memory_path(tmp_path: Path) -> None:
    seed(0)
    module = TinyLM()
    initial = module.net.model.layers[0].mlp.down_proj.weight.detach().clone()
    callback = StreamedPTQ(GPTQ, calib_batches=3, calib_dataloader=loader(), max_shard_bytes=8000)
    make_trainer(tmp_path, [callback]).fit(module, train_dataloaders=loader())
    saved, export = tmp_path / "float_hf", tmp_path / "export" / "quark"
    assert callback.exported == {"path": str(export), "checkpoint": str(saved)}
    assert (saved / "model.safetensors.index.json").is_file() and (export / "model.safetensors.index.json").is_file()
    trained = module.net.model.layers[0].mlp.down_proj.weight.detach()
    assert not torch.equal(trained, initial)
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    assert torch.equal(reference.model.layers[0].mlp.down_proj.weight, trained)
    batches = [b for _, b in zip(range(3), loader(), strict=False)]
    ModelQuantizer(GPTQ).quantize_model(reference, batches)
    a, b = read(export_quark_dir(reference, tmp_path / "memory")), read(export)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((export / "config.json").read_text())["quantization_config"]["quant_method"] == "quark"


def test_a_module_without_a_hugging_face_model_is_refused_before_training(tmp_path: Path) -> None:
    class Plain(TinyLM):
        export_module = None

    with pytest.raises(ValueError, match="has no save_pretrained.*export_module"):
        make_trainer(tmp_path, [StreamedPTQ(GPTQ, calib_dataloader=loader())]).fit(Plain(), train_dataloaders=loader())


def test_a_taken_export_folder_is_refused_before_training(tmp_path: Path) -> None:
    (tmp_path / "export" / "quark").mkdir(parents=True)
    (tmp_path / "export" / "quark" / "mine.txt").write_text("x")
    module = TinyLM()
    before = module.net.model.layers[0].mlp.down_proj.weight.detach().clone()
    with pytest.raises(ValueError, match="not empty"):
        make_trainer(tmp_path, [StreamedPTQ(GPTQ, calib_dataloader=loader())]).fit(module, train_dataloaders=loader())
    assert torch.equal(module.net.model.layers[0].mlp.down_proj.weight, before)  # no step was taken


def test_a_config_that_cannot_stream_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="quant_mode=fx_graph_mode captures the whole model"):
        StreamedPTQ({"global_quant_config": {"weight": W4}, "quant_mode": "fx_graph_mode"})
    with pytest.raises(ValueError, match="calib_batches=0"):
        StreamedPTQ(GPTQ, calib_batches=0)
