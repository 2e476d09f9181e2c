"""QuantCallback: QAT (prepare in setup, observer warm-up, fake quantization in every stage, sanity check, BN freeze)
and PTQ (calibration after fit or before test, calibration data, quantized.ckpt)."""

from __future__ import annotations

import os

import pytest
import torch
from cb_helpers import (
    BNNet,
    BoringMLP,
    DataModule,
    Probe,
    QuantCallback,
    assert_states_equal,
    float_forward,
    loader,
    make_data,
    make_trainer,
    manual_forward,
    minmax_config,
    qstate,
    quantizers,
    seed,
    tqt_config,
    tqt_params,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from quark.torch.quantization.nn.modules import QuantLinear, QuantMixin
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize, TQTFakeQuantize
from quark_lightning.tasks.recipes import recipe


def _scales(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.endswith("<scale>")}


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def _assert_quantized_outputs(model: BoringMLP, outputs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each recorded (input, logits) is the quantized model's output, bit for bit, and not the float one."""
    assert outputs
    for x, logits in outputs:
        assert torch.equal(logits, manual_forward(model, x))
        assert not torch.allclose(logits, float_forward(model, x), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------- QAT
def test_qat_prepares_in_setup_so_configure_optimizers_trains_tqt_thresholds(tmp_path) -> None:
    seed(0)
    model = BoringMLP(lr=0.5)
    probe = Probe()
    trainer = make_trainer(
        tmp_path, [QuantCallback(tqt_config(), mode="qat", observer_steps=2), probe], limit_train_batches=6
    )
    trainer.fit(model, datamodule=DataModule())

    assert type(model.fc1) is QuantLinear and type(model.fc2) is QuantLinear
    assert isinstance(model.fc1._weight_quantizer, TQTFakeQuantize)
    thresholds = tqt_params(model)
    assert len(thresholds) == 2 and all(isinstance(t, nn.Parameter) for t in thresholds)
    in_optimizer = {id(p) for group in model.optimizer.param_groups for p in group["params"]}
    assert {id(t) for t in thresholds} <= in_optimizer
    # the float weights are still the optimizer's (the twin shares them)
    assert {id(model.fc1.weight), id(model.fc2.weight)} <= in_optimizer

    # initialised on the first batch, then learned: the thresholds move at every step
    first, last = probe.states_after_step[0], probe.states_after_step[-1]
    for name in ("fc1.weight.log_threshold", "fc2.weight.log_threshold"):
        assert bool(first[name.replace("log_threshold", "initialized")])
        moves = [probe.states_after_step[i][name] for i in range(len(probe.states_after_step))]
        assert all(not torch.equal(a, b) for a, b in zip(moves, moves[1:], strict=False)), name
        assert not torch.equal(first[name], last[name])
    assert torch.equal(last["fc1.weight.log_threshold"], model.fc1._weight_quantizer.log_threshold.detach())


def test_qat_observers_run_for_observer_steps_then_are_fixed(tmp_path) -> None:
    seed(0)
    model = BoringMLP(lr=0.5, weight_decay=0.2)  # weight decay shrinks the weights' range from step to step
    probe = Probe()
    steps = 3
    trainer = make_trainer(
        tmp_path, [QuantCallback(minmax_config(), mode="qat", observer_steps=steps), probe], limit_train_batches=8
    )
    trainer.fit(model, datamodule=DataModule())

    after = [_scales(s) for s in probe.states_after_step]
    assert len(after) == 8
    # before the fixing step the weight scales follow the weights (they change at every step) ...
    for i in range(steps - 1):
        changed = _changed(after[i], after[i + 1])
        assert "fc1.weight.<scale>" in changed and "fc2.weight.<scale>" in changed, (i, changed)
    # ... from then on nothing changes any more: every scale is the one of the last observed step
    for i in range(steps - 1, len(after)):
        assert_states_equal(after[i], after[steps - 1])
    observing = [[bool(v) for k, v in s.items() if k.endswith(".observer_enabled")] for s in probe.states_after_step]
    assert all(all(flags) for flags in observing[:steps]) and not any(any(flags) for flags in observing[steps:])
    # the fixed weight ranges are those of the weights in the last observed step (not a running range over steps)
    last_observed = probe.weights_before_step[steps - 1]
    running = []  # the range over all observed steps: at least one end differs from the last step's
    for name in ("fc1", "fc2"):
        observer = getattr(model, name)._weight_quantizer.observer
        w = last_observed[f"{name}.weight"]
        assert float(observer.min_val) == float(w.min()) and float(observer.max_val) == float(w.max())
        seen = torch.stack([s[f"{name}.weight"] for s in probe.weights_before_step[:steps]])
        running += [float(seen.min()) != float(w.min()), float(seen.max()) != float(w.max())]
    assert any(running)
    # the fixed activation range is the one of the observed batches only
    data = DataModule().train.tensors[0]
    x_seen, x_all = data[: 8 * steps], data
    lo, hi = model.fc1._input_quantizer.observer.min_val, model.fc1._input_quantizer.observer.max_val
    assert float(lo) == float(x_seen.min()) and float(hi) == float(x_seen.max())
    assert (float(x_all.min()), float(x_all.max())) != (float(lo), float(hi))  # the later batches would widen it


@pytest.mark.parametrize("config", [tqt_config, minmax_config], ids=["tqt", "minmax"])
def test_qat_fake_quantization_stays_on_in_train_validate_test_predict(tmp_path, config) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    trainer = make_trainer(tmp_path, [QuantCallback(config(), mode="qat", observer_steps=2)], limit_train_batches=4)
    trainer.fit(model, datamodule=dm)

    # training: every step's logits are the quantized forward (also while observing)
    assert len(model.train_checks) == 4
    for _, logits, manual in model.train_checks:
        assert torch.equal(logits, manual)
    # validation at the end of the epoch: the weights are final, the metric is the quantized model's
    _assert_quantized_outputs(model, model.val_outputs)
    assert len(model.val_outputs) == 2
    y = dm.val.tensors[1]
    manual_losses = [
        nn.functional.cross_entropy(manual_forward(model, x), y[8 * i : 8 * i + 8])
        for i, (x, _) in enumerate(model.val_outputs)
    ]
    float_losses = [
        nn.functional.cross_entropy(float_forward(model, x), y[8 * i : 8 * i + 8])
        for i, (x, _) in enumerate(model.val_outputs)
    ]
    logged = float(trainer.callback_metrics["val_loss"])
    assert logged == pytest.approx(float(torch.stack(manual_losses).mean()), rel=1e-6)
    assert logged != pytest.approx(float(torch.stack(float_losses).mean()), rel=1e-6)

    before = qstate(model)
    trainer.test(model, datamodule=dm, verbose=False)
    _assert_quantized_outputs(model, model.test_outputs)
    predictions = trainer.predict(model, datamodule=dm)
    x_pred = dm.test.tensors[0]
    assert torch.equal(torch.cat(predictions), manual_forward(model, x_pred[: len(torch.cat(predictions))]))
    assert_states_equal(before, qstate(model))  # evaluation never changes a statistic


@pytest.mark.parametrize("logger", [False, True], ids=["no-logger", "csv-logger"])
@pytest.mark.parametrize("config", [tqt_config, minmax_config], ids=["tqt", "minmax"])
def test_sanity_check_changes_no_statistic(tmp_path, config, logger) -> None:
    """A sanity check that does no training: every statistic, qparam and flag is as it was before it (and the
    report logged at the end of fit, with a logger, does not change one either)."""
    seed(0)
    model = BoringMLP()
    probe = Probe()
    trainer = make_trainer(
        tmp_path,
        [QuantCallback(config(), mode="qat", observer_steps=5), probe],
        num_sanity_val_steps=2,
        limit_train_batches=0,
        logger=CSVLogger(str(tmp_path)) if logger else False,
    )
    trainer.fit(model, datamodule=DataModule())

    assert len(model.val_outputs) == 2  # the sanity check ran two validation batches through the model
    assert probe.at_fit_start is not None and probe.at_sanity_end is not None
    # observers were on (as created) when the sanity check started: without the pause they would have recorded
    assert all(bool(v) for k, v in probe.at_fit_start.items() if k.endswith("observer_enabled"))
    assert_states_equal(probe.at_fit_start, probe.at_sanity_end)
    assert_states_equal(probe.at_fit_start, qstate(model))
    # the sanity check ran in float (nothing is calibrated yet): its outputs are the float model's
    for x, logits in model.val_outputs:
        assert torch.allclose(logits, float_forward(model, x), atol=1e-6)


def test_sanity_check_before_training_leaves_qat_statistics_alone(tmp_path) -> None:
    """With training after it: the state at the start of training is the state before the sanity check."""
    seed(0)
    model = BoringMLP()
    probe = Probe()
    trainer = make_trainer(
        tmp_path, [QuantCallback(minmax_config(), mode="qat", observer_steps=2), probe], num_sanity_val_steps=2
    )
    trainer.fit(model, datamodule=DataModule())
    assert_states_equal(probe.at_fit_start, probe.at_train_start)
    # and the observers then saw exactly the first two training batches (not the sanity batches)
    x = DataModule().train.tensors[0][:16]
    observer = model.fc1._input_quantizer.observer
    assert float(observer.min_val) == float(x.min()) and float(observer.max_val) == float(x.max())


def test_bn_statistics_frozen_from_freeze_bn_epoch(tmp_path) -> None:
    seed(0)
    model = BNNet()
    probe = Probe()
    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=2, freeze_bn_epoch=1)
    trainer = make_trainer(tmp_path, [cb, probe], max_epochs=3, limit_train_batches=3)
    trainer.fit(model, datamodule=DataModule(images=True))

    means = probe.bn_means
    assert [e for e, _ in means] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    epoch0 = [m for e, m in means if e == 0]
    later = [m for e, m in means if e >= 1]
    assert all(not torch.equal(a, b) for a, b in zip(epoch0, epoch0[1:], strict=False))  # updating in epoch 0
    assert all(torch.equal(m, epoch0[-1]) for m in later)  # frozen from epoch 1 on
    assert [t for e, t in probe.bn_training if e == 0] == [True] * 3
    assert [t for e, t in probe.bn_training if e >= 1] == [False] * 6
    assert torch.equal(model.bn.running_mean, epoch0[-1])


def test_bn_not_frozen_without_freeze_bn_epoch(tmp_path) -> None:
    seed(0)
    model = BNNet()
    probe = Probe()
    trainer = make_trainer(
        tmp_path,
        [QuantCallback(minmax_config(), mode="qat", observer_steps=2), probe],
        max_epochs=2,
        limit_train_batches=2,
    )
    trainer.fit(model, datamodule=DataModule(images=True))
    means = [m for _, m in probe.bn_means]
    assert all(not torch.equal(a, b) for a, b in zip(means, means[1:], strict=False))


# ----------------------------------------------------------------------------------------------- PTQ
def _calibration_calls(model: BoringMLP, start: int, end: int) -> list[tuple[bool, bool, torch.Tensor]]:
    return model.calls[start:end]


class CallMark(Probe):
    """Remembers how many forwards the model had run when a hook was reached (placed around QuantCallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: dict[str, int] = {}

    def on_fit_end(self, trainer, pl_module) -> None:
        self.marks["fit_end"] = len(pl_module.calls)

    def on_test_start(self, trainer, pl_module) -> None:
        self.marks["test_start"] = len(pl_module.calls)


def test_ptq_trains_float_then_calibrates_after_fit(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    before, after, probe = CallMark(), CallMark(), Probe()
    cb = QuantCallback(recipe("w8a8_int8"), mode="ptq", calib_batches=3, log_sqnr=False)
    trainer = make_trainer(tmp_path, [before, probe, cb, after], limit_train_batches=4, enable_checkpointing=True)
    trainer.fit(model, datamodule=dm)

    # training and validation during fit were float: no quantizer observed or quantized
    for state in probe.states_after_step:
        assert not any(bool(v) for k, v in state.items() if k.endswith(("observer_enabled", "fake_quant_enabled")))
    for x, logits in model.val_outputs:
        assert torch.allclose(logits, float_forward(model, x), atol=1e-6)

    # calibration: exactly calib_batches forwards, in eval mode under no_grad, on the first training batches
    calls = model.calls[before.marks["fit_end"] : after.marks["fit_end"]]
    assert len(calls) == 3
    assert all(not training and not grad for training, grad, _ in calls)
    train_x = dm.train.tensors[0]
    for i, (_, _, x) in enumerate(calls):
        assert torch.equal(x, train_x[8 * i : 8 * i + 8])
    observer = model.fc1._input_quantizer.observer
    seen = train_x[:24]
    assert float(observer.min_val) == float(seen.min()) and float(observer.max_val) == float(seen.max())
    assert cb.calibrated
    for _, q in quantizers(model):
        assert bool(q.initialized) and bool(q.fake_quant_enabled) and not bool(q.observer_enabled)

    # test reports the quantized model's metrics
    fixed = qstate(model)
    trainer.test(model, datamodule=dm, verbose=False)
    _assert_quantized_outputs(model, model.test_outputs)
    assert_states_equal(fixed, qstate(model))  # already calibrated: testing does not calibrate again

    # quantized.ckpt holds the calibrated state
    path = cb.quantized_checkpoint
    assert path is not None and os.path.basename(path) == "quantized.ckpt" and os.path.isfile(path)
    checkpoint = torch.load(path, weights_only=False)
    state = model.state_dict()
    quant_keys = [k for k in state if "_quantizer." in k]
    assert any(k.endswith("_input_quantizer.observer.max_val") for k in quant_keys)
    for key in quant_keys:
        assert torch.equal(checkpoint["state_dict"][key], state[key]), key
    assert [s for k, s in checkpoint["callbacks"].items() if k.startswith("QuantCallback")][0]["calibrated"] is True


def test_ptq_of_a_trained_model_via_test_calibrates_before_testing(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    make_trainer(tmp_path / "float", limit_train_batches=4).fit(model, datamodule=dm)  # trained without the callback
    assert not any(isinstance(m, QuantMixin) for m in model.modules())
    n_float = len(model.calls)

    before, after = CallMark(), CallMark()
    cb = QuantCallback(recipe("w8a8_int8"), mode="ptq", calib_batches=2, log_sqnr=False)
    trainer = make_trainer(tmp_path, [before, cb, after])
    trainer.test(model, datamodule=dm, verbose=False)

    calls = model.calls[before.marks["test_start"] : after.marks["test_start"]]
    assert before.marks["test_start"] == n_float and len(calls) == 2
    assert all(not training and not grad for training, grad, _ in calls)
    assert torch.equal(calls[0][2], dm.train.tensors[0][:8]) and torch.equal(calls[1][2], dm.train.tensors[0][8:16])
    assert len(model.calls) == after.marks["test_start"] + 2  # then the two test batches
    _assert_quantized_outputs(model, model.test_outputs)
    assert cb.calibrated


@pytest.mark.parametrize(("calib_batches", "calib_epochs", "expected"), [(None, 1, 5), (2, 1, 2), (2, 2, 4)])
def test_ptq_uses_the_given_calib_dataloader(tmp_path, calib_batches, calib_epochs, expected) -> None:
    seed(0)
    model = BoringMLP()
    calib = make_data(40, seed=7, shift=3.0)
    before, after = CallMark(), CallMark()
    cb = QuantCallback(
        minmax_config(),
        mode="ptq",
        calib_dataloader=loader(calib),
        calib_batches=calib_batches,
        calib_epochs=calib_epochs,
        log_sqnr=False,
    )
    trainer = make_trainer(tmp_path, [before, cb, after], limit_train_batches=2)
    trainer.fit(model, datamodule=DataModule())

    calls = model.calls[before.marks["fit_end"] : after.marks["fit_end"]]
    assert len(calls) == expected
    per_epoch = expected // calib_epochs
    for i, (training, grad, x) in enumerate(calls):
        j = i % per_epoch
        assert not training and not grad
        assert torch.equal(x, calib.tensors[0][8 * j : 8 * j + 8])
    seen = calib.tensors[0][: 8 * per_epoch]
    observer = model.fc1._input_quantizer.observer
    assert float(observer.min_val) == float(seen.min()) and float(observer.max_val) == float(seen.max())


def test_ptq_calib_forward_feeds_each_batch(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    fed = []

    def feed(module, batch):
        fed.append(batch)
        return module(batch[0] * 2.0)

    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2, calib_forward=feed, log_sqnr=False)
    make_trainer(tmp_path, [cb], limit_train_batches=2).fit(model, datamodule=DataModule())
    assert len(fed) == 2
    x = DataModule().train.tensors[0][:16] * 2.0
    observer = model.fc1._input_quantizer.observer
    assert float(observer.max_val) == float(x.max()) and float(observer.min_val) == float(x.min())


def test_ptq_without_calibration_data_says_what_to_give(tmp_path) -> None:
    class NoTrainData(BoringMLP):
        def test_dataloader(self):
            return loader(make_data(16, seed=3))

    model = NoTrainData()
    trainer = make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="ptq")])
    with pytest.raises(ValueError, match="calib_dataloader"):
        trainer.test(model, verbose=False)


def test_qat_quantizers_are_scaled_fake_quantize_for_minmax(tmp_path) -> None:
    """The min-max config (used by many tests here) really has an observer on every role."""
    seed(0)
    model = BoringMLP()
    make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="qat", observer_steps=1)], limit_train_batches=1).fit(
        model, datamodule=DataModule()
    )
    kinds = {name: type(q) for name, q in quantizers(model)}
    assert set(kinds) == {"fc1.input_tensors", "fc1.weight", "fc2.input_tensors", "fc2.weight"}
    assert set(kinds.values()) == {ScaledFakeQuantize}
