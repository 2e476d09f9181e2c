"""QuantCallback with ordinary Lightning patterns: DataModules that build their splits in ``setup(stage)``, forwards
that take more than the input, float checkpoints as a start, quantized checkpoints read safely, the progress bar and
logging, observer warm-up counted in batches, and LightningCLI."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from cb_helpers import (
    BoringMLP,
    DataModule,
    Probe,
    QuantCallback,
    float_forward,
    loader,
    make_data,
    make_trainer,
    manual_forward,
    minmax_config,
    quantizers,
    seed,
    tqt_config,
)
from lightning.pytorch import LightningDataModule
from lightning.pytorch.demos import LightningTransformer, Transformer
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from torch import nn
from torch.utils.data import DataLoader, Dataset

from callbacks.quant import QUANTIZED_CHECKPOINT_KEY, load_quantized_checkpoint
from quark_lightning.tasks.recipes import recipe


def _assert_calibrated(model: nn.Module) -> None:
    qs = list(quantizers(model))
    assert qs
    for name, q in qs:
        assert bool(q.initialized) and bool(q.fake_quant_enabled) and not bool(q.observer_enabled), name


# ----------------------------------------------------------------------------------------------- calibration data
class StageDataModule(BoringDataModule):
    """Lightning's BoringDataModule (splits built in ``setup(stage)``), recording the stages it was set up for."""

    def __init__(self) -> None:
        super().__init__()
        self.stages: list[str] = []

    def setup(self, stage: str) -> None:
        self.stages.append(stage)
        super().setup(stage)


@pytest.mark.parametrize("fn", ["test", "validate", "predict"])
def test_ptq_with_a_datamodule_that_builds_its_splits_in_setup(tmp_path, fn) -> None:
    """The README recipe ``trainer.test(model, datamodule=dm)`` with BoringDataModule: set up for "fit", once."""
    seed(0)
    model, dm = BoringModel(), StageDataModule()
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=3)
    trainer = make_trainer(tmp_path, [cb], limit_val_batches=2, limit_predict_batches=2)
    getattr(trainer, fn)(model, datamodule=dm, **({} if fn == "predict" else {"verbose": False}))
    assert cb.calibrated
    _assert_calibrated(model)
    assert dm.stages == [fn, "fit"]  # the stage's own setup by Lightning, "fit" once by the callback
    seen = torch.stack([dm.random_full[i] for i in range(3)])  # the first three training samples
    observer = model.layer._input_quantizer.observer
    assert float(observer.min_val) == float(seen.min()) and float(observer.max_val) == float(seen.max())


def test_ptq_calibration_data_errors_say_what_is_wrong(tmp_path) -> None:
    class NoTrain(LightningDataModule):
        def test_dataloader(self) -> DataLoader:
            return loader(make_data(16))

    class Broken(NoTrain):
        def train_dataloader(self) -> DataLoader:
            raise OSError("the disk is gone")

    with pytest.raises(ValueError, match=r"datamodule NoTrain has no train_dataloader\(\).*calib_dataloader="):
        make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="ptq")]).test(
            BoringMLP(), datamodule=NoTrain(), verbose=False
        )
    with pytest.raises(ValueError, match=r"train_dataloader\(\) raised OSError: the disk is gone") as err:
        make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="ptq")]).test(
            BoringMLP(), datamodule=Broken(), verbose=False
        )
    assert "has no train_dataloader" not in str(err.value)


class Tokens(Dataset):
    """(inputs, target) token pairs like lightning.pytorch.demos.WikiText2's, from a fixed random sequence."""

    def __init__(self, vocab: int = 32, block: int = 6, n: int = 24) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n * block + 1,), generator=g)
        self.block, self.n = block, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block : (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class TinyTransformer(LightningTransformer):
    """Lightning's demo LightningTransformer (``forward(inputs, target)``), tiny, on random tokens (no download)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=32)
        self.model = Transformer(vocab_size=32, ninp=8, nhead=2, nhid=16, nlayers=1, dropout=0.0)
        self.fed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.fed.append((inputs, target))
        return super().forward(inputs, target)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=4)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.nll_loss(self(*batch), batch[1].view(-1))
        self.log("test_loss", loss)
        return loss

    def test_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(n=8), batch_size=4)


@pytest.mark.filterwarnings("ignore:.*stay float.*")
def test_default_calibration_feed_for_a_forward_of_inputs_and_target(tmp_path) -> None:
    """Lightning's demo Transformer: calibration calls forward(inputs, target) with the (inputs, target) batches."""
    seed(0)
    model = TinyTransformer()
    config = minmax_config()
    cb = QuantCallback(config, mode="ptq", calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], limit_test_batches=1)
    trainer.test(model, verbose=False)
    assert cb.calibrated and len(model.fed) == 2 + 1  # two calibration batches, one test batch
    first = next(iter(model.train_dataloader()))
    assert torch.equal(model.fed[0][0], first[0]) and torch.equal(model.fed[0][1], first[1])
    _assert_calibrated(model)


