"""Smaller pieces behind QuantCallback: learnable quantizers before their first batch, the setup summary, the DDP
broadcast exclusion of quantizer buffers."""

from __future__ import annotations

import logging

import pytest
import torch
from cb_helpers import BoringMLP, DataModule, QuantCallback, make_trainer, minmax_config, tqt_config, tqt_spec

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.tensor_quantize import LSQFakeQuantize, TQTFakeQuantize
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT


def _learnable(kind: str):
    if kind == "tqt":
        return TQTFakeQuantize(QuantizationSpec.from_dict(tqt_spec()))
    return LSQFakeQuantize(QuantizationSpec.from_dict({**INT8_PER_TENSOR_ACT, "qat_spec": {"method": "lsq"}}))


@pytest.mark.parametrize("kind", ["tqt", "lsq"])
def test_learnable_quantizer_without_threshold_passes_through_when_switched_off(kind) -> None:
    """Evaluation before the first training batch (the sanity check) switches both off: no error, no init."""
    q = _learnable(kind)
    x = torch.randn(4, 8)
    q.disable_observer()
    q.disable_fake_quant()
    assert q(x) is x and not bool(q.initialized)
    q.enable_fake_quant()
    with pytest.raises(RuntimeError, match="observer on first"):
        q(x)  # quantizing still needs a threshold
    q.enable_observer()
    out = q(x)
    assert bool(q.initialized) and not torch.equal(out, x)


def test_setup_logs_the_table_of_quantized_layers(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    make_trainer(tmp_path, [QuantCallback(tqt_config(), mode="qat")], limit_train_batches=1).fit(
        BoringMLP(), datamodule=DataModule()
    )
    text = "\n".join(r.getMessage() for r in caplog.records if "quantizing 2 layer(s)" in r.getMessage())
    lines = text.splitlines()
    assert any(line.split()[:3] == ["fc1", "Linear", "input_tensors"] for line in lines), text
    assert any(line.split()[:3] == ["fc2", "Linear", "weight"] for line in lines), text


def test_quantizer_buffers_are_kept_out_of_ddp_buffer_broadcast(tmp_path) -> None:
    model = BoringMLP()
    model._ddp_params_and_buffers_to_ignore = ["user.choice"]  # what the user already excluded stays excluded
    make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="qat")], limit_train_batches=1).fit(
        model, datamodule=DataModule()
    )
    ignored = set(model._ddp_params_and_buffers_to_ignore)
    buffers = {n for n, _ in model.named_buffers() if "_quantizer" in n}
    assert "user.choice" in ignored
    assert {"fc1._input_quantizer.observer.min_val", "fc2._weight_quantizer.scale"} <= buffers <= ignored
    assert not any(n in ignored for n, _ in model.named_parameters())  # parameters keep DDP's gradient reduction


@pytest.mark.parametrize("config", ["minmax", "tqt"])
def test_after_the_warm_up_batches_walk_the_model_only_for_learned_quantizers(tmp_path, monkeypatch, config) -> None:
    """After the warm-up a batch changes nothing for min-max quantizers, so it walks no module; TQT / LSQ thresholds
    are still switched per batch (each initialises on its first batch, then learns), so with them every batch walks."""
    import callbacks.schedule as schedule

    cfg = minmax_config() if config == "minmax" else tqt_config()
    model = BoringMLP()
    cb = QuantCallback(cfg, mode="qat", observer_steps=2)
    walked_at: list[int] = []  # the batches seen when a walk over the model's quantizers started
    inner = schedule.iter_quantizers

    def counting(module):
        walked_at.append(cb._batches_seen)
        return inner(module)

    monkeypatch.setattr(schedule, "iter_quantizers", counting)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=6, limit_val_batches=0)
    trainer.fit(model, datamodule=DataModule())
    assert cb._batches_seen == 6
    after = sorted({n for n in walked_at if n > 2})  # the batches after the switch (batch 2 fixes the observers)
    assert after == ([] if config == "minmax" else [3, 4, 5])
    assert {0, 1, 2} <= set(walked_at)  # the warm-up and the switch still walk
    if config == "minmax":
        assert all(not bool(q.observer_enabled) for _, q in inner(model))
