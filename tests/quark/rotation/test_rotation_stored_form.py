"""The stored form of an online rotation (amd-quark 0.13's): ``input_rotation`` is written as the int8 +-1 signs of
one diagonal block (checked against scipy's Sylvester Hadamard matrix), the rotation entry of the exported config
names the online-rotated layers in ``online_config.online_rotation_layers``, and our importers read the stored form
back to the very buffer and logits. A full-size rotation of a size that is not a power of two gets a warning (amd-quark
builds its own, different Hadamard matrix there)."""

import copy
import json
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from rot_models import WEIGHT, hf_batches, hf_llama, logits, plain_llama

from quark.torch import ModelQuantizer
from quark.torch.algorithm.rotation import ROTATION_BUFFER
from quark.torch.algorithm.rotation.hadamard import block_hadamard_matrix
from quark.torch.export.front_end import export_model, import_model
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.online_rotation import decode_input_rotation, decoded_rotations, encode_input_rotation

scipy_linalg = pytest.importorskip("scipy.linalg")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float.*")
DOWN = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(("size", "block"), [(64, 16), (128, 128)])
def test_encode_is_sylvesters_signs_of_one_block_and_decodes_bit_for_bit(size, block):
    rotation = block_hadamard_matrix(size, block).to(torch.float32)  # the buffer as add_online_rotation stores it
    stored = encode_input_rotation(rotation)
    assert stored.dtype == torch.int8 and stored.shape == (block, block)
    assert torch.equal(stored, torch.tensor(scipy_linalg.hadamard(block), dtype=torch.int8))
    back = decode_input_rotation(stored, size)
    assert back.dtype == torch.float32 and torch.equal(back, rotation)


def test_a_rotation_that_is_no_hadamard_block_is_stored_as_it_is():
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    q = q.to(torch.float32)
    assert torch.equal(encode_input_rotation(q), q)
    assert torch.equal(decode_input_rotation(q, 32), q)  # a float [in, in] value (earlier exports) read as it is


def test_trainable_form_is_the_float_block():
    rotation = block_hadamard_matrix(64, 16).to(torch.float32)
    stored = encode_input_rotation(rotation, as_signs=False)
    assert stored.dtype == torch.float32 and torch.equal(stored, rotation[:16, :16])
    assert torch.equal(decode_input_rotation(stored, 64), rotation)
    uneven = rotation.clone()
    uneven[16:32, 16:32] *= -1  # blocks that differ: stored whole
    assert torch.equal(encode_input_rotation(uneven, as_signs=False), uneven)
    assert torch.equal(encode_input_rotation(uneven), uneven)


def test_decode_refuses_a_bad_stored_value():
    with pytest.raises(ValueError, match=r"x.input_rotation: \(32, 32\).*48 inputs"):
        decode_input_rotation(torch.ones(32, 32, dtype=torch.int8), 48, "x.input_rotation")
    with pytest.raises(ValueError, match=r"\+-1"):
        decode_input_rotation(torch.zeros(4, 4, dtype=torch.int8), 8)
    with pytest.raises(ValueError, match=r"\(3, 3\).*8 inputs"):
        decode_input_rotation(torch.eye(3), 8)


def test_decoded_rotations_reads_lazily_and_leaves_other_keys():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    signs = torch.tensor(scipy_linalg.hadamard(4), dtype=torch.int8)
    tensors = {"0.input_rotation": signs, "0.weight": torch.ones(4, 8)}
    lazy = decoded_rotations(model, _Lazy(tensors))
    assert not isinstance(lazy, dict) and set(lazy) == set(tensors)
    expected = torch.block_diag(*[torch.tensor(scipy_linalg.hadamard(4), dtype=torch.float64) / 2] * 2).float()
    assert torch.equal(lazy["0.input_rotation"], expected) and lazy["0.weight"] is tensors["0.weight"]
    assert torch.equal(decoded_rotations(model, tensors)["0.input_rotation"], expected)


class _Lazy(Mapping):
    """A mapping that is not a dict (as a lazily read export directory's tensors are)."""

    def __init__(self, tensors):
        self._tensors = tensors

    def __getitem__(self, key):
        return self._tensors[key]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)


def _rotated(rotation_size, intermediate=None):
    model = hf_llama(False)
    if intermediate is not None:
        model = plain_llama(intermediate)
    config = Config.from_dict(
        {
            "global_quant_config": {"weight": WEIGHT},
            "algo_config": [{"name": "rotation", "r1": True, "r2": True, "r4": True, "rotation_size": rotation_size}],
        }
    )
    return ModelQuantizer.freeze(ModelQuantizer(config).quantize_model(model, hf_batches()))


@pytest.mark.parametrize("fmt", ["quark", "safetensors"])
def test_export_stores_amd_quarks_form_and_reimports_exactly(fmt, tmp_path: Path):
    model = _rotated(64)  # R4 on 192 inputs: 3 blocks of 64
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # amd-quark applies this rotation: no warning
        warnings.filterwarnings("ignore", ".*stay float.*")
        export_model(copy.deepcopy(model), tmp_path, [fmt])
    weights = next(tmp_path.rglob("*.safetensors"))
    stored = safetensors_torch.load_file(str(weights))
    key = next(k for k in stored if k.endswith(f"{DOWN}.{ROTATION_BUFFER}"))
    assert stored[key].dtype == torch.int8 and stored[key].shape == (64, 64)
    assert torch.equal(stored[key], torch.tensor(scipy_linalg.hadamard(64), dtype=torch.int8))
    if fmt == "quark":
        config = json.loads(next(tmp_path.rglob("config.json")).read_text())["quantization_config"]
    else:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            config = json.loads(f.metadata()["quantization_config"])
    rotation = next(a for a in config["algo_config"] if a["name"] == "rotation")
    assert rotation["online_config"]["online_rotation_layers"] == [DOWN, "model.layers.1.mlp.down_proj"]
    assert "train_steps" not in rotation and "train_lr" not in rotation  # amd-quark 0.13's RotationConfig refuses them
    fresh = import_model(hf_llama(False), tmp_path, fmt)
    buffer = getattr(dict(fresh.named_modules())[DOWN], ROTATION_BUFFER)
    assert buffer.shape == (192, 192) and torch.equal(
        buffer, getattr(dict(model.named_modules())[DOWN], ROTATION_BUFFER)
    )
    x = hf_batches(1, seed=4)[0]
    assert torch.equal(logits(fresh, x), logits(model, x))


def test_full_size_rotation_not_a_power_of_two_warns(tmp_path: Path):
    model = _rotated(None)  # R4 on 192 inputs, one block: amd-quark builds its own Hadamard matrix of 192
    with pytest.warns(UserWarning, match=r"amd-quark 0.13 will not apply.*down_proj.*192 inputs, not a power of two"):
        export_model(model, tmp_path, ["quark"])


def test_full_size_power_of_two_exports_without_warning(tmp_path: Path):
    model = _rotated(None, intermediate=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", ".*stay float.*")
        export_model(model, tmp_path, ["quark"])
    stored = safetensors_torch.load_file(str(next(tmp_path.rglob("*.safetensors"))))
    assert stored[f"{DOWN}.{ROTATION_BUFFER}"].shape == (128, 128)
