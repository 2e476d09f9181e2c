"""QuantCallback(distill=...) on two CPU ranks (gloo): DDP with the copy and the self teacher leaves identical
parameters on both ranks with finite logged losses; FSDP2 (ModelParallelStrategy) runs the self teacher the same
way and refuses the copy teacher in setup. The runs happen in ``distill_script.py`` (Lightning relaunches it for
rank 1); each rank trains on its own data."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distill_script import MODES

SCRIPT = Path(__file__).with_name("distill_script.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,  # two processes
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("distill")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SCRIPT.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"distillation runs failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return {m: [torch.load(out / f"{m}_rank{r}.pt", weights_only=False) for r in (0, 1)] for m in MODES}


@pytest.mark.parametrize("mode", ["ddp_copy", "ddp_self", "fsdp_self"])
def test_ranks_end_identical_with_finite_distillation_loss(ranks, mode) -> None:
    a, b = ranks[mode]
    assert a["world_size"] == b["world_size"] == 2
    different = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    assert not different, f"ranks differ in {different}"
    for r in (a, b):
        m = r["metrics"]
        assert math.isfinite(m["distill_loss"]) and m["distill_loss"] >= 0
        assert m["total_loss"] == pytest.approx(0.5 * m["task_loss"] + 0.5 * m["distill_loss"], rel=1e-5)
    assert a["metrics"]["task_loss"] != b["metrics"]["task_loss"]  # each rank saw its own data


def test_copy_teacher_distils_under_ddp(ranks) -> None:
    assert all(r["metrics"]["distill_loss"] > 1e-3 for r in ranks["ddp_copy"])  # the student moved off its teacher


def test_fsdp2_copy_teacher_is_refused(ranks) -> None:
    for r in ranks["fsdp_copy"]:
        assert "teacher='copy') under FSDP2" in r["error"] and "teacher='self'" in r["error"]
        assert "params" not in r
