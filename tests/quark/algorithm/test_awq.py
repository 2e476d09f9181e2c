"""AWQ per decoder layer: the scale search against round-to-nearest and its closed form, folding (the float function
does not change), and the clipping search per output row and input group. References are computed here."""

from __future__ import annotations

import copy

import pytest
import torch
from algo_refs import make_spec, ref_rtn
from torch import nn

import quark.torch.algorithm.awq as awq_module
from quark.torch.algorithm.awq import CLIP_GRID, CLIP_STEPS, N_GRID, awq_layer, rtn
from quark.torch.algorithm.smoothquant import fold_scales
from quark.torch.quantization.config.config import AWQConfig, QuantizationSpec
from quark_lightning.tasks.char_lm import DecoderLayer

D, OUT = 32, 48
OUTLIERS = torch.tensor([3, 11, 20])


class NormBlock(nn.Module):
    """norm -> two linears reading the same normalised input (a q/k/v-like scaling group)."""

    def __init__(self, norm: str = "rms") -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D) if norm == "rms" else nn.LayerNorm(D)
        self.a = nn.Linear(D, OUT)
        self.b = nn.Linear(D, OUT, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y = self.norm(hidden_states)
        return torch.cat([self.a(y), self.b(y)], dim=-1)


GROUP = [{"prev_op": "norm", "layers": ["a", "b"], "inp": "a"}]


def _block(norm: str = "rms", seed: int = 0) -> NormBlock:
    torch.manual_seed(seed)
    block = NormBlock(norm)
    with torch.no_grad():
        block.norm.weight.copy_(1 + 0.1 * torch.randn(D))
        block.norm.weight[OUTLIERS] = 25.0  # outlier input channels of the linears
        if norm == "layer":
            block.norm.bias.copy_(0.1 * torch.randn(D))
    return block.eval()


def _inputs(seed: int = 1, batches: int = 3, tokens: int = 40) -> list:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(2, tokens, D, generator=g) + 0.5,), {}) for _ in range(batches)]


def _specs(spec: QuantizationSpec | None, names: list[str], prefix: str = "blk"):
    table = {f"{prefix}.{n}": spec for n in names}
    return lambda name: table.get(name)


@pytest.fixture
def no_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scale search and folding only (clipping changes the float weights on purpose)."""
    monkeypatch.setattr(awq_module, "_search_clip", lambda *args, **kwargs: None)


def _group_error(
    x: torch.Tensor, weights: list[torch.Tensor], quantized: list[torch.Tensor], reference: list[torch.Tensor]
) -> float:
    """Sum of squared output errors of the group's linears (biases cancel)."""
    return sum(
        float(((x.double() @ q.double().T) - r.double()).pow(2).sum())
        for q, r in zip(quantized, reference, strict=True)
    )


# ----------------------------------------------------------------------------------------------- scale search
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("scheme", [(4, "per_group", 16, False), (3, "per_channel", None, True)])
def test_scale_search_loss_not_above_rtn_and_is_the_grid_minimum(no_clip, norm: str, scheme) -> None:
    bits, qscheme, group, sym = scheme
    block = _block(norm)
    inputs = _inputs()
    original = copy.deepcopy(block)
    with torch.no_grad():
        x = torch.cat([original.norm(a[0]).reshape(-1, D) for a, _ in inputs])
    w = [original.a.weight.detach(), original.b.weight.detach()]
    reference = [x @ wi.T for wi in w]

    ratios = awq_layer(
        block, inputs, AWQConfig(scaling_layers=GROUP), "blk", _specs(make_spec(bits, qscheme, group, sym), ["a", "b"])
    )
    ratio = ratios["norm"]
    assert 0.0 < ratio < 1.0  # the outlier channels are worth protecting

    # folding: the norm's weight (and bias) divided by s, the linears' input columns multiplied by s
    s = original.norm.weight.detach() / block.norm.weight.detach()
    torch.testing.assert_close(block.a.weight, original.a.weight * s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block.b.weight, original.b.weight * s, rtol=1e-5, atol=1e-6)
    if norm == "layer":
        torch.testing.assert_close(block.norm.bias, original.norm.bias / s, rtol=1e-5, atol=1e-6)
    # the scale is AWQ's closed form: mean|x|^ratio, normalised by sqrt(max * min)
    expected = x.abs().mean(dim=0).pow(ratio).clamp(min=1e-4)
    expected = expected / (expected.max() * expected.min()).sqrt()
    torch.testing.assert_close(s, expected, rtol=1e-4, atol=1e-6)

    def loss(scale: torch.Tensor) -> float:
        quantized = [ref_rtn(wi * scale, bits, sym, group) / scale for wi in w]
        return _group_error(x, w, quantized, reference)

    rtn_loss = loss(torch.ones(D))
    chosen = loss(s)
    grid = []
    for i in range(N_GRID):
        si = x.abs().mean(dim=0).pow(i / N_GRID).clamp(min=1e-4)
        grid.append(loss(si / (si.max() * si.min()).sqrt()))
    assert chosen <= rtn_loss * (1 + 1e-6)
    assert chosen < 0.95 * rtn_loss  # strictly better here: outliers are what AWQ is for
    assert chosen == pytest.approx(min(grid), rel=1e-4)
    # and the quantized model's output is exactly that: (X / s) rtn(W s)^T
    with torch.no_grad():
        x_new = torch.cat([block.norm(a[0]).reshape(-1, D) for a, _ in inputs])
    quantized_new = [
        ref_rtn(block.a.weight.detach(), bits, sym, group),
        ref_rtn(block.b.weight.detach(), bits, sym, group),
    ]
    assert sum(
        float(((x_new.double() @ q.double().T) - r.double()).pow(2).sum())
        for q, r in zip(quantized_new, reference, strict=True)
    ) == pytest.approx(chosen, rel=1e-3)


