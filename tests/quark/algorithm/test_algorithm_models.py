"""GPTQ, AWQ and SmoothQuant through ModelQuantizer.quantize_model on whole models: a tiny trained LLaMA-named LM
(quark_lightning.tasks.char_lm), models without a decoder stack (MLP, CNN), and a decoder whose layers take keyword arguments.

Quality is judged by output error against the float model (GPTQ vs round-to-nearest), Hessians against ones computed
here from the layers' inputs, failures by the model being exactly as before."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from algo_refs import correlated_inputs, ref_qparams, requantize, spec_dict
from torch import nn

import quark.torch.algorithm.api as algo_api
import quark.torch.algorithm.awq as awq_module
from quark.torch import ModelQuantizer
from quark.torch.algorithm.structure import derive_scaling_groups
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.nn.modules.quant_modules import QuantLinear
from quark_lightning.tasks.char_lm import CharTransformer, load_python_corpus

TINY = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 128, "max_seq_len": 32}
W3 = spec_dict(3, "per_group", 32, sym=False)  # uint3, asymmetric, groups of 32 input features
W8A8 = {"weight": spec_dict(8, "per_channel"), "input_tensors": spec_dict(8, "per_tensor")}
LLAMA_MODULES = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
LLAMA_GROUPS = [
    {
        "prev_op": "input_layernorm",
        "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "inp": "self_attn.q_proj",
        "module2inspect": "self_attn",
    },
    {"prev_op": "self_attn.v_proj", "layers": ["self_attn.o_proj"], "inp": "self_attn.o_proj"},
    {
        "prev_op": "post_attention_layernorm",
        "layers": ["mlp.gate_proj", "mlp.up_proj"],
        "inp": "mlp.gate_proj",
        "module2inspect": "mlp",
    },
    {"prev_op": "mlp.up_proj", "layers": ["mlp.down_proj"], "inp": "mlp.down_proj"},
]


# ----------------------------------------------------------------------------------------------- fixtures, helpers
@pytest.fixture(scope="module")
def corpus() -> dict[str, torch.Tensor]:
    return load_python_corpus(train_bytes=20_000, val_bytes=4_000, test_bytes=4_000)


@pytest.fixture(scope="module")
def lm(corpus) -> CharTransformer:
    """The tiny LM after 30 Adam steps on Python source: weights with structure, not init noise."""
    torch.manual_seed(0)
    model = CharTransformer(**TINY)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = corpus["train"]
    g = torch.Generator().manual_seed(0)
    first = None
    for _ in range(30):
        starts = torch.randint(0, len(tokens) - 33, (16,), generator=g)
        window = torch.stack([tokens[s : s + 33] for s in starts])
        loss = F.cross_entropy(model(window[:, :-1]).reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = float(loss.detach()) if first is None else first
    assert float(loss.detach()) < first - 1.0  # it did learn something (from ~5.5 nats)
    return model.eval()


def _windows(tokens: torch.Tensor, batch: int, length: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([tokens[offset + i * (length + 1) : offset + i * (length + 1) + length + 1] for i in range(batch)])
    return x[:, :-1], x[:, 1:]


@pytest.fixture(scope="module")
def calib(corpus) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_windows(corpus["val"], 4, 32, offset=i * 4 * 33) for i in range(3)]


@pytest.fixture(scope="module")
def held_x(corpus) -> torch.Tensor:
    return _windows(corpus["test"], 8, 32)[0]


def _config(weight: dict[str, Any] | None = None, **kwargs: Any) -> Config:
    return Config.from_dict({"global_quant_config": {"weight": weight or W3}, **kwargs})


def quantized(model: nn.Module, batches: list[Any], weight: dict[str, Any] | None = None, **kwargs: Any) -> nn.Module:
    """A quantized deep copy of ``model`` (``kwargs``: algo_config / pre_quant_opt_config / ...)."""
    return ModelQuantizer(_config(weight, **kwargs)).quantize_model(copy.deepcopy(model), batches)


@torch.no_grad()
def output_error(model: nn.Module, reference: nn.Module, *inputs: torch.Tensor) -> float:
    return float(((model(*inputs) - reference(*inputs)) ** 2).sum())


def snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, type]]]:
    return {k: v.clone() for k, v in model.state_dict().items()}, [(n, type(m)) for n, m in model.named_modules()]


def assert_same_model(model: nn.Module, snap: tuple[dict[str, torch.Tensor], list[tuple[str, type]]]) -> None:
    state, modules = snap
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    now = model.state_dict()
    assert list(now) == list(state)
    for key, value in state.items():
        assert torch.equal(now[key], value), key
    assert "quant_config" not in model.__dict__


def assert_states_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def record_gptq(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Per quantized layer: the Hessian (and its row count) and the GPTQResult, as the driver produced them."""
    records: dict[str, dict[str, Any]] = {}
    results: list[Any] = []
    real_quantize, real_gptq = algo_api._quantize_module, algo_api.gptq_quantize

    def gptq(*args: Any, **kwargs: Any) -> Any:
        results.append(real_gptq(*args, **kwargs))
        return results[-1]

    taken: dict[int, torch.Tensor] = {}  # the driver takes a shared accumulator's Hessian at its first module

    def quantize_module(name: str, module: nn.Module, hessian: Any, *args: Any) -> None:
        if hessian.hessian is not None:
            taken[id(hessian)] = hessian.hessian.clone()
        real_quantize(name, module, hessian, *args)
        records[name] = {"hessian": taken[id(hessian)], "count": hessian.count, "result": results[-1]}

    monkeypatch.setattr(algo_api, "gptq_quantize", gptq)
    monkeypatch.setattr(algo_api, "_quantize_module", quantize_module)
    return records


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


