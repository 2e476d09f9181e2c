"""QuantCallback under Lightning's ModelParallelStrategy (FSDP2 ``fully_shard`` per decoder layer + root, two CPU
ranks, gloo): TQT and LSQ QAT with identical state on every rank and trained thresholds, sharded checkpoints that
resume bit for bit and consolidate into one file for ``load_quantized_checkpoint``, and an export gathered to one
directory equal to the single-process export of the same weights and qparams.

The runs happen in a subprocess (``fsdp_script.py``, Lightning relaunches it for rank 1); each rank trains on its
own half of the data and writes its gathered state for these tests.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cb_helpers import QuantCallback
from fsdp_script import CKPT_STEP, LSQ_CONFIG, STEPS, TQT_CONFIG, LitLM, token_data
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from callbacks.quant import load_quantized_checkpoint
from callbacks.quantizer_state import pause_quantizers
from callbacks.sharded_checkpoints import consolidate_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.export import export_model
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.distributed import gathered_parameters, write_initial_values
from quark.torch.quantization.report import model_size_bits, weight_sqnr

pytest.importorskip("transformers")
SCRIPT = Path(__file__).with_name("fsdp_script.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,  # two processes
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("fsdp")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's packages
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "all", str(out)],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, f"FSDP2 run failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    results = {}
    for mode in ("tqt", "resume", "lsq", "ptq"):
        results[mode] = [torch.load(out / f"{mode}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert [r["world_size"] for r in results[mode]] == [2, 2]
    return out, results


def _different(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("mode", ["tqt", "lsq", "ptq"])
def test_every_rank_holds_the_same_weights_qparams_and_quantizer_state(runs, mode) -> None:
    pair = runs[1][mode]
    assert not _different(pair[0]["state"], pair[1]["state"])
    if mode == "ptq":
        assert pair[0]["first"] is None  # nothing learned
    else:
        assert not _different(pair[0]["first"], pair[1]["first"])
    keys = pair[0]["state"]
    assert any(k.endswith("_input_quantizer.scale") for k in keys)  # activation qparams, reduced over both ranks
    assert all(bool(v) for k, v in keys.items() if k.endswith(".initialized"))


def _initial_weights(kind: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in LitLM(kind).named_parameters()}


def test_tqt_thresholds_start_from_the_whole_weight_and_train(runs) -> None:
    """Each weight's log2 threshold after the first step is its 3SD initialisation from the whole (gathered) weight
    plus one Adam step at quantizer_lr, lm_head too (the root module's): nothing was lost with the gathered copy."""
    pair = runs[1]["tqt"]
    weights = _initial_weights("llama")
    first, final = pair[0]["first"], pair[0]["final"]
    assert len(first) == 15  # 7 Linears x 2 decoder layers + lm_head
    for where, value in first.items():
        layer = where.split("'")[1]
        w = weights[f"{layer}.weight"].double()
        init = math.log2(float(w.mean().abs() + 3 * w.std(unbiased=False)))
        # Adam's first step moves by its learning rate: quantizer_lr (0.05) found the sharded thresholds, not the
        # weights' rate (3e-3)
        assert 0.05 * 0.9 <= abs(float(value) - init) <= 0.05 * 1.001, (where, float(value), init)
        assert not torch.equal(final[where], value), f"{where} did not train"


def test_lsq_scales_start_from_the_whole_weight_per_channel_and_train(runs) -> None:
    pair = runs[1]["lsq"]
    weights = _initial_weights("plain")
    first, final = pair[0]["first"], pair[0]["final"]
    weight_scales = {w: v for w, v in first.items() if w.endswith("weight)")}
    assert len(weight_scales) == 9 and len(first) == 18  # weights per channel, inputs per tensor
    for where, value in weight_scales.items():
        w = weights[f"{where.split(chr(39))[1]}.weight"]
        init = 2 * w.abs().mean(dim=1) / math.sqrt(127)  # one per output channel, each rank's shard included
        assert value.shape == init.shape
        assert float((value - init).abs().max()) <= 2e-3 * 1.001, where
    assert all(not torch.equal(final[w], first[w]) for w in first)


def test_sharded_checkpoint_resumes_bit_for_bit(runs) -> None:
    """STEPS steps in one run against CKPT_STEP steps, a sharded checkpoint and a resume for the rest: every
    parameter, qparam, learned threshold and quantizer flag equal, on both ranks."""
    out, results = runs
    assert (out / "ckpt" / f"epoch=0-step={CKPT_STEP}.ckpt" / ".metadata").is_file()  # a directory of shards
    for rank in (0, 1):
        straight, resumed = results["tqt"][rank]["state"], results["resume"][rank]["state"]
        assert not _different(straight, resumed)
    assert results["resume"][0]["first"] != results["tqt"][0]["first"]  # the resumed run started at step 3


def test_consolidated_checkpoint_loads_into_one_process(runs, tmp_path) -> None:
    out, results = runs
    path = consolidate_checkpoint(out / "ckpt" / f"epoch=0-step={STEPS}.ckpt", tmp_path / "one.ckpt")
    model = load_quantized_checkpoint(LitLM("llama"), path, freeze=False)
    assert not _different(results["tqt"][0]["state"], {k: v for k, v in model.state_dict().items()})
    with pytest.raises(FileExistsError, match="never overwritten"):
        consolidate_checkpoint(out / "ckpt" / f"epoch=0-step={STEPS}.ckpt", path)
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        consolidate_checkpoint(tmp_path, tmp_path / "two.ckpt")


def test_ptq_calibration_writes_a_sharded_quantized_checkpoint_that_consolidates(runs, tmp_path) -> None:
    out, results = runs
    folder = Path(results["ptq"][0]["quantized_checkpoint"])
    assert (folder / ".metadata").is_file()
    model = load_quantized_checkpoint(LitLM("plain"), consolidate_checkpoint(folder, tmp_path / "q.ckpt"), freeze=False)
    assert not _different(results["ptq"][0]["state"], dict(model.state_dict()))


def _prepared(kind: str, config: dict, state: dict[str, torch.Tensor]) -> LitLM:
    """One process: the model with the quantized twins, holding ``state``."""
    model = LitLM(kind)
    ModelQuantizer(Config.from_dict(config)).prepare(model)
    model.load_state_dict(state)
    return model


def test_the_report_reads_the_gathered_weights(runs) -> None:
    """The SQNR / model-size report logged at the end of the FSDP2 fit equals one process's on the same weights."""
    out, results = runs
    with open(out / "log" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("quant/model_size_bits")]
    last = rows[-1]
    model = _prepared("llama", TQT_CONFIG, results["tqt"][0]["state"])
    with pause_quantizers(model):
        expected = {f"quant/sqnr_weight/{k}": v for k, v in weight_sqnr(model).items()}
        quantized_bits, float_bits = model_size_bits(model)
    assert len(expected) == 15
    for key, value in expected.items():
        assert float(last[key]) == pytest.approx(value, rel=1e-6), key
    assert float(last["quant/model_size_bits"]) == quantized_bits
    assert float(last["quant/fp32_size_bits"]) == float_bits


def test_gathered_export_equals_the_single_process_export(runs, tmp_path) -> None:
    """Rank zero's export under FSDP2 against the export of one process holding the same (gathered) state."""
    out, results = runs
    model = _prepared("llama", TQT_CONFIG, results["tqt"][0]["state"])
    with pause_quantizers(model):
        export_model(model, tmp_path, ["safetensors", "quark"])
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out / "export") for p in (out / "export").rglob("*") if p.is_file())
    assert len(files) >= 3  # model.safetensors, quark/config.json, quark/model.safetensors
    for name in files:
        if name.suffix == ".safetensors":
            assert _safetensors(tmp_path / name) == _safetensors(out / "export" / name), name
        else:
            assert (tmp_path / name).read_bytes() == (out / "export" / name).read_bytes(), name


