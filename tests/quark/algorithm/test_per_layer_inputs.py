"""GPTQ, AWQ and SmoothQuant run each decoder layer on what the model itself passes that layer (issue 33): Gemma2/3
give sliding-attention and full-attention layers different masks (``layer_types``), Gemma3 also different rotary
embeddings (rope base 1e4 local, 1e6 global). Before, every layer got layer 0's keyword arguments.

Tiny transformers models with random weights; sliding_window=4 with 16 tokens, so the sliding mask matters. The
reference is a plain forward of the float model with every layer hooked: its (args, kwargs) and outputs."""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from algo_refs import spec_dict
from torch import nn

import quark.torch.algorithm.api as api
from quark.torch import ModelQuantizer
from quark.torch.algorithm.capture import hidden_of
from quark.torch.quantization.config.config import Config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant")

VOCAB, TOKENS = 128, 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
_WINDOWED = {**_COMMON, "sliding_window": 4, "layer_types": LAYER_TYPES}
MODELS: dict[str, Callable[[], nn.Module]] = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_WINDOWED)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**_WINDOWED)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON)),
}

W4, W8, A8 = spec_dict(4, "per_group", 16, sym=False), spec_dict(8, "per_channel"), spec_dict(8, "per_tensor")
CONFIGS = {
    "gptq": {"global_quant_config": {"weight": W4}, "algo_config": {"name": "gptq"}},
    "awq": {"global_quant_config": {"weight": W4}, "algo_config": {"name": "awq"}},
    "smoothquant": {
        "global_quant_config": {"weight": W8, "input_tensors": A8},
        "pre_quant_opt_config": {"name": "smoothquant"},
    },
}
#: the function of api.py each algorithm hands a decoder layer and its inputs to, and where those inputs are
PROCESS = {"gptq": ("_gptq_layer", 3), "awq": ("awq_layer", 1), "smoothquant": ("smooth_layer", 1)}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def batches() -> list[dict[str, torch.Tensor]]:
    """Two batches, the second left-padded (so the full-attention mask is a tensor too)."""
    g = torch.Generator().manual_seed(1)
    padded = torch.ones(2, TOKENS, dtype=torch.long)
    padded[1, :5] = 0
    return [
        {"input_ids": torch.randint(0, VOCAB, (2, TOKENS), generator=g), "attention_mask": mask}
        for mask in (torch.ones(2, TOKENS, dtype=torch.long), padded)
    ]


Call = tuple[tuple[Any, ...], dict[str, Any]]