# ----------------------------------------------------------------------------------------------- GPTQ on the LM
@pytest.mark.parametrize("desc_act", [False, True])
def test_lm_gptq_beats_rtn_keeps_its_qparams_and_freezes(lm, calib, held_x, monkeypatch, desc_act: bool) -> None:
    rtn = quantized(lm, calib)
    records = record_gptq(monkeypatch)
    gptq = quantized(lm, calib, algo_config={"name": "gptq", "desc_act": desc_act})
    assert output_error(gptq, lm, held_x) < 0.5 * output_error(rtn, lm, held_x)  # measured 0.02x - 0.06x

    linears = quant_linears(gptq)
    assert set(records) == set(linears) and len(linears) == 2 * 7 + 1  # every decoder linear and lm_head
    for name, module in linears.items():
        result, quantizer = records[name]["result"], module._weight_quantizer
        # the weight is GPTQ's result exactly, and GPTQ's qparams are what the quantizer holds
        assert torch.equal(module.weight, result.weight), name
        assert torch.equal(quantizer.scale, result.scale) and torch.equal(quantizer.zero_point, result.zero_point)
        assert quantizer.scale.shape == (module.out_features, module.in_features // 32)
        # its fake quantization leaves the weight as it is; so does torch's kernel with those qparams
        assert torch.equal(quantizer(module.weight), module.weight)
        assert torch.equal(requantize(module.weight, quantizer.scale, quantizer.zero_point, 3, False), module.weight)
    # not re-observed: at least some groups' min-max qparams of the final weight differ from GPTQ's
    assert any(
        not torch.equal(ref_qparams(m.weight.detach(), 3, False, 32)[0], m._weight_quantizer.scale)
        for m in linears.values()
    )

    with torch.no_grad():
        before = gptq(held_x)
    frozen = ModelQuantizer.freeze(gptq)
    with torch.no_grad():
        torch.testing.assert_close(frozen(held_x), before, rtol=0, atol=0)
    for name, module in quant_linears(frozen).items():
        assert torch.equal(module._weight_quantizer.scale, records[name]["result"].scale)


def test_lm_batch_formats_tuple_dict_tensor_give_the_same_result(lm, calib) -> None:
    algo = {"name": "gptq", "desc_act": False}
    as_tuples = quantized(lm, calib, algo_config=algo)
    as_dicts = quantized(lm, [{"input_ids": x} for x, _ in calib], algo_config=algo)
    as_tensors = quantized(lm, [x for x, _ in calib], algo_config=algo)
    assert_states_equal(as_tuples, as_dicts)
    assert_states_equal(as_tuples, as_tensors)


def test_lm_batches_of_different_lengths(lm, corpus, monkeypatch) -> None:
    batches = [
        _windows(corpus["val"], 4, 12),
        _windows(corpus["val"], 3, 20, offset=400),
        _windows(corpus["val"], 2, 32, offset=900),
    ]
    n_rows = 4 * 12 + 3 * 20 + 2 * 32
    # the float inputs of layer 0's q_proj (nothing before it is quantized): the reference Hessian
    rows: list[torch.Tensor] = []
    handle = lm.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, args: rows.append(args[0].reshape(-1, 64))
    )
    with torch.no_grad():
        for x, _ in batches:
            lm(x)
    handle.remove()
    x = torch.cat(rows).double()
    expected = 2.0 / x.shape[0] * x.T @ x

    records = record_gptq(monkeypatch)
    model = quantized(lm, batches, algo_config={"name": "gptq"})
    assert all(r["count"] == n_rows for r in records.values())  # every batch, at its own length, in every layer
    torch.testing.assert_close(
        records["model.layers.0.self_attn.q_proj"]["hessian"].double(), expected, rtol=1e-4, atol=1e-5
    )
    # q, k and v share one input: one pass, one Hessian
    for name in ("k_proj", "v_proj"):
        assert torch.equal(
            records[f"model.layers.0.self_attn.{name}"]["hessian"],
            records["model.layers.0.self_attn.q_proj"]["hessian"],
        )
    with torch.no_grad():
        assert model(batches[0][0]).shape == (4, 12, 256)


