"""Fixed rotations through ModelQuantizer: the float function is kept (both test models, GQA, tied and untied),
a broken transform raises EquivalenceError and leaves the model as it was, the refused settings and models, and the
weights are what the rotations say (checked against a hand computation)."""

import copy

import pytest
import torch
from rot_models import char_batches, char_model, hf_batches, hf_llama, logits
from torch import nn

import quark.torch.algorithm.rotation.apply as rotation_apply
from quark.torch import ModelQuantizer
from quark.torch.algorithm.rotation import ROTATION_BUFFER, hadamard_matrix, rotation_plan
from quark.torch.quantization.config.config import Config, QuantizationConfig, RotationConfig
from quark.torch.quantization.equivalence import EquivalenceError

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")

FULL = RotationConfig(r1=True, r2=True, r4=True)


def rotated(model: nn.Module, batches, rotation: RotationConfig = FULL, **kwargs) -> nn.Module:
    config = Config(global_quant_config=QuantizationConfig(), algo_config=[rotation], **kwargs)
    return ModelQuantizer(config).quantize_model(copy.deepcopy(model), batches)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize(
    "rotation", [FULL, RotationConfig(r1=True, r2=False, r4=False), RotationConfig(r1=False, r2=True, r4=True)]
)
def test_char_transformer_function_kept(rotation):
    model, batches = char_model(), char_batches()
    out = rotated(model, batches, rotation)
    held = char_batches(1, seed=5)[0]
    assert rel(logits(out, held), logits(model, held)) < 1e-5


@pytest.mark.parametrize(("tie", "kv_heads"), [(False, 2), (True, 2), (False, 4), (True, 4)])
def test_hf_llama_function_kept(tie, kv_heads):
    model = hf_llama(tie, kv_heads)
    out = rotated(model, hf_batches())
    held = hf_batches(1, seed=5)[0]
    assert rel(logits(out, held), logits(model, held)) < 1e-5
    assert out.config.tie_word_embeddings is False
    assert out.lm_head.weight is not out.model.embed_tokens.weight
    # the weights did change: R1 rotates the embeddings
    assert rel(out.model.embed_tokens.weight, model.model.embed_tokens.weight) > 0.5


def test_weights_are_the_hand_computed_rotation():
    model = char_model()
    out = rotated(model, char_batches())
    r1, r2, r4 = hadamard_matrix(64), hadamard_matrix(16), hadamard_matrix(192)
    src, dst = model.model.layers[0], out.model.layers[0]
    w = src.input_layernorm.weight.double()
    q = src.self_attn.q_proj.weight.double() * w[None, :] @ r1
    assert torch.allclose(dst.self_attn.q_proj.weight.double(), q, atol=1e-6)
    assert torch.allclose(dst.input_layernorm.weight, torch.ones(64))
    v = src.self_attn.v_proj.weight.double() * w[None, :] @ r1
    v = torch.cat([r2.T @ head for head in v.split(16, 0)], 0)
    assert torch.allclose(dst.self_attn.v_proj.weight.double(), v, atol=1e-6)
    o = r1.T @ src.self_attn.o_proj.weight.double()
    o = torch.cat([head @ r2 for head in o.split(16, 1)], 1)
    assert torch.allclose(dst.self_attn.o_proj.weight.double(), o, atol=1e-6)
    down = r1.T @ src.mlp.down_proj.weight.double() @ r4
    assert torch.allclose(dst.mlp.down_proj.weight.double(), down, atol=1e-6)
    assert torch.allclose(getattr(dst.mlp.down_proj, ROTATION_BUFFER).double(), r4, atol=1e-7)
    assert torch.allclose(
        out.model.embed_positions.weight.double(), model.model.embed_positions.weight.double() @ r1, atol=1e-6
    )


