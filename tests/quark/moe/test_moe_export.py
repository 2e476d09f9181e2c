"""Export and import of fused MoE experts, per family (tiny Mixtral, Qwen2-MoE, Qwen3-MoE):

- amd-quark's directory stores every expert's gate, up and down projections as Linears of their own under the names
  the family's hub checkpoints use (the names ``save_pretrained`` writes for the float model: Mixtral's
  ``block_sparse_moe.experts.{e}.w1|w3|w2`` and ``block_sparse_moe.gate``, the Qwen group's
  ``mlp.experts.{e}.gate_proj|up_proj|down_proj``), with per-expert ``weight_scale`` (one per expert and projection per
  tensor, as vLLM's ``w13_weight_scale`` [E, 2] / ``w2_weight_scale`` [E] are filled) and ``input_scale`` (gate and
  up: the expert's one input scale);
- importing into a fresh float model of the family gives the exported model's logits and qparams bit for bit;
- this project's single file round-trips too;
- a model whose experts transformers cannot name (not a transformers model) is refused with a clear error, and so is
  a directory whose gate and up input scales of one expert differ (before the model is touched);
- ONNX export refuses the experts (their graph depends on the routing) with that reason.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from moe_models import EXPERTS, FAMILIES, W8A8, build, eval_ids, experts_layers, token_batches
from safetensors.torch import load_file, save_file
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir, import_quark_dir
from quark.torch.export.safetensors import import_model_from_safetensors
from quark.torch.export.single_file import read_single_file, write_single_file
from quark.torch.quantization.nn.modules import QuantFusedExperts
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

pytestmark = pytest.mark.filterwarnings("ignore:.*stay float")

COMPANIONS = ("_scale", "_zero_point")
PER_TENSOR = {**INT8_PER_TENSOR_ACT}
#: the hub module names of expert e's gate, up and down projections, per family
HUB = {
    "mixtral": (
        "block_sparse_moe.experts.{e}.w1",
        "block_sparse_moe.experts.{e}.w3",
        "block_sparse_moe.experts.{e}.w2",
    ),
    "qwen2_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
    "qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
}


def quantized(family: str, config: dict | None = None) -> nn.Module:
    model = build(family)
    ModelQuantizer(config or W8A8).quantize_model(model, token_batches())
    return model


def qparams(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantizer's (scale, zero point), by layer and slot."""
    out = {}
    for name, m in experts_layers(model).items():
        for slot, q in m.quantizer_slots():
            scale, zp = q.calculate_qparams()
            out[f"{name}.{slot.attr}"] = torch.cat([scale.float().flatten(), zp.float().flatten()])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_quark_dir_uses_the_hub_names_and_round_trips_bit_for_bit(tmp_path, family) -> None:
    model = quantized(family)
    expected = model(eval_ids()).logits.detach()
    export_quark_dir(model, tmp_path / "q")
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))

    build(family).save_pretrained(tmp_path / "hf")  # transformers' own names for the float model
    hub = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert {k for k in stored if not k.endswith(COMPANIONS)} == hub
    for layer in range(2):
        for e in range(EXPERTS):
            for module in HUB[family]:
                key = f"model.layers.{layer}.{module.format(e=e)}"
                assert stored[key + ".weight"].dtype == torch.int8, key
                assert {key + s for s in (".weight_scale", ".input_scale")} <= set(stored), key
        gate, up, _ = (f"model.layers.{layer}.{m.format(e=1)}" for m in HUB[family])
        assert torch.equal(stored[gate + ".input_scale"], stored[up + ".input_scale"])  # one input per expert
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "quark"

    fresh = build(family, seed=7)
    imported = import_quark_dir(fresh, tmp_path / "q")
    assert all(isinstance(m, QuantFusedExperts) for m in experts_layers(imported).values())
    assert torch.equal(imported(eval_ids()).logits, expected)
    reference = qparams(model)
    assert {k: v for k, v in qparams(imported).items()}.keys() == reference.keys()
    for key, value in qparams(imported).items():
        assert torch.equal(value, reference[key]), key


