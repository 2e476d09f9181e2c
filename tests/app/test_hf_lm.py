"""experiment=hf_lm: a Hugging Face LLaMA (AutoModelForCausalLM) built from conf/model/hf_llama.yaml or loaded from a
local save_pretrained directory (with its tokenizer when it has one, bytes otherwise), trained, quantized by the presets
and exported as amd-quark's Hugging Face directory (export=[quark]), which reloads to the perplexity the run reported.
Everything is offline: models are random, tokenizers are trained here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from app_helpers import compose_cfg
from hydra.utils import instantiate

from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import run

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
DATA = ("data.train_bytes=20000", "data.val_bytes=4000", "data.test_bytes=4000")
TINY_HF = (
    "experiment=hf_lm",
    *DATA,
    "model.config.num_hidden_layers=1",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    *SMOKE,
)
DOWN_PROJ = "net.model.layers.0.mlp.down_proj"


def tiny_llama(vocab_size: int, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE trained in-process on a little of the corpus (no download), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from quark_lightning.tasks.char_lm import load_python_corpus

    text = bytes(load_python_corpus(20000, 100, 100)["train"].to(torch.uint8).numpy()).decode("utf-8", "replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@torch.no_grad()
def perplexity(model: torch.nn.Module, datamodule) -> float:  # noqa: ANN001
    """exp(mean token cross entropy) of a bare HF causal LM over the test split, as the task computes it."""
    model.eval()
    total, count = 0.0, 0
    for x, y in datamodule.test_dataloader():
        logits = model(input_ids=x).logits.float()
        total += float(
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        )
        count += y.numel()
    return math.exp(total / count)


def data_of(results: dict, tokenizer: str | None = None):  # noqa: ANN201
    """The test split the run evaluated on (the run's data node, optionally another tokenizer directory)."""
    from quark_lightning.tasks.hf_lm import HFPythonSourceDataModule

    node = dict(results["config"]["data"])
    node.pop("_target_")
    if tokenizer is not None:
        node["tokenizer"] = tokenizer
    datamodule = HFPythonSourceDataModule(**node)
    datamodule.setup("test")
    return datamodule


def reload_quark_dir(results: dict) -> torch.nn.Module:
    """The export=[quark] directory rebuilt from its config.json alone (amd-quark's model=None import)."""
    from quark.torch.export import import_model_from_safetensors

    directory = Path(results["export"]["quark"]["path"])
    written = json.loads((directory / "config.json").read_text())
    assert written["model_type"] == "llama" and written["architectures"] == ["LlamaForCausalLM"]
    assert written["quantization_config"]["quant_method"] == "quark"
    with pytest.warns(UserWarning, match="stay float"):  # embeddings and RMSNorms keep float weights
        return import_model_from_safetensors(None, directory)


# ----------------------------------------------------------------------------------------------- composition
def test_experiment_composes_a_llama_with_perplexity(tmp_path: Path) -> None:
    cfg = compose_cfg("experiment=hf_lm")
    assert cfg.model._target_ == "quark_lightning.tasks.hf_lm.HFCausalLM" and cfg.model.pretrained is None
    assert cfg.model.config.model_type == "llama" and cfg.model.config.vocab_size == 258
    assert cfg.model.config.max_position_embeddings >= cfg.data.seq_len
    assert cfg.data._target_ == "quark_lightning.tasks.hf_lm.HFPythonSourceDataModule" and cfg.data.tokenizer is None
    assert (cfg.data.train_bytes, cfg.data.seq_len) == (1_000_000, 128)  # python_source's corpus and windows
    assert (cfg.metric.name, cfg.metric.mode, cfg.trainer.max_epochs) == ("test_ppl", "min", 2)
    assert compose_cfg("experiment=hf_lm", f"model.pretrained={tmp_path}").data.tokenizer == str(tmp_path)

    from quark.torch.algorithm import find_decoder_layers

    model = instantiate(compose_cfg(*TINY_HF).model)
    assert type(model.net).__name__ == "LlamaForCausalLM" and model.net.config.architectures == ["LlamaForCausalLM"]
    name, layers = find_decoder_layers(model)
    assert name == "net.model.layers" and len(layers) == 1
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 258)