@pytest.mark.parametrize(
    "derived, explicit",
    [
        (
            {"algo_config": {"name": "gptq"}},
            {
                "algo_config": {
                    "name": "gptq",
                    "model_decoder_layers": "model.layers",
                    "inside_layer_modules": LLAMA_MODULES,
                }
            },
        ),
        (
            {"algo_config": {"name": "awq"}},
            {"algo_config": {"name": "awq", "model_decoder_layers": "model.layers", "scaling_layers": LLAMA_GROUPS}},
        ),
        (
            {"pre_quant_opt_config": {"name": "smoothquant", "alpha": 0.5}},
            {
                "pre_quant_opt_config": {
                    "name": "smoothquant",
                    "alpha": 0.5,
                    "model_decoder_layers": "layers",
                    "scaling_layers": LLAMA_GROUPS,
                }
            },
        ),
    ],
    ids=["gptq", "awq", "smoothquant"],
)
def test_explicit_structure_equal_to_the_derived_one_gives_the_same_result(lm, calib, derived, explicit) -> None:
    a = quantized(lm, calib, **derived)
    b = quantized(lm, calib, **explicit)
    assert_states_equal(a, b)
    changed = [k for k, v in a.state_dict().items() if k in lm.state_dict() and not torch.equal(v, lm.state_dict()[k])]
    assert changed  # the algorithm did change the model (weights, norms)


def test_lm_gptq_inside_layer_modules_subset(lm, calib, monkeypatch) -> None:
    records = record_gptq(monkeypatch)
    model = quantized(
        lm, calib, algo_config={"name": "gptq", "inside_layer_modules": ["mlp.down_proj", "self_attn.o_proj"]}
    )
    assert list(records) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.self_attn.o_proj",
        "lm_head",
    ]
    for i in range(2):  # the others keep their float weights (round-to-nearest at run time)
        assert torch.equal(model.model.layers[i].self_attn.q_proj.weight, lm.model.layers[i].self_attn.q_proj.weight)
        assert not torch.equal(model.model.layers[i].mlp.down_proj.weight, lm.model.layers[i].mlp.down_proj.weight)


