"""Hugging Face models as they come (default configs: ``use_cache=True``), one tiny random-weight model per family
built from its transformers config, through round-to-nearest, GPTQ, AWQ and SmoothQuant.

Each algorithm's output error on its calibration data must be no worse than plain round-to-nearest's with the same
format, the model's config must be left as it was, and the result must equal the one on a ``use_cache=False`` copy
(a KV cache built while layers are captured and re-run would make the later passes attend to stale keys)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from algo_refs import spec_dict
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.algorithm import MODEL_FAMILIES, find_decoder_layers, model_family
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.hf import is_hf_conv1d
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant")

VOCAB, HIDDEN, FFN = 128, 64, 128
_COMMON = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4}
#: family -> (model class, config), all tiny
MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_COMMON, intermediate_size=FFN, num_key_value_heads=2, max_position_embeddings=64)
    ),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**_COMMON, intermediate_size=FFN, num_key_value_heads=2, max_position_embeddings=64)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_COMMON, intermediate_size=FFN, num_key_value_heads=4, max_position_embeddings=64)
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(**_COMMON, ffn_dim=FFN, word_embed_proj_dim=HIDDEN, max_position_embeddings=64)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64)
    ),
    "phi": lambda: transformers.PhiForCausalLM(
        transformers.PhiConfig(**_COMMON, intermediate_size=FFN, max_position_embeddings=64)
    ),
    "falcon": lambda: transformers.FalconForCausalLM(
        transformers.FalconConfig(**_COMMON, new_decoder_architecture=False, parallel_attn=True)
    ),
    "bert": lambda: transformers.BertModel(
        transformers.BertConfig(**_COMMON, intermediate_size=FFN, max_position_embeddings=64)
    ),
    "bert-cls": lambda: transformers.BertForSequenceClassification(
        transformers.BertConfig(**_COMMON, intermediate_size=FFN, max_position_embeddings=64, num_labels=3)
    ),
}
FAMILY_OF = {"mistral": "llama", "qwen2": "llama", "bert-cls": "bert"}

W4 = spec_dict(4, "per_group", 32, sym=False)
W8, A8 = spec_dict(8, "per_channel"), spec_dict(8, "per_tensor")


def build(name: str, use_cache: bool | None = None) -> nn.Module:
    """The tiny model with activation outliers, as trained LLMs have: a few channels of every norm scaled up (that
    is what SmoothQuant and AWQ are for; with plain random weights there is nothing for them to find)."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    g = torch.Generator().manual_seed(3)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.ndim == 1:
            with torch.no_grad():
                weight.mul_(1 + 15 * (torch.rand(weight.shape, generator=g) > 0.9).float())
    if use_cache is not None and hasattr(model.config, "use_cache"):
        model.config.use_cache = use_cache
    return model


def batches(ragged: bool = False) -> list[dict[str, torch.Tensor]]:
    """Calibration batches: with ``ragged``, different lengths and right padding under an attention mask."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, length in enumerate([16, 16, 12, 9] if ragged else [16, 16, 16]):
        ids = torch.randint(0, VOCAB, (2, length), generator=g)
        mask = torch.ones_like(ids)
        if ragged and i % 2:
            mask[1, length // 2 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def output(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the error is measured on: an LM's logits, an encoder's last hidden states (for a classifier too: its
    three pooled logits would say little about the layers the algorithms change); padded positions masked out."""
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    logits = getattr(out, "logits", None)
    tensor = logits if logits is not None and logits.ndim == 3 else out.hidden_states[-1]
    return tensor * batch["attention_mask"].unsqueeze(-1)


def error(model: nn.Module, reference: list[torch.Tensor], data: list[dict[str, torch.Tensor]]) -> float:
    return sum(float((output(model, b) - r).pow(2).mean()) for b, r in zip(data, reference, strict=True)) / len(data)


def quantize(model: nn.Module, config: dict[str, Any], data: list[dict[str, torch.Tensor]]) -> nn.Module:
    return ModelQuantizer(Config.from_dict(config)).quantize_model(model, data)