# ----------------------------------------------------------------------------------------------- runs
def test_ptq_run_reports_perplexity_and_its_quark_export_reloads(tmp_path: Path) -> None:
    results = run(compose_cfg(*TINY_HF, "quant=int8_per_channel", "export=[quark]"), tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    m = on_disk["metric"]
    assert (m["name"], m["mode"]) == ("test_ppl", "min")
    assert 1.0 < m["float"] < 1000.0 and math.isfinite(m["quantized"]) and abs(m["delta"]) < 0.05 * m["float"]
    assert on_disk["float_metrics"]["test_ppl"] == pytest.approx(
        math.exp(on_disk["float_metrics"]["test_loss"]), rel=1e-5
    )
    assert on_disk["task"]["model"] == "quark_lightning.tasks.hf_lm.HFCausalLM"
    assert on_disk["layers"][DOWN_PROJ]["weight"]["dtype"] == "int8" and "net.lm_head" in on_disk["layers"]

    info = on_disk["export"]["quark"]
    assert info["module"] == "net" and Path(info["weights"]).stat().st_size == info["file_bytes"]
    assert info["ratio"] < 0.6  # int8 Linear weights; the float embedding is the rest
    reloaded = reload_quark_dir(results)
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert perplexity(reloaded, data_of(results)) == pytest.approx(m["quantized"], rel=1e-4)


def test_pretrained_directory_without_tokenizer_reads_bytes(tmp_path: Path) -> None:
    tiny_llama(vocab_size=258).save_pretrained(tmp_path / "llama")
    # lr 0: the run's float model is the saved one, so its perplexity is the directory's own
    results = run(
        compose_cfg(
            "experiment=hf_lm", *DATA, *SMOKE, f"model.pretrained={tmp_path / 'llama'}", "model.lr=0", "quant=w4_rtn"
        ),
        tmp_path / "run",
    )
    assert results["config"]["data"]["tokenizer"] == str(tmp_path / "llama")
    datamodule = data_of(results)
    assert datamodule.tokenizer is None and datamodule.vocab_size == 256
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert results["metric"]["float"] == pytest.approx(perplexity(saved, datamodule), rel=1e-4)
    assert results["layers"]["net.model.layers.1.mlp.down_proj"]["weight"]["dtype"] == "uint4"  # both saved layers


def test_pretrained_directory_with_tokenizer_uses_it_and_exports_it(tmp_path: Path) -> None:
    directory = tmp_path / "llama"
    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(directory)
    tiny_llama(vocab_size=len(tokenizer), tie=True).save_pretrained(directory)  # tied embeddings, as small LMs have
    results = run(
        compose_cfg(
            "experiment=hf_lm",
            *DATA,
            *SMOKE,
            f"model.pretrained={directory}",
            "model.lr=0",
            "quant=int8_per_channel",
            "export=[quark]",
        ),
        tmp_path / "run",
    )
    datamodule = data_of(results)
    assert datamodule.vocab_size == len(tokenizer) == 400
    test_ids = datamodule.corpus["test"]
    assert len(test_ids) < 0.8 * 4000 and int(test_ids.max()) >= 256  # BPE tokens (merges), not bytes
    saved = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert results["metric"]["float"] == pytest.approx(perplexity(saved, datamodule), rel=1e-4)

    exported = Path(results["export"]["quark"]["path"])
    assert (exported / "tokenizer.json").is_file()
    reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert reloaded_tokenizer("def f(x):\n")["input_ids"] == tokenizer("def f(x):\n")["input_ids"]
    reloaded = reload_quark_dir(results)
    assert perplexity(reloaded, data_of(results, tokenizer=str(exported))) == pytest.approx(
        results["metric"]["quantized"], rel=1e-4
    )


def test_gptq_on_the_hf_llama_exports_packed_uint4(tmp_path: Path) -> None:
    """GPTQ walks net.model.layers; lm_head excluded by its app name is excluded by its HF name in the directory."""
    results = run(compose_cfg(*TINY_HF, "quant=w4_gptq", "export=[quark]", "quant.exclude=[net.lm_head]"), tmp_path)
    assert results["quark_config"]["algo_config"]["name"] == "gptq"
    weight = results["layers"][DOWN_PROJ]["weight"]
    assert (weight["dtype"], weight["group_size"], weight["bits"]) == ("uint4", 32, 4.0)
    assert "net.lm_head" not in results["layers"]
    written = json.loads((Path(results["export"]["quark"]["path"]) / "config.json").read_text())
    assert written["quantization_config"]["exclude"] == ["lm_head"]
    m = results["metric"]
    assert math.isfinite(m["quantized"]) and abs(m["delta"]) < 0.05 * m["float"]
    reloaded = reload_quark_dir(results)
    assert perplexity(reloaded, data_of(results)) == pytest.approx(m["quantized"], rel=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("model.config.vocab_size=200",),
            r"the data's vocabulary \(byte-level tokens: 256 ids\) exceeds the model's vocab_size 200",
        ),
        (("data.seq_len=256",), r"data.seq_len=256 exceeds the model's max_position_embeddings=128"),
        (
            ("model.pretrained=/no/such/dir",),
            r"data.tokenizer \(experiment=hf_lm: model.pretrained's\) '/no/such/dir' is not a directory",
        ),
        (
            ("quant=int8_per_channel", "export=[tflite]"),
            r"export=\['tflite'\] is not known; allowed: \['safetensors', 'onnx', 'quark'\]",
        ),
        (("quant=bfp16", "export=[quark]"), r"bfp16 per_group weights have no amd-quark style layout"),
    ],
)
def test_mistakes_stop_before_training(overrides: tuple[str, ...], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg(*TINY_HF, *overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_pretrained_directory_without_a_config_stops_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.pretrained='.*' has no config.json \(written by save_pretrained\?\)"):
        run(compose_cfg(*TINY_HF, f"model.pretrained={tmp_path}"), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_quark_export_of_a_model_without_hf_config_writes_the_whole_lightning_module(tmp_path: Path) -> None:
    """No ``export_module``: the directory holds the LightningModule (keys net.*) and reloads into a fresh one."""
    from quark.torch.export import import_model_from_safetensors
    from quark_lightning.tasks.lightning_digits import DigitsClassifier

    results = run(compose_cfg(*SMOKE, "export=[quark]"), tmp_path)
    info = results["export"]["quark"]
    assert info["module"] is None and 8.0 < info["bits_per_parameter"] < 9.5
    written = json.loads((Path(info["path"]) / "config.json").read_text())
    assert set(written) == {"quantization_config"}
    restored = import_model_from_safetensors(DigitsClassifier(), info["path"])
    assert restored.net.fc2.weight.shape == (10, 128)


# ----------------------------------------------------------------------------------------------- every preset
PRESETS = [
    "bf16",
    "bfp16",
    "brevitas_int8",
    "fp8_e4m3",
    "int4_per_group",
    "int8_graph",
    "int8_per_tensor",
    "mx6",
    "mx9",
    "mxfp4",
    "mxfp4_even",
    "mxfp8",
    "w3_awq",
    "w3_gptq",
    "w3_rtn",
    "w4_awq",
    "w4_rtn",
    "w4a4_rotated",
    "w4a4_spinquant",
    "w4a8_tqt",
    "w4a8_tqt_graph",
    "w8a8",
    "w8a8_smoothquant",
]


def test_the_list_is_every_preset() -> None:
    presets = {p.stem for p in (Path(__file__).parents[2] / "conf" / "quant").glob("*.yaml")}
    # w4_edges8 names the digits CNN's layers (net.conv1, net.fc2): on an LM the app stops (test_unmatched_names.py)
    assert set(PRESETS) == presets - {
        "none",
        "mixed_auto",
        "int8_per_channel",
        "w4_gptq",
        "w4_edges8",
        "w4a8_qad",  # tests/app/test_qad_preset.py runs it on both LMs
    }  # those two: tests above


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_on_the_hf_llama(preset: str, tmp_path: Path) -> None:
    """Each preset of conf/quant, graph-mode ones included (torch.export capture of LlamaForCausalLM: mask building,
    rotary embedding), quantizes the HF LLaMA and keeps its perplexity close."""
    results = run(compose_cfg(*TINY_HF, f"quant={preset}"), tmp_path)
    m = results["metric"]
    assert math.isfinite(m["quantized"]) and abs(m["delta"]) < 0.1 * m["float"]
    assert DOWN_PROJ in results["layers"]