# ----------------------------------------------------------------------------------------------- AWQ, SmoothQuant, lists
def test_lm_awq_and_awq_then_gptq(lm, calib, held_x) -> None:
    x_calib = torch.cat([x for x, _ in calib])
    rtn = quantized(lm, calib)
    awq = quantized(lm, calib, algo_config={"name": "awq"})
    both = quantized(lm, calib, algo_config=[{"name": "awq"}, {"name": "gptq"}])
    gptq = quantized(lm, calib, algo_config={"name": "gptq"})
    for model in (awq, both):  # AWQ ran: its scales are folded into the norms (a ratio of 0, i.e. RTN, keeps one)
        for layer, ref in zip(model.model.layers, lm.model.layers, strict=True):
            norms = ("input_layernorm", "post_attention_layernorm")
            assert any(not torch.equal(getattr(layer, n).weight, getattr(ref, n).weight) for n in norms)
    assert output_error(awq, lm, x_calib) < output_error(rtn, lm, x_calib)
    assert output_error(both, lm, held_x) < 0.5 * output_error(rtn, lm, held_x)
    assert not torch.equal(both.lm_head.weight, gptq.lm_head.weight)
    for module in quant_linears(both).values():  # GPTQ ran last: the weights are on its grid
        assert torch.equal(module._weight_quantizer(module.weight), module.weight)


def _with_outlier_channels(lm: CharTransformer, factor: float = 30.0) -> CharTransformer:
    """The same function with a few huge activation channels after each norm (what large LLMs show)."""
    model = copy.deepcopy(lm)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, linears in (
                (layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                (layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj]),
            ):
                idx = torch.tensor([5, 17, 40])
                norm.weight[idx] *= factor
                for lin in linears:
                    lin.weight[:, idx] /= factor
    return model


def test_smoothquant_in_algo_config_runs_as_in_pre_quant_opt_config(lm, calib, held_x) -> None:
    """amd-quark 0.13 places SmoothQuantConfig in algo_config: it runs there (not silently skipped), with the same
    result as from pre_quant_opt_config, and before an AWQ that follows it in the list."""
    outliers = _with_outlier_channels(lm)
    sq = {"name": "smoothquant", "alpha": 0.5}
    pre = quantized(outliers, calib, global_quant_config=W8A8, pre_quant_opt_config=sq)
    algo = quantized(outliers, calib, global_quant_config=W8A8, algo_config=sq)
    naive = quantized(outliers, calib, global_quant_config=W8A8)
    with torch.no_grad():
        assert torch.equal(algo(held_x), pre(held_x))
        assert not torch.equal(algo(held_x), naive(held_x))
    for layer, ref in zip(algo.model.layers, outliers.model.layers, strict=True):
        assert not torch.equal(layer.input_layernorm.weight, ref.input_layernorm.weight)
    with pytest.raises(ValueError, match="CLEConfig, which runs from pre_quant_opt_config only"):
        Config.from_dict({"global_quant_config": {"weight": W3}, "algo_config": {"name": "cle"}})


def test_lm_smoothquant_keeps_the_float_function_and_helps_w8a8_with_outliers(lm, calib, held_x) -> None:
    outliers = _with_outlier_channels(lm)
    naive = quantized(outliers, calib, global_quant_config=W8A8)
    smooth = quantized(
        outliers, calib, global_quant_config=W8A8, pre_quant_opt_config={"name": "smoothquant", "alpha": 0.5}
    )
    assert output_error(smooth, outliers, held_x) < 0.5 * output_error(naive, outliers, held_x)
    for _, q in iter_quantizers(smooth):
        q.disable_fake_quant()
    with torch.no_grad():  # with every quantizer off: the float function of the original model
        torch.testing.assert_close(smooth(held_x), outliers(held_x), rtol=1e-4, atol=1e-4)
    assert not torch.equal(
        smooth.model.layers[0].input_layernorm.weight, outliers.model.layers[0].input_layernorm.weight
    )
    assert not torch.equal(smooth.model.layers[1].mlp.gate_proj.weight, outliers.model.layers[1].mlp.gate_proj.weight)


