"""QuantCallback under DDP (two CPU ranks, gloo): identical qparams on every rank, reduced over every rank's data.

The runs happen in a subprocess (``ddp_script.py``: Lightning relaunches the script for rank 1); each rank sees
different data, and writes its quantization state for these tests to compare.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cb_helpers import BoringMLP, loader, qstate
from ddp_script import MODES, PTQ_CONFIG, rank_data

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config

SCRIPT = Path(__file__).with_name("ddp_script.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,  # two processes per test
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ddp")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # each rank one thread, as _calibrate_on below: the same float sums, bit for bit
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "all", str(out)],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"DDP run failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    results = {}
    for mode in MODES:
        results[mode] = [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert [r["world_size"] for r in results[mode]] == [2, 2]
    return results


def _assert_ranks_identical(pair: list[dict], key: str = "qstate") -> None:
    a, b = pair[0][key], pair[1][key]
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"ranks differ in {different}"


def _x(rank: int, batches: int | None = None) -> torch.Tensor:
    x = rank_data(rank).tensors[0]
    return x if batches is None else x[: 8 * batches]


def test_ranks_really_saw_different_data() -> None:
    assert float(_x(0).max()) != float(_x(1).max()) and float(_x(0).min()) != float(_x(1).min())


def test_ptq_calibration_gives_every_rank_the_same_qparams(ranks) -> None:
    _assert_ranks_identical(ranks["ptq"])
    _assert_ranks_identical(ranks["ptq"], "weights")  # DDP kept the float training in sync
    state = ranks["ptq"][0]["qstate"]
    assert all(bool(v) for k, v in state.items() if k.endswith(".initialized"))


def _calibrate_on(weights: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One-process calibration on ``x``, in batches of the ranks' size and on one thread as each rank ran: fc2's
    inputs are float sums (fc1's outputs), equal bit for bit only when summed by the same kernel in the same order."""
    model = BoringMLP()
    model.load_state_dict(weights, strict=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ModelQuantizer(Config.from_dict(PTQ_CONFIG)).quantize_model(model, loader(torch.utils.data.TensorDataset(x)))
    finally:
        torch.set_num_threads(threads)
    return qstate(model)


def test_two_rank_ptq_calibration_equals_one_rank_calibration_on_the_union(ranks) -> None:
    ddp = ranks["ptq"][0]
    union = _calibrate_on(ddp["weights"], torch.cat([_x(0), _x(1)]))
    only_rank0 = _calibrate_on(ddp["weights"], _x(0))
    compared = [k for k in union if "observer" in k or k.endswith(("<scale>", "<zero_point>"))]
    assert "fc1.input_tensors.observer.max_val" in compared and "fc2.input_tensors.<scale>" in compared
    different = [k for k in compared if not torch.equal(union[k], ddp["qstate"][k])]
    assert not different, different
    # the reduction mattered: rank 0's data alone gives other activation qparams
    assert not torch.equal(only_rank0["fc1.input_tensors.<scale>"], ddp["qstate"]["fc1.input_tensors.<scale>"])
    assert not torch.equal(only_rank0["fc2.input_tensors.<scale>"], ddp["qstate"]["fc2.input_tensors.<scale>"])


def test_qat_observers_are_reduced_when_fixed(ranks) -> None:
    pair = ranks["qat"]
    _assert_ranks_identical(pair)
    _assert_ranks_identical(pair, "at_fix")  # identical from the step the qparams were fixed on
    _assert_ranks_identical(pair, "weights")
    # fc1's input range: both ranks' first two (observer_steps) batches, not one rank's
    state = pair[0]["at_fix"]
    union = torch.cat([_x(0, 2), _x(1, 2)])
    assert float(state["fc1.input_tensors.observer.min_val"]) == float(union.min())
    assert float(state["fc1.input_tensors.observer.max_val"]) == float(union.max())
    assert float(_x(0, 2).max()) != float(union.max()) and float(_x(1, 2).min()) != float(union.min())
    assert not any(
        bool(v) for k, v in state.items() if k.startswith("fc1.input_tensors") and k.endswith("observer_enabled")
    )
    assert torch.equal(pair[0]["qstate"]["fc1.input_tensors.<scale>"], state["fc1.input_tensors.<scale>"])  # then fixed


def test_tqt_thresholds_stay_in_sync_across_ranks(ranks) -> None:
    pair = ranks["qat"]
    before = [r["threshold_before_sync"] for r in pair]
    after = [r["threshold_after_sync"] for r in pair]
    assert not torch.equal(before[0], before[1])  # each rank initialised fc2's input threshold from its own batch
    assert torch.equal(after[0], after[1])
    assert torch.allclose(after[0], (before[0] + before[1]) / 2, rtol=0, atol=1e-6)
    final = [r["qstate"]["fc2.input_tensors.log_threshold"] for r in pair]
    assert torch.equal(final[0], final[1]) and not torch.equal(final[0], after[0])  # learned, and still in sync


def test_qat_that_ends_before_observer_steps_fixes_reduced_qparams(ranks) -> None:
    pair = ranks["qat_short"]
    _assert_ranks_identical(pair)
    state = pair[0]["qstate"]
    union = torch.cat([_x(0, 2), _x(1, 2)])
    assert float(state["fc1.input_tensors.observer.max_val"]) == float(union.max())
    assert float(state["fc1.input_tensors.observer.min_val"]) == float(union.min())


def test_lsq_per_channel_and_tqt_train_under_ddp_with_identical_qparams(ranks) -> None:
    pair = ranks["lsq"]
    _assert_ranks_identical(pair)
    _assert_ranks_identical(pair, "weights")
    state = pair[0]["qstate"]
    assert state["fc1.weight.<scale>"].numel() == 32 and state["fc1.input_tensors.<scale>"].numel() == 16
    assert all(bool(v) for k, v in state.items() if k.endswith(".initialized"))


def test_lsq_per_channel_on_an_axis_the_layer_does_not_fix_is_refused_before_ddp_wraps() -> None:
    from cb_helpers import QuantCallback
    from ddp_script import LSQ_CONFIG
    from lightning.pytorch import Trainer

    weight = LSQ_CONFIG["global_quant_config"]["weight"]
    config = {
        **LSQ_CONFIG,
        "layer_quant_config": {"fc1": {"weight": weight, "input_tensors": {**weight, "ch_axis": 0}}},
    }
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert trainer.world_size == 2
    with pytest.raises(ValueError, match=r"layer 'fc1' \(Linear, input_tensors\).*ch_axis=-1"):
        QuantCallback(Config.from_dict(config), mode="qat").setup(trainer, BoringMLP(), "fit")


def test_moe_experts_routed_differently_per_rank_keep_the_ranks_in_step(ranks) -> None:
    """Expert 1 had data only on rank 0's first warm-up batch (its weight statistics are reset every warm-up batch),
    expert 2 only on rank 1 after the warm-up. Before, the ranks disagreed on which quantizers were still observing,
    so one rank entered a collective the other skipped (a hang under DDP)."""
    pair = ranks["moe"]
    _assert_ranks_identical(pair)
    _assert_ranks_identical(pair, "weights")
    assert pair[0]["pending"] == pair[1]["pending"] == ["layer 'experts.1' (Linear, weight)"]
    state = pair[0]["qstate"]
    assert all(bool(state[f"experts.2.{role}.initialized"]) for role in ("weight", "input_tensors"))
    assert not bool(state["experts.2.input_tensors.observer_enabled"])  # fixed after its first batch
    assert state["experts.2.weight.<scale>"].shape == (32,)  # per channel: rank 0 took rank 1's shape and values
    assert bool(state["experts.1.weight.observer_enabled"]) and not bool(state["experts.1.weight.initialized"])
