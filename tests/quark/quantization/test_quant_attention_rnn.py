"""Attention and recurrent twins: equal to torch's float modules with their quantizers off (torch's own kernels are
the reference), every weight they hold reaches the output once quantized (also inside nn.Transformer layers in eval
under no_grad, where torch would take its fused fast path), trainable by QAT, restored bit for bit from a state_dict."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from quark.torch import ModelQuantizer
from quark.torch.quantization.nn.modules import (
    QuantLinear,
    QuantLSTM,
    QuantMixin,
    QuantMultiheadAttention,
)
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
W8A8_OUT = {"global_quant_config": {**W8A8["global_quant_config"], "output_tensors": INT8_PER_TENSOR_ACT}}


def _prepared_off(module: nn.Module, config: dict = W8A8_OUT) -> nn.Module:
    """A prepared copy of ``module`` (wrapped: the engine swaps children) with every quantizer off."""
    wrapper = nn.ModuleDict({"m": copy.deepcopy(module)})
    ModelQuantizer(config).prepare(wrapper)
    for m in wrapper.modules():
        if isinstance(m, QuantMixin):
            for _, q in m.quantizer_slots():
                q.disable_observer()
                q.disable_fake_quant()
    return wrapper["m"]


def _max_diff(a: object, b: object) -> float:
    if a is None and b is None:
        return 0.0
    if isinstance(a, tuple):
        return max(_max_diff(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if not isinstance(a, torch.Tensor):  # PackedSequence
        return _max_diff(a.data, b.data)  # type: ignore[attr-defined]
    return float((a - b).detach().abs().max())  # type: ignore[operator]


MHA_KWARGS = [
    {},
    {"batch_first": True},
    {"kdim": 6, "vdim": 5},
    {"add_bias_kv": True, "add_zero_attn": True},
    {"bias": False},
]


@pytest.mark.parametrize("kwargs", MHA_KWARGS, ids=lambda k: ",".join(k) or "default")
def test_attention_twin_equals_torch_with_quantizers_off(kwargs: dict) -> None:
    torch.manual_seed(0)
    float_mha = nn.MultiheadAttention(8, 2, **kwargs).eval()
    twin = _prepared_off(float_mha)
    assert isinstance(twin, QuantMultiheadAttention) and isinstance(twin.out_proj, QuantLinear)
    tgt, src, batch = 4, 5, 3
    first = kwargs.get("batch_first", False)

    def seq(n: int, dim: int) -> torch.Tensor:
        return torch.randn(batch, n, dim) if first else torch.randn(n, batch, dim)

    query, key, value = seq(tgt, 8), seq(src, kwargs.get("kdim", 8)), seq(src, kwargs.get("vdim", 8))
    padding = torch.rand(batch, src) < 0.3
    padding[:, 0] = False
    mask = torch.rand(tgt, src) < 0.3
    mask[:, 0] = False
    for need, average, pad, masked in itertools.product([True, False], repeat=4):
        args = {
            "need_weights": need,
            "average_attn_weights": average,
            "key_padding_mask": padding if pad else None,
            "attn_mask": mask if masked else None,
        }
        assert _max_diff(float_mha(query, key, value, **args), twin(query, key, value, **args)) < 1e-5, args
    if "kdim" not in kwargs:  # self-attention: unbatched, and causal through SDPA and through explicit weights
        x = torch.randn(tgt, 8)
        assert _max_diff(float_mha(x, x, x), twin(x, x, x)) < 1e-6
        causal = nn.Transformer.generate_square_subsequent_mask(tgt)
        for need in (True, False):
            args = {"attn_mask": causal, "is_causal": True, "need_weights": need}
            assert _max_diff(float_mha(query, query, query, **args), twin(query, query, query, **args)) < 1e-5


RNN_CASES = [
    (nn.LSTM, {}),
    (nn.LSTM, {"num_layers": 3, "bidirectional": True, "batch_first": True}),
    (nn.LSTM, {"num_layers": 2, "proj_size": 3, "bidirectional": True}),
    (nn.LSTM, {"num_layers": 2, "bias": False}),
    (nn.GRU, {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    (nn.GRU, {"num_layers": 2, "dropout": 0.3}),
    (nn.RNN, {"num_layers": 2, "nonlinearity": "relu"}),
]


@pytest.mark.parametrize(("cls", "kwargs"), RNN_CASES, ids=lambda v: v.__name__ if isinstance(v, type) else ",".join(v))
def test_recurrent_twin_equals_torch_with_quantizers_off(cls: type[nn.Module], kwargs: dict) -> None:
    torch.manual_seed(0)
    float_rnn = cls(6, 5, **kwargs).eval()
    twin = _prepared_off(float_rnn)
    assert type(twin).__name__ == f"Quant{cls.__name__}"
    first = kwargs.get("batch_first", False)
    x = torch.randn(3, 7, 6) if first else torch.randn(7, 3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # oneDNN does not do projections: torch says so once
        out, hidden = float_rnn(x)
        assert _max_diff((out, hidden), twin(x)) == 0.0
        assert _max_diff(float_rnn(x, hidden), twin(x, hidden)) == 0.0
        one = x[0] if first else x[:, 0]
        assert _max_diff(float_rnn(one), twin(one)) == 0.0  # unbatched
        packed = pack_padded_sequence(x, torch.tensor([2, 7, 4]), batch_first=first, enforce_sorted=False)
        assert _max_diff(float_rnn(packed), twin(packed)) == 0.0
        assert _max_diff(float_rnn(packed, hidden), twin(packed, hidden)) == 0.0


@pytest.mark.parametrize("cls", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_cell_twin_equals_torch_with_quantizers_off(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    cell = cls(6, 5).eval()
    twin = _prepared_off(cell)
    x = torch.randn(3, 6)
    hidden = cell(x)
    assert _max_diff(cell(x), twin(x)) == 0.0
    assert _max_diff(cell(x, hidden), twin(x, hidden)) == 0.0
    assert _max_diff(cell(x[0]), twin(x[0])) == 0.0


# ----------------------------------------------------------------------------------------------- user models
class EncoderClassifier(nn.Module):
    """A user's text classifier: embedding, a 2-layer batch-first Transformer encoder, mean pool, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), src_key_padding_mask=padding).mean(dim=1))


