"""MoE routers (tiny Mixtral, Qwen2-MoE, Qwen3-MoE; GPT-OSS's biased and Llama4's ``nn.Linear`` routers on their own):

- by default a router stays float, and the summary / float_layers reason says how to quantize it;
- named in ``layer_quant_config`` it becomes a twin sharing its Parameter (state_dict keys unchanged), and prepare
  warns once that vLLM loads routers unquantized;
- with its quantizers off the twin's router logits, scores and top-k indices equal the float router's exactly;
- with an int8 per-channel weight (and a per-tensor input) its outputs equal the float router's computed on torch's
  own ``fake_quantize_per_channel_affine`` weight (and ``fake_quantize_per_tensor_affine`` input);
- a QAT step through ``QuantCallback`` trains the router's weight through its quantizer, and a checkpoint reloads bit
  for bit; freezing and baking change no output;
- amd-quark's directory stores the router as a Linear under the family's hub name (``mlp.gate`` /
  ``block_sparse_moe.gate``: ``weight`` codes, ``weight_scale``, ``input_scale``) and imports back bit for bit; so does
  the single file;
- a router-like module whose forward is not ``F.linear(x, self.weight)`` stays float with a reason, named or not.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from moe_models import FAMILIES, HIDDEN, W8A8, build, eval_ids, token_batches, transformers, weight_share
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import QuantCallback, load_quantized_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir, import_quark_dir
from quark.torch.export.safetensors import import_model_from_safetensors
from quark.torch.export.single_file import read_single_file, write_single_file
from quark.torch.quantization.nn.modules import QuantMoERouter
from quark.torch.quantization.nn.modules.quant_experts import MOE_ROUTER_REASON as EXPERTS_MODULE_REASON
from quark.torch.quantization.nn.modules.quant_router import MOE_ROUTER_FLOAT, MOE_ROUTER_REASON
from quark.torch.quantization.state import paused_quantizers
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*stay float",
    "ignore:.*are quantized \\(named in the Config\\)",
    "ignore:.*does not have many workers.*",
    "ignore:.*number of training batches.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*LeafSpec.*",
    "ignore:.*received no calibration token.*",
)

ROUTERS = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
#: the routers named, with the global W8A8 entry
NAMED = {**W8A8, "layer_quant_config": {"*.mlp.gate": W8A8["global_quant_config"]}}
#: only the routers quantized: int8 per-channel weight, int8 per-tensor static input
ROUTER_ONLY = {
    "global_quant_config": {},
    "layer_quant_config": {"*.mlp.gate": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}},
}
#: the hub module name of layer L's router, per family
HUB_ROUTER = {
    "mixtral": "model.layers.{L}.block_sparse_moe.gate",
    "qwen2_moe": "model.layers.{L}.mlp.gate",
    "qwen3_moe": "model.layers.{L}.mlp.gate",
}


def quantized(family: str, config: dict, seed: int = 0) -> nn.Module:
    model = build(family, seed)
    ModelQuantizer(config).quantize_model(model, token_batches())
    return model


def hidden_states(seed: int = 3) -> torch.Tensor:
    return torch.randn(2, 16, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_same_routing(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    """Router logits, scores and top-k indices equal, element for element."""
    assert len(got) == len(expected) == 3
    for name, a, b in zip(("logits", "scores", "indices"), got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


# ----------------------------------------------------------------------------------------------- default: float
@pytest.mark.parametrize("family", FAMILIES)
def test_routers_are_float_by_default_and_the_reason_says_how_to_quantize_them(family) -> None:
    model = build(family)
    quantizer = ModelQuantizer(W8A8)
    floats = {f.name: f.reason for f in quantizer.float_layers(model)}
    assert all(floats[r] == MOE_ROUTER_REASON for r in ROUTERS)
    assert "layer_quant_config" in MOE_ROUTER_REASON and "'*.mlp.gate'" in MOE_ROUTER_REASON
    assert EXPERTS_MODULE_REASON is MOE_ROUTER_REASON  # the old import path names the same reason
    summary = quantizer.summary(model)
    assert all(f"{r}" in summary for r in ROUTERS) and MOE_ROUTER_REASON in summary
    quantizer.prepare(model)
    assert not any(isinstance(model.get_submodule(r), QuantMoERouter) for r in ROUTERS)


# ----------------------------------------------------------------------------------------------- named: a twin
@pytest.mark.parametrize("family", FAMILIES)
def test_a_named_router_is_a_twin_sharing_its_parameter(family) -> None:
    model = build(family)
    originals = {r: model.get_submodule(r) for r in ROUTERS}
    weights = {r: m.weight for r, m in originals.items()}
    keys = set(model.state_dict())
    plans = {p.name: p for p in ModelQuantizer(NAMED).resolve(model)}
    assert all("*.mlp.gate" in str(plans[r].source) for r in ROUTERS)
    with pytest.warns(UserWarning, match=r"MoE router\(s\) \[.*mlp.gate.*\] are quantized.*vLLM") as record:
        ModelQuantizer(NAMED).prepare(model)
    assert sum("vLLM builds MoE routers unquantized" in str(w.message) for w in record) == 1  # once per prepare
    for r, original in originals.items():
        twin = model.get_submodule(r)
        assert isinstance(twin, QuantMoERouter) and isinstance(twin, type(original)), r
        assert twin.weight is weights[r]
        assert twin._weight_quantizer is not None and twin._input_quantizer is not None
    assert {k for k in model.state_dict() if "_quantizer." not in k} == keys
    floats = {f.name for f in ModelQuantizer(NAMED).float_layers(model)}
    assert not floats & set(ROUTERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_with_quantizers_off_routes_exactly_as_the_float_router(family) -> None:
    reference = build(family)
    model = quantized(family, NAMED)
    x = hidden_states()
    with torch.no_grad():
        for r in ROUTERS:
            expected = reference.get_submodule(r)(x)
            with paused_quantizers(model, fake_quant=True):
                assert_same_routing(model.get_submodule(r)(x), expected)
            assert not torch.equal(model.get_submodule(r)(x)[0], expected[0])  # quantized when switched on
        eager = copy.deepcopy(reference)
        eager.set_experts_implementation("eager")
        with paused_quantizers(model, fake_quant=True):
            assert torch.equal(model(eval_ids()).logits, eager(eval_ids()).logits)


# ----------------------------------------------------------------------------------------------- numerics
def _per_channel_reference(weight: torch.Tensor) -> torch.Tensor:
    """torch's own per-row int8 fake quantization with the symmetric min-max scale amax / 127.5 (amd-quark's)."""
    weight = weight.detach()
    scale = torch.clamp(weight.abs().amax(dim=1) / 127.5, min=torch.finfo(torch.float32).eps)
    zero = torch.zeros(weight.shape[0], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(weight, scale, zero, 0, -128, 127)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_router_routes_as_the_float_router_on_torchs_fake_quantized_weight_and_input(family) -> None:
    reference = build(family)
    model = build(family)
    seen: dict[str, float] = {}

    def record(name: str) -> Any:
        def hook(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen[name] = max(seen.get(name, 0.0), float(args[0].abs().amax()))

        return hook

    for r in ROUTERS:  # the router's raw inputs during calibration (a pre-hook runs before the twin's quantizer)
        model.get_submodule(r).register_forward_pre_hook(record(r))
    ModelQuantizer(ROUTER_ONLY).quantize_model(model, token_batches())
    x = hidden_states()
    with torch.no_grad():
        for r in ROUTERS:
            twin, float_router = model.get_submodule(r), copy.deepcopy(reference.get_submodule(r))
            float_router.weight.copy_(_per_channel_reference(reference.get_submodule(r).weight))
            assert not torch.equal(float_router.weight, reference.get_submodule(r).weight)
            scale, zero = twin._input_quantizer.calculate_qparams()
            assert torch.equal(scale.float().reshape(()), torch.tensor(seen[r] / 127.5))  # amax / 127.5 of its inputs
            xq = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero), -128, 127)
            assert_same_routing(twin(x), float_router(xq))
            with paused_quantizers(twin, fake_quant=lambda q, t=twin: q is t._input_quantizer):  # the weight alone
                assert_same_routing(twin(x), float_router(x))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_freeze_and_bake_keep_the_routing_and_the_weight_lies_on_torchs_grid(family) -> None:
    reference = build(family)
    model = quantized(family, ROUTER_ONLY)
    expected = model(eval_ids()).logits
    assert weight_share(model) > 0  # model_size_bits counts the routers' int8 weights
    ModelQuantizer.freeze(model, bake_weights=True)
    assert torch.equal(model(eval_ids()).logits, expected)
    for r in ROUTERS:
        assert torch.equal(
            model.get_submodule(r).weight.detach(), _per_channel_reference(reference.get_submodule(r).weight)
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_with_the_routers_named_w8a8_quantizes_every_weight(family) -> None:
    assert weight_share(quantized(family, NAMED)) == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------- QAT
class LitMoE(LightningModule):
    def __init__(self, family: str, init_seed: int = 0) -> None:
        super().__init__()
        self.model = build(family, seed=init_seed).train()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@torch.no_grad()
def _logits(lit: LitMoE) -> torch.Tensor:
    lit.eval()
    try:
        return lit.model(input_ids=eval_ids()).logits
    finally:
        lit.train()


def test_qat_trains_the_router_through_its_quantizers_and_reloads_bit_for_bit(tmp_path) -> None:
    torch.manual_seed(0)
    lit = LitMoE("qwen3_moe")
    before = {r: lit.model.get_submodule(r).weight.detach().clone() for r in ROUTERS}
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randint(0, 128, (8, 16), generator=g)), batch_size=4, shuffle=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        limit_train_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
        deterministic=True,
        callbacks=[QuantCallback(NAMED, mode="qat", observer_steps=1), ckpt],
    ).fit(lit, train_dataloaders=data)

    for r in ROUTERS:
        twin = lit.model.get_submodule(r)
        assert isinstance(twin, QuantMoERouter), r
        assert not torch.equal(twin.weight.detach(), before[r]), f"{r} did not train"
        for _, q in twin.quantizers():
            assert bool(q.fake_quant_enabled) and bool(q.initialized), r
    # the gradient reaching the router's Parameter is the quantized forward's
    batch = next(iter(data))[0]
    twin = lit.model.get_submodule(ROUTERS[0])
    lit.zero_grad()
    lit.training_step((batch,), 0).backward()
    quantized_grad = twin.weight.grad.clone()
    lit.zero_grad()
    with paused_quantizers(lit, fake_quant=True):
        lit.training_step((batch,), 0).backward()
    assert quantized_grad.abs().sum() > 0 and not torch.allclose(quantized_grad, twin.weight.grad)

    expected = _logits(lit)
    loaded = load_quantized_checkpoint(LitMoE("qwen3_moe", init_seed=1), ckpt.best_model_path)
    assert isinstance(loaded.model.get_submodule(ROUTERS[0]), QuantMoERouter)
    assert torch.equal(_logits(loaded), expected)


# ----------------------------------------------------------------------------------------------- export / import
def _router_qparams(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for r in ROUTERS:
        for slot, q in model.get_submodule(r).quantizer_slots():
            scale, zp = q.calculate_qparams()
            out[f"{r}.{slot.attr}"] = torch.cat([scale.float().flatten(), zp.float().flatten()])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_quark_dir_stores_the_router_under_its_hub_name_and_round_trips_bit_for_bit(tmp_path, family) -> None:
    model = quantized(family, NAMED)
    expected = model(eval_ids()).logits.detach()
    export_quark_dir(model, tmp_path / "q")
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    build(family).save_pretrained(tmp_path / "hf")
    hub = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert {k for k in stored if not k.endswith(("_scale", "_zero_point"))} == hub
    for layer, r in enumerate(ROUTERS):
        key = HUB_ROUTER[family].format(L=layer)
        twin = model.get_submodule(r)
        assert stored[f"{key}.weight"].dtype == torch.int8 and stored[f"{key}.weight"].shape == twin.weight.shape
        scale, _ = twin._weight_quantizer.calculate_qparams()
        assert torch.equal(stored[f"{key}.weight_scale"], scale.float())
        assert torch.equal(
            stored[f"{key}.weight"].float() * scale.float()[:, None], twin._weight_quantizer(twin.weight)
        )
        assert f"{key}.input_scale" in stored
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert "*.mlp.gate" in config["layer_quant_config"]

    imported = import_quark_dir(build(family, seed=7), tmp_path / "q")
    assert all(isinstance(imported.get_submodule(r), QuantMoERouter) for r in ROUTERS)
    assert torch.equal(imported(eval_ids()).logits, expected)
    reference = _router_qparams(model)
    assert _router_qparams(imported).keys() == reference.keys()
    assert all(torch.equal(v, reference[k]) for k, v in _router_qparams(imported).items())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_single_file_baked_and_skeleton_round_trips_of_the_router(tmp_path, family) -> None:
    model = quantized(family, NAMED)
    expected = model(eval_ids()).logits.detach()
    path = write_single_file(model, tmp_path / "single")
    assert "model.layers.0.mlp.gate.weight" in load_file(str(path))
    imported = read_single_file(build(family, seed=9), path)
    assert isinstance(imported.get_submodule(ROUTERS[0]), QuantMoERouter)
    assert torch.equal(imported(eval_ids()).logits, expected)
    baked = ModelQuantizer.freeze(copy.deepcopy(model), bake_weights=True)
    export_quark_dir(model, tmp_path / "a")
    export_quark_dir(baked, tmp_path / "b")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    skeleton = import_model_from_safetensors(None, tmp_path / "a")  # built from config.json on the meta device
    assert isinstance(skeleton.get_submodule(ROUTERS[0]), QuantMoERouter)
    assert torch.equal(skeleton(eval_ids()).logits, expected)


# ----------------------------------------------------------------------------------------------- other routers
class _Experts(nn.Module):
    """Stand-in fused experts (3-D Parameters [E, ...]): what marks the router beside them as an MoE router."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, HIDDEN))


