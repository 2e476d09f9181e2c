"""Two gloo ranks with different calibration batches train the rotations to the same result (gradients averaged)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]
HERE = Path(__file__).parent


def _worker(rank: int, store: str, out: str) -> None:
    sys.path.insert(0, str(HERE))
    from spin_models import char_batches, char_model, quantized

    from quark.torch.quantization.config.config import RotationConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        rotation = RotationConfig(r1=True, r2=True, r4=True, trainable=True, train_steps=4, train_lr=1.5)
        model = quantized(char_model(), char_batches(2, seed=rank), rotation)
        weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        gathered = [torch.zeros_like(weight) for _ in range(2)]
        dist.all_gather(gathered, weight)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


def test_ranks_end_with_the_same_rotation(tmp_path):
    out = tmp_path / "weights.pt"
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    first, second = torch.load(out)
    assert torch.equal(first, second)
