"""Streamed PTQ (``quark.torch.streaming.stream_quantize``, issue 36 part 2) against the in-memory path.

The reference is the in-memory path itself, run independently: ``from_pretrained`` of the same checkpoint,
``ModelQuantizer(config).quantize_model`` and ``export_quark_dir``. Every tensor of the two export directories must be
equal bit for bit, and their config.json documents equal. The checkpoint is a tiny random LLaMA saved by
``save_pretrained`` with a shard size that puts shard boundaries inside decoder layers (checked)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from algo_refs import spec_dict

from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir
from quark.torch.streaming import HFCheckpoint, stream_quantize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant")

VOCAB, LAYERS = 96, 4
W4 = spec_dict(4, "per_group", 16, sym=False)
W8 = spec_dict(8, "per_channel")
A8_DYNAMIC = {**spec_dict(8, "per_tensor"), "is_dynamic": True, "observer_cls": "PerTensorMinMaxObserver"}
TQT = {
    **spec_dict(4, "per_tensor"),
    "scale_type": "pof2",
    "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"},
}
CONFIGS: dict[str, dict[str, Any]] = {
    "rtn": {"global_quant_config": {"weight": W4}},
    "gptq": {"global_quant_config": {"weight": W4}, "algo_config": {"name": "gptq"}},
    "awq": {"global_quant_config": {"weight": W4}, "algo_config": {"name": "awq"}},
    "awq_then_gptq": {"global_quant_config": {"weight": W4}, "algo_config": [{"name": "awq"}, {"name": "gptq"}]},
    "smoothquant_w8a8_dynamic": {
        "global_quant_config": {"weight": W8, "input_tensors": A8_DYNAMIC},
        "pre_quant_opt_config": {"name": "smoothquant"},
        "algo_config": {"name": "gptq"},
    },
}


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaMA as a sharded checkpoint (shards of ~20 kB: several per decoder layer)."""
    path = tmp_path_factory.mktemp("ckpt") / "sharded"
    tiny_llama().save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaMA as one model.safetensors."""
    path = tmp_path_factory.mktemp("ckpt") / "single"
    tiny_llama().save_pretrained(path)
    return path


def calibration() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=g)} for _ in range(3)]


def in_memory(checkpoint: Path, config: dict[str, Any], out: Path) -> Path:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ModelQuantizer(config).quantize_model(model, calibration())
    return export_quark_dir(model, out)


def read_dir(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of an export directory (any number of shards) and its config.json."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(str(file)))
    return tensors, json.loads((path / "config.json").read_text())


def assert_same_export(a: Path, b: Path) -> None:
    ta, ca = read_dir(a)
    tb, cb = read_dir(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and ta[key].shape == tb[key].shape, key
        assert torch.equal(ta[key].reshape(-1).view(torch.uint8), tb[key].reshape(-1).view(torch.uint8)), key
    assert ca == cb


def test_the_fixture_has_shard_boundaries_inside_decoder_layers(sharded: Path) -> None:
    files = HFCheckpoint(sharded).files
    per_layer = [{f for k, f in files.items() if k.startswith(f"model.layers.{i}.")} for i in range(LAYERS)]
    assert len(set(files.values())) > LAYERS and any(len(s) > 1 for s in per_layer)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_streamed_equals_in_memory_tensor_for_tensor(sharded: Path, tmp_path: Path, name: str) -> None:
    config = CONFIGS[name]
    reference = in_memory(sharded, config, tmp_path / "memory")
    streamed = stream_quantize(sharded, config, calibration(), tmp_path / "stream", max_shard_bytes=6000)
    assert (streamed / "model.safetensors.index.json").is_file()  # written in several shards
    assert_same_export(reference, streamed)


def test_the_algorithms_change_the_result(sharded: Path, tmp_path: Path) -> None:
    """The equality above would hold trivially if no algorithm ran: GPTQ's and AWQ's codes differ from RTN's."""
    out = {n: read_dir(stream_quantize(sharded, CONFIGS[n], calibration(), tmp_path / n))[0] for n in CONFIGS}
    key = "model.layers.3.mlp.down_proj.weight"
    assert not torch.equal(out["rtn"][key], out["gptq"][key])
    assert not torch.equal(out["rtn"][key], out["awq"][key])
    assert not torch.equal(out["awq"][key], out["awq_then_gptq"][key])
    assert not torch.equal(out["rtn"]["lm_head.weight"], out["gptq"]["lm_head.weight"])  # GPTQ after the stack


