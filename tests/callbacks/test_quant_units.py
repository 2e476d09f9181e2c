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
def test_the_model_is_walked_once_per_epoch_and_after_the_warm_up_only_for_learned_quantizers(
    tmp_path, monkeypatch, config
) -> None:
    """The per-batch schedule sets quantizers found by one walk over the model per epoch, not one per batch; after the
    warm-up a batch changes nothing for min-max quantizers, so it sets nothing; TQT / LSQ thresholds are still switched
    per batch (each initialises on its first batch, then learns), from a walk made after the switch (fixing the
    observers may swap quantizers)."""
    import callbacks.schedule as schedule

    cfg = minmax_config() if config == "minmax" else tqt_config()
    model = BoringMLP()
    cb = QuantCallback(cfg, mode="qat", observer_steps=2)
    walked_at: list[tuple[int, int]] = []  # (epoch, batches seen) when a walk over the model's quantizers started
    inner = schedule._walk_quantizers
    set_at: list[int] = []
    enable = TQTFakeQuantize.enable_observer

    def counting(module):
        walked_at.append((trainer.current_epoch, cb._batches_seen))
        return inner(module)

    def switching(q, enabled=True):
        set_at.append(cb._batches_seen)
        return enable(q, enabled)

    monkeypatch.setattr(schedule, "_walk_quantizers", counting)
    monkeypatch.setattr(TQTFakeQuantize, "enable_observer", switching)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=3, limit_val_batches=0, max_epochs=2)
    trainer.fit(model, datamodule=DataModule())
    assert cb._batches_seen == 6
    # the warm-up's epoch once; the second epoch once where a learned quantizer is set after the warm-up
    assert walked_at == ([(0, 0)] if config == "minmax" else [(0, 0), (1, 3)])
    if config == "minmax":
        assert all(not bool(q.observer_enabled) for _, q in schedule.iter_quantizers(model))
    else:
        assert {3, 4, 5} <= set(set_at)  # every batch after the warm-up still switches the thresholds


def test_a_quantizer_put_in_a_slot_during_the_warm_up_is_observed_from_the_next_batch(tmp_path) -> None:
    """The per-batch schedule keeps its walk while every quantizer is the one it found: a weight quantizer swapped in
    mid-epoch (observer off, stale statistics) gets its observer switched on and reset before the next batch like the
    others, so its range is that batch's weight."""
    from lightning.pytorch import Callback

    seen: dict[str, object] = {}

    class Swap(Callback):  # after QuantCallback in the list: its batch-start hook runs after the schedule's
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                old = pl_module.fc2._weight_quantizer
                fresh = type(old)(old.spec)
                fresh.observer.min_val = torch.tensor(-1e6)  # stale statistics the reset must drop
                fresh.observer.max_val = torch.tensor(1e6)
                fresh.disable_observer()
                pl_module.fc2._weight_quantizer = seen["fresh"] = fresh

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:
                seen["enabled"] = bool(pl_module.fc2._weight_quantizer.observer_enabled)

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if trainer.fit_loop.batch_idx == 1:
                q, w = pl_module.fc2._weight_quantizer, pl_module.fc2.weight.detach()
                seen["range"] = (float(q.observer.min_val), float(q.observer.max_val), float(w.min()), float(w.max()))

    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=10)
    model = BoringMLP()
    make_trainer(tmp_path, [cb, Swap()], limit_train_batches=2, limit_val_batches=0).fit(model, datamodule=DataModule())
    assert model.fc2._weight_quantizer is seen["fresh"] and seen["enabled"]
    lo, hi, wmin, wmax = seen["range"]  # type: ignore[misc]
    assert (lo, hi) == (wmin, wmax)
