"""``ptq_from=<dir>``: the app quantizes a Hugging Face checkpoint one decoder layer at a time into
``<run dir>/export/quark`` without building the model. The reference is the in-memory path on the same checkpoint
and the same calibration batches (the data's train loader after the run's seed): ``from_pretrained``,
``ModelQuantizer.quantize_model``, ``export_quark_dir``; every tensor equal bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from app_helpers import compose_cfg
from hydra.utils import instantiate

from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir
from quark_lightning.app.conf import ConfigError, build_quant
from quark_lightning.app.run import run
from quark_lightning.app.streamed import calibration_batches

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

DATA = ("experiment=hf_lm", "data.train_bytes=20000", "data.val_bytes=4000", "data.test_bytes=4000")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level LLaMA (the hf_lm data's vocabulary: 256 bytes + BOS/EOS) saved in several shards."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="60KB")
    return path


def read(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(str(file)))
    return out


def test_a_run_streams_the_checkpoint_into_the_run_dir_as_the_in_memory_path_would(
    checkpoint: Path, tmp_path: Path
) -> None:
    cfg = compose_cfg(*DATA, "quant=w4_gptq", "quant.calib_batches=2", f"ptq_from={checkpoint}")
    results = run(cfg, tmp_path / "run")
    export = tmp_path / "run" / "export" / "quark"
    assert results["export"]["path"] == str(export) and (export / "config.json").is_file()
    assert results["export"]["calib_batches"] == 2 and not (tmp_path / "run" / "checkpoints").exists()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    batches = calibration_batches(instantiate(cfg.data), 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ModelQuantizer(build_quant(cfg.quant)[1]).quantize_model(model, batches)
    a, b = read(export_quark_dir(model, tmp_path / "memory")), read(export)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    ("quant", "message"),
    [("quant=none", "pick a PTQ preset"), ("quant=w8a8", "static activation quantizers")],
)
def test_what_cannot_stream_stops_before_the_run_dir_is_touched(
    checkpoint: Path, tmp_path: Path, quant: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg(*DATA, quant, f"ptq_from={checkpoint}"), tmp_path / "run")
    assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") == []


def test_a_missing_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        run(compose_cfg(*DATA, "quant=w4_rtn", f"ptq_from={tmp_path / 'nowhere'}"), tmp_path / "run")