@pytest.mark.filterwarnings("ignore:.*stay float.*")
def test_demo_transformer_ptq_calibrates_once_and_its_checkpoint_reloads_bit_for_bit(tmp_path) -> None:
    """Attention inside nn.Transformer: calibrated at the end of fit, not again for validate/test, and the quantized
    checkpoint restores every attention and Linear quantizer (load_quantized_checkpoint: strict)."""
    seed(0)
    model = TinyTransformer()
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=2, limit_val_batches=0, limit_test_batches=1)
    trainer.fit(model)
    calibrated_fed = len(model.fed)
    trainer.test(model, verbose=False)
    trainer.test(model, verbose=False)
    assert len(model.fed) == calibrated_fed + 2  # two test batches, no calibration batch
    attention = [n for n, m in model.named_modules() if type(m).__name__ == "QuantMultiheadAttention"]
    assert len(attention) == 3
    restored = load_quantized_checkpoint(TinyTransformer(), cb.quantized_checkpoint)
    inputs, target = next(iter(model.test_dataloader()))
    model.eval()
    with torch.no_grad():
        assert torch.equal(restored(inputs, target), model(inputs, target))
        model.model.transformer.encoder.layers[0].self_attn._weight_quantizer.disable_fake_quant()
        assert not torch.equal(restored(inputs, target), model(inputs, target))  # the attention weights are quantized


def test_default_feed_that_cannot_fit_the_forward_names_calib_forward(tmp_path) -> None:
    class TwoInputs(BoringMLP):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return super().forward(x + y)

    cb = QuantCallback(minmax_config(), mode="ptq", calib_dataloader=[torch.randn(4, 16)] * 2)
    with pytest.raises(
        ValueError,
        match=r"Tensor\[4, 16\].*TwoInputs\.forward\(x: .*calib_forward=lambda model, batch: model\(batch\[0\], batch\[1\]\)",
    ):
        make_trainer(tmp_path, [cb]).test(TwoInputs(), datamodule=DataModule(), verbose=False)


# ----------------------------------------------------------------------------------------------- float checkpoints
def _float_checkpoint(tmp_path, steps: int = 2) -> tuple[str, dict[str, torch.Tensor]]:
    seed(0)
    model = BoringMLP(lr=0.3)
    trainer = make_trainer(tmp_path / "float", limit_train_batches=steps)
    trainer.fit(model, datamodule=DataModule())
    path = str(tmp_path / "float.ckpt")
    trainer.save_checkpoint(path)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fn", ["test", "validate", "predict"])
def test_ptq_evaluation_from_a_float_checkpoint_loads_then_calibrates(tmp_path, fn) -> None:
    path, weights = _float_checkpoint(tmp_path)
    seed(1)
    model = BoringMLP()  # other weights: they must come from the checkpoint
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], limit_predict_batches=2)
    dm = DataModule()
    out = getattr(trainer, fn)(model, datamodule=dm, ckpt_path=path, **({} if fn == "predict" else {"verbose": False}))
    assert torch.equal(model.fc1.weight, weights["fc1.weight"]) and torch.equal(model.fc2.bias, weights["fc2.bias"])
    assert cb.calibrated
    _assert_calibrated(model)
    x_seen = dm.train.tensors[0][:16]
    observer = model.fc1._input_quantizer.observer
    assert float(observer.min_val) == float(x_seen.min()) and float(observer.max_val) == float(x_seen.max())
    if fn == "predict":
        x = dm.test.tensors[0][:16]
        assert torch.equal(torch.cat(out), manual_forward(model, x))
    else:
        outputs = model.test_outputs if fn == "test" else model.val_outputs
        for x, logits in outputs:
            assert torch.equal(logits, manual_forward(model, x))
            assert not torch.allclose(logits, float_forward(model, x), atol=1e-6)


