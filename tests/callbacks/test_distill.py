"""QuantCallback(distill=...): the losses against hand computations, the combined loss Lightning backpropagates,
the two teachers (same first step), exact resume, hidden-state MSE and the refusals before any step."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from callbacks.distill import Distillation, distill_loss, position_mask
from callbacks.quant import QuantCallback
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.char_lm import CharLM
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")

VOCAB, SEQ = 32, 16


def config() -> Config:
    """int8 per-tensor weights and activations (min-max observers)."""
    return Config.from_dict(
        {"global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT}}
    )


class ConstantLR(CharLM):
    """AdamW at a constant rate (CharLM's cosine follows max_epochs, which a resumed test run changes)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def model(seed: int = 0) -> CharLM:
    torch.manual_seed(seed)
    return ConstantLR(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=SEQ)


def loader(n: int = 8, batch: int = 4) -> DataLoader:
    """Token windows, some targets -100 (ignored by the task loss and, with mask='auto', by distillation)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y[:, :3] = -100
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def trainer(callbacks: list, tmp: Path | None = None, **kwargs) -> Trainer:
    args = {
        "logger": False,
        "enable_checkpointing": tmp is not None,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "accelerator": "cpu",
        "default_root_dir": str(tmp) if tmp else None,
        "deterministic": True,
    }
    args.update(kwargs)
    return Trainer(callbacks=callbacks, **args)


# ----------------------------------------------------------------------------------------------- losses by hand
def hand_kl(s: torch.Tensor, t: torch.Tensor, temp: float, keep: torch.Tensor) -> torch.Tensor:
    """sum_v p_t (log p_t - log p_s) per position, in float64 by explicit softmax, mean over kept, times T^2."""
    s, t = s.double() / temp, t.double() / temp
    ps, pt = s.exp() / s.exp().sum(-1, keepdim=True), t.exp() / t.exp().sum(-1, keepdim=True)
    per = (pt * (pt.log() - ps.log())).sum(-1)
    return per[keep].mean() * temp**2


def hand_jsd(s: torch.Tensor, t: torch.Tensor, temp: float, keep: torch.Tensor) -> torch.Tensor:
    """0.5 KL(p_t || m) + 0.5 KL(p_s || m) with m the mixture, mean over kept, times T^2."""
    s, t = s.double() / temp, t.double() / temp
    ps, pt = s.exp() / s.exp().sum(-1, keepdim=True), t.exp() / t.exp().sum(-1, keepdim=True)
    m = (ps + pt) / 2
    per = 0.5 * (pt * (pt / m).log()).sum(-1) + 0.5 * (ps * (ps / m).log()).sum(-1)
    return per[keep].mean() * temp**2


@pytest.mark.parametrize("kind,hand", [("kl", hand_kl), ("jsd", hand_jsd)])
@pytest.mark.parametrize("temp", [1.0, 2.5])
def test_losses_match_hand_computation_with_ignored_targets(kind, hand, temp) -> None:
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 11, generator=g) * 3, torch.randn(3, 5, 11, generator=g) * 3
    y = torch.randint(0, 11, (3, 5), generator=g)
    y[0, :2] = -100
    y[2, 4] = -100
    mask = position_mask("auto", (None, y), s)
    assert mask.sum() == 12
    got = distill_loss(s, t, kind, temp, mask)
    torch.testing.assert_close(got.double(), hand(s, t, temp, y != -100), rtol=1e-5, atol=1e-6)
    everything = distill_loss(s, t, kind, temp, None)
    torch.testing.assert_close(everything.double(), hand(s, t, temp, torch.ones_like(mask)), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, everything)  # the ignored positions were really left out
    assert distill_loss(t, t, kind, temp, mask).abs() < 1e-6


def test_auto_masks_of_dict_batches_and_callables() -> None:
    logits = torch.zeros(2, 4, 7)
    labels = torch.tensor([[-100, 1, 2, 3], [5, 6, -100, -100]])
    hf = position_mask("auto", {"input_ids": labels, "labels": labels}, logits)  # logit t predicts label t + 1
    assert hf.tolist() == [[True, True, True, False], [True, False, False, False]]
    attention = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert position_mask("auto", {"attention_mask": attention}, logits).tolist() == attention.bool().tolist()
    assert position_mask(None, {"labels": labels}, logits) is None
    custom = position_mask(lambda b: b["input_ids"] > 2, {"input_ids": labels}, logits)
    assert custom.tolist() == (labels > 2).tolist()
    with pytest.raises(ValueError, match="logits' shape"):
        position_mask(lambda b: torch.ones(3, dtype=torch.bool), {}, logits)


# ----------------------------------------------------------------------------------------------- the training step
class GradProbe(Callback):
    """The gradients Lightning's backward left, step by step."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


class ZeroLR(CharLM):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(
    "distill",
    [
        Distillation(loss="kl", temperature=1.0, weight=0.5),
        Distillation(loss="jsd", temperature=2.0, weight=1.0, hidden_layers=("net.model.layers.0",), hidden_weight=3.0),
    ],
    ids=["kl-w0.5", "jsd-hidden"],
)
def test_backpropagated_loss_is_the_weighted_sum(distill) -> None:
    torch.manual_seed(0)
    lm = ZeroLR(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=SEQ)
    float_lm = copy.deepcopy(lm).eval()
    probe = GradProbe()
    data = loader(n=4)
    trainer([QuantCallback(config(), distill=distill, log_sqnr=False), probe], max_steps=1).fit(lm, data)
    x, y = next(iter(data))
    for q in lm.modules():  # the qparams of the step (statistics of that batch); observing again changes nothing
        if isinstance(q, FakeQuantizeBase):
            q.enable_observer(False)
    lm.train()
    lm.zero_grad()
    hidden: dict[str, torch.Tensor] = {}
    handles = [
        m.get_submodule("net.model.layers.0").register_forward_hook(lambda mod, a, o, k=k: hidden.__setitem__(k, o))
        for k, m in (("student", lm), ("teacher", float_lm))
    ]
    student = lm(x)
    with torch.no_grad():
        teacher = float_lm(x)
    for h in handles:
        h.remove()
    task = F.cross_entropy(student.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / y.numel()
    keep = y != -100
    ls, lt = F.log_softmax(student / distill.temperature, -1), F.log_softmax(teacher / distill.temperature, -1)
    if distill.loss == "kl":
        per = (lt.exp() * (lt - ls)).sum(-1)
    else:
        m = (ls.exp() + lt.exp()) / 2
        per = 0.5 * (lt.exp() * (lt - m.log())).sum(-1) + 0.5 * (ls.exp() * (ls - m.log())).sum(-1)
    kd = per[keep].mean() * distill.temperature**2
    if distill.hidden_layers:
        kd = kd + distill.hidden_weight * (hidden["student"] - hidden["teacher"]).pow(2).mean(-1)[keep].mean()
    ((1 - distill.weight) * task + distill.weight * kd).backward()
    (recorded,) = probe.grads
    assert recorded.keys() == {n for n, p in lm.named_parameters() if p.grad is not None}
    for name, p in lm.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(recorded[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert "training_step" not in lm.__dict__  # the wrapper is gone after fit


def params(lm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lm.state_dict().items()}


def test_self_and_copy_teachers_take_the_same_first_step() -> None:
    after = {}
    for teacher in ("copy", "self"):
        lm = model()
        cb = QuantCallback(config(), distill={"teacher": teacher, "weight": 0.7}, log_sqnr=False)
        trainer([cb], max_steps=1).fit(lm, loader())
        after[teacher] = params(lm)
    plain = model()
    trainer([QuantCallback(config(), log_sqnr=False)], max_steps=1).fit(plain, loader())
    for k, v in after["copy"].items():
        assert torch.equal(v, after["self"][k]), k
    assert any(not torch.equal(v, params(plain)[k]) for k, v in after["copy"].items())  # distillation did something


@pytest.mark.parametrize("teacher", ["copy", "self"])
def test_resume_is_bit_exact(teacher, tmp_path) -> None:
    """Four steps straight == two, then resume from the checkpoint for two more (two batches an epoch)."""
    straight = model()
    distill = {"teacher": teacher, "loss": "jsd", "weight": 0.8}
    trainer([QuantCallback(config(), distill=distill, log_sqnr=False)], max_epochs=2).fit(straight, loader())
    half = model()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    cb = QuantCallback(config(), distill=distill, log_sqnr=False)
    trainer([cb, ckpt], tmp_path, max_epochs=1).fit(half, loader())
    assert ("distill_teacher" in cb.state_dict()) == (teacher == "copy")
    resumed = model(seed=5)  # other weights: all of it must come from the checkpoint
    cb = QuantCallback(config(), distill=distill, log_sqnr=False)
    trainer([cb, ModelCheckpoint(dirpath=tmp_path / "r")], tmp_path, max_epochs=2).fit(
        resumed, loader(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    for k, v in params(straight).items():
        assert torch.equal(v, params(resumed)[k]), k


def test_copy_teacher_is_frozen_and_restored_from_the_checkpoint(tmp_path) -> None:
    lm = model()
    start = params(lm)
    cb = QuantCallback(config(), distill={"teacher": "copy"}, log_sqnr=False)
    trainer([cb, ModelCheckpoint(dirpath=tmp_path, save_last=True)], tmp_path, max_epochs=1).fit(lm, loader())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("QuantCallback"))["distill_teacher"]
    assert torch.equal(state["net.lm_head.weight"], start["net.lm_head.weight"])
    assert not torch.equal(params(lm)["net.lm_head.weight"], start["net.lm_head.weight"])


# ----------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss": "mse"}, "Distillation.loss='mse'.*allowed"),
        ({"teacher": "ema"}, "Distillation.teacher='ema'"),
        ({"temperature": 0}, "Distillation.temperature=0"),
        ({"weight": 1.5}, "Distillation.weight=1.5 must be a number in \\[0.0, 1.0\\]"),
        ({"hidden_weight": -1}, "Distillation.hidden_weight"),
        ({"mask": "labels"}, "Distillation.mask='labels'"),
        ({"hidden_layers": "net.lm_head"}, "Distillation.hidden_layers"),
        ({"alpha": 0.5}, "unknown field.*alpha"),
    ],
)
def test_bad_fields_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        QuantCallback(config(), distill=kwargs)


def test_ptq_with_distill_is_refused() -> None:
    with pytest.raises(ValueError, match="mode='qat'"):
        QuantCallback(config(), mode="ptq", distill=Distillation())


class StepCounter(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


class Manual(CharLM):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False


@pytest.mark.parametrize(
    "lm,distill,match",
    [
        (None, {"hidden_layers": ["net.model.layers.7"]}, "net.model.layers.7.*not in ConstantLR"),
        ("manual", {}, "automatic_optimization=False"),
    ],
)
def test_setup_refusals_come_before_any_step(lm, distill, match) -> None:
    module = Manual(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=192, max_seq_len=SEQ) if lm else model()
    counter = StepCounter()
    with pytest.raises(ValueError, match=match):
        trainer([QuantCallback(config(), distill=distill, log_sqnr=False), counter], max_steps=2).fit(module, loader())
    assert counter.steps == 0


def test_logged_losses(tmp_path) -> None:
    lm = model()
    t = trainer([QuantCallback(config(), distill={"weight": 0.25}, log_sqnr=False)], max_steps=2)
    t.fit(lm, loader())
    m = t.callback_metrics
    assert {"distill_loss", "task_loss", "total_loss"} <= m.keys()
    expected = 0.75 * float(m["task_loss"]) + 0.25 * float(m["distill_loss"])
    assert math.isclose(float(m["total_loss"]), expected, rel_tol=1e-5)
    assert float(m["distill_loss"]) > 0