def plain_forward_calls(
    model: nn.Module, data: list[dict[str, torch.Tensor]]
) -> tuple[list[list[Call]], list[list[torch.Tensor]]]:
    """Per layer, the (args, kwargs) the model calls it with and its hidden-state output, per batch."""
    layers = model.model.layers
    calls: list[list[Call]] = [[] for _ in layers]
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):
        handles.append(
            layer.register_forward_pre_hook(lambda m, a, k, i=i: calls[i].append((a, dict(k))), with_kwargs=True)
        )
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: outputs[i].append(hidden_of(o))))
    try:
        with torch.no_grad():
            for batch in data:
                model(**batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls, outputs


def algorithm_inputs(
    name: str, algo: str, monkeypatch: pytest.MonkeyPatch
) -> dict[int, tuple[list[Call], list[torch.Tensor]]]:
    """Per decoder layer, the inputs the algorithm runs it on and the layer's outputs on them; the algorithm's own
    step is replaced by the recording, so the layers stay the float ones."""
    function, position = PROCESS[algo]
    seen: dict[int, tuple[list[Call], list[torch.Tensor]]] = {}

    def record(*args: Any, **kwargs: Any) -> dict[str, float]:
        layer, inputs = args[1 if algo == "gptq" else 0], args[position]
        index = len(seen)
        with torch.no_grad():
            seen[index] = (inputs, [hidden_of(layer(*a, **k)) for a, k in inputs])
        return {}

    monkeypatch.setattr(api, function, record)
    ModelQuantizer(Config.from_dict(copy.deepcopy(CONFIGS[algo]))).quantize_model(build(name), batches())
    return seen


def same_value(a: Any, b: Any) -> bool:
    """Exactly equal: tensors bit for bit (same shape and dtype), tuples element-wise, anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, tuple | list) or isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A decoder layer's hidden-state input: its first positional argument, or ``hidden_states=``."""
    return args[0] if args else kwargs["hidden_states"]


MASKS_AND_ROPE = ("attention_mask", "position_embeddings", "position_ids")


@pytest.mark.parametrize("algo", list(CONFIGS))
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_each_layer_runs_on_the_inputs_the_model_passes_it(
    name: str, algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference_calls, reference_outputs = plain_forward_calls(build(name), batches())
    seen = algorithm_inputs(name, algo, monkeypatch)
    assert sorted(seen) == list(range(len(LAYER_TYPES)))
    for i, (inputs, outputs) in seen.items():
        assert len(inputs) == len(reference_calls[i]) == 2
        for b, ((args, kwargs), (ref_args, ref_kwargs)) in enumerate(zip(inputs, reference_calls[i], strict=True)):
            where = f"layer {i} ({LAYER_TYPES[i]}), batch {b}"
            for key in MASKS_AND_ROPE:
                assert same_value(kwargs.get(key), ref_kwargs.get(key)), f"{key} of {where}"
            torch.testing.assert_close(
                hidden_in(args, kwargs), hidden_in(ref_args, ref_kwargs), rtol=1e-5, atol=1e-6, msg=where
            )
            torch.testing.assert_close(outputs[b], reference_outputs[i][b], rtol=1e-5, atol=1e-6, msg=where)
    for i in range(2, len(LAYER_TYPES)):  # layers of one type share their masks and rope: held once, not copied
        for (_, kwargs), (_, same_type) in zip(seen[i][0], seen[i - 2][0], strict=True):
            assert all(kwargs[key] is same_type[key] for key in MASKS_AND_ROPE)


def test_gemma3_layers_really_get_different_masks_and_rope() -> None:
    """The premise: in a plain forward, full-attention layers get another mask and other rotary embeddings than the
    sliding-attention layers (else the test above could not tell)."""
    calls, _ = plain_forward_calls(build("gemma3"), batches())
    sliding, full = calls[0][1][1], calls[1][1][1]  # batch 1 (padded): both masks are tensors
    assert not same_value(sliding["attention_mask"], full["attention_mask"])
    assert not same_value(sliding["position_embeddings"], full["position_embeddings"])
    assert same_value(sliding["position_embeddings"], calls[2][1][1]["position_embeddings"])


def test_smoothquant_statistics_of_global_layers_come_from_their_own_inputs() -> None:
    """End to end: the scale SmoothQuant folds from v_proj into o_proj of each layer is max|X|^a / max|W|^(1-a) with
    X the input o_proj receives in a plain forward of the float model (it depends on the attention mask and rope)."""
    alpha = 0.5
    model = build("gemma3")
    o_projs = {i: layer.self_attn.o_proj for i, layer in enumerate(model.model.layers)}
    absmax: dict[int, torch.Tensor] = {}

    def record(i: int, x: torch.Tensor) -> None:
        current = x.abs().reshape(-1, x.shape[-1]).amax(dim=0)
        absmax[i] = current if i not in absmax else torch.maximum(absmax[i], current)

    handles = [m.register_forward_pre_hook(lambda m, a, i=i: record(i, a[0])) for i, m in o_projs.items()]
    with torch.no_grad():
        for batch in batches():
            model(**batch, use_cache=False)
    for h in handles:
        h.remove()
    weights = {i: m.weight.detach().clone() for i, m in o_projs.items()}
    config = copy.deepcopy(CONFIGS["smoothquant"])
    config["pre_quant_opt_config"]["alpha"] = alpha
    quantized = ModelQuantizer(Config.from_dict(config)).quantize_model(model, batches())
    for i, layer in enumerate(quantized.model.layers):
        folded = layer.self_attn.o_proj.weight.detach() / weights[i]  # o_proj's columns were multiplied by s
        expected = (absmax[i].pow(alpha) / weights[i].abs().amax(dim=0).pow(1 - alpha)).clamp(min=1e-3)
        torch.testing.assert_close(
            folded.mean(dim=0), expected, rtol=1e-4, atol=1e-6, msg=f"layer {i} ({LAYER_TYPES[i]})"
        )


@pytest.mark.parametrize("algo", ["gptq", "smoothquant"])
def test_llama_layers_get_the_very_objects_of_layer_0(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaMA passes every layer the same mask and rotary embeddings: each layer's keyword arguments are layer 0's
    objects (nothing copied; the same values as before per-layer capture)."""
    seen = algorithm_inputs("llama", algo, monkeypatch)
    assert len(seen) == 4
    first = [kwargs for _, kwargs in seen[0][0]]
    for i in range(1, 4):
        for b, (_, kwargs) in enumerate(seen[i][0]):
            assert kwargs.keys() == first[b].keys()
            for key, value in kwargs.items():
                assert value is first[b][key], f"{key} of layer {i}, batch {b}"
            assert isinstance(first[b]["position_embeddings"], tuple)


class Widening(nn.Module):
    """A layer from ``inp`` to ``out`` features, with a keyword argument."""

    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(inp, out)

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden_states) * scale


class MixedBetweenLayers(nn.Module):
    """A stack whose model code transforms each layer's real output (16 features): a layer that returns its input (8
    features) breaks it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Widening(8, 16), Widening(16, 16)])
        self.mix = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((1,), 2.0)
        for layer in self.layers:
            x = self.mix(layer(x, scale=scale))
        return x


