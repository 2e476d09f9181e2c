"""The streamed export's writer: tensors go to disk as they are added, ``finish`` groups them into shards of at most
``max_shard_bytes`` (a larger tensor alone), in the order added, with Hugging Face's names and index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quark.torch.streaming.writer import ShardedExport

st = pytest.importorskip("safetensors")


def _layers() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    small = lambda n: torch.randn(n, generator=g)  # noqa: E731
    return [
        {"a.w": small(100), "a.b": torch.arange(10, dtype=torch.int32)},  # 440 bytes
        {"b.w": small(300)},  # 1200 bytes: more than a shard
        {"c.w": small(50), "c.s": torch.ones(3, dtype=torch.bfloat16)},  # 206 bytes
        {"d.w": small(60)},  # 240 bytes
    ]


def test_shards_hold_at_most_the_limit_in_the_order_added(tmp_path: Path) -> None:
    export = ShardedExport(tmp_path / "out", max_shard_bytes=500)
    added = _layers()
    for tensors in added:
        export.add(tensors)
    assert len(list(export.tmp.glob("part-*.safetensors"))) == len(added)  # on disk already, not in memory
    out = export.finish({"quantization_config": {}})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted({*weight_map.values()})
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [weight_map[k] for k in ("a.w", "a.b", "b.w", "c.w", "c.s", "d.w")] == [files[0]] * 2 + [files[1]] + [
        files[2]
    ] * 3
    assert index["metadata"]["total_size"] == 440 + 1200 + 206 + 240
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "model.safetensors.index.json", "config.json"])
    for tensors in added:
        for key, value in tensors.items():
            with st.safe_open(str(out / weight_map[key]), framework="pt") as f:
                got = f.get_tensor(key)
            assert got.dtype == value.dtype and torch.equal(got, value), key


def test_one_shard_is_model_safetensors_and_a_key_twice_is_refused(tmp_path: Path) -> None:
    export = ShardedExport(tmp_path / "out")
    export.add({"x": torch.ones(4)})
    with pytest.raises(ValueError, match="written twice"):
        export.add({"x": torch.zeros(4)})
    out = export.finish({})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    export = ShardedExport(tmp_path / "out", max_shard_bytes=64)
    export.add({"x": torch.ones(40)})
    export.abort()
    assert list(tmp_path.iterdir()) == []
