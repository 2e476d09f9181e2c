"""``import_quark_dir`` reads a sharded amd-quark export directory (``stream_quantize``'s shards plus
``model.safetensors.index.json``) as it reads a single ``model.safetensors``.

The reference is the in-memory path run independently: ``from_pretrained`` of the same checkpoint and
``ModelQuantizer(config).quantize_model``. The imported model's weights must equal the in-memory model's
fake-quantized weights (its weight quantizer applied to its float weight), its weight qparams the in-memory
quantizers' own, and its logits the in-memory model's, bit for bit. Broken directories (a shard missing, a tensor the
index places in a shard that lacks it, an index naming files outside the directory, a stale ``model.safetensors``
beside the index) are refused with a ValueError naming the problem, before the model is touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from quark.torch import ModelQuantizer, import_model_from_safetensors
from quark.torch.export.quark_format import import_quark_dir
from quark.torch.export.skeleton import hf_skeleton
from quark.torch.streaming import stream_quantize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant")

VOCAB = 96
INDEX = "model.safetensors.index.json"
#: uint4 asymmetric per group of 16 (packed codes, zero points), GPTQ: codes no plain rounding gives
W4_GPTQ: dict[str, Any] = {
    "global_quant_config": {
        "weight": {
            "dtype": "uint4",
            "qscheme": "per_group",
            "ch_axis": 1,
            "group_size": 16,
            "observer_cls": "PerGroupMinMaxObserver",
            "symmetric": False,
            "scale_type": "float",
            "round_method": "half_even",
            "is_dynamic": False,
        }
    },
    "algo_config": {"name": "gptq"},
}


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def calibration() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=g)} for _ in range(2)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    tiny_llama().save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.fixture(scope="module")
def streamed(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The streamed export, in shards of ~6 kB (several per decoder layer)."""
    out = tmp_path_factory.mktemp("export") / "stream"
    return stream_quantize(checkpoint, W4_GPTQ, calibration(), out, max_shard_bytes=6000, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    """The in-memory quantized model (calibrated, not frozen)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    ModelQuantizer(W4_GPTQ).quantize_model(model, calibration())
    return model


def weight_quantized(model: Any) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "_weight_quantizer", None) is not None}


def shards(path: Path) -> list[str]:
    return sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))


def test_the_export_is_sharded(streamed: Path) -> None:
    assert len(shards(streamed)) >= 4 and not (streamed / "model.safetensors").exists()


def test_a_sharded_export_imports_bit_for_bit(streamed: Path, reference: Any) -> None:
    imported = import_quark_dir(hf_skeleton(streamed, attn_implementation="sdpa"), streamed)
    ours, theirs = weight_quantized(imported), weight_quantized(reference)
    assert sorted(ours) == sorted(theirs) and len(ours) == 3 * 7 + 1  # every projection and the lm_head
    with torch.no_grad():
        for name, m in theirs.items():
            wq, got = m._weight_quantizer, ours[name]._weight_quantizer
            assert torch.equal(ours[name].weight, wq(m.weight)), name
            assert torch.equal(got.scale, wq.scale) and torch.equal(
                got.zero_point.to(wq.zero_point.dtype), wq.zero_point
            ), name
        ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
        assert torch.equal(imported(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_the_front_end_builds_and_imports_a_sharded_export(streamed: Path, reference: Any) -> None:
    imported = import_model_from_safetensors(None, streamed, attn_implementation="sdpa")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(imported(input_ids=ids).logits, reference(input_ids=ids).logits)


# ----------------------------------------------------------------------------------------------- broken directories
def broken(streamed: Path, tmp_path: Path) -> Path:
    path = tmp_path / "broken"
    shutil.copytree(streamed, path)
    return path


def edit_index(path: Path, edit: Any) -> None:
    index = json.loads((path / INDEX).read_text())
    edit(index["weight_map"])
    (path / INDEX).write_text(json.dumps(index))


def assert_refused(path: Path, match: str) -> None:
    model = hf_skeleton(path, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=match):
        import_quark_dir(model, path)
    assert all(p.device.type == "meta" for p in model.parameters())  # refused before the model was touched


def test_a_missing_shard_is_named(streamed: Path, tmp_path: Path) -> None:
    path = broken(streamed, tmp_path)
    gone = shards(path)[1]
    (path / gone).unlink()
    assert_refused(path, rf"names shard file\(s\) missing .*{gone}")


def test_a_tensor_the_index_places_in_a_shard_without_it_is_named(streamed: Path, tmp_path: Path) -> None:
    path = broken(streamed, tmp_path)
    first, second = shards(path)[:2]
    key = next(k for k, f in json.loads((path / INDEX).read_text())["weight_map"].items() if f == second)
    edit_index(path, lambda m: m.update({key: first}))
    assert_refused(path, rf"places tensor\(s\) \['{key}'\] in {first}, which does not hold them")


def test_a_tensor_named_only_in_the_index_is_named(streamed: Path, tmp_path: Path) -> None:
    path = broken(streamed, tmp_path)
    edit_index(path, lambda m: m.update({"model.layers.0.extra.weight": shards(path)[0]}))
    assert_refused(path, r"places tensor\(s\) \['model.layers.0.extra.weight'\]")


def test_a_shard_holding_tensors_the_index_does_not_place_there_is_refused(streamed: Path, tmp_path: Path) -> None:
    path = broken(streamed, tmp_path)
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    held: dict[str, list[str]] = {}
    for k, f in weight_map.items():
        held.setdefault(f, []).append(k)
    shard, keys = next((f, ks) for f, ks in sorted(held.items()) if len(ks) > 1)  # stays in the index without one
    edit_index(path, lambda m: m.pop(keys[-1]))
    assert_refused(path, rf"{shard} holds tensor\(s\) \['{keys[-1]}'\] that .* does not place there")


@pytest.mark.parametrize("outside", ["../model-00001-of-00009.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_an_index_naming_files_outside_the_directory_is_refused(streamed: Path, tmp_path: Path, outside: str) -> None:
    path = broken(streamed, tmp_path)
    shutil.copy(path / shards(path)[0], tmp_path / shards(path)[0])  # the file exists outside: still refused
    edit_index(path, lambda m: m.update({next(iter(m)): outside}))
    assert_refused(path, rf"names files outside the directory .*{outside}")


def test_a_stale_single_file_beside_the_index_is_refused(streamed: Path, tmp_path: Path) -> None:
    path = broken(streamed, tmp_path)
    shutil.copy(path / shards(path)[0], path / "model.safetensors")  # one shard's tensors only
    assert_refused(path, r"holds both model.safetensors and model.safetensors.index.json with different tensors")


def test_a_single_file_beside_the_index_with_other_values_is_refused(streamed: Path, tmp_path: Path) -> None:
    path = broken(streamed, tmp_path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards(path):
        tensors.update(safetensors.torch.load_file(str(path / shard)))
    key = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[key] = tensors[key] * 2
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    assert_refused(path, rf"different content: tensor '{key}' differs")


def test_a_single_file_beside_the_index_with_the_same_content_imports(
    streamed: Path, tmp_path: Path, reference: Any
) -> None:
    """The check above is no blanket refusal: the same tensors in both layouts import as the shards alone."""
    path = broken(streamed, tmp_path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards(path):
        tensors.update(safetensors.torch.load_file(str(path / shard)))
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    imported = import_quark_dir(hf_skeleton(path, attn_implementation="sdpa"), path)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(imported(input_ids=ids).logits, reference(input_ids=ids).logits)
