"""Training the rotations lowers the quantized model's KL from the float model below the Hadamard start's, on held-out
batches of a tiny CharTransformer with outlier channels in its residual stream (W4A4, per-token int4 inputs)."""

import pytest
import torch
from spin_models import char_batches, char_model, kl, quantized

from quark.torch.algorithm.rotation.scale_grad import reduce_dims
from quark.torch.quantization.config.config import RotationConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")


def outlier_model() -> torch.nn.Module:
    model = char_model()
    with torch.no_grad():
        for embedding in (model.model.embed_tokens, model.model.embed_positions):
            embedding.weight[:, :3] *= 50  # three residual channels far larger than the rest
        model.lm_head.weight *= 10  # sharper next-token distributions: quantization error shows in the KL
    return model


@pytest.mark.slow
def test_learned_rotation_beats_hadamard_start_on_held_out_batches():
    torch.manual_seed(0)
    model, batches, held = outlier_model(), char_batches(4), char_batches(2, seed=7)
    fixed = quantized(model, batches, RotationConfig(r1=True, r2=True, r4=True))
    learned = quantized(
        model, batches, RotationConfig(r1=True, r2=True, r4=True, trainable=True, train_steps=30, train_lr=1.5)
    )
    assert kl(learned, model, held) < kl(fixed, model, held)


def test_scale_gradient_reduces_over_the_quantizer_groups():
    from spin_models import _spec

    from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

    weight, tokens = (
        ScaledFakeQuantize(_spec("int4_per_channel_sym")),
        ScaledFakeQuantize(_spec("int4_per_token_dynamic")),
    )
    assert reduce_dims(weight, torch.zeros(8, 4)) == (1,)  # one absmax per output channel
    assert reduce_dims(tokens, torch.zeros(2, 5, 64)) == (2,)  # one absmax per token


def test_scale_gradient_matches_a_differentiable_absmax_reference():
    from spin_models import _spec

    from quark.torch.algorithm.rotation.scale_grad import add_scale_gradient
    from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

    quantizer = ScaledFakeQuantize(_spec("int4_per_token_dynamic"))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    x1 = x.clone().requires_grad_(True)
    out = quantizer(x1)
    (add_scale_gradient(quantizer, (x1,), out) * w).sum().backward()
    # reference: s = absmax / 7.5 differentiated, the rounded integers (the engine's) straight-through
    x2 = x.clone().requires_grad_(True)
    s = x2.abs().amax(-1, keepdim=True) / 7.5
    r = x2 / s
    q = (r + (out.detach() / s.detach() - r).detach()) * s
    (q * w).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    assert not torch.allclose(x1.grad, w)  # not the rounding's straight-through gradient alone
