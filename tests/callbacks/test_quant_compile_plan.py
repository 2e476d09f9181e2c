"""``QuantCallback`` tells auto compile mode how long its QAT fit is (``formats.plan_step_start`` / ``plan_step_end``
/ ``plan_run_end``): a fit with too few elements left to pay a compile back runs its format kernels eagerly, a long
enough one compiles them after its first step, and a fit that ends or raises leaves no plan behind."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import QuantCallback
from quark.torch.quantization.formats import Backend, set_compile
from quark.torch.quantization.formats.grouping import compile_warm
from quark.torch.quantization.formats.kernel_store import store_root
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT
from tests.callbacks.cb_helpers import CrashAt

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
WIDTH, BATCH = 256, 128  # inputs of 2^15 and weights of 2^16 elements: past every kernel's auto-mode threshold


class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class TwoOptimizers(Wide):
    """Manual optimization with one optimizer per Linear: each step of each counts in ``global_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opts = self.optimizers()
        for opt in opts:  # type: ignore[union-attr]
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:  # type: ignore[union-attr]
            opt.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        return [torch.optim.SGD(self.net[0].parameters(), lr=1e-2), torch.optim.SGD(self.net[2].parameters(), lr=1e-2)]


class Stream(torch.utils.data.IterableDataset):
    """Batches of a stream: no length, so Lightning cannot tell how many steps an epoch has."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.batches):
            yield torch.randn(BATCH, WIDTH), torch.randint(0, 4, (BATCH,))


class WarmAtBatchEnd(Callback):
    """Records, after every training batch, whether auto mode's warm-up is over, what the batch counted and what the
    run plan expects to come (placed after ``QuantCallback``: its hooks have run)."""

    def __init__(self) -> None:
        self.warm: list[bool] = []
        self.counted: list[int] = []
        self.remaining: list[int | None] = []
        self._start = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._start = Backend.seen_numel

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.warm.append(compile_warm())
        self.counted.append(Backend.seen_numel - self._start)
        self.remaining.append(Backend.remaining_numel)


@pytest.fixture
def auto_mode(backend_state: type, compiles: list[str]) -> None:
    """Auto mode, every field restored afterwards (``backend_state``), ``torch.compile`` replaced by the eager body
    (``compiles``: nothing is really compiled); the warm-up's count alone is over at the first call."""
    set_compile(None)
    Backend.warmup_numel, Backend.seen_numel, Backend.warm, Backend.loading, Backend.unstored = (
        1,
        0,
        False,
        False,
        False,
    )


