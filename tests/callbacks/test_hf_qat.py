"""QuantCallback on a Hugging Face causal LM: a LightningModule wrapping ``AutoModelForCausalLM`` (random weights
from a tiny config, default ``use_cache=True``) whose ``training_step`` returns ``self.model(input_ids=...,
labels=...).loss``, as the README's callback section has it.

QAT with int4 per-group weights + int8 activations and with fp8 weights + activations, every decoder Linear (and
the lm_head, per the config) quantized and fake-quantizing as computed here by hand; ModelCheckpoint files resume
bit for bit and reload with ``load_quantized_checkpoint`` into a fresh wrapper with the trained model's logits;
GPT-2's ``Conv1D`` projections; nothing reported as quantized that no forward reaches; ``config.use_cache`` as it
was after fit and calibration (calibration itself runs without a KV cache).
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from cb_helpers import QuantCallback, assert_states_equal, make_trainer, qstate, seed
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks.quant import load_quantized_checkpoint
from quark.torch.quantization.coverage import track_forward
from quark.torch.quantization.nn.modules import QuantMixin
from quark_lightning.tasks.recipes import FP8_PER_TENSOR, INT4_G32_WEIGHT, INT8_PER_TENSOR_ACT

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, HIDDEN = 128, 16, 64
W4A8 = {"global_quant_config": {"weight": INT4_G32_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
FP8 = {"global_quant_config": {"weight": FP8_PER_TENSOR, "input_tensors": FP8_PER_TENSOR}}
DECODER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
GPT2_CONV1DS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")  # embeddings, norms


# ----------------------------------------------------------------------------------------------- models and data
def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(config)


class LitCausalLM(LightningModule):
    """What a user writes around a causal LM: no forward of its own, the steps call the wrapped model."""

    def __init__(self, build: Callable[[], nn.Module] = llama, init_seed: int = 0, lr: float = 1e-3) -> None:
        super().__init__()
        torch.manual_seed(init_seed)
        self.model = build()
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LitWithForward(LitCausalLM):
    """The same with a forward (the callback's default calibration feed calls it); records ``use_cache`` per call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_cache_seen: list[tuple[bool, bool]] = []  # (training, config.use_cache) of every forward

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        self.use_cache_seen.append((self.training, bool(self.model.config.use_cache)))
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(batch[0], labels=batch[0]).loss
        self.losses.append(float(loss.detach()))
        return loss


class WithSpareHead(LitWithForward):
    """A quantizable head that no forward uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.value_head = nn.Linear(HIDDEN, 1)


def token_loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g)), batch_size=batch_size, shuffle=False
    )


def eval_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def logits(lit: LitCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The wrapped model's logits in eval mode (the module's mode is put back)."""
    training = lit.training
    lit.eval()
    try:
        return lit.model(input_ids=ids).logits
    finally:
        lit.train(training)


class Recorder(Logger):
    """Keeps the last value of every metric logged."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


# ----------------------------------------------------------------------------------------------- checks by hand
def fake_int(
    t: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int, group: int | None
) -> torch.Tensor:
    """Integer fake quantization of a [out, in] tensor: per tensor (scale a scalar) or per group of ``group`` input
    features (scale [out, in / group]), as torch's fake_quantize kernels compute it: ``round(t * (1 / scale))``, half
    to even (a weight at the end of its group's range sits on a rounding tie: ``t / scale`` may round the other way)."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if group is None:
        return (torch.round(t * torch.reciprocal(scale)) + zero_point).clamp(qmin, qmax).sub(zero_point) * scale
    out, inp = t.shape
    blocks = t.reshape(out, inp // group, group)
    s, zp = scale.unsqueeze(-1), zero_point.unsqueeze(-1)
    return ((torch.round(blocks * torch.reciprocal(s)) + zp).clamp(qmin, qmax).sub(zp) * s).reshape(out, inp)


def fake_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def weight_out_in(layer: nn.Module) -> torch.Tensor:
    """[out, in], whatever the storage (transformers' Conv1D keeps [in, out])."""
    return layer.weight.t() if any(c.__name__ == "Conv1D" for c in type(layer).__mro__) else layer.weight


def check_fake_quant(lit: LitCausalLM, layers: dict[str, nn.Module], scheme: str) -> None:
    """Each quantized layer's output on the inputs a forward gives it equals the linear map of its input and weight
    quantized here by hand with its qparams (and differs from the float one)."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:  # None: the output stays
            seen.setdefault(name, (args[0], out))

        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in layers.items()]
    try:
        logits(lit, eval_ids())
    finally:
        for h in hooks:
            h.remove()
    assert set(seen) == set(layers)
    for name, layer in layers.items():
        x, out = seen[name]
        w = weight_out_in(layer).detach()
        w_scale, w_zp = layer._weight_quantizer.calculate_qparams()
        x_scale, x_zp = layer._input_quantizer.calculate_qparams()
        if scheme == "w4a8":
            assert w_scale.shape == (w.shape[0], w.shape[1] // 32), name  # one scale per output row and group of 32
            wq, xq = fake_int(w, w_scale, w_zp, 4, 32), fake_int(x, x_scale, x_zp, 8, None)
            assert all(len(torch.unique(row)) <= 16 for row in (wq / w_scale.repeat_interleave(32, 1)).round())
        else:
            assert w_scale.numel() == 1 and x_scale.numel() == 1, name
            wq, xq = fake_fp8(w, w_scale), fake_fp8(x, x_scale)
        expected = nn.functional.linear(xq, wq, layer.bias)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.allclose(out, nn.functional.linear(x, w, layer.bias)), f"{name} is not quantized"


def quantized_layers(lit: LitCausalLM) -> dict[str, nn.Module]:
    return {n: m for n, m in lit.named_modules() if isinstance(m, QuantMixin)}


def assert_all_ready(layers: dict[str, nn.Module]) -> None:
    for name, layer in layers.items():
        for role, q in layer.quantizers():
            assert bool(q.fake_quant_enabled) and not bool(q.observer_enabled), f"{name}.{role}"
            assert bool(q.initialized), f"{name}.{role} has no qparams"


def fit_qat(
    tmp_path: Any, lit: LitCausalLM, config: dict[str, Any], callbacks: list | None = None, **overrides: Any
) -> QuantCallback:
    cb = QuantCallback(config, mode="qat", observer_steps=2)
    make_trainer(tmp_path, [cb, *(callbacks or [])], **overrides).fit(lit, train_dataloaders=token_loader())
    return cb


# ----------------------------------------------------------------------------------------------- 1, 2: QAT
@pytest.mark.parametrize("exclude_lm_head", [False, True])
def test_qat_int4_per_group_weights_int8_activations(tmp_path, exclude_lm_head) -> None:
    seed(0)
    lit = LitCausalLM()
    float_linears = {n for n, m in lit.named_modules() if isinstance(m, nn.Linear)}
    config = {**W4A8, "exclude": ["model.lm_head"]} if exclude_lm_head else W4A8
    before = logits(lit, eval_ids())

    fit_qat(tmp_path, lit, config)

    assert len(lit.losses) == 4 and all(math.isfinite(v) for v in lit.losses)
    layers = quantized_layers(lit)
    decoder = {f"model.model.layers.{i}.{p}" for i in range(2) for p in DECODER_LINEARS}
    assert set(layers) == decoder | (set() if exclude_lm_head else {"model.lm_head"})
    assert float_linears == decoder | {"model.lm_head"}  # every Linear of the model is accounted for
    if exclude_lm_head:
        assert type(lit.model.lm_head) is nn.Linear
    for name, layer in layers.items():
        assert layer._weight_quantizer.spec.dtype.name == "int4" and layer._weight_quantizer.spec.group_size == 32, name
        assert layer._input_quantizer.spec.dtype.name == "int8", name
    assert_all_ready(layers)
    check_fake_quant(lit, layers, "w4a8")
    assert not torch.equal(logits(lit, eval_ids()), before)  # trained
    assert lit.model.config.use_cache is True


def test_qat_fp8_weights_and_activations(tmp_path) -> None:
    seed(0)
    lit = LitCausalLM()
    fit_qat(tmp_path, lit, FP8)

    assert len(lit.losses) == 4 and all(math.isfinite(v) for v in lit.losses)
    layers = quantized_layers(lit)
    assert set(layers) == {f"model.model.layers.{i}.{p}" for i in range(2) for p in DECODER_LINEARS} | {"model.lm_head"}
    for name, layer in layers.items():
        assert {q.spec.dtype.name for _, q in layer.quantizers()} == {"fp8_e4m3"}, name
    assert_all_ready(layers)
    check_fake_quant(lit, layers, "fp8")
    assert lit.model.config.use_cache is True


# ----------------------------------------------------------------------------------------------- 3: checkpoints
@pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*", "ignore:.*dirpath has changed.*")
def test_checkpoints_resume_and_reload_with_the_trained_logits(tmp_path) -> None:
    """Two epochs of two batches, a ModelCheckpoint per epoch; observers run for 3 batches, across the resume."""
    ids = eval_ids()

    def run(root: Any, lit: LitCausalLM, ckpt_path: str | None = None) -> None:
        cb = QuantCallback(W4A8, mode="qat", observer_steps=3)
        ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_epochs=1, save_top_k=-1)
        trainer = make_trainer(root, [cb, ckpt], max_epochs=2, limit_train_batches=2)
        trainer.fit(lit, train_dataloaders=token_loader(), ckpt_path=ckpt_path)

    seed(0)
    trained = LitCausalLM()
    run(tmp_path / "a", trained)
    files = sorted(glob.glob(str(tmp_path / "a" / "ckpt" / "*.ckpt")))
    assert [os.path.basename(f) for f in files] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    expected = logits(trained, ids)

    # Trainer resume from the first epoch's file into a fresh wrapper (other initial weights)
    seed(0)
    resumed = LitCausalLM(init_seed=1)
    run(tmp_path / "b", resumed, ckpt_path=files[0])
    assert_states_equal(qstate(resumed), qstate(trained))
    for (name, a), b in zip(resumed.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(logits(resumed, ids), expected)

    # inference without a Trainer
    loaded = load_quantized_checkpoint(LitCausalLM(init_seed=2), files[-1])
    assert torch.equal(logits(loaded, ids), expected)
    assert loaded.model.config.use_cache is True and trained.model.config.use_cache is True
    generated = loaded.model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)  # with its KV cache
    assert generated.shape == (2, 7)


# ----------------------------------------------------------------------------------------------- 4: GPT-2 (Conv1D)
def test_gpt2_conv1d_qat_and_reload(tmp_path) -> None:
    seed(0)
    lit = LitCausalLM(gpt2)
    conv1ds = {f"model.transformer.h.{i}.{p}" for i in range(2) for p in GPT2_CONV1DS}
    assert {n for n, m in lit.named_modules() if type(m).__name__ == "Conv1D"} == conv1ds
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"))
    fit_qat(tmp_path, lit, W4A8, [ckpt])

    layers = quantized_layers(lit)
    assert len(lit.losses) == 4 and all(math.isfinite(v) for v in lit.losses)
    assert set(layers) == conv1ds | {"model.lm_head"}
    assert_all_ready(layers)
    check_fake_quant(lit, layers, "w4a8")
    assert lit.model.config.use_cache is True

    expected = logits(lit, eval_ids())
    loaded = load_quantized_checkpoint(LitCausalLM(gpt2, init_seed=1), ckpt.best_model_path)
    assert set(quantized_layers(loaded)) == set(layers)
    assert torch.equal(logits(loaded, eval_ids()), expected)


# ----------------------------------------------------------------------------------------------- reporting, KV cache
@pytest.mark.filterwarnings("ignore:.*no forward reached.*")
@pytest.mark.parametrize("mode", ["qat", "ptq"])
def test_nothing_reported_as_quantized_that_no_forward_reaches(tmp_path, mode) -> None:
    seed(0)
    lit = WithSpareHead()
    recorder = Recorder()
    cb = QuantCallback(W4A8, mode=mode, observer_steps=2)
    make_trainer(tmp_path, [cb], logger=recorder, log_every_n_steps=1).fit(lit, train_dataloaders=token_loader())

    with torch.no_grad(), track_forward(lit, functional=False) as record:
        lit.eval()
        lit(eval_ids())
    reached = record["reached"]
    assert "value_head" not in reached and len(reached) == 15
    weights = {k.removeprefix("quant/sqnr_weight/") for k in recorder.metrics if k.startswith("quant/sqnr_weight/")}
    activations = {k.removeprefix("quant/sqnr_act/") for k in recorder.metrics if k.startswith("quant/sqnr_act/")}
    assert weights == reached and activations == reached
    # int4 weights of the reached layers count 4 bits; everything else (the spare head included) its float bits
    reached_weights = sum(lit.get_submodule(n).weight.numel() for n in reached)
    total = sum(p.numel() for p in lit.parameters())
    assert recorder.metrics["quant/fp32_size_bits"] == 32 * total
    assert recorder.metrics["quant/model_size_bits"] == 32 * total - 28 * reached_weights
    assert lit.model.config.use_cache is True


def test_ptq_calibrates_without_kv_cache_and_restores_use_cache(tmp_path) -> None:
    """Calibration on the loader given to ``fit``; its forwards see ``use_cache=False``, training and afterwards
    the model's own setting; the quantized checkpoint reloads with the calibrated logits."""
    seed(0)
    lit = LitWithForward()
    cb = QuantCallback(W4A8, mode="ptq", calib_batches=2)
    make_trainer(tmp_path, [cb], logger=Recorder(), log_every_n_steps=1).fit(lit, train_dataloaders=token_loader())

    assert cb.calibrated
    assert [seen for seen in lit.use_cache_seen if seen[0]] == [(True, True)] * 4  # training
    assert [seen for seen in lit.use_cache_seen if not seen[0]] == [(False, False)] * 3  # 2 calibration, 1 SQNR report
    assert lit.model.config.use_cache is True
    layers = quantized_layers(lit)
    assert_all_ready(layers)
    check_fake_quant(lit, layers, "w4a8")
    loaded = load_quantized_checkpoint(LitWithForward(init_seed=1), cb.quantized_checkpoint)
    assert torch.equal(logits(loaded, eval_ids()), logits(lit, eval_ids()))


def test_module_without_forward(tmp_path) -> None:
    """QAT with a logger: the activation report is skipped with a warning (not a crash at the observers' fix).
    PTQ: the default calibration feed is refused with advice; ``calib_forward`` feeds the wrapped model."""
    seed(0)
    lit = LitCausalLM()
    with pytest.warns(UserWarning, match=r"activation SQNR not reported.*defines no forward"):
        make_trainer(
            tmp_path, [QuantCallback(W4A8, mode="qat", observer_steps=2)], logger=Recorder(), log_every_n_steps=1
        ).fit(lit, train_dataloaders=token_loader())
    assert_all_ready(quantized_layers(lit))

    with pytest.raises(ValueError, match=r"LitCausalLM: it defines no forward.*calib_forward="):
        make_trainer(tmp_path, [QuantCallback(W4A8, mode="ptq")]).fit(LitCausalLM(), train_dataloaders=token_loader())

    lit = LitCausalLM()
    cb = QuantCallback(
        W4A8, mode="ptq", calib_batches=2, calib_forward=lambda module, batch: module.model(input_ids=batch[0])
    )
    make_trainer(tmp_path, [cb]).fit(lit, train_dataloaders=token_loader())
    assert cb.calibrated and lit.model.config.use_cache is True
    assert_all_ready(quantized_layers(lit))