class RecurrentTagger(nn.Module):
    """A user's sequence model: bidirectional 2-layer LSTM, a GRU on top, a GRUCell refinement, Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 12, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(24, 10, batch_first=True)
        self.cell = nn.GRUCell(10, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.lstm(x)[0])
        return self.head(self.cell(out[:, -1], out[:, 0]))  # hidden state given: weight_hh matters


def _weight_quantizers(model: nn.Module) -> list[tuple[str, str, object]]:
    return [
        (name, slot.tensor, q)
        for name, m in model.named_modules()
        if isinstance(m, QuantMixin)
        for slot, q in m.quantizer_slots()
        if slot.role == "weight"
    ]


def _every_weight_quantizer_matters(model: nn.Module, *inputs: torch.Tensor) -> None:
    """Calibrated ``model`` in eval under no_grad: switching off any one weight quantizer changes the output.
    Activation quantizers are off meanwhile: their rounding could absorb a small change upstream."""
    model.eval()
    acts = [q for m in model.modules() if isinstance(m, QuantMixin) for s, q in m.quantizer_slots() if s.tensor is None]
    for q in acts:
        q.disable_fake_quant()
    with torch.no_grad():
        reference = model(*inputs)
        for name, tensor, q in _weight_quantizers(model):
            q.disable_fake_quant()  # type: ignore[attr-defined]
            changed = not torch.equal(model(*inputs), reference)
            q.enable_fake_quant()  # type: ignore[attr-defined]
            assert changed, f"{name}.{tensor}: its quantizer does not reach the output"
    for q in acts:
        q.enable_fake_quant()


def test_transformer_encoder_runs_through_the_twins_in_eval() -> None:
    torch.manual_seed(0)
    model = EncoderClassifier().eval()
    tokens = torch.randint(0, 50, (6, 9))
    padding = torch.zeros(6, 9, dtype=torch.bool)
    padding[:3, 6:] = True  # padded input: torch would pack it as a nested tensor for its fused kernel
    with pytest.warns(UserWarning, match="stay float"):  # embeddings and LayerNorms are listed once
        ModelQuantizer(W8A8).quantize_model(model, forward_loop=lambda m: m(tokens, padding))
    layers = dict(model.named_modules())
    assert isinstance(layers["encoder.layers.0.self_attn"], QuantMultiheadAttention)
    assert isinstance(layers["encoder.layers.1.linear2"], QuantLinear)
    assert len(_weight_quantizers(model)) == 2 * 4 + 1  # per layer: in_proj, out_proj, linear1, linear2; the head
    _every_weight_quantizer_matters(model, tokens, padding)
    _every_weight_quantizer_matters(model, tokens)


def test_lightning_demo_transformer_quantizes_every_linear_and_attention() -> None:
    torch.manual_seed(0)
    model = Transformer(vocab_size=40, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0).eval()
    tokens, target = torch.randint(0, 40, (4, 7)), torch.randint(0, 40, (4, 7))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelQuantizer(W8A8).quantize_model(model, forward_loop=lambda m: m(tokens, target))
    assert not [w for w in caught if "no forward reached" in str(w.message)]
    attention = [n for n, m in model.named_modules() if isinstance(m, QuantMultiheadAttention)]
    assert sorted(attention) == [
        "transformer.decoder.layers.0.multihead_attn",
        "transformer.decoder.layers.0.self_attn",
        "transformer.encoder.layers.0.self_attn",
    ]
    floats = {f.name: f.reason for f in ModelQuantizer(W8A8).float_layers(model)}
    assert all("normalization" in r or "embeddings" in r for r in floats.values()), floats
    _every_weight_quantizer_matters(model, tokens, target)


def test_recurrent_model_every_weight_reaches_the_output_and_reloads_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = RecurrentTagger().eval()
    x = torch.randn(5, 6, 8)
    ModelQuantizer(W8A8).quantize_model(model, [x])
    assert isinstance(model.lstm, QuantLSTM)
    # 2 layers x 2 directions x (ih, hh) + GRU (ih, hh) + cell (ih, hh) + head
    assert len(_weight_quantizers(model)) == 8 + 2 + 2 + 1
    inputs = [
        q
        for n, m in model.named_modules()
        if isinstance(m, QuantMixin)
        for s, q in m.quantizer_slots()
        if s.role == "input_tensors"
    ]
    assert len(inputs) == 2 + 1 + 1 + 1 and all(bool(q.initialized) for q in inputs)  # the LSTM's second layer's too
    _every_weight_quantizer_matters(model, x)
    restored = RecurrentTagger()
    ModelQuantizer(W8A8).prepare(restored)
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(restored.eval()(x), model(x))


def test_attention_checkpoint_reloads_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = EncoderClassifier().eval()
    tokens = torch.randint(0, 50, (6, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ModelQuantizer(W8A8).quantize_model(model, forward_loop=lambda m: m(tokens))
        restored = EncoderClassifier()
        ModelQuantizer(W8A8).prepare(restored)
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(restored.eval()(tokens), model(tokens))


def test_qat_trains_attention_and_recurrent_weights() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2, kdim=6, vdim=6), "lstm": nn.LSTM(8, 8, num_layers=2)})
    tqt = {**INT8_PER_TENSOR_ACT, "scale_type": "pof2", "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"}}
    config = {"global_quant_config": {"weight": tqt, "input_tensors": INT8_PER_TENSOR_ACT}}
    ModelQuantizer(config).prepare(model)
    x, kv = torch.randn(5, 3, 8), torch.randn(4, 3, 6)
    for m in model.modules():  # observe one batch, then train: learnable thresholds initialise on it
        if isinstance(m, QuantMixin):
            for _, q in m.quantizer_slots():
                q.enable_observer()
    out, _ = model["attn"](x, kv, kv)
    loss = model["lstm"](out)[0].square().mean()
    loss.backward()
    for name, p in model.named_parameters():
        if "_quantizer" not in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    thresholds = [p for n, p in model.named_parameters() if n.endswith("log_threshold")]
    assert len(thresholds) == 3 + 1 + 4  # q/k/v projection weights, out_proj, the LSTM's 2 x (ih, hh)
    assert all(t.grad is not None for t in thresholds)


def test_configured_by_layer_type_and_owned_out_proj_follows() -> None:
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2), "gru": nn.GRU(8, 8), "fc": nn.Linear(8, 8)})
    config = {
        "global_quant_config": {},
        "layer_type_quant_config": {
            "MultiheadAttention": {"weight": INT8_PER_CHANNEL_WEIGHT},
            "GRU": {"weight": INT8_PER_CHANNEL_WEIGHT},
        },
    }
    with pytest.warns(UserWarning, match="stay float"):
        plans = {p.name: p for p in ModelQuantizer(config).resolve(model)}
        ModelQuantizer(config).prepare(model)
    assert set(plans) == {"attn", "attn.out_proj", "gru"}  # fc: no spec at any level
    assert "owner" in plans["attn.out_proj"].source["weight"]
    where = model["attn"]._weight_quantizer.where
    assert where == "layer 'attn' (MultiheadAttention, in_proj_weight)"
    assert model["gru"]._weight_hh_l0_quantizer.where == "layer 'gru' (GRU, weight_hh_l0)"