def test_a_model_that_cannot_pass_through_falls_back_to_layer_0_arguments(caplog: pytest.LogCaptureFixture) -> None:
    from quark.torch.algorithm.capture import capture_each_layer_inputs, layer_by_layer

    model = MixedBetweenLayers()
    data = [torch.randn(2, 3, 8), torch.randn(1, 3, 8)]
    with caplog.at_level(logging.WARNING):
        calls = capture_each_layer_inputs(model, model.layers, data, lambda m, x: m(x))
    assert "could not capture each decoder layer's own inputs of MixedBetweenLayers (RuntimeError" in caplog.text
    for b, x in enumerate(data):
        assert torch.equal(calls[0][b][0][0], x) and calls[1][b][0][0] is None
        assert calls[1][b][1]["scale"] is calls[0][b][1]["scale"]
    streamed = [inputs for _, inputs in layer_by_layer(model, model.layers, data, lambda m, x: m(x))]
    with torch.no_grad():
        assert torch.equal(streamed[1][0][0][0], model.layers[0](data[0], scale=torch.full((1,), 2.0)))
    assert all("forward" not in layer.__dict__ for layer in model.layers)  # the real forwards are back


class BiasLayer(nn.Module):
    """A layer returning a tuple as transformers 4.x layers and T5's do: (hidden states, position bias); the first
    layer computes the bias, the model passes it to the others."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bias_table = nn.Parameter(torch.randn(3)) if first else None

    def forward(
        self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if position_bias is None:
            position_bias = self.bias_table.repeat(hidden_states.shape[1] // 3 + 1)[: hidden_states.shape[1], None]
        return self.fc(hidden_states) + position_bias, position_bias


class BiasStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([BiasLayer(first=True), BiasLayer(first=False), BiasLayer(first=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        for layer in self.layers:
            x, bias = layer(x, position_bias=bias)
        return x


def test_tuple_outputs_and_arguments_made_by_an_earlier_layer(caplog: pytest.LogCaptureFixture) -> None:
    """Layers returning tuples: the pass-through keeps the structure (layer 0 runs for real), so the bias layer 0
    computes reaches the later layers, each batch its own (different lengths); layer 0 gets none."""
    from quark.torch.algorithm.capture import capture_each_layer_inputs

    torch.manual_seed(0)
    model = BiasStack()
    data = [torch.randn(2, 5, 8), torch.randn(1, 7, 8)]
    reference: list[list[Call]] = [[] for _ in model.layers]
    handles = [
        layer.register_forward_pre_hook(lambda m, a, k, i=i: reference[i].append((a, dict(k))), with_kwargs=True)
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad():
        for x in data:
            model(x)
    for h in handles:
        h.remove()
    with caplog.at_level(logging.WARNING):
        calls = capture_each_layer_inputs(model, model.layers, data, lambda m, x: m(x))
    assert caplog.text == ""
    for i in range(3):
        for b in range(2):
            assert same_value(calls[i][b][1]["position_bias"], reference[i][b][1]["position_bias"]), (i, b)
    assert calls[0][0][1]["position_bias"] is None and calls[1][1][1]["position_bias"].shape == (7, 1)


def test_captured_layer_calls_never_hold_a_kv_cache() -> None:
    """Whatever a transformers version calls the cache keyword (``past_key_value(s)``, Bloom's ``layer_past``, the
    5.2x layers' ``cache``), captured calls carry None there and ``use_cache=False``; other keywords are kept."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from quark.torch.quantization.hf import CACHE_KWARGS, without_cache

    signature = inspect.signature(LlamaDecoderLayer.forward).parameters
    assert [k for k in signature if k in CACHE_KWARGS], (
        "this transformers' LLaMA layer takes its cache by a name we miss"
    )
    mask = torch.ones(2)
    kwargs = {name: object() for name in CACHE_KWARGS} | {"use_cache": True, "attention_mask": mask}
    assert without_cache(kwargs) == {**dict.fromkeys(CACHE_KWARGS), "use_cache": False, "attention_mask": mask}