def _fit(
    steps: int, *extra: Callback, module: LightningModule | None = None, data: Any = None, **trainer_args: Any
) -> WarmAtBatchEnd:
    torch.manual_seed(0)
    if data is None:
        data = TensorDataset(torch.randn(BATCH * steps, WIDTH), torch.randint(0, 4, (BATCH * steps,)))
    probe = WarmAtBatchEnd()
    trainer = Trainer(
        **{"max_steps": steps, **trainer_args},
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[QuantCallback(W8A8, mode="qat", observer_steps=2, save_quantized=False), probe, *extra],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = DataLoader(data, batch_size=None if isinstance(data, Stream) else BATCH)
        trainer.fit(module or Wide(), loader)
    return probe


def test_a_qat_fit_too_short_to_pay_back_runs_eagerly(auto_mode: None, served: list[str]) -> None:
    Backend.payback_numel = 1 << 50
    probe = _fit(4)
    assert probe.warm == [False] * 4 and served == []
    assert Backend.remaining_numel is None and Backend.seen_numel == 0  # the fit's count is dropped at its end


def test_a_long_enough_qat_fit_compiles_after_its_first_step(auto_mode: None, served: list[str]) -> None:
    Backend.payback_numel = 1
    probe = _fit(4)
    assert probe.warm == [True] * 4  # measured at the end of the first step: enough to go
    assert served and "int_forward" in served
    assert Backend.remaining_numel is None and compile_warm()


@pytest.mark.parametrize("store", ["empty", "other kernels"])
def test_a_qat_fit_long_enough_to_load_finds_nothing_stored_and_runs_eagerly(
    auto_mode: None, served: list[str], compiles: list[str], tmp_path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """A fit whose elements to go pay back loading stored kernels (``stored_payback_numel``) but not a compile: with
    an empty store it never tries; with one that holds other kernels it tries after its first step, its first kernel
    call finds none, and it runs eagerly from there (the compiled paths' kernels run eagerly would be slower). Nothing
    is compiled, and the plan goes on measuring its eager steps."""
    monkeypatch.setenv("QUARK_KERNEL_CACHE", str(tmp_path))
    if store == "other kernels":
        (store_root() / "another-kernel").mkdir(parents=True)  # type: ignore[operator]
    Backend.stored_payback_numel, Backend.payback_numel = 1, 1 << 50
    probe = _fit(4)
    assert Backend.unstored and not Backend.loading and not Backend.warm and compiles == []
    if store == "empty":
        assert probe.warm == [False] * 4 and served == []
        assert probe.remaining == [c * left for c, left in zip(probe.counted, (3, 2, 1, 0), strict=True)]
    else:
        assert probe.warm == [True, False, False, False] and len(served) == 1  # the call that found nothing stored
        assert probe.remaining[1] is None  # the step that switched back measured nothing
        assert probe.remaining[2:] == [c * left for c, left in zip(probe.counted[2:], (1, 0), strict=True)]


def test_a_fit_that_raises_leaves_no_plan(auto_mode: None, served: list[str]) -> None:
    Backend.payback_numel = 1 << 50
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(4, CrashAt(2))
    assert served == [] and Backend.remaining_numel is None and Backend.step_mark is None
    assert Backend.seen_numel == 0


@pytest.mark.parametrize(("steps", "accumulate"), [(4, 1), (2, 2)])
def test_the_plan_counts_the_batches_left(auto_mode: None, served: list[str], steps: int, accumulate: int) -> None:
    """After each of the fit's 4 batches the plan expects that batch's count times the batches left: 3, 2, 1, 0,
    with gradient accumulation too (the optimizer steps every second batch)."""
    Backend.payback_numel = 1 << 50
    probe = _fit(steps, accumulate_grad_batches=accumulate)
    assert len(probe.counted) == 4 and all(probe.counted)
    assert probe.remaining == [c * left for c, left in zip(probe.counted, (3, 2, 1, 0), strict=True)]
    assert served == []


@pytest.mark.parametrize("case", ["stream", "two optimizers"])
def test_a_fit_of_unknown_length_compiles_once_it_has_counted_the_payback(
    auto_mode: None, served: list[str], case: str
) -> None:
    """A loader without a length (``max_steps=-1``: Lightning's estimate is -1) or manual optimization with two
    optimizers (``global_step`` counts each one's steps, not batches): the batches left are not known, so the plan
    is dropped after each step and the run compiles once it has counted ``payback_numel`` (rent or buy), as a loop
    that tells nothing does: never in a fit that counts less, from the step that reaches it in one that counts more."""

    def fit() -> WarmAtBatchEnd:
        if case == "stream":
            return _fit(-1, data=Stream(4), max_epochs=1)
        data = TensorDataset(torch.randn(BATCH * 4, WIDTH), torch.randint(0, 4, (BATCH * 4,)))
        return _fit(8, module=TwoOptimizers(), data=data)  # two optimizer steps a batch: 8 steps are 4 batches

    Backend.payback_numel = 1 << 50
    short = fit()
    assert short.warm == [False] * 4 and short.remaining == [None] * 4 and all(short.counted)
    assert served == []
    Backend.seen_numel = 0  # a new process
    Backend.payback_numel = sum(short.counted[:2]) + 1  # reached by the third batch
    probe = fit()
    assert probe.counted[:2] == short.counted[:2]
    assert probe.warm == [False, False, True, True] and probe.remaining == [None] * 4
    assert served