def test_per_tensor_weights_store_one_scale_per_expert_and_projection(tmp_path) -> None:
    config = {"global_quant_config": {"weight": PER_TENSOR, "input_tensors": INT8_PER_TENSOR_ACT}}
    model = quantized("mixtral", config)
    export_quark_dir(model, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    twin = model.model.layers[0].mlp.experts
    for e in range(EXPERTS):
        for proj, module in zip(("gate", "up", "down"), HUB["mixtral"], strict=True):
            key = f"model.layers.0.{module.format(e=e)}.weight_scale"
            scale, _ = getattr(twin, f"_e{e}_{proj}_weight_quantizer").calculate_qparams()
            assert stored[key].shape == () and torch.equal(stored[key], scale.float()), key
    w1 = torch.stack([stored[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight_scale"] for e in range(EXPERTS)])
    w3 = torch.stack([stored[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight_scale"] for e in range(EXPERTS)])
    assert not torch.equal(w1, w3)  # vLLM's w13_weight_scale [E, 2]: two scales per expert
    imported = import_quark_dir(build("mixtral", seed=3), tmp_path)
    assert torch.equal(imported(eval_ids()).logits, model(eval_ids()).logits)


def test_a_baked_model_exports_the_same_files_and_a_skeleton_imports_them(tmp_path) -> None:
    """``freeze(bake_weights=True)`` writes each expert's quantized values into its block: the directory is the same
    file for file; ``model=None`` builds the model from config.json on the meta device and fills it."""
    model = quantized("mixtral")
    baked = ModelQuantizer.freeze(copy.deepcopy(model), bake_weights=True)
    export_quark_dir(model, tmp_path / "a")
    export_quark_dir(baked, tmp_path / "b")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    imported = import_model_from_safetensors(None, tmp_path / "a")
    assert torch.equal(imported(eval_ids()).logits, model(eval_ids()).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_file_round_trips_bit_for_bit(tmp_path, family) -> None:
    model = quantized(family)
    path = write_single_file(model, tmp_path)
    stored = load_file(str(path))
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in stored
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored  # stored per expert, not also in float
    imported = read_single_file(build(family, seed=9), path)
    assert torch.equal(imported(eval_ids()).logits, model(eval_ids()).logits)


def test_experts_transformers_cannot_name_are_refused(tmp_path) -> None:
    class Box(nn.Module):  # not a transformers model: no checkpoint conversion names its experts
        def __init__(self) -> None:
            super().__init__()
            self.experts = build("mixtral").model.layers[0].mlp.experts

        def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return self.experts(x, idx, w)

    box = Box()
    x = torch.randn(8, 64)
    idx = torch.stack([torch.arange(8) % EXPERTS, (torch.arange(8) + 1) % EXPERTS], dim=1)
    ModelQuantizer(W8A8).quantize_model(box, forward_loop=lambda m: m(x, idx, torch.rand(8, 2)))
    with pytest.raises(ValueError, match=r"layer 'experts' \(QuantMixtralExperts\).*does not split \['experts'\]"):
        export_quark_dir(box, tmp_path / "q")
    assert not (tmp_path / "q").exists()
    write_single_file(box, tmp_path / "single")  # this project's format stores them under the model's own names


def test_gate_and_up_input_scales_of_one_expert_must_agree(tmp_path) -> None:
    export_quark_dir(quantized("qwen3_moe"), tmp_path)
    path = Path(tmp_path) / "model.safetensors"
    stored = load_file(str(path))
    key = "model.layers.1.mlp.experts.2.up_proj.input_scale"
    stored[key] = stored[key] * 2
    save_file(stored, str(path), metadata={"format": "pt"})
    fresh = build("qwen3_moe")
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"experts.2.gate_proj.input_scale' and .*experts.2.up_proj.input_scale' differ"
    ):
        import_quark_dir(fresh, tmp_path)
    assert not any(isinstance(m, QuantFusedExperts) for m in fresh.modules())  # checked before the model is touched
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_onnx_refuses_the_experts_with_the_reason(tmp_path) -> None:
    """The per-expert loop depends on the routing of each input: a traced graph would hold one routing only."""
    from quark.torch.export import export_onnx

    model = quantized("mixtral")
    with pytest.raises(
        ValueError, match=r"layer 'model.layers.0.mlp.experts' \(QuantMixtralExperts\) has no fixed graph"
    ):
        export_onnx(model, tmp_path, (eval_ids(),))
    assert not any(tmp_path.iterdir())
