"""``QuantCallback(quantizer_lr=...)``: learned quantizer parameters in a group of their own, following the schedule
of the group they came from, through resume."""

from __future__ import annotations

import pytest
import torch
from cb_helpers import BoringMLP, DataModule, make_trainer, seed, tqt_config, tqt_params
from torch import nn

from callbacks import QuantCallback
from callbacks.quantizer_lr import follow_schedule, split_quantizer_groups


def _net_and_thresholds() -> tuple[nn.Module, list[nn.Parameter]]:
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    thresholds = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(3))]
    for i, t in enumerate(thresholds):
        net.register_parameter(f"t{i}", t)
    return net, thresholds


def _adamw(net: nn.Module) -> torch.optim.AdamW:
    """The usual two groups: decay on matrices, none on vectors (thresholds fall in both)."""
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 or n == "t0"]
    rest = [p for n, p in net.named_parameters() if p.ndim < 2 and n != "t0"]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.8, 0.9)
    )


def test_split_moves_the_parameters_into_one_group_without_decay_and_follows_the_schedule() -> None:
    net, thresholds = _net_and_thresholds()
    opt = _adamw(net)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))  # built before the split
    splits = split_quantizer_groups([opt], thresholds, lr=0.02, schedulers=[sched])
    assert len(opt.param_groups) == 3 and len(splits) == 1 and len(sched.base_lrs) == 3  # torch zips them strictly
    group = opt.param_groups[2]
    assert [id(p) for p in group["params"]] == [id(t) for t in thresholds]
    assert group["lr"] == 0.02 and group["weight_decay"] == 0.0 and group["betas"] == (0.8, 0.9)
    kept = {id(p) for g in opt.param_groups[:2] for p in g["params"]}
    assert not kept & {id(t) for t in thresholds} and len(kept) == len(list(net.parameters())) - 2
    for step in range(3):
        follow_schedule(splits, 0.02)
        assert opt.param_groups[2]["lr"] == pytest.approx(0.02 / (1 + step))
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / (1 + step))
        net(torch.randn(2, 4)).sum().backward()
        (thresholds[0].sum() + thresholds[1].sum()).backward()
        opt.step()
        sched.step()
    assert all(not torch.all(t == 0) for t in thresholds)


def test_without_a_scheduler_the_rate_is_relative_to_the_first_batch_and_survives_a_state_reload() -> None:
    """The callback stores ``source_lr0`` in its state and hands it to the new split on resume (as done here)."""
    net, thresholds = _net_and_thresholds()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    splits = split_quantizer_groups([opt], thresholds, lr=0.5)
    opt.param_groups[0]["lr"] *= 0.25  # a callback rescaling rates when training starts
    follow_schedule(splits, 0.5)
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["momentum"] == 0.9
    net(torch.randn(2, 4)).sum().backward()
    thresholds[1].sum().backward()
    opt.step()
    state = opt.state_dict()

    net2, thresholds2 = _net_and_thresholds()  # resume: the same split, then the saved state
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    splits2 = split_quantizer_groups([opt2], thresholds2, lr=0.5)
    splits2[0].source_lr0 = splits[0].source_lr0
    opt2.load_state_dict(state)  # replaces the group dicts: splits are looked up by index
    opt2.param_groups[0]["lr"] = 0.0125  # the schedule halved it since
    follow_schedule(splits2, 0.5)
    assert opt2.param_groups[1]["lr"] == pytest.approx(0.5 * 0.0125 / 0.025)
    assert torch.equal(opt2.state[thresholds2[1]]["momentum_buffer"], opt.state[thresholds[1]]["momentum_buffer"])


def test_quant_callback_trains_thresholds_at_quantizer_lr(tmp_path) -> None:  # noqa: ANN001
    seed(0)
    model = BoringMLP(lr=0.05, weight_decay=0.01)
    trainer = make_trainer(tmp_path, [QuantCallback(tqt_config(), mode="qat", observer_steps=2, quantizer_lr=0.3)])
    trainer.fit(model, datamodule=DataModule())
    thresholds = tqt_params(model)
    groups = model.optimizer.param_groups
    assert len(groups) == 2 and [id(p) for p in groups[1]["params"]] == [id(t) for t in thresholds]
    assert groups[1]["lr"] == 0.3 and groups[1]["weight_decay"] == 0.0 and groups[0]["weight_decay"] == 0.01
    assert {id(model.fc1.weight), id(model.fc2.weight)} <= {id(p) for p in groups[0]["params"]}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantizer_lr": 0.0}, r"quantizer_lr=0.0.*finite float > 0"),
        ({"quantizer_lr": float("nan")}, r"quantizer_lr=nan.*finite float > 0"),
        ({"quantizer_lr": True}, r"quantizer_lr=True"),
        ({"quantizer_lr": 0.01, "mode": "ptq"}, r"quantizer_lr.*needs mode='qat'"),
    ],
)
def test_bad_quantizer_lr_is_refused_by_name(kwargs, match) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        QuantCallback(tqt_config(), **{"mode": "qat", **kwargs})


def test_sequential_schedulers_get_the_new_group_too() -> None:
    net, thresholds = _net_and_thresholds()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
    splits = split_quantizer_groups([opt], thresholds, lr=1.0, schedulers=[sched])
    seen = []
    for _ in range(5):
        follow_schedule(splits, 1.0)
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
        opt.step()
        sched.step()
    for base, quant in seen:  # the quantizer group runs the same schedule at its own rate
        assert quant == pytest.approx(base / 0.1 * 1.0)
    assert seen[0][0] == pytest.approx(0.05) and seen[2][0] == pytest.approx(0.1)


@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*")
def test_resume_with_quantizer_lr_continues_exactly(tmp_path) -> None:  # noqa: ANN001
    """A run interrupted after a checkpoint and resumed equals the uninterrupted run, quantizer group included."""
    import glob

    from lightning.pytorch.callbacks import ModelCheckpoint

    def callbacks() -> list:
        return [QuantCallback(tqt_config(), mode="qat", observer_steps=2, quantizer_lr=0.3)]

    common = dict(max_steps=8, max_epochs=-1, limit_train_batches=4, limit_val_batches=1)
    seed(0)
    model_a = BoringMLP(lr=0.2)
    make_trainer(tmp_path / "a", callbacks(), **common).fit(model_a, datamodule=DataModule(n=32))
    seed(0)
    model_b = BoringMLP(lr=0.2)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path / "b", [*callbacks(), ckpt], **{**common, "max_steps": 4}).fit(
        model_b, datamodule=DataModule(n=32)
    )
    path = glob.glob(str(tmp_path / "ckpt" / "*step=4.ckpt"))
    seed(123)
    model_c = BoringMLP(lr=0.2)
    make_trainer(tmp_path / "c", callbacks(), **common).fit(model_c, datamodule=DataModule(n=32), ckpt_path=path[0])
    a, c = model_a.state_dict(), model_c.state_dict()
    assert [k for k in a if not torch.equal(a[k], c[k])] == []
    assert model_c.optimizer.param_groups[1]["lr"] == 0.3
