"""Checkpoints of QuantCallback runs: the quantization state in ModelCheckpoint files, bit-exact crash and resume,
``test(ckpt_path="best")`` and ``load_quantized_checkpoint`` into a fresh model."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from cb_helpers import (
    BoringMLP,
    CrashAt,
    DataModule,
    Probe,
    QuantCallback,
    float_forward,
    make_trainer,
    manual_forward,
    minmax_config,
    qstate,
    quantizers,
    seed,
    tqt_config,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.quant import load_quantized_checkpoint
from quark.torch.quantization.nn.modules import QuantLinear
from quark.torch.quantization.tensor_quantize import FrozenScaledFakeQuantize
from quark_lightning.tasks.recipes import recipe


def _quant_keys(model: torch.nn.Module) -> list[str]:
    return [k for k in model.state_dict() if "_quantizer." in k]


def test_model_checkpoint_holds_every_quantizer_buffer_and_param(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    probe = Probe()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, [QuantCallback(tqt_config(), mode="qat", observer_steps=1), probe, ckpt], limit_train_batches=4
    )
    trainer.fit(model, datamodule=DataModule())

    expected = {f"{name}.{k}" for name, m in model.named_modules() for k in m.state_dict() if "_quantizer" in name}
    assert {
        "fc1._weight_quantizer.log_threshold",
        "fc1._weight_quantizer.initialized",
        "fc1._input_quantizer.scale",
        "fc1._input_quantizer.zero_point",
        "fc1._input_quantizer.observer.min_val",
        "fc1._input_quantizer.observer.max_val",
        "fc1._input_quantizer.observer_enabled",
        "fc1._input_quantizer.fake_quant_enabled",
    } <= expected
    files = sorted(glob.glob(str(tmp_path / "ckpt" / "*.ckpt")))
    assert [os.path.basename(f) for f in files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    for path, step in zip(files, (2, 4), strict=True):
        state = torch.load(path, weights_only=False)["state_dict"]
        assert expected <= set(state)
        # the values are the model's after that step
        after = probe.states_after_step[step - 1]
        assert torch.equal(state["fc1._weight_quantizer.log_threshold"], after["fc1.weight.log_threshold"])
        assert torch.equal(state["fc2._input_quantizer.observer.max_val"], after["fc2.input_tensors.observer.max_val"])
        assert torch.equal(state["fc2._input_quantizer.scale"], after["fc2.input_tensors.<scale>"])


def _weights_and_qstate(model: BoringMLP) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out.update(qstate(model))
    return out


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")  # B's ModelCheckpoint: not needed
@pytest.mark.parametrize("crash_step", [2, 4, 6])  # while observing, at an epoch boundary, after the fix
def test_crash_then_resume_is_bit_exact(tmp_path, crash_step) -> None:
    """Mid-epoch resume needs a resumable train loader (Lightning restarts the epoch's data otherwise)."""
    total, observer_steps = 10, 3

    def callbacks() -> list:
        return [QuantCallback(tqt_config(), mode="qat", observer_steps=observer_steps)]

    common = dict(
        max_steps=total, max_epochs=-1, limit_train_batches=4, limit_val_batches=1
    )  # 32 samples: 4 batches, an epoch each 4 steps

    # A: uninterrupted
    seed(0)
    model_a = BoringMLP(lr=0.2)
    make_trainer(tmp_path / "a", callbacks(), **common).fit(model_a, datamodule=DataModule(n=32, resumable=True))
    assert model_a.trainer.global_step == total

    # B: crashes at crash_step after a checkpoint written at that step, then a new Trainer resumes from it
    seed(0)
    model_b = BoringMLP(lr=0.2)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer(tmp_path / "b", [*callbacks(), CrashAt(crash_step), ckpt], **common).fit(
            model_b, datamodule=DataModule(n=32, resumable=True)
        )
    path = glob.glob(str(tmp_path / "ckpt" / f"*step={crash_step}.ckpt"))
    assert len(path) == 1

    seed(123)  # a different initialisation: everything must come from the checkpoint
    model_c = BoringMLP(lr=0.2)
    trainer = make_trainer(tmp_path / "c", callbacks(), **common)
    trainer.fit(model_c, datamodule=DataModule(n=32, resumable=True), ckpt_path=path[0])
    assert trainer.global_step == total

    a, c = _weights_and_qstate(model_a), _weights_and_qstate(model_c)
    assert a.keys() == c.keys()
    different = [k for k in a if not torch.equal(a[k], c[k])]
    assert not different, different
    # the compared state holds what the issue names: weights, TQT thresholds, observer min/max, scales
    assert {
        "fc1.weight",
        "fc1.weight.log_threshold",
        "fc2.input_tensors.observer.min_val",
        "fc2.input_tensors.<scale>",
    } <= a.keys()
    assert not torch.equal(a["fc1.weight"], model_b.fc1.weight.detach())  # B had not got there before crashing


@pytest.mark.parametrize("mode", ["qat", "ptq"])
def test_test_with_best_checkpoint_after_fit(tmp_path, mode) -> None:
    seed(0)
    model = BoringMLP(lr=0.3)
    dm = DataModule()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss", save_top_k=1)
    cb = QuantCallback(recipe("w8a8_int8"), mode=mode, observer_steps=2, calib_batches=2)
    trainer = make_trainer(tmp_path, [cb, ckpt], max_epochs=3, enable_checkpointing=True)
    trainer.fit(model, datamodule=dm)
    best = ckpt.best_model_path
    assert best and os.path.isfile(best)

    trainer.test(ckpt_path="best", datamodule=dm, verbose=False)
    saved = torch.load(best, weights_only=False)["state_dict"]
    assert torch.equal(model.fc1.weight, saved["fc1.weight"])  # the best weights were tested
    for _, q in quantizers(model):
        assert bool(q.initialized) and bool(q.fake_quant_enabled)
    for x, logits in model.test_outputs:
        assert torch.equal(logits, manual_forward(model, x))
        assert not torch.allclose(logits, float_forward(model, x), atol=1e-6)
    if mode == "ptq":  # written during fit in float: the best weights were calibrated again before testing
        assert not bool(saved["fc1._input_quantizer.initialized"])
        assert torch.equal(model.fc1._input_quantizer.observer.max_val, dm.train.tensors[0][:16].max())


@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.parametrize("config_name", ["tqt", "minmax"])
def test_load_quantized_checkpoint_after_qat_is_bit_exact(tmp_path, freeze, config_name) -> None:
    seed(0)
    model = BoringMLP()
    config = tqt_config() if config_name == "tqt" else minmax_config()
    trainer = make_trainer(tmp_path, [QuantCallback(config, mode="qat", observer_steps=2)], limit_train_batches=4)
    trainer.fit(model, datamodule=DataModule())
    path = str(tmp_path / "final.ckpt")
    trainer.save_checkpoint(path)

    fresh = load_quantized_checkpoint(BoringMLP(), path, freeze=freeze)
    assert not fresh.training and type(fresh.fc1) is QuantLinear
    if freeze:
        assert isinstance(fresh.fc1._weight_quantizer, FrozenScaledFakeQuantize)
    x = DataModule().test.tensors[0]
    model.eval()
    with torch.no_grad():
        expected, got = model(x), fresh(x)
    assert torch.equal(expected, got)
    assert torch.equal(expected, manual_forward(model, x))


def test_load_quantized_checkpoint_of_ptq_is_bit_exact(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    cb = QuantCallback(recipe("w8a8_int8"), mode="ptq", calib_batches=3)
    make_trainer(tmp_path, [cb], limit_train_batches=4).fit(model, datamodule=DataModule())
    assert cb.quantized_checkpoint == os.path.join(str(tmp_path), "quantized.ckpt")

    fresh = load_quantized_checkpoint(BoringMLP(), cb.quantized_checkpoint)
    x = DataModule().test.tensors[0]
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
        assert not torch.allclose(fresh(x), float_forward(fresh, x), atol=1e-6)
    # strict=True: a state_dict with a key too many (or too few) is refused
    checkpoint = torch.load(cb.quantized_checkpoint, weights_only=False)
    checkpoint["state_dict"]["fc1._input_quantizer.bogus"] = torch.zeros(())
    bad = str(tmp_path / "bad.ckpt")
    torch.save(checkpoint, bad)
    with pytest.raises(RuntimeError, match="bogus"):
        load_quantized_checkpoint(BoringMLP(), bad)


def test_load_quantized_checkpoint_refuses_a_checkpoint_without_quant_state(tmp_path) -> None:
    trainer = make_trainer(tmp_path, limit_train_batches=1)
    trainer.fit(BoringMLP(), datamodule=DataModule())
    path = str(tmp_path / "plain.ckpt")
    trainer.save_checkpoint(path)
    with pytest.raises(ValueError, match="QuantCallback"):
        load_quantized_checkpoint(BoringMLP(), path)
