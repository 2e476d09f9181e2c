"""QuantCallback with quant_mode=fx_graph_mode: the module's network is captured and quantized as a graph, the
LightningModule keeps its steps, logging and checkpoints."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import fx, nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks.quant import QuantCallback, load_quantized_checkpoint
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.graph import QuantConvBn2d
from quark.torch.quantization.nn.modules import QuantConv2d

warnings.filterwarnings("ignore", message=".*LeafSpec.*")

SYM8 = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "round_method": "half_even",
    "scale_type": "float",
    "is_dynamic": False,
}
W8 = {**SYM8, "qscheme": "per_channel", "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}


class ResNetish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(self.b1(self.c1(x)) + x)
        return self.fc(x.mean((2, 3)))


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ResNetish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)  # the last batch is smaller: the batch is dynamic


def trainer(tmp_path, callback: QuantCallback, epochs: int = 2) -> Trainer:  # noqa: ANN001
    return Trainer(
        max_epochs=epochs,
        callbacks=[callback],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def graph_config(weight: dict = W8) -> Config:
    return Config.from_dict(
        {"global_quant_config": {"input_tensors": SYM8, "weight": weight}, "quant_mode": "fx_graph_mode"}
    )


def test_qat_graph_mode_trains_freezes_bn_and_resumes(tmp_path) -> None:  # noqa: ANN001
    pl.seed_everything(0)
    model = Classifier()
    callback = QuantCallback(graph_config(), mode="qat", observer_steps=3, freeze_bn_epoch=1)
    t = trainer(tmp_path, callback)
    t.fit(model, loader(), loader())
    assert isinstance(model.net, fx.GraphModule)  # the LightningModule is the same object, its network a graph
    assert isinstance(model.net.get_submodule("c1"), QuantConvBn2d)
    bn = model.net.get_submodule("b1")
    assert not bn.training  # frozen from epoch 1 on
    assert torch.isfinite(t.callback_metrics["val_loss"])
    assert any(k.startswith("net._graph_quantizers.") for k in model.state_dict())
    assert "net.c1.weight" in model.state_dict()  # eager-mode key names
    # resume from the last checkpoint in a fresh module and callback
    ckpt = t.checkpoint_callback.best_model_path
    resumed = Classifier()
    t2 = trainer(tmp_path, QuantCallback(graph_config(), mode="qat", observer_steps=3, freeze_bn_epoch=1), epochs=3)
    t2.fit(resumed, loader(), loader(), ckpt_path=ckpt)
    assert t2.current_epoch == 3 and torch.isfinite(t2.callback_metrics["val_loss"])


def test_ptq_graph_mode_checkpoint_round_trip(tmp_path) -> None:  # noqa: ANN001
    pl.seed_everything(0)
    model = Classifier()
    callback = QuantCallback(graph_config(), mode="ptq", calib_batches=3, calib_dataloader=loader())
    t = trainer(tmp_path, callback)
    t.fit(model, loader(), loader())
    assert type(model.net.get_submodule("c1")) is QuantConv2d  # BatchNorm folded before calibration
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.net.modules())
    x = next(iter(loader()))[0]
    model.eval()
    with torch.no_grad():
        expected = model(x)
    tested = t.test(model, loader())[0]["test_loss"]
    # a fresh float module loads the quantized checkpoint (recaptured from the recorded input shapes)
    fresh = load_quantized_checkpoint(Classifier(), callback.quantized_checkpoint)
    with torch.no_grad():
        assert torch.allclose(fresh(x), expected, atol=1e-6)
    # and a fresh trainer + callback tests it: the folded state loads into the unfolded graph
    again = Trainer(
        callbacks=[QuantCallback(graph_config(), mode="ptq")],
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    result = again.test(Classifier(), loader(), ckpt_path=callback.quantized_checkpoint)[0]["test_loss"]
    assert abs(result - tested) < 1e-6


def test_ptq_graph_mode_exports_safetensors_and_onnx(tmp_path) -> None:  # noqa: ANN001
    """Before, the exporters found no ``quant_config`` on the LightningModule (graph mode prepares its children) and
    the end of fit raised after calibration, losing the run's results."""
    import onnxruntime as ort

    pl.seed_everything(0)
    model = Classifier()
    callback = QuantCallback(
        graph_config(),
        mode="ptq",
        calib_batches=3,
        calib_dataloader=loader(),
        export=["safetensors", "onnx"],
        export_dir=str(tmp_path / "out"),
    )
    trainer(tmp_path, callback, epochs=1).fit(model, loader(), loader())
    assert set(callback.exported) == {"safetensors", "onnx"}
    x = next(iter(loader()))[0]
    model.eval()
    with torch.no_grad():
        expected = model(x).numpy()
    session = ort.InferenceSession(callback.exported["onnx"]["path"])
    out = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    assert abs(out - expected).max() < 0.05  # within an int8 step or two of the fake-quant model