def test_a_single_file_checkpoint_streams_into_one_file_the_import_reads(single: Path, tmp_path: Path) -> None:
    config = CONFIGS["gptq"]
    reference = in_memory(single, config, tmp_path / "memory")
    streamed = stream_quantize(single, config, calibration(), tmp_path / "stream")  # default shard size: one file
    assert sorted(os.listdir(streamed)) == ["config.json", "model.safetensors"]
    assert_same_export(reference, streamed)
    from quark.torch.export.quark_format import import_quark_dir
    from quark.torch.export.skeleton import hf_skeleton

    model = import_quark_dir(hf_skeleton(streamed, attn_implementation="sdpa"), streamed)
    ids = calibration()[0]["input_ids"]
    assert torch.isfinite(model(input_ids=ids).logits).all()


# ----------------------------------------------------------------------------------------------- errors
def test_a_missing_shard_is_named_before_any_work(sharded: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in sharded.iterdir():
        (broken / f.name).symlink_to(f)
    victim = sorted(p.name for p in sharded.glob("model-*.safetensors"))[2]
    (broken / victim).unlink()
    with pytest.raises(ValueError, match=rf"missing from .*{victim}"):
        stream_quantize(broken, CONFIGS["rtn"], None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tensor_missing_from_the_index_is_named(sharded: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in sharded.iterdir():
        if f.name != "model.safetensors.index.json":
            (broken / f.name).symlink_to(f)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"in no file.*model\.layers\.2\.mlp\.up_proj\.weight"):
        stream_quantize(broken, CONFIGS["rtn"], None, tmp_path / "out")


def test_no_config_json_or_no_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        stream_quantize(tmp_path / "nowhere", CONFIGS["rtn"], None, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        stream_quantize(tmp_path / "empty", CONFIGS["rtn"], None, tmp_path / "out")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="neither model.safetensors.index.json"):
        stream_quantize(tmp_path / "empty", CONFIGS["rtn"], None, tmp_path / "out")


def test_a_model_without_a_known_decoder_stack_is_refused(tmp_path: Path) -> None:
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=2)
    transformers.ResNetForImageClassification(config).save_pretrained(tmp_path / "resnet")
    with pytest.raises(ValueError, match="no stack of decoder layers of a known family"):
        stream_quantize(tmp_path / "resnet", CONFIGS["rtn"], None, tmp_path / "out", attn_implementation="eager")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"global_quant_config": {"weight": W8, "input_tensors": spec_dict(8, "per_tensor")}}, "static activation"),
        (
            {"global_quant_config": {"weight": TQT}},
            "learnable quantizer .*quantization-aware training",
        ),
        ({"global_quant_config": {"weight": W4}, "algo_config": [{"name": "gptq"}, {"name": "gptq"}]}, "one GPTQ"),
        ({"global_quant_config": {"weight": W4}, "quant_mode": "fx_graph_mode"}, "fx_graph_mode"),
    ],
)
def test_configs_that_need_the_whole_model_are_refused(
    sharded: Path, tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        stream_quantize(sharded, config, calibration(), tmp_path / "out")
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


def test_algorithms_without_batches_are_refused(sharded: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need calibration batches"):
        stream_quantize(sharded, CONFIGS["gptq"], [], tmp_path / "out")


def test_an_output_dir_that_is_not_new_or_empty_is_left_alone(sharded: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        stream_quantize(sharded, CONFIGS["rtn"], None, out)
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    link = tmp_path / "link"
    (tmp_path / "elsewhere").mkdir()
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="symbolic link"):
        stream_quantize(sharded, CONFIGS["rtn"], None, link)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_an_empty_output_dir_is_used(sharded: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    stream_quantize(sharded, CONFIGS["rtn"], None, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    assert os.listdir(tmp_path) == ["out"]  # no temporary left beside it


def test_a_failure_midway_leaves_no_directory_and_no_temporary(
    sharded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = HFCheckpoint.materialize

    def fail_at_layer_2(self: HFCheckpoint, model: Any, prefix: str, device: torch.device) -> None:
        if prefix == "model.layers.2":
            raise OSError("disk gone")
        real(self, model, prefix, device)

    monkeypatch.setattr(HFCheckpoint, "materialize", fail_at_layer_2)
    with pytest.raises(OSError, match="disk gone"):
        stream_quantize(sharded, CONFIGS["gptq"], calibration(), tmp_path / "out", max_shard_bytes=2000)
    assert os.listdir(tmp_path) == []


def test_tied_embeddings_stream_as_in_memory(tmp_path: Path) -> None:
    """lm_head tied to the input embeddings (absent from the checkpoint): read once, GPTQ keeps it at RTN as in memory."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tied", max_shard_size="20KB")
    assert "lm_head.weight" not in HFCheckpoint(tmp_path / "tied").files
    reference = in_memory(tmp_path / "tied", CONFIGS["gptq"], tmp_path / "memory")
    streamed = stream_quantize(tmp_path / "tied", CONFIGS["gptq"], calibration(), tmp_path / "stream")
    assert_same_export(reference, streamed)