def test_online_r4_input_seen_rotated():
    model = char_model()
    out = rotated(model, char_batches(), RotationConfig(r1=False, r4=True))
    seen, ref = [], []
    out.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: ref.append(a[0]))
    x = char_batches(1, seed=3)[0]
    logits(out, x), logits(model, x)
    assert torch.allclose(seen[0].double(), ref[0].double() @ hadamard_matrix(192), atol=1e-5)


def test_rotation_size_blocks():
    model = char_model()
    out = rotated(model, char_batches(), RotationConfig(r1=True, r2=True, r4=True, rotation_size=16))
    x = char_batches(1, seed=5)[0]
    assert rel(logits(out, x), logits(model, x)) < 1e-5
    r4 = getattr(out.model.layers[0].mlp.down_proj, ROTATION_BUFFER)
    assert torch.allclose(r4.double(), torch.block_diag(*[hadamard_matrix(16)] * 12), atol=1e-7)
    with pytest.raises(ValueError, match="rotation_size=24 does not divide the size 64 of the residual stream"):
        rotated(model, char_batches(), RotationConfig(rotation_size=24))


def test_random_r1_seeded_from_torch_seed():
    model = char_model()
    torch.manual_seed(7)
    a = rotated(model, char_batches(), RotationConfig(random_r1=True))
    torch.manual_seed(7)
    b = rotated(model, char_batches(), RotationConfig(random_r1=True))
    torch.manual_seed(8)
    c = rotated(model, char_batches(), RotationConfig(random_r1=True))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    x = char_batches(1, seed=5)[0]
    assert rel(logits(c, x), logits(model, x)) < 1e-5


def test_broken_transform_raises_and_restores(monkeypatch):
    model = hf_llama(tie=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def not_orthogonal(n, block=None, *, generator=None, dtype=torch.float64, device=None):
        return hadamard_matrix(n) + 0.1 * torch.eye(n, dtype=torch.float64)

    monkeypatch.setattr(rotation_apply, "block_hadamard_matrix", not_orthogonal)
    config = Config(global_quant_config=QuantizationConfig(), algo_config=[FULL])
    with pytest.raises(EquivalenceError, match=r"rotation \(norm fusion\+R1\+R2\+R4\) changed what"):
        rotation_apply.run_rotation(model, FULL, _context(hf_batches()))
    after = model.state_dict()
    assert set(after) == set(before)  # no input_rotation buffer left
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.tie_word_embeddings
    assert not model.model.layers[0].mlp.down_proj._forward_pre_hooks
    with pytest.raises(EquivalenceError):  # and through ModelQuantizer
        ModelQuantizer(config).quantize_model(model, hf_batches())


def _context(batches):
    from quark.torch.quantization.algo_registry import AlgorithmContext

    return AlgorithmContext(batches, lambda m, b: m(b))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"r3": True}, "r3"), ({"online_r1_rotation": True}, "online_r1_rotation")],
)
def test_refused_fields(kwargs, field):
    with pytest.raises(NotImplementedError, match=f"RotationConfig.{field}=True"):
        rotated(char_model(), char_batches(), RotationConfig(**kwargs))


def test_config_checks_follow_amd_quark():
    with pytest.raises(NotImplementedError, match="rotation_size"):
        RotationConfig(random_r1=True, rotation_size=32)
    with pytest.raises(ValueError, match="online_r1_rotation=False has no effect along r1=False"):
        RotationConfig(r1=False, online_r1_rotation=False)
    with pytest.raises(ValueError, match="train_smooth=True along trainable=False"):
        RotationConfig(train_smooth=True)
    with pytest.raises(ValueError, match="rotation_size=0"):
        RotationConfig(rotation_size=0)
    assert RotationConfig().online_r1_rotation is False
    assert RotationConfig(trainable=True).train_smooth is False
    c = Config.from_dict({"global_quant_config": {}, "algo_config": [{"name": "rotation", "r4": True}]})
    assert c.algo_config[0] == RotationConfig(r4=True)
    assert Config.from_dict(c.to_dict()) == c


