"""Learned rotations: parametrizations keep the float function for any orthonormal R, fold writes the same weights
as folding the matrices directly (same Parameters, no parametrization left, a fixed rotation's state_dict keys), the
handler's trainable path keeps the float function and leaves R orthonormal, the weight quantizer sees the rotated
weight, the loss is the KL (checked against torch's kl_div), and the config refuses bad training fields."""

import copy

import pytest
import torch
import torch.nn.functional as F
from spin_models import char_batches, char_model, logits, quantized
from torch.nn.utils import parametrize

import quark.torch.algorithm.rotation.training as training
from quark.torch.algorithm.rotation import fold_r1, fold_r2, rotation_plan
from quark.torch.algorithm.rotation.apply import apply_rotations
from quark.torch.algorithm.rotation.cayley import orthonormality_error
from quark.torch.algorithm.rotation.learned import attach_learned_rotations, fold_learned
from quark.torch.algorithm.rotation.training import rotation_loss
from quark.torch.quantization.config.config import RotationConfig
from quark.torch.quantization.state import paused_quantizers

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")

FIXED = RotationConfig(r1=True, r2=True, r4=True)
LEARNED = RotationConfig(r1=True, r2=True, r4=True, trainable=True, train_steps=3, train_lr=0.05)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def random_orthonormal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def test_any_rotation_keeps_function_and_fold_matches_direct_folding():
    model, x = char_model(), char_batches(1, seed=3)[0]
    want = logits(model, x)
    plan = rotation_plan(model, LEARNED)
    learned = attach_learned_rotations(model, plan, LEARNED)
    originals = {n: p for n, p in model.named_parameters() if n.endswith(".original")}
    with torch.no_grad():
        learned.r1.copy_(random_orthonormal(64, 1))
        for i, r in enumerate(learned.r2.values()):
            r.copy_(random_orthonormal(16, 10 + i))
    assert rel(logits(model, x), want) < 1e-5
    r1, r2 = learned.r1.detach().clone(), [r.detach().clone() for r in learned.r2.values()]
    # the reference: the same matrices folded directly into a fixed-rotation copy (norms fused, R4 added, no R1/R2)
    ref = char_model()
    apply_rotations(ref, plan, RotationConfig(r1=False, r2=False, r4=True))
    fold_r1(ref, plan, r1)
    for site, r in zip(plan.heads, r2, strict=True):
        fold_r2(ref, type(plan)(**{**plan.__dict__, "heads": (site,)}), r)
    fold_learned(model, learned)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert model.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.allclose(model.state_dict()[key], value, atol=1e-6), key
    assert rel(logits(model, x), want) < 1e-5
    # the Parameters the optimizer / twins held are the ones that now hold the folded weights
    names = {n.replace("parametrizations.", "").replace(".original", ""): p for n, p in originals.items()}
    params = dict(model.named_parameters())
    assert all(params[n] is p for n, p in names.items())


def test_trainable_handler_keeps_float_function_and_orthonormal(monkeypatch):
    model, batches = char_model(), char_batches(2)
    seen = {}
    real_fold, real_train = training.fold_learned, training.train_rotation

    def spy_fold(m, learned):
        seen["r1"] = learned.r1.detach().clone()
        seen["r2"] = [r.detach().clone() for r in learned.r2.values()]
        return real_fold(m, learned)

    def spy_train(m, learned, context, steps, lr):
        q_proj = m.model.layers[0].self_attn.q_proj
        quantizer = dict(q_proj.quantizers())["weight"]
        got = []
        handle = quantizer.register_forward_pre_hook(lambda mod, args: got.append(args[0].detach().clone()))
        with torch.no_grad():  # a different R1: the weight quantizer must see the weight it gives
            learned.r1.copy_(random_orthonormal(64, 5))
            context.run(m, context.batches[0])
        handle.remove()
        assert torch.allclose(got[0], q_proj.weight.detach())
        assert torch.allclose(got[0], q_proj.parametrizations.weight.original.detach() @ learned.r1.detach(), atol=1e-6)
        seen["result"] = real_train(m, learned, context, steps, lr)
        return seen["result"]

    monkeypatch.setattr(training, "fold_learned", spy_fold)
    monkeypatch.setattr(training, "train_rotation", spy_train)
    out = quantized(model, batches, LEARNED)
    assert orthonormality_error(seen["r1"]) < 1e-5
    assert all(orthonormality_error(r) < 1e-5 for r in seen["r2"])
    fixed = quantized(model, batches, FIXED)
    assert out.state_dict().keys() == fixed.state_dict().keys()
    assert not any(parametrize.is_parametrized(m) for m in out.modules())
    float_out = copy.deepcopy(out)
    held = char_batches(1, seed=5)[0]
    with paused_quantizers(float_out, fake_quant=True):
        assert rel(logits(float_out, held), logits(model, held)) < 1e-5
    # requires_grad restored: as a fixed rotation leaves it
    assert {n: p.requires_grad for n, p in out.named_parameters()} == {
        n: p.requires_grad for n, p in fixed.named_parameters()
    }


def test_loss_is_kl_and_mse_otherwise():
    g = torch.Generator().manual_seed(0)
    q, p = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    want = F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="sum") / 10
    assert torch.allclose(rotation_loss(q, p, vocab=11), want, atol=1e-6)
    assert torch.allclose(rotation_loss(q, p, vocab=7), ((q - p) ** 2).mean())
    assert float(rotation_loss(p, p, vocab=11)) == pytest.approx(0, abs=1e-7)


@pytest.mark.parametrize(
    ("field", "value"), [("train_steps", 0), ("train_steps", 2.5), ("train_lr", 0), ("train_lr", -1.0)]
)
def test_config_refuses_bad_training_fields(field, value):
    with pytest.raises(ValueError, match=f"RotationConfig.{field}="):
        RotationConfig(trainable=True, **{field: value})