def test_no_spec_no_search(no_clip) -> None:
    block = _block()
    before = copy.deepcopy(block.state_dict())
    assert awq_layer(block, _inputs(), AWQConfig(scaling_layers=GROUP), "blk", _specs(None, [])) == {}
    assert all(torch.equal(v, block.state_dict()[k]) for k, v in before.items())


# ----------------------------------------------------------------------------------------------- folding, decoder layer
def _llama_layer(seed: int = 2) -> DecoderLayer:
    torch.manual_seed(seed)
    layer = DecoderLayer(d_model=32, n_heads=4, d_ff=64)
    with torch.no_grad():
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight[OUTLIERS] = 20.0
    return layer.eval()


LLAMA_LINEARS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def test_folding_keeps_the_float_function_of_a_decoder_layer(no_clip) -> None:
    layer = _llama_layer()
    original = copy.deepcopy(layer)
    inputs = [((torch.randn(2, 12, 32),), {}), ((torch.randn(3, 7, 32),), {})]  # two sequence lengths
    ratios = awq_layer(
        layer,
        inputs,
        AWQConfig(),
        "model.layers.0",
        _specs(make_spec(4, "per_group", 16, False), LLAMA_LINEARS, "model.layers.0"),
    )
    assert set(ratios) == {"input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"}
    assert all(r > 0 for r in ratios.values())  # every group rescaled: the folds below are not identities
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj"):
        assert not torch.equal(layer.get_submodule(name).weight, original.get_submodule(name).weight)
    with torch.no_grad():
        for ((args, _),) in zip(inputs, strict=True):
            torch.testing.assert_close(layer(*args), original(*args), rtol=1e-4, atol=1e-5)
    # a linear -> linear fold (v_proj -> o_proj): v's output rows divided, o's input columns multiplied, same s
    s_norm = original.input_layernorm.weight / layer.input_layernorm.weight
    s_vo = (original.self_attn.v_proj.weight * s_norm)[:, 0] / layer.self_attn.v_proj.weight[:, 0]
    torch.testing.assert_close(
        layer.self_attn.o_proj.weight, original.self_attn.o_proj.weight * s_vo, rtol=1e-4, atol=1e-6
    )