def test_layernorm_refused_before_any_change():
    model = char_model()
    for layer in model.model.layers:
        layer.input_layernorm = nn.LayerNorm(64, bias=False)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError, match=r"norm model.layers.0.input_layernorm \(LayerNorm, family 'llama'\) is not an RMS norm"
    ):
        rotated(model, char_batches())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_other_family_refused():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).eval()
    with pytest.raises(
        ValueError, match=r"decoder layer transformer.h.0 \(GPT2Block\) is of family 'gpt2'.*\['llama', 'gemma'\]"
    ):
        rotated(gpt2, [torch.randint(0, 64, (1, 8))])


def test_no_decoder_stack_refused():
    with pytest.raises(ValueError, match="has no decoder stack"):
        rotated(nn.Sequential(nn.Linear(8, 8)), [torch.randn(2, 8)])


def test_explicit_scaling_layers_give_the_derived_plan():
    model = char_model()
    attn = [
        "model.layers.layer_id.self_attn.q_proj",
        "model.layers.layer_id.self_attn.k_proj",
        "model.layers.layer_id.self_attn.v_proj",
    ]
    mlp = ["model.layers.layer_id.mlp.gate_proj", "model.layers.layer_id.mlp.up_proj"]
    second = {
        "prev_modules": ["model.layers.layer_id.self_attn.o_proj"],
        "norm_module": "model.layers.layer_id.post_attention_layernorm",
        "next_modules": mlp,
    }
    layers = {
        "first_layer": [
            {
                "prev_modules": ["model.embed_tokens", "model.embed_positions"],
                "norm_module": "model.layers.layer_id.input_layernorm",
                "next_modules": attn,
            },
            second,
        ],
        "middle_layers": [
            {
                "prev_modules": ["model.layers.pre_layer_id.mlp.down_proj"],
                "norm_module": "model.layers.layer_id.input_layernorm",
                "next_modules": attn,
            },
            second,
        ],
        "last_layer": [
            {
                "prev_modules": ["model.layers.layer_id.mlp.down_proj"],
                "norm_module": "model.norm",
                "next_modules": ["lm_head"],
            }
        ],
    }
    derived = rotation_plan(model, RotationConfig())
    explicit = rotation_plan(model, RotationConfig(scaling_layers=layers))
    assert set(explicit.readers) == set(derived.readers) and set(explicit.writers) == set(derived.writers)
    assert set(explicit.embeddings) == set(derived.embeddings) and set(explicit.norms) == set(derived.norms)
    assert explicit.heads == derived.heads and explicit.down_projs == derived.down_projs
    out = rotated(model, char_batches(), RotationConfig(scaling_layers=layers, r2=True, r4=True))
    x = char_batches(1, seed=5)[0]
    assert rel(logits(out, x), logits(model, x)) < 1e-5
    with pytest.raises(ValueError, match="names 'model.nope'"):
        rotation_plan(model, RotationConfig(scaling_layers={"last_layer": [{"next_modules": ["model.nope"]}]}))


def test_lightning_module_names():
    from quark_lightning.tasks.char_lm import PerplexityLM  # noqa: F401  (the names below are net.model.*)

    wrapper = nn.Module()
    wrapper.net = char_model()
    plan = rotation_plan(wrapper, RotationConfig())
    assert plan.readers[0] == "net.model.layers.0.self_attn.q_proj" and plan.embeddings[0] == "net.model.embed_tokens"
    assert "net.lm_head" in plan.readers


def test_gemma_unit_offset_norms_tied_and_one_kv_head():
    transformers = pytest.importorskip("transformers")
    from rot_models import _perturb

    config = transformers.GemmaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = _perturb(transformers.GemmaForCausalLM(config), 0)
    assert rotation_plan(model, RotationConfig()).family == "gemma"
    out = rotated(model, hf_batches())
    x = hf_batches(1, seed=5)[0]
    assert rel(logits(out, x), logits(model, x)) < 1e-5
    assert torch.equal(out.model.layers[0].input_layernorm.weight, torch.zeros(64))  # x * (1 + 0): identity scaling