# ----------------------------------------------------------------------------------------------- models without a decoder stack
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, stride=2)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.c2(F.relu(self.c1(x)))).mean(dim=(2, 3)))


def test_mlp_gptq_layer_by_layer_beats_rtn(monkeypatch) -> None:
    torch.manual_seed(10)
    model = MLP().eval()
    x = correlated_inputs(256, 48, rank=8, seed=11)
    batches = [(chunk, None) for chunk in x[:192].split(64)]
    held_out = x[192:]
    weight = spec_dict(3, "per_channel")
    rtn = quantized(model, batches, weight=weight)
    records = record_gptq(monkeypatch)
    gptq = quantized(model, batches, weight=weight, algo_config={"name": "gptq"})
    assert list(records) == ["fc1", "fc2", "fc3"]  # forward order, one at a time
    assert all(r["count"] == 192 for r in records.values())
    assert output_error(gptq, model, held_out) < 0.5 * output_error(rtn, model, held_out)
    # fc2 saw the outputs of the already quantized fc1 (sequential), not the float ones
    with torch.no_grad():
        h = F.relu(F.linear(x[:192], gptq.fc1.weight, gptq.fc1.bias)).double()
    torch.testing.assert_close(records["fc2"]["hessian"].double(), 2.0 / 192 * h.T @ h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", ["per_channel", "per_group"])
def test_cnn_gptq_layer_by_layer_beats_rtn(scheme: str) -> None:
    torch.manual_seed(12)
    model = CNN().eval()
    images = F.avg_pool2d(torch.randn(24, 3, 16, 16), 5, stride=1, padding=2)  # smooth images: correlated patches
    batches = [(chunk,) for chunk in images[:16].split(8)]
    weight = spec_dict(3, "per_channel") if scheme == "per_channel" else spec_dict(3, "per_group", 4, sym=False)
    extra = {"layer_quant_config": {"c1": {"weight": spec_dict(3, "per_channel")}}}  # 3 input channels: no groups of 4
    rtn = quantized(model, batches, weight=weight, **extra)
    gptq = quantized(model, batches, weight=weight, algo_config={"name": "gptq"}, **extra)
    assert output_error(gptq, model, images[16:]) < 0.5 * output_error(rtn, model, images[16:])  # measured ~0.01x
    for name in ("c1", "c2", "head"):
        q_gptq, q_rtn = getattr(gptq, name)._weight_quantizer, getattr(rtn, name)._weight_quantizer
        assert q_gptq.scale.shape == q_rtn.scale.shape  # the quantizer's own qparams layout
        assert torch.equal(q_gptq(getattr(gptq, name).weight), getattr(gptq, name).weight)


# ----------------------------------------------------------------------------------------------- failures leave the model as it was
def test_failure_midway_restores_the_model(lm, calib, monkeypatch) -> None:
    model = copy.deepcopy(lm)
    snap = snapshot(model)
    real, calls = algo_api.gptq_quantize, []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 9:  # in the second decoder layer, after AWQ and eight GPTQ layers changed weights
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(algo_api, "gptq_quantize", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        ModelQuantizer(_config(algo_config=[{"name": "awq"}, {"name": "gptq"}])).quantize_model(model, calib)
    assert len(calls) == 9
    assert_same_model(model, snap)


def test_awq_failure_midway_restores_the_norms(lm, calib, monkeypatch) -> None:
    model = copy.deepcopy(lm)
    snap = snapshot(model)
    real, calls = awq_module._search_clip, []

    def flaky(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 8:  # second decoder layer: the first one's norms are already rescaled
            raise RuntimeError("clip failed")
        real(*args, **kwargs)

    monkeypatch.setattr(awq_module, "_search_clip", flaky)
    with pytest.raises(RuntimeError, match="clip failed"):
        ModelQuantizer(_config(algo_config={"name": "awq"})).quantize_model(model, calib)
    assert_same_model(model, snap)


# ----------------------------------------------------------------------------------------------- errors
def test_awq_and_smoothquant_need_a_decoder_stack() -> None:
    model = MLP()
    snap = snapshot(model)
    batches = [torch.randn(4, 48)]
    for algo in ({"algo_config": {"name": "awq"}}, {"pre_quant_opt_config": {"name": "smoothquant"}}):
        with pytest.raises(ValueError, match="model_decoder_layers"):
            ModelQuantizer(_config(spec_dict(4, "per_group", 16, sym=False), **algo)).quantize_model(model, batches)
        assert_same_model(model, snap)


def test_structure_errors(lm, calib) -> None:
    model = copy.deepcopy(lm)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"model_decoder_layers='model\.blocks'.*model\.layers"):
        ModelQuantizer(_config(algo_config={"name": "gptq", "model_decoder_layers": "model.blocks"})).quantize_model(
            model, calib
        )
    with pytest.raises(ValueError, match=r"inside_layer_modules \['self_attn\.nope'\]"):
        ModelQuantizer(
            _config(algo_config={"name": "gptq", "inside_layer_modules": ["self_attn.nope"]})
        ).quantize_model(model, calib)
    bad_group = [{"prev_op": "input_layernorm", "layers": ["self_attn.qkv"]}]
    with pytest.raises(ValueError, match=r"scaling_layers\[0\] names \['self_attn\.qkv'.*'self_attn\.q_proj'"):
        ModelQuantizer(_config(algo_config={"name": "awq", "scaling_layers": bad_group})).quantize_model(model, calib)
    assert_same_model(model, snap)


def test_algorithms_need_a_dataloader(lm, calib) -> None:
    model = copy.deepcopy(lm)
    snap = snapshot(model)
    for algo in (
        {"algo_config": {"name": "gptq"}},
        {"algo_config": {"name": "awq"}},
        {"pre_quant_opt_config": {"name": "smoothquant"}},
    ):
        with pytest.raises(ValueError, match="dataloader"):
            ModelQuantizer(_config(**algo)).quantize_model(model, forward_loop=lambda m: m(calib[0][0]))
        assert_same_model(model, snap)


# ----------------------------------------------------------------------------------------------- decoder layers with keyword arguments
class KwLayer(nn.Module):
    """A decoder layer called as layer(h, attention_mask=mask): padded positions are zeroed before each block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, None]:
        m = attention_mask.unsqueeze(-1).to(hidden_states.dtype)
        h = hidden_states + self.self_attn(hidden_states * m)
        return (h + self.mlp(h * m), None)  # a tuple, as Hugging Face layers return


class KwModel(nn.Module):
    def __init__(self, d: int = 32, keyword_hidden: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(KwLayer(d) for _ in range(2))
        self.head = nn.Linear(d, 50)
        self.keyword_hidden = keyword_hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = (
                layer(hidden_states=h, attention_mask=attention_mask)
                if self.keyword_hidden
                else layer(h, attention_mask=attention_mask)
            )[0]
        return self.head(h)


@pytest.mark.parametrize("keyword_hidden", [False, True])
def test_decoder_layers_with_keyword_arguments(keyword_hidden: bool, monkeypatch) -> None:
    torch.manual_seed(13)
    model = KwModel(keyword_hidden=keyword_hidden).eval()
    g = torch.Generator().manual_seed(14)
    batches = []
    for b, t in ((3, 10), (2, 16), (4, 7)):  # every batch its own length and its own padding mask
        ids = torch.randint(0, 50, (b, t), generator=g)
        lengths = torch.randint(2, t + 1, (b,), generator=g)
        batches.append({"input_ids": ids, "attention_mask": (torch.arange(t) < lengths.unsqueeze(1)).long()})
    records = record_gptq(monkeypatch)
    qmodel = quantized(
        model,
        batches,
        weight=spec_dict(4, "per_channel"),
        algo_config={"name": "gptq", "model_decoder_layers": "layers"},
    )

    def hessian(rows: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(rows).double()
        return 2.0 / x.shape[0] * x.T @ x

    def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:  # with the GPTQ weight, no quantizer
        return F.linear(x, module.weight, module.bias)

    with torch.no_grad():  # inputs masked per batch; each module sees the outputs of the ones quantized before it
        attn_rows, mlp_rows, next_rows = [], [], []
        for batch in batches:
            m = batch["attention_mask"].unsqueeze(-1).float()
            h = model.embed(batch["input_ids"])
            layer = qmodel.layers[0]
            attn_rows.append((h * m).reshape(-1, 32))
            h1 = h + linear(layer.self_attn, h * m)
            mlp_rows.append((h1 * m).reshape(-1, 32))
            h2 = h1 + linear(layer.mlp[2], F.relu(linear(layer.mlp[0], h1 * m)))
            next_rows.append((h2 * m).reshape(-1, 32))
    torch.testing.assert_close(
        records["layers.0.self_attn"]["hessian"].double(), hessian(attn_rows), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(records["layers.0.mlp.0"]["hessian"].double(), hessian(mlp_rows), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        records["layers.1.self_attn"]["hessian"].double(), hessian(next_rows), rtol=1e-4, atol=1e-5
    )
    assert set(records) == {f"layers.{i}.{n}" for i in range(2) for n in ("self_attn", "mlp.0", "mlp.2")} | {"head"}
    with torch.no_grad():
        assert qmodel(**batches[1]).shape == (2, 16, 50)


def test_gptq_without_true_sequential_takes_every_hessian_from_the_float_layer(monkeypatch) -> None:
    torch.manual_seed(15)
    model = KwModel().eval()
    batch = {"input_ids": torch.randint(0, 50, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.long)}
    records = record_gptq(monkeypatch)
    algo = {"name": "gptq", "true_sequential": False, "model_decoder_layers": "layers"}
    qmodel = quantized(model, [batch], weight=spec_dict(4, "per_channel"), algo_config=algo)
    with torch.no_grad():
        h = model.embed(batch["input_ids"])
        float_rows = (h + model.layers[0].self_attn(h)).reshape(-1, 32).double()
        quantized_rows = (h + F.linear(h, qmodel.layers[0].self_attn.weight, qmodel.layers[0].self_attn.bias)).reshape(
            -1, 32
        )
    hessian = records["layers.0.mlp.0"]["hessian"].double()
    torch.testing.assert_close(hessian, 2.0 / float_rows.shape[0] * float_rows.T @ float_rows, rtol=1e-4, atol=1e-5)
    quantized_rows = quantized_rows.double()
    assert not torch.allclose(
        hessian, 2.0 / quantized_rows.shape[0] * quantized_rows.T @ quantized_rows, rtol=1e-4, atol=1e-5
    )


def test_unknown_layout_needs_scaling_layers() -> None:
    with pytest.raises(
        ValueError, match=r"cannot derive scaling_layers.*\['self_attn', 'mlp', 'mlp\.0', 'mlp\.1', 'mlp\.2'\]"
    ):
        derive_scaling_groups(KwLayer(8))
    model = KwModel()
    snap = snapshot(model)
    batches = [{"input_ids": torch.randint(0, 50, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long)}]
    with pytest.raises(ValueError, match="Give scaling_layers explicitly"):
        ModelQuantizer(_config(algo_config={"name": "awq", "model_decoder_layers": "layers"})).quantize_model(
            model, batches
        )
    assert_same_model(model, snap)
    assert not any(isinstance(m, QuantMixin) for m in model.modules())


def test_gptq_conv_groups_must_run_along_input_channels() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, (1, 4)))
    snap = snapshot(model)
    weight = {**spec_dict(4, "per_group", 2, sym=False), "ch_axis": -1}  # groups along the kernel width
    with pytest.raises(ValueError, match=r"layer '0'.*ch_axis=1"):
        ModelQuantizer(_config(weight, algo_config={"name": "gptq"})).quantize_model(model, [torch.randn(2, 4, 3, 8)])
    assert_same_model(model, snap)
