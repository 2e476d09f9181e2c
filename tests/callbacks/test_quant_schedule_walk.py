"""QuantCallback's QAT schedule keeps its walk over the model's quantizers while the module tree is unchanged
(``schedule._quantizers_now``): a layer or quantizer put in place during a fit, or between fits, is switched on and
reset like the others from the next batch, and the walk keeps no layer alive. (Cases found by a review of the first
version, which checked only the slots it had walked.)"""

from __future__ import annotations

import gc
import types
import weakref

import torch
from cb_helpers import BoringMLP, DataModule, QuantCallback, make_trainer, minmax_config
from lightning.pytorch import Callback

from quark.torch.quantization.api import ModelQuantizer


def test_a_layer_swapped_in_during_the_warm_up_is_observed_from_the_next_batch(tmp_path) -> None:
    """Like test_a_quantizer_put_in_a_slot_during_the_warm_up..., but the whole quantized layer is replaced (a fresh
    QuantLinear twin of fc2, observers off). The old per-batch walk switched its observers on at the next batch."""
    seen: dict[str, object] = {}

    class Swap(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                old = pl_module.fc2
                fresh = type(old).from_float(
                    old.to_float() if hasattr(old, "to_float") else torch.nn.Linear(old.in_features, old.out_features),
                    old.quant_config,
                )
                fresh.load_state_dict(old.state_dict(), strict=False)
                for _, q in fresh.quantizer_slots():
                    q.disable_observer()
                pl_module.fc2 = seen["fresh"] = fresh

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:
                seen["enabled"] = {s.attr: bool(q.observer_enabled) for s, q in pl_module.fc2.quantizer_slots()}

    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=10)
    model = BoringMLP()
    make_trainer(tmp_path, [cb, Swap()], limit_train_batches=2, limit_val_batches=0).fit(model, datamodule=DataModule())
    assert model.fc2 is seen["fresh"]
    assert all(seen["enabled"].values()), seen["enabled"]  # type: ignore[union-attr]


def test_a_quantizer_put_in_an_empty_slot_during_the_warm_up_is_observed(tmp_path) -> None:
    """fc2 has no output quantizer; one is added after batch 0 (observer off). The old walk enabled it at batch 1."""
    seen: dict[str, object] = {}

    class Add(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                layer = pl_module.fc2
                slots = {s.attr: s for s in layer.quant_slots}
                empty = [s for s in layer.quant_slots if getattr(layer, s.attr, None) is None]
                src = layer._input_quantizer
                fresh = type(src)(src.spec)
                fresh.disable_observer()
                seen["slot"] = empty[0].attr
                layer.set_quantizer(empty[0], fresh)
                seen["fresh"] = fresh
                seen["slots"] = list(slots)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:
                seen["enabled"] = bool(seen["fresh"].observer_enabled)  # type: ignore[union-attr]

    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=10)
    model = BoringMLP()
    make_trainer(tmp_path, [cb, Add()], limit_train_batches=2, limit_val_batches=0).fit(model, datamodule=DataModule())
    assert seen["enabled"], seen


def test_a_layer_swapped_in_during_the_warm_up_has_its_weight_observer_reset_per_batch(tmp_path) -> None:
    """A fresh twin of fc2 (observers on, its weight observer holding stale statistics) put in place of fc2 after
    batch 0, as a progressive-QAT callback would: during the warm-up each batch's weight range must be the current
    weight's (the observer is reset before each batch; the old per-batch walk did). The cached walk still holds the old
    fc2 (its slots unchanged), so the new weight observer is never reset this epoch."""
    ranges: list[tuple[float, ...]] = []

    class Swap(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                old = pl_module.fc2
                fresh = type(old).from_float(old.to_float(), old.quant_config)
                fresh._weight_quantizer.observer.min_val = torch.tensor(-1e6)  # stale statistics the reset must drop
                fresh._weight_quantizer.observer.max_val = torch.tensor(1e6)
                pl_module.fc2 = fresh

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if trainer.fit_loop.batch_idx >= 1:
                q, w = pl_module.fc2._weight_quantizer, pl_module.fc2.weight.detach()
                ranges.append((float(q.observer.min_val), float(q.observer.max_val), float(w.min()), float(w.max())))

    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=10)
    torch.manual_seed(0)
    model = BoringMLP(lr=0.5)
    make_trainer(tmp_path, [cb, Swap()], limit_train_batches=6, limit_val_batches=0).fit(model, datamodule=DataModule())
    assert len(ranges) == 5
    assert all((lo, hi) == (wmin, wmax) for lo, hi, wmin, wmax in ranges), ranges


def test_a_layer_swapped_between_two_fits_is_reset_in_the_second_warm_up(tmp_path) -> None:
    """Fit 1 ends inside the warm-up (on_fit_end fixes the observers, but the walk is only dropped on the in-batch
    switch). Between fits the user replaces fc2 by a fresh twin; fit 2 (a new Trainer, epoch 0 again) reuses fit 1's
    walk (same module, same epoch number, the old fc2's slots unchanged), so fc2's new weight observer is never reset."""
    ranges: list[tuple[float, ...]] = []

    class Watch(Callback):
        def on_before_backward(self, trainer, pl_module, loss) -> None:
            q, w = pl_module.fc2._weight_quantizer, pl_module.fc2.weight.detach()
            ranges.append((float(q.observer.min_val), float(q.observer.max_val), float(w.min()), float(w.max())))

    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=10)
    torch.manual_seed(0)
    model = BoringMLP()
    make_trainer(tmp_path, [cb], limit_train_batches=2, limit_val_batches=0).fit(model, datamodule=DataModule())
    old = model.fc2
    fresh = type(old).from_float(old.to_float(), old.quant_config)
    fresh._weight_quantizer.observer.min_val = torch.tensor(-1e6)  # stale statistics the reset must drop
    fresh._weight_quantizer.observer.max_val = torch.tensor(1e6)
    model.fc2 = fresh
    make_trainer(tmp_path, [cb, Watch()], limit_train_batches=2, limit_val_batches=0).fit(
        model, datamodule=DataModule()
    )
    assert len(ranges) == 2
    assert all((lo, hi) == (wmin, wmax) for lo, hi, wmin, wmax in ranges), ranges


def test_the_walk_keeps_no_layer_alive() -> None:
    """The walk holds the module by weak reference and no layer at all: a model dropped after a fit is freed."""
    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=10)
    model = BoringMLP()
    ModelQuantizer(minmax_config()).prepare(model)
    cb._update_observers(types.SimpleNamespace(current_epoch=0), model)  # what a warm-up batch does
    assert cb._quantizer_walk is not None
    refs = [weakref.ref(model), weakref.ref(model.fc1), weakref.ref(model.fc1.weight)]
    del model
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