def test_qat_fit_from_a_float_checkpoint_starts_from_its_weights_and_loop_state(tmp_path) -> None:
    path, weights = _float_checkpoint(tmp_path, steps=4)
    seed(1)
    model = BoringMLP(lr=0.3)
    probe = Probe()
    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=2)
    trainer = make_trainer(tmp_path, [cb, probe], max_epochs=2, limit_train_batches=4)
    trainer.fit(model, datamodule=DataModule(), ckpt_path=path)
    assert trainer.global_step == 8  # the float run's 4 steps (its loop state), then 4 QAT steps
    first = probe.weights_before_step[0]
    assert torch.equal(first["fc1.weight"], weights["fc1.weight"]) and torch.equal(
        first["fc2.weight"], weights["fc2.weight"]
    )
    # the observers ran on the first two QAT batches although global_step was already past observer_steps
    x = DataModule().train.tensors[0][:16]
    observer = model.fc1._input_quantizer.observer
    assert float(observer.min_val) == float(x.min()) and float(observer.max_val) == float(x.max())
    _assert_calibrated(model)
    assert len(model.train_checks) == 4
    for _, logits, manual in model.train_checks:
        assert torch.equal(logits, manual)


def test_qat_fit_from_a_float_checkpoint_with_learnable_thresholds_says_how_to_start(tmp_path) -> None:
    path, _ = _float_checkpoint(tmp_path)
    trainer = make_trainer(tmp_path, [QuantCallback(tqt_config(), mode="qat")], max_epochs=2)
    with pytest.raises(ValueError, match=r"optimizer state.*layer 'fc1'.*load_state_dict"):
        trainer.fit(BoringMLP(), datamodule=DataModule(), ckpt_path=path)


def test_plain_load_from_checkpoint_of_a_quantized_model_names_load_quantized_checkpoint(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=2)
    trainer.fit(model, datamodule=DataModule())
    with pytest.raises(RuntimeError, match="load_quantized_checkpoint") as err:
        BoringMLP.load_from_checkpoint(cb.quantized_checkpoint)
    assert str(err.value).index(QUANTIZED_CHECKPOINT_KEY) < str(err.value).index("_quantizer")  # the advice first
    # the same file still serves every quantized use
    fresh = load_quantized_checkpoint(BoringMLP(), cb.quantized_checkpoint)
    x = DataModule().test.tensors[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), model.eval()(x))
    again = BoringMLP()
    tester = make_trainer(tmp_path / "t", [QuantCallback(minmax_config(), mode="ptq")])
    tester.test(again, datamodule=DataModule(), ckpt_path=cb.quantized_checkpoint, verbose=False)
    assert torch.equal(again.fc1._input_quantizer.scale, model.fc1._input_quantizer.scale)
    assert not tester.callbacks[0].calibrated or tester.callbacks[0]._calibrated_for() is again
    for x_test, logits in again.test_outputs:
        assert torch.equal(logits, manual_forward(model, x_test))