def test_q_and_k_are_not_clipped_the_others_are() -> None:
    torch.manual_seed(3)
    layer = _llama_layer()
    with torch.no_grad():  # heavy-tailed weights: clipping pays off somewhere
        for name in LLAMA_LINEARS:
            w = layer.get_submodule(name).weight
            w.copy_(torch.distributions.StudentT(2.0).sample(w.shape) * 0.05)
    inputs = [((torch.randn(2, 16, 32),), {})]
    specs = _specs(make_spec(3, "per_group", 16, False), LLAMA_LINEARS, "p")
    scaled_only = copy.deepcopy(layer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(awq_module, "_search_clip", lambda *args, **kwargs: None)
        awq_layer(scaled_only, inputs, AWQConfig(), "p", specs)
    awq_layer(layer, inputs, AWQConfig(), "p", specs)
    for name in ("self_attn.q_proj", "self_attn.k_proj"):
        assert torch.equal(layer.get_submodule(name).weight, scaled_only.get_submodule(name).weight)
    clipped = [
        n
        for n in LLAMA_LINEARS[2:]
        if not torch.equal(layer.get_submodule(n).weight, scaled_only.get_submodule(n).weight)
    ]
    assert clipped
    for name in clipped:  # clipping only ever shrinks magnitudes
        assert bool((layer.get_submodule(name).weight.abs() <= scaled_only.get_submodule(name).weight.abs()).all())


def test_fold_scales_into_layernorm_with_bias_and_errors() -> None:
    torch.manual_seed(4)
    norm, lin = nn.LayerNorm(8), nn.Linear(8, 5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(6, 8)
    with torch.no_grad():
        before = lin(norm(x))
        fold_scales(norm, [lin], torch.rand(8) * 3 + 0.1, "test")
        torch.testing.assert_close(lin(norm(x)), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ReLU"):
        fold_scales(nn.ReLU(), [lin], torch.ones(8), "test")


# ----------------------------------------------------------------------------------------------- clipping
class OneLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 12, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden_states)


def _per_row_group_error(x: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """mean over tokens of (x_g . delta_rg)^2 for every output row r and input group g: [rows, groups]."""
    rows, columns = delta.shape
    xg = x.double().reshape(x.shape[0], columns // group, group)
    dg = delta.double().reshape(rows, columns // group, group)
    return torch.einsum("tgc,rgc->trg", xg, dg).pow(2).mean(dim=0)


def _row_error(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """sum over tokens of (x . delta_r)^2 for every output row r: [rows]."""
    return (x.double() @ delta.double().T).pow(2).sum(dim=0)


def _clip_only(w: torch.Tensor, inputs: list, spec: QuantizationSpec) -> torch.Tensor:
    layer = OneLinear()
    with torch.no_grad():
        layer.fc.weight.copy_(w)
    assert awq_layer(layer, inputs, AWQConfig(scaling_layers=[]), "blk", _specs(spec, ["fc"])) == {}  # clipping only
    return layer.fc.weight.detach()


@pytest.mark.parametrize("scheme", [(3, "per_group", 16, False), (4, "per_channel", None, True)])
def test_clipping_never_increases_the_output_error(scheme, monkeypatch) -> None:
    bits, qscheme, group, sym = scheme
    torch.manual_seed(5)
    w = torch.distributions.StudentT(2.0).sample((12, 64)) * 0.1
    g = torch.Generator().manual_seed(6)
    inputs = [((torch.randn(4, 25, 64, generator=g),), {}) for _ in range(2)]  # every token counts
    x = torch.cat([a[0].reshape(-1, 64) for a, _ in inputs])
    spec = make_spec(bits, qscheme, group, sym)
    size = group or 64

    def on_grid(clipped: torch.Tensor) -> None:
        """Every (row, group) is the original clamped to a grid fraction (1.0 .. 0.55) of its own max magnitude."""
        wg, cg = w.reshape(12, -1, size), clipped.reshape(12, -1, size)
        threshold = cg.abs().amax(dim=-1, keepdim=True)
        fraction = threshold / wg.abs().amax(dim=-1, keepdim=True)
        steps = (1 - fraction) * CLIP_GRID
        assert bool(((steps - steps.round()).abs() < 1e-3).all())
        assert float(fraction.min()) >= 1 - (CLIP_STEPS - 1) / CLIP_GRID - 1e-6
        torch.testing.assert_close(cg, torch.maximum(torch.minimum(wg, threshold), -threshold))

    # AWQ's own choice: per (row, group), the least error of the group's partial output
    with monkeypatch.context() as mp:
        mp.setattr(awq_module, "CLIP_SWEEPS", 0)
        per_group = _clip_only(w, inputs, spec)
    before = _per_row_group_error(x, ref_rtn(w, bits, sym, group) - w, size)
    after = _per_row_group_error(x, ref_rtn(per_group, bits, sym, group) - w, size)
    assert bool((after <= before * (1 + 1e-6) + 1e-12).all())
    assert bool((after < 0.95 * before).any())  # heavy tails: clipping does help somewhere
    on_grid(per_group)
    # then row-wise sweeps (cross-group terms included): each row's output error only goes down
    clipped = _clip_only(w, inputs, spec)
    on_grid(clipped)
    rows_before = _row_error(x, ref_rtn(per_group, bits, sym, group) - w)
    rows_after = _row_error(x, ref_rtn(clipped, bits, sym, group) - w)
    assert bool((rows_after <= rows_before * (1 + 1e-5) + 1e-9).all())
    assert bool((rows_after <= _row_error(x, ref_rtn(w, bits, sym, group) - w) * (1 + 1e-5)).all())
    if qscheme == "per_group":
        assert bool((rows_after < 0.99 * rows_before).any())  # the sweeps found something here


def test_rtn_helper() -> None:
    w = torch.randn(6, 32)
    assert rtn(w, None) is w
    assert torch.equal(rtn(w, make_spec(3, "per_group", 8, False)), ref_rtn(w, 3, False, 8))


# ----------------------------------------------------------------------------------------------- merged calls
def test_merge_concatenates_batches_keeps_shared_arguments_and_splits_what_does_not_fit(monkeypatch) -> None:
    shared = torch.randn(1, 5, 4)
    calls = [
        ((torch.randn(1, 5, 8),), {"rope": (shared, shared.clone()), "ids": torch.full((1, 5), i), "flag": False})
        for i in range(3)
    ]
    calls.append(((torch.randn(1, 6, 8),), {"rope": (shared, shared), "ids": torch.zeros(1, 6), "flag": False}))
    calls.append(((torch.randn(2, 5, 8),), {"rope": (shared, shared), "ids": torch.zeros(2, 5), "flag": True}))
    merged = awq_module._merge(calls)
    assert len(merged) == 3  # the first three together; another length; another flag
    (hidden,), kwargs = merged[0]
    assert torch.equal(hidden, torch.cat([c[0][0] for c in calls[:3]]))
    assert torch.equal(kwargs["ids"], torch.cat([c[1]["ids"] for c in calls[:3]]))  # per sample: concatenated
    assert kwargs["rope"][0].shape == (3, 5, 4)  # batch-sized in every call: concatenated too
    assert merged[1] is calls[3] and merged[2] is calls[4]
    monkeypatch.setattr(awq_module, "MERGE_TOKENS", 10)  # two calls of 5 tokens at most
    assert len(awq_module._merge(calls[:3])) == 2


def test_merged_calls_give_the_result_of_separate_calls(monkeypatch) -> None:
    inputs = [((torch.randn(1, 9, 32),), {}) for _ in range(4)]
    specs = _specs(make_spec(4, "per_group", 16, False), LLAMA_LINEARS, "p")
    merged, separate = _llama_layer(), _llama_layer()
    ratios = awq_layer(merged, inputs, AWQConfig(), "p", specs)
    monkeypatch.setattr(awq_module, "MERGE_TOKENS", 0)
    assert awq_module._merged_calls(separate, inputs) is inputs
    assert awq_layer(separate, inputs, AWQConfig(), "p", specs) == ratios
    for (name, a), b in zip(merged.state_dict().items(), separate.state_dict().values(), strict=True):
        # the same up to rounding, but for a clipping choice that summation order may tip here and there
        assert float((~torch.isclose(a, b, rtol=1e-4, atol=1e-5)).float().mean()) < 0.01, name


class BatchDependent(nn.Module):
    """A layer whose output depends on what else is in the batch: merging its calls would change it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden_states - hidden_states.mean(dim=0, keepdim=True))


def test_calls_stay_separate_when_merging_changes_the_output() -> None:
    inputs = [((torch.randn(2, 3, 8),), {}) for _ in range(3)]
    assert len(awq_module._merge(inputs)) == 1
    assert awq_module._merged_calls(BatchDependent(), inputs) is inputs
    assert awq_module._merged_calls(OneLinearEight(), inputs) is not inputs


class OneLinearEight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc(hidden_states)


def test_input_statistics_give_the_output_error_from_gram_or_rows_and_follow_a_scale() -> None:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(3, 5, 16, generator=g) for _ in range(2)]
    delta = torch.randn(6, 16, generator=g)
    s = torch.rand(16, generator=g) + 0.5
    x = torch.cat([a.reshape(-1, 16) for a in xs])
    for want in ("rows", "gram"):
        stats = awq_module._InputStats(16, want_gram=want == "gram", want_rows=want == "rows", block=8)
        for a in xs:
            stats.add(a)
        assert stats.tokens == 30
        torch.testing.assert_close(stats.mean_abs(), x.abs().mean(dim=0))
        assert stats.output_error(delta) == pytest.approx(float((x @ delta.T).pow(2).sum()), rel=1e-5)
        stats.rescale(s)
        assert stats.output_error(delta) == pytest.approx(float(((x / s) @ delta.T).pow(2).sum()), rel=1e-5)
        blocks = stats.blocks
        xg = (x / s).reshape(30, 2, 8)
        torch.testing.assert_close(blocks, torch.einsum("tgc,tgd->gcd", xg, xg), rtol=1e-4, atol=1e-4)
