"""QuantCallback's schedules: QAT observer warm-up, BatchNorm freezing and quantizer learning rate; PTQ calibration."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from callbacks.calibration_data import as_model_input, as_trained
from callbacks.mixed_precision import choose as choose_mixed
from callbacks.mixed_precision import write_config_yaml, write_sensitivity_csv
from callbacks.quantizer_lr import split_quantizer_groups
from callbacks.quantizer_state import device_of, is_learnable, is_ready, keep_out_of_ddp_broadcast, layers_of
from quark.torch import ModelQuantizer
from quark.torch.algorithm.sensitivity import average_bits, mixed_precision_config
from quark.torch.quantization.api import format_plans, run_batch
from quark.torch.quantization.distributed import flags_across_ranks, sync_observers, sync_quantizers
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.observer import ObserverResets
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


#: module registrations (a submodule set, replaced or set to None anywhere) counted since the hook went in
_tree_changes = 0
_tree_hook: Any = None


def _count_tree_change(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    global _tree_changes
    _tree_changes += 1


def module_tree_generation() -> int:
    """A number that changes whenever any module gets, replaces or drops a submodule (``nn.Module.__setattr__``,
    ``add_module``, ``register_module``: torch's global registration hook, installed on the first call), so a walk
    over a model is known to be current without walking it again."""
    global _tree_hook
    if _tree_hook is None:
        _tree_hook = register_module_module_registration_hook(_count_tree_change)
    return _tree_changes


class _Walk(NamedTuple):
    """What the QAT schedule sets per batch, from one walk over the module (``_walk_quantizers``)."""

    #: the TQT / LSQ quantizers
    learnables: list[FakeQuantizeBase]
    #: the other static quantizers, with whether each takes a weight or bias
    observed: list[tuple[FakeQuantizeBase, bool]]
    #: the weight and bias quantizers' observers, reset before each warm-up batch (their range is the current one)
    weight_resets: ObserverResets


def _walk_quantizers(pl_module: nn.Module) -> _Walk:
    """``_Walk`` of ``pl_module``."""
    static = [(role, q) for role, q in iter_quantizers(pl_module) if not q.is_dynamic]
    observed = [(q, role in ("weight", "bias")) for role, q in static if not is_learnable(q)]
    observers = [o for q, weight in observed if weight and (o := getattr(q, "observer", None)) is not None]
    return _Walk([q for _, q in static if is_learnable(q)], observed, ObserverResets(observers))


class QuantSchedule:
    """Mixin of QuantCallback: when observers run and qparams are fixed (QAT warm-up, PTQ calibration epochs)."""

    def _split_quantizer_lr(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """QAT with ``quantizer_lr``: the learned quantizer parameters move to groups of their own, per optimizer."""
        params = [p for _, q in iter_quantizers(pl_module) if is_learnable(q) for p in q.parameters()]
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        self._lr_splits = split_quantizer_groups(trainer.optimizers, params, self.quantizer_lr, schedulers)
        for split, lr0 in zip(self._lr_splits, self._restored_lr0, strict=False):
            split.source_lr0 = lr0  # resume: the schedule factor is relative to the first run's start
        if params and not self._lr_splits:
            rank_zero_warn(
                f"QuantCallback(quantizer_lr={self.quantizer_lr}): no optimizer holds the {len(params)} learned "
                "quantizer parameter(s), so they do not train; build the optimizer from self.parameters()."
            )

    def _freeze_batchnorm(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """QAT: from ``freeze_bn_epoch`` on, BatchNorm layers use and keep their running statistics."""
        if self.freeze_bn_epoch is not None and trainer.current_epoch >= self.freeze_bn_epoch:
            for m in pl_module.modules():
                if isinstance(m, BN_TYPES) and m.training:
                    m.eval()

    def _update_observers(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Observers run for the first ``observer_steps`` training batches (weights: their current values), then are
        fixed. Batches, not optimizer steps: with gradient accumulation or several optimizers they differ."""
        observing = self._batches_seen < self.observer_steps
        seen = self._learnable_seen  # (the module last scanned, whether it had TQT / LSQ quantizers)
        if not observing and not self._observing and seen is not None and seen[0]() is pl_module and not seen[1]:
            return  # after the warm-up only TQT / LSQ quantizers change per batch, and this module's last scan found none
        if observing:
            self._pending = []  # a new warm-up (a later fit) observes everything again
        learnables, observed, weight_resets = self._quantizers_now(trainer, pl_module)
        for q in learnables:
            q.enable_observer(not is_ready(q))  # TQT / LSQ: initialise on the first batch, then learn
        if observing:
            weight_resets()  # weights move every step: their range is the current one
            for q, _ in observed:
                q.enable_observer(True)
        learnable = bool(learnables)
        if self._observing and not observing:
            self._fix_observers(trainer, pl_module, batch)  # (drops the walk: fixing may swap quantizers)
            learnable = any(is_learnable(q) for _, q in iter_quantizers(pl_module))
        self._learnable_seen = (weakref.ref(pl_module), learnable)  # a walk over every module per batch is not free
        self._observing = observing

    def _quantizers_now(self, trainer: Trainer, pl_module: LightningModule) -> _Walk:
        """The quantizers the per-batch schedule sets (``_walk_quantizers``), from a walk kept while the module tree
        is unchanged (``module_tree_generation``), within one epoch of one fit: inside ``Trainer.fit`` a walk per
        batch and its checks cost more than the settings (width-512 MLP, 6 quantizers: 176 -> 97 us a warm-up
        batch). Holds the quantizers, not the layers; dropped when a fit's training ends."""
        key = (pl_module, getattr(trainer, "current_epoch", None), module_tree_generation())
        walk = self._quantizer_walk
        if walk is not None and walk[0]() is key[0] and walk[1:3] == key[1:]:
            return walk[3]
        plan = _walk_quantizers(pl_module)
        self._quantizer_walk = (weakref.ref(pl_module), key[1], key[2], plan)
        return plan

    def _fix_observers(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Reduce the statistics across ranks, fix the qparams (observers off) and log the report. Quantizers without
        qparams on some rank (an MoE expert the router has not chosen yet) keep observing, on every rank alike: the
        first batch that reaches one on any rank calibrates it, and its qparams are fixed after it (``_fix_pending``)."""
        self._quantizer_walk = None  # fixing may swap quantizers
        sync_observers(pl_module)  # statistics are the union of the ranks'
        candidates = [q for _, q in iter_quantizers(pl_module) if not q.is_dynamic and not is_learnable(q)]
        ready = flags_across_ranks([is_ready(q) for q in candidates], "all", device_of(candidates))
        self._pending = []
        for q, ok in zip(candidates, ready, strict=True):
            if ok:
                q.disable_observer()
            else:
                q.forget_qparams()  # a rank's qparams from an earlier warm-up batch: every rank starts alike
                q.enable_observer(True)
                self._pending.append(q)
        self._observing = False
        rank_zero_info(f"QuantCallback: observers fixed after {self._batches_seen} training batch(es)")
        if self._pending:
            layers = layers_of(pl_module, self._pending)
            rank_zero_warn(
                f"QuantCallback: {len(layers)} layer(s) no training batch reached in the {self._batches_seen} observer "
                f"batch(es): {layers}. Their observers stay on: the first batch that reaches one calibrates it, then "
                "its qparams are fixed. Layers never reached run in float after ModelQuantizer.freeze and are exported "
                "in float."
            )
        self._log_report(trainer, pl_module, batch if self.log_sqnr else None)

    def _fix_pending(self) -> None:
        """Fix the qparams of the quantizers a batch has reached (on any rank) since the warm-up ended, with the
        statistics reduced across ranks; the same list on every rank, so the collectives line up."""
        reached = flags_across_ranks([is_ready(q) for q in self._pending], "any", device_of(self._pending))
        done = [q for q, r in zip(self._pending, reached, strict=True) if r]
        if not done:
            return
        sync_quantizers(done)  # ranks that saw no data for them take the others' statistics and qparams
        for q in done:
            q.disable_observer()
        self._pending = [q for q, r in zip(self._pending, reached, strict=True) if not r]
        rank_zero_info(
            f"QuantCallback: observers fixed after batch {self._batches_seen} for {sorted({q.where for q in done})}"
        )

    def _model_calibrated(self, pl_module: LightningModule) -> bool:
        quantizers = [q for _, q in iter_quantizers(pl_module)]
        return (
            bool(quantizers)
            and all(is_ready(q) for q in quantizers)
            and all(bool(q.fake_quant_enabled) for q in quantizers)
        )

    def _needs_calibration(self, pl_module: LightningModule) -> bool:
        """PTQ before evaluation: not when this callback calibrated (or restored the calibration of) this very module
        (a quantizer that no forward reaches stays without qparams: calibrating again would not change that), nor
        when every quantizer has its qparams and is on (a model calibrated elsewhere)."""
        if self.calibrated and self._calibrated_for is not None and self._calibrated_for() is pl_module:
            return False
        return not self._model_calibrated(pl_module)

    def calibrate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Calibration epochs: observers see the calibration batches (eval, no_grad), then the qparams are fixed
        (reduced across ranks) and fake quantization is switched on. With ``mixed_precision``, the formats are chosen
        and the layers swapped first."""
        if self._mixed_pending(pl_module):
            self._choose_mixed(trainer, pl_module)
        data = self._calibration_data(trainer, pl_module)
        total = None
        if self.calib_batches is not None:
            total = self.calib_batches * self.calib_epochs
        elif hasattr(data, "__len__"):
            total = len(data) * self.calib_epochs  # type: ignore[arg-type]
        batches: Iterable[Any] = itertools.chain.from_iterable(
            itertools.islice(data, self.calib_batches) for _ in range(self.calib_epochs)
        )
        if self.progress_bar and trainer.is_global_zero and trainer.progress_bar_callback is not None:
            from tqdm.auto import tqdm

            batches = tqdm(batches, total=total, desc="Calibrating", leave=False)
        for _, q in iter_quantizers(pl_module):  # the qparams describe these calibration batches only
            observer = getattr(q, "observer", None)
            if observer is not None and not q.is_dynamic and not is_learnable(q):
                observer.reset_state()
        forward_loop = None
        if self.calib_forward is not None:

            def forward_loop(model: nn.Module, batches: Iterable[Any] = batches) -> None:  # noqa: E306
                for batch in batches:
                    self.calib_forward(model, trainer.strategy.batch_to_device(as_trained(trainer, batch)))  # type: ignore[misc]

            self.quantizer.calibrate(pl_module, forward_loop=forward_loop)
        else:  # in the module's dtype, as its training batches (precision="64-true" / "bf16-true")
            self.quantizer.calibrate(
                pl_module, (as_model_input(pl_module, as_trained(trainer, batch)) for batch in batches)
            )
        sync_observers(pl_module)
        self.calibrated = True
        self._calibrated_for = weakref.ref(pl_module)
        rank_zero_info("QuantCallback: calibration done; qparams fixed")
        self._log_report(trainer, pl_module, self._first_batch(trainer, pl_module))

    def _mixed_pending(self, pl_module: LightningModule) -> bool:
        return self.mixed_precision is not None and not any(isinstance(m, QuantMixin) for m in pl_module.modules())

    def _choose_mixed(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Sensitivity on the float module, allocation under the budget (rank zero's on every rank), then the swap."""
        search = self.mixed_precision
        assert search is not None
        data = self._calibration_data(trainer, pl_module)
        batches = [
            trainer.strategy.batch_to_device(as_trained(trainer, b)) for b in itertools.islice(data, search.batches)
        ]
        if not batches:
            raise ValueError("QuantCallback(mixed_precision=...): the calibration data yielded no batch")
        if self.calib_forward is not None:
            run = self.calib_forward
        else:
            batches = [as_model_input(pl_module, b) for b in batches]
            run = run_batch
        config, choice, sensitivities = choose_mixed(pl_module, self.config, search, batches, run)  # type: ignore[arg-type]
        choice = trainer.strategy.broadcast(choice, src=0)
        config = mixed_precision_config(self.config, choice, search.resolved)
        self.config, self.quantizer, self.mixed_choice = config, ModelQuantizer(config), choice
        plans = self.quantizer.resolve(pl_module)
        self.quantizer.prepare(pl_module)
        keep_out_of_ddp_broadcast(pl_module)
        bits = average_bits(choice, sensitivities)
        rank_zero_info(
            f"QuantCallback: mixed precision at {bits:.3f} weight bits per parameter, scales counted\n{format_plans(plans)}"
        )
        if trainer.is_global_zero:
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            write_sensitivity_csv(folder / "sensitivity.csv", sensitivities, choice)
            write_config_yaml(folder / "mixed_precision.yaml", config, sensitivities, choice)
        self._log(trainer, {"quant/mixed_avg_bits": bits})