# ----------------------------------------------------------------------------------------------- untrusted files
class _Payload:
    """Unpickling this calls open(path, "w"): the file appears when (and only when) the pickle is executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_load_quantized_checkpoint_refuses_a_pickle_payload_without_running_it(tmp_path) -> None:
    seed(0)
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    make_trainer(tmp_path, [cb], limit_train_batches=2).fit(BoringMLP(), datamodule=DataModule())
    checkpoint = torch.load(cb.quantized_checkpoint, weights_only=True)  # our own file: plain types only
    marker = tmp_path / "pwned"
    checkpoint["hyper_parameters"] = {"note": _Payload(str(marker))}
    bad = str(tmp_path / "bad.ckpt")
    torch.save(checkpoint, bad)

    with pytest.raises(ValueError, match=r"bad\.ckpt was refused.*nothing in it was run") as err:
        load_quantized_checkpoint(BoringMLP(), bad)
    assert "open" in str(err.value)  # what it would have called
    assert not marker.exists()
    # the payload is real: an unrestricted load would have run it
    proof = tmp_path / "proof"
    checkpoint["hyper_parameters"] = {"note": _Payload(str(proof))}
    torch.save(checkpoint, bad)
    torch.load(bad, weights_only=False)["hyper_parameters"]["note"].close()
    assert proof.exists()


def test_load_quantized_checkpoint_errors_name_the_layer(tmp_path) -> None:
    seed(0)
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    make_trainer(tmp_path, [cb], limit_train_batches=2).fit(BoringMLP(), datamodule=DataModule())
    checkpoint = torch.load(cb.quantized_checkpoint, weights_only=True)
    for key in [k for k in checkpoint["state_dict"] if k.startswith("fc2._input_quantizer.")]:
        del checkpoint["state_dict"][key]
    bad = str(tmp_path / "partial.ckpt")
    torch.save(checkpoint, bad)
    with pytest.raises(ValueError, match=r"no quantizer state for layer 'fc2' \(Linear, input_tensors\): .*scale"):
        load_quantized_checkpoint(BoringMLP(), bad)


UNREACHED = pytest.mark.filterwarnings("ignore:.*no forward reached.*")


class Spare(BoringMLP):
    """A quantized layer that the forward never reaches (as MultiheadAttention's out_proj once was)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(4, 4)


@UNREACHED
def test_a_layer_no_batch_reached_loads_and_runs_in_float(tmp_path) -> None:
    """A spare head (or an MoE expert no batch was routed to) has weight qparams but no input qparams: the checkpoint
    loads; frozen, that layer runs float, named in a warning; unfrozen, reaching it raises naming it."""
    seed(0)
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    make_trainer(tmp_path, [cb], limit_train_batches=2).fit(Spare(), datamodule=DataModule())
    with pytest.warns(UserWarning, match=r"run in float from now on .*\['spare'\]"):
        frozen = load_quantized_checkpoint(Spare(), cb.quantized_checkpoint)
    assert not list(frozen.spare.quantizers()) and list(frozen.fc1.quantizers()) and list(frozen.fc2.quantizers())
    x = torch.randn(3, 4)
    assert torch.equal(frozen.spare(x), torch.nn.functional.linear(x, frozen.spare.weight, frozen.spare.bias))
    with pytest.warns(UserWarning, match=r"raise if a forward reaches them .*\['spare'\]"):
        unfrozen = load_quantized_checkpoint(Spare(), cb.quantized_checkpoint, freeze=False)
    with pytest.raises(RuntimeError, match="spare"):
        unfrozen.spare(x)


@UNREACHED
@pytest.mark.parametrize("recipe_name", ["w8a8_int8", "w4a8_tqt_3sd"])
def test_a_head_qat_never_reached_loads_and_runs_in_float(tmp_path, recipe_name) -> None:
    """QAT observes weights in the forward too: a head no training batch reached has no qparams at all (TQT: no
    threshold); it runs in float after loading, named, and the reached layers stay quantized."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seed(0)
    cb = QuantCallback(recipe(recipe_name), mode="qat", observer_steps=2)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    make_trainer(tmp_path, [cb, ckpt], limit_train_batches=3).fit(Spare(), datamodule=DataModule())
    with pytest.warns(UserWarning, match=r"run in float from now on .*\['spare'\]"):
        loaded = load_quantized_checkpoint(Spare(), ckpt.last_model_path or ckpt.best_model_path)
    assert not list(loaded.spare.quantizers()) and list(loaded.fc1.quantizers())


@UNREACHED
def test_a_weight_quantizer_without_qparams_is_refused_naming_the_layer(tmp_path) -> None:
    seed(0)
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    make_trainer(tmp_path, [cb], limit_train_batches=2).fit(BoringMLP(), datamodule=DataModule())
    checkpoint = torch.load(cb.quantized_checkpoint, weights_only=True)
    checkpoint["state_dict"]["fc1._weight_quantizer.initialized"].fill_(0)
    bad = str(tmp_path / "uncalibrated.ckpt")
    torch.save(checkpoint, bad)
    with pytest.raises(
        ValueError, match=r"uncalibrated.ckpt: layer 'fc1' \(QuantLinear\): the weight quantizer has no qparams"
    ):
        load_quantized_checkpoint(BoringMLP(), bad)


# ----------------------------------------------------------------------------------------------- smaller things
@UNREACHED
def test_ptq_does_not_calibrate_again_before_each_stage(tmp_path) -> None:
    seed(0)
    model = Spare()
    dm = DataModule()
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=3)
    trainer = make_trainer(tmp_path, [cb])
    trainer.validate(model, datamodule=dm, verbose=False)
    after_validate = len(model.calls)
    assert after_validate == 3 + 2  # calibration, then the two validation batches
    trainer.test(model, datamodule=dm, verbose=False)
    assert len(model.calls) == after_validate + 2  # the two test batches only


def test_calibration_progress_bar_follows_the_trainer(tmp_path, capfd) -> None:
    seed(0)
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    make_trainer(tmp_path, [cb], enable_progress_bar=False).test(BoringMLP(), datamodule=DataModule(), verbose=False)
    assert "Calibrating" not in capfd.readouterr().err


def test_layer_table_is_logged_once_per_callback(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=2)
    trainer.fit(BoringMLP(), datamodule=DataModule())
    trainer.test(BoringMLP(), datamodule=DataModule(), verbose=False)  # a second (fresh) model, the same callback
    tables = [r for r in caplog.records if "quantizing 2 layer(s)" in r.getMessage()]
    assert len(tables) == 1


def test_qat_validate_before_fit_warns_once_that_observers_have_not_run(tmp_path) -> None:
    trainer = make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="qat")])
    model, dm = BoringMLP(), DataModule()
    with pytest.warns(UserWarning, match=r"validate\(\) before the observers have run.*layer 'fc1'") as record:
        trainer.validate(model, datamodule=dm, verbose=False)
        trainer.validate(model, datamodule=dm, verbose=False)
    assert (
        sum("observers have not run" in str(w.message) or "before the observers" in str(w.message) for w in record) == 1
    )


def test_observer_steps_count_training_batches_with_gradient_accumulation(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=4)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=8, accumulate_grad_batches=4)
    trainer.fit(model, datamodule=DataModule())
    assert trainer.global_step == 2
    x = DataModule().train.tensors[0][:32]  # the four observed batches, not all eight
    observer = model.fc1._input_quantizer.observer
    assert float(observer.min_val) == float(x.min()) and float(observer.max_val) == float(x.max())
    assert cb.state_dict()["batches_seen"] == 8


class TwoOptimizers(BoringMLP):
    """Manual optimization with one optimizer per layer: each batch makes two optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, loss = self._loss(batch)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.fc1.parameters(), lr=0.1), torch.optim.SGD(self.fc2.parameters(), lr=0.1)]