def _safetensors(path: Path) -> tuple[dict[str, str], dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]]:
    """A safetensors file's metadata and every tensor's dtype, shape and bytes. Not the file's bytes: safetensors
    writes its metadata map in an order that varies from process to process (two single-process exports differ)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = {}
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            t = f.get_tensor(key)
            tensors[key] = (t.dtype, tuple(t.shape), t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return dict(f.metadata() or {}), tensors


def test_the_docs_fsdp2_program_runs_as_a_script(tmp_path) -> None:
    """docs/lightning.md's FSDP2 program, saved as a file and run: two processes, the export, the consolidated
    checkpoint loaded in one process."""
    text = (ROOT / "docs" / "lightning.md").read_text()
    section = text[text.index("## FSDP2") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("\n```\n")]
    (tmp_path / "fsdp2_qat.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "fsdp2_qat.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert "torch.Size([1, 32, 128])" in run.stdout
    assert (tmp_path / "export" / "quark" / "config.json").is_file() and (tmp_path / "qat.ckpt").is_file()


@pytest.mark.parametrize("what", ["freeze", "export_model", "prepare"])
def test_engine_calls_on_the_sharded_model_are_refused_with_what_to_do(runs, what) -> None:
    out, results = runs
    message = results["tqt"][0]["refusals"][what]
    assert "sharded by FSDP2" in message and "DTensor" in message, message
    assert {"freeze": "consolidate", "export_model": "gathered_parameters", "prepare": "before fully_shard"}[
        what
    ] in message
    assert not (out / "never").exists()


# ----------------------------------------------------------------------------------------------- no processes
def _fsdp2_trainer(tmp_path) -> Trainer:
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"config": {**TQT_CONFIG, "quant_mode": "fx_graph_mode"}}, "graph_mode"),
        ({"export": ["onnx"]}, "onnx"),
        ({"mode": "ptq", "config": {**TQT_CONFIG, "algo_config": [{"name": "gptq"}]}}, "gptq"),
    ],
)
def test_what_fsdp2_cannot_run_is_refused_in_setup(tmp_path, kwargs, named) -> None:
    config = kwargs.pop("config", TQT_CONFIG)
    cb = QuantCallback(Config.from_dict(config), **kwargs)
    model = LitLM("plain")
    with pytest.raises(ValueError, match=f"ModelParallelStrategy \\(FSDP2\\) does not support: .*{named}"):
        cb.setup(_fsdp2_trainer(tmp_path), model, "fit")
    assert not any(n.endswith("_quantizer") for n, _ in model.named_modules())  # refused before the swap


def test_tensor_parallelism_is_refused_in_setup(tmp_path) -> None:
    trainer = _fsdp2_trainer(tmp_path)
    trainer.strategy._device_mesh = {"tensor_parallel": types.SimpleNamespace(size=lambda: 2)}  # as set up for TP=2
    with pytest.raises(ValueError, match="does not support: tensor_parallel_size > 1"):
        QuantCallback(Config.from_dict(TQT_CONFIG)).setup(trainer, LitLM("plain"), "fit")


def test_fsdp1_is_refused_with_the_fsdp2_alternative() -> None:
    """Lightning runs FSDPStrategy on GPUs only; the check needs only the strategy."""
    trainer = types.SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="does not support FSDPStrategy.*ModelParallelStrategy"):
        QuantCallback(Config.from_dict(LSQ_CONFIG))._check_sharding(trainer)


def test_without_fsdp2_the_helpers_leave_the_model_alone() -> None:
    model = LitLM("plain")
    ModelQuantizer(Config.from_dict(LSQ_CONFIG)).prepare(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with gathered_parameters(model) as same:
        assert same is model
    assert write_initial_values(model) == 0
    assert not _different(before, model.state_dict())
    assert token_data().tensors[0].shape[0] == 48