ALGORITHMS = {
    "gptq": (
        {"global_quant_config": {"weight": W4}, "algo_config": {"name": "gptq"}},
        {"global_quant_config": {"weight": W4}},
    ),
    "awq": (
        {"global_quant_config": {"weight": W4}, "algo_config": {"name": "awq"}},
        {"global_quant_config": {"weight": W4}},
    ),
    "smoothquant": (
        {
            "global_quant_config": {"weight": W8, "input_tensors": A8},
            "pre_quant_opt_config": {"name": "smoothquant", "alpha": 0.5},
        },
        {"global_quant_config": {"weight": W8, "input_tensors": A8}},
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_family_is_found_in_the_table(name: str) -> None:
    model = build(name)
    found = find_decoder_layers(model)
    assert found is not None
    prefix, layers = found
    assert len(layers) == 2
    assert model_family(layers[0]).name.startswith(FAMILY_OF.get(name, name))  # type: ignore[union-attr]


@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("name", list(MODELS))
def test_algorithm_no_worse_than_rtn_with_the_default_kv_cache(name: str, algo: str) -> None:
    data = batches(ragged=True)
    reference = [output(build(name), b) for b in data]
    with_algo, plain = ALGORITHMS[algo]
    model = build(name)
    cache_before = getattr(model.config, "use_cache", None)
    quantized = quantize(model, with_algo, data)
    assert getattr(model.config, "use_cache", None) == cache_before  # the user's config as it was
    rtn = quantize(build(name), plain, data)
    ours, baseline = error(quantized, reference, data), error(rtn, reference, data)
    assert 0 < ours <= baseline * 1.0001, (ours, baseline)
    # every linear projection of the stack is quantized (GPT-2's Conv1D included)
    _, layers = find_decoder_layers(quantized)  # type: ignore[misc]
    projections = [m for m in layers.modules() if isinstance(m, nn.Linear) or is_hf_conv1d(m)]
    assert projections and all(isinstance(m, QuantMixin) and m._weight_quantizer is not None for m in projections)
    if cache_before:  # the same result as with the cache off from the start
        no_cache = quantize(build(name, use_cache=False), with_algo, data)
        for b in data:
            assert torch.equal(output(quantized, b), output(no_cache, b))


def test_the_table_has_every_family_the_issue_names() -> None:
    names = {f.name for f in MODEL_FAMILIES}
    assert {"llama", "opt", "gpt2", "phi", "bert"} <= names and any(n.startswith("falcon") for n in names)


def test_a_model_no_family_fits_gets_an_error_listing_what_was_found() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mix(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    config = {"global_quant_config": {"weight": W4 | {"group_size": 8}}, "algo_config": {"name": "awq"}}
    with pytest.raises(ValueError, match=r"blocks.*2 x Block.*MODEL_FAMILIES"):
        quantize(Net(), config, [torch.randn(2, 8)])


def test_explicit_scaling_layers_win_over_the_table() -> None:
    """A user's own groups replace the family's: here only the MLP group, so q/k/v keep their float weights."""
    data = batches()
    model = build("llama")
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    up_before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    groups = [
        {
            "prev_op": "post_attention_layernorm",
            "layers": ["mlp.gate_proj", "mlp.up_proj"],
            "inp": "mlp.gate_proj",
            "module2inspect": "mlp",
        }
    ]
    smooth = {"name": "smoothquant", "alpha": 0.5, "scaling_layers": groups, "model_decoder_layers": "model.layers"}
    quantize(model, {"global_quant_config": {"weight": W8, "input_tensors": A8}, "pre_quant_opt_config": smooth}, data)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_before)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, up_before)


# ----------------------------------------------------------------------------------------------- transformers' Conv1D
SPECS = {
    "int8 per-channel": spec_dict(8, "per_channel"),
    "uint4 per-group": W4,
    "int8 per-tensor": spec_dict(8, "per_tensor"),
    "fp8 per-channel": {
        "dtype": "fp8_e4m3",
        "qscheme": "per_channel",
        "ch_axis": 0,
        "observer_cls": "PerChannelMinMaxObserver",
        "is_dynamic": False,
    },
    "mxfp4": {
        "dtype": "mx",
        "mx_element_dtype": "fp4",
        "qscheme": "per_group",
        "ch_axis": 1,
        "group_size": 32,
        "is_dynamic": False,
    },
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_conv1d_quantizes_exactly_as_the_equivalent_linear(spec: str) -> None:
    """transformers' Conv1D (weight [in, out]) with a config quantizes as nn.Linear with the transposed weight does:
    per-channel per output feature, per-group along input features, the same qparams."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(96, 64)
    nn.init.normal_(conv.weight)
    nn.init.normal_(conv.bias)
    linear = nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    x = torch.randn(4, 5, 64)
    config = {"global_quant_config": {"weight": SPECS[spec], "input_tensors": A8}}
    qc = quantize(nn.Sequential(conv), config, [x])[0]
    ql = quantize(nn.Sequential(linear), config, [x])[0]
    assert type(qc).__name__ == "QuantConv1D" and isinstance(qc, Conv1D)
    assert qc.weight is conv.weight  # the user's Parameter, still [in, out]
    assert torch.equal(qc(x), ql(x))
    assert not torch.equal(qc(x), conv(x))
    for (_, a), (_, b) in zip(qc.quantizers(), ql.quantizers(), strict=True):
        if isinstance(a, ScaledFakeQuantize):  # the same qparams, in Linear's layout
            for qa, qb in zip(a.calculate_qparams(), b.calculate_qparams(), strict=True):
                assert torch.equal(qa, qb)


def test_conv1d_gptq_equals_gptq_on_the_equivalent_linear() -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(96, 64)
    linear = nn.Linear(64, 96)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    data = [torch.randn(8, 64) for _ in range(3)]
    config = {"global_quant_config": {"weight": W4}, "algo_config": {"name": "gptq"}}
    qc = quantize(nn.Sequential(conv), config, data)[0]
    ql = quantize(nn.Sequential(linear), copy.deepcopy(config), data)[0]
    assert torch.equal(qc.weight.t(), ql.weight)
    assert torch.equal(qc._weight_quantizer.scale, ql._weight_quantizer.scale)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_derived_group_folds_without_changing_the_float_function(name: str) -> None:
    """Folding any positive per-channel scale into a group's prev_op and its layers leaves the float model's output
    as it was: the table's groups are where the algorithms may move scales (a post-norm encoder's norm is not)."""
    from quark.torch.algorithm.smoothquant import fold_scales
    from quark.torch.algorithm.structure import derive_scaling_groups
    from quark.torch.quantization.hf import linear_weight

    model = build(name).double()
    data = batches(ragged=True)
    reference = [output(model, b) for b in data]
    _, layers = find_decoder_layers(model)  # type: ignore[misc]
    g = torch.Generator().manual_seed(0)
    folded = 0
    for layer in layers:
        modules = dict(layer.named_modules())
        for group in derive_scaling_groups(layer):
            channels = linear_weight(modules[group.layers[0]]).shape[1]
            scales = torch.rand(channels, generator=g, dtype=torch.float64) * 3 + 0.25
            fold_scales(modules[group.prev_op], [modules[n] for n in group.layers], scales, group.prev_op)
            folded += 1
    assert folded >= len(layers)
    for b, r in zip(data, reference, strict=True):
        torch.testing.assert_close(output(model, b), r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spec", ["int8 per-channel", "uint4 per-group", "fp8 per-channel"])
def test_gpt2_exports_to_the_quark_directory_and_reloads_with_the_same_logits(spec: str, tmp_path: Any) -> None:
    """A GPT-2 (Conv1D layers) through amd-quark's directory format and our single file: the reloaded model gives
    the quantized model's logits; the Conv1D weight is stored as the equivalent Linear's [out, in]."""
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from quark.torch.export.quark_format import export_quark_dir, import_quark_dir

    data = batches()
    config = {"global_quant_config": {"weight": SPECS[spec], "input_tensors": A8}}
    model = quantize(build("gpt2"), config, data)
    expected = [output(model, b) for b in data]
    out = export_quark_dir(model, tmp_path / "gpt2")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("transformer.h.0.mlp.c_fc.weight")
    c_fc = build("gpt2").transformer.h[0].mlp.c_fc.weight  # [in 64, out 256]
    assert stored.shape[0] == (c_fc.shape[0] if spec == "uint4 per-group" else c_fc.shape[1])  # Linear's layouts
    reloaded = import_quark_dir(build("gpt2"), out)
    for b, e in zip(data, expected, strict=True):
        torch.testing.assert_close(output(reloaded, b), e, rtol=0, atol=1e-5)
    # this project's single file, and amd-quark's loader entry point with model=None (the HF skeleton)
    from quark.torch.export.safetensors import export_safetensors, import_model_from_safetensors

    export_safetensors(model, tmp_path / "single", custom_mode=None)
    single = import_model_from_safetensors(build("gpt2"), tmp_path / "single")
    skeleton = import_model_from_safetensors(None, out)
    for b, e in zip(data, expected, strict=True):
        torch.testing.assert_close(output(single, b), e, rtol=0, atol=1e-5)
        torch.testing.assert_close(output(skeleton, b), e, rtol=0, atol=1e-5)


def test_a_models_own_norms_are_named_as_norms_among_the_float_layers() -> None:
    model = build("llama")
    floats = {
        f.name: f.reason
        for f in ModelQuantizer(Config.from_dict({"global_quant_config": {"weight": W4}})).float_layers(model)
    }
    assert floats["model.layers.0.input_layernorm"] == "normalization layer (kept float)"
    assert floats["model.norm"] == "normalization layer (kept float)"