def test_observer_steps_count_training_batches_with_two_optimizers(tmp_path) -> None:
    seed(0)
    model = TwoOptimizers()
    probe = Probe()
    trainer = make_trainer(
        tmp_path, [QuantCallback(minmax_config(), mode="qat", observer_steps=3), probe], limit_train_batches=6
    )
    trainer.fit(model, datamodule=DataModule())
    assert trainer.global_step == 12
    # weight ranges are those of the last observed batch: the third one (not the second, as optimizer steps would say)
    for name in ("fc1", "fc2"):
        w = probe.weights_before_step[2][f"{name}.weight"]
        observer = getattr(model, name)._weight_quantizer.observer
        assert float(observer.min_val) == float(w.min()) and float(observer.max_val) == float(w.max())
        assert not torch.equal(w, probe.weights_before_step[1][f"{name}.weight"])


# ----------------------------------------------------------------------------------------------- LightningCLI
_CLI_TRAINER = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.accelerator=cpu",
]
_CLI_CONFIG = {"global_quant_config": {"weight": recipe("w8a8_int8").global_quant_config.weight.to_dict()}}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jsonargparse's about Lightning's own calls
@pytest.mark.parametrize("form", ["command-line", "yaml"])
def test_lightning_cli_fit_with_quant_callback(tmp_path, monkeypatch, form) -> None:
    pytest.importorskip("jsonargparse")
    import yaml
    from lightning.pytorch.cli import LightningCLI

    if form == "command-line":
        args = [
            "fit",
            *_CLI_TRAINER,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=callbacks.QuantCallback",
            f"--trainer.callbacks.config={yaml.safe_dump(_CLI_CONFIG)}",
            "--trainer.callbacks.mode=qat",
            "--trainer.callbacks.observer_steps=1",
        ]
    else:
        config = {
            "trainer": {
                "default_root_dir": str(tmp_path),
                "callbacks": [
                    {
                        "class_path": "callbacks.QuantCallback",
                        "init_args": {"config": _CLI_CONFIG, "mode": "qat", "observer_steps": 1},
                    }
                ],
            }
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        args = ["fit", f"--config={path}", *_CLI_TRAINER]
    monkeypatch.setattr(sys, "argv", ["train.py"])  # pytest's own arguments are not the CLI's
    cli = LightningCLI(BoringMLP, DataModule, args=args, save_config_callback=None)
    cbs = [c for c in cli.trainer.callbacks if isinstance(c, QuantCallback)]
    assert len(cbs) == 1 and cbs[0].mode == "qat" and cbs[0].observer_steps == 1
    assert cli.trainer.global_step == 2
    assert {name for name, _ in quantizers(cli.model)} == {"fc1.weight", "fc2.weight"}
    _assert_calibrated(cli.model)
    assert os.path.isdir(tmp_path)


# ----------------------------------------------------------------------------------------------- recurrent QAT
class LSTMClassifier(BoringMLP):
    """A sequence classifier: the (16-feature) samples as 4 steps of 4 features through a 2-layer LSTM."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)
        self.fc1 = None  # BoringMLP's own fc1 check (manual_forward) does not apply
        self.proj = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.view(x.shape[0], 4, 4))
        return self.fc2(self.act(self.proj(out[:, -1])))


def test_qat_trains_an_lstm_and_its_checkpoint_reloads_bit_for_bit(tmp_path) -> None:
    seed(0)
    model = LSTMClassifier()
    before = model.lstm.weight_hh_l1.detach().clone()
    trainer = make_trainer(tmp_path, [QuantCallback(tqt_config(), mode="qat", observer_steps=2)], limit_train_batches=3)
    trainer.fit(model, datamodule=DataModule())
    assert type(model.lstm).__name__ == "QuantLSTM" and not torch.equal(model.lstm.weight_hh_l1, before)
    thresholds = [n for n, _ in model.named_parameters() if n.startswith("lstm.") and n.endswith("log_threshold")]
    assert len(thresholds) == 4  # weight_ih/hh of both layers
    assert bool(model.lstm._input_quantizer_l1.initialized)  # the second layer's input was observed
    path = str(tmp_path / "qat.ckpt")
    trainer.save_checkpoint(path)
    restored = load_quantized_checkpoint(LSTMClassifier(), path)
    x = make_data(8).tensors[0]
    model.eval()
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))


class _Routed(pl.LightningModule):
    """An MoE written as users write it (a loop over experts, each on the tokens routed to it) whose router starts
    choosing expert 2 only after the observer warm-up; experts 1 and 3 are never chosen."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
        self.router = nn.Linear(32, 4)
        self.experts = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
        self.route(0)

    def route(self, expert: int) -> None:
        with torch.no_grad():
            self.router.weight.zero_()
            self.router.bias.zero_()
            self.router.bias[expert] = 10.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        choice, out = self.router(h).argmax(-1), torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            rows = choice == i
            if rows.any():
                out[rows] = expert(h[rows])
        return self.head(out)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 3:
            self.route(2)
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@UNREACHED
def test_an_expert_first_reached_after_the_observer_warm_up_is_calibrated_by_its_first_batch(tmp_path) -> None:
    """Before, the training step that first routed tokens to expert 2 raised "has no qparams yet"."""
    seed(0)
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 16), torch.randint(0, 4, (48,))), batch_size=8)
    model = _Routed()
    cb = QuantCallback(recipe("w8a8_int8"), mode="qat", observer_steps=2)
    with pytest.warns(UserWarning, match=r"3 layer\(s\) no training batch reached .*experts.1.*experts.2.*experts.3"):
        make_trainer(tmp_path, [cb], max_steps=6, limit_train_batches=None).fit(model, train_dataloaders=data)
    reached = [q for _, q in model.experts[2].quantizers()]
    assert reached and all(bool(q.initialized) and not bool(q.observer_enabled) for q in reached)
    assert all(bool(q.observer_enabled) for i in (1, 3) for _, q in model.experts[i].quantizers())
    assert {q.where for q in cb._pending} == {q.where for i in (1, 3) for _, q in model.experts[i].quantizers()}
    scale = model.experts[2]._input_quantizer.scale.clone()
    model.train()
    model(torch.randn(8, 16))  # fixed after its first batch: later batches leave its qparams alone
    assert torch.equal(model.experts[2]._input_quantizer.scale, scale)