class _MatmulRouter(nn.Module):
    """A router whose forward multiplies by the transposed weight instead of calling ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.num_experts = 2, 4
        self.weight = nn.Parameter(torch.randn(4, HIDDEN))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = hidden_states.reshape(-1, HIDDEN) @ self.weight.t()
        scores, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, scores, indices


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = _MatmulRouter(), _Experts()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate(x)


def test_a_router_whose_forward_is_not_f_linear_stays_float_with_a_reason_named_or_not() -> None:
    config = {**W8A8, "layer_quant_config": {"gate": W8A8["global_quant_config"]}}
    for cfg in (W8A8, config):
        block = _Block()
        reason = {f.name: f.reason for f in ModelQuantizer(cfg).float_layers(block)}["gate"]
        assert reason.startswith(f"{MOE_ROUTER_FLOAT}; the router twin cannot quantize it")
        assert "passes its weight to t" in reason and "F.linear 0 times" in reason
        ModelQuantizer(cfg).prepare(block)
        assert not isinstance(block.gate, QuantMoERouter)


def test_gpt_oss_and_llama4_routers_get_the_twin_when_named() -> None:
    """GPT-OSS's router has a bias (``F.linear(x, w, b)``), Llama4's is an ``nn.Linear`` subclass with its own forward
    (top-k then sigmoid): both run their own forward in the twin, exactly with quantizers off."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    torch.manual_seed(0)
    routers = {
        "gpt_oss": GptOssTopKRouter(
            transformers.GptOssConfig(hidden_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2)
        ),
        "llama4": Llama4Router(
            transformers.Llama4TextConfig(hidden_size=HIDDEN, num_local_experts=4, num_experts_per_tok=1)
        ),
    }
    nn.init.normal_(routers["gpt_oss"].bias)
    nn.init.normal_(routers["gpt_oss"].weight)
    x = torch.randn(10, HIDDEN)
    for family, router in routers.items():
        box = nn.ModuleDict({"router": router})
        expected = router(x)
        reasons = {f.name: f.reason for f in ModelQuantizer(W8A8).float_layers(box)}
        assert reasons["router"] == MOE_ROUTER_REASON, family  # a router, even without experts beside it
        ModelQuantizer({**W8A8, "layer_quant_config": {"router": W8A8["global_quant_config"]}}).quantize_model(
            box, forward_loop=lambda m: m["router"](x)
        )
        twin = box["router"]
        assert isinstance(twin, QuantMoERouter) and isinstance(twin, type(router)), family
        with torch.no_grad(), paused_quantizers(box, fake_quant=True):
            got = twin(x)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), family
        assert not torch.equal(twin(x)[0], expected[0]), family
