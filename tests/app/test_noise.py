"""What a new user sees on documented commands says something or nothing (issue 33, item 7): no warning about a
preset's layer type the model does not have, no TracerWarning from an ONNX export, no Lightning advertisement or
deprecation notice of Lightning's own code, a layer table that names what learns a threshold, labelled bit averages
and deltas that show a nonzero digit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.api import format_plans
from quark_lightning.app.conf import build_quant
from quark_lightning.app.run import _one_log_line_per_message, fit_layer_types, format_delta, format_table
from quark_lightning.tasks.digits import DigitsCNN
from tests.app.app_helpers import ROOT, compose_cfg


def _results(float_value: float, quantized: float, mixed: dict | None = None) -> dict:
    """The keys of results.json that format_table reads."""
    results = {
        "metric": {"name": "test_ppl", "float": float_value, "quantized": quantized, "delta": quantized - float_value},
        "quant": {"name": "w4_rtn", "mode": "ptq", "weight_bits": 4.0, "act_bits": 32.0},
        "size": {"fp32_bytes": 4096, "quantized_bytes": 1024},
        "wall_time_s": {"total_s": 1.0},
    }
    if mixed is not None:
        results["mixed_precision"] = mixed
        results["quant"]["weight_bits"] = mixed["avg_element_bits"]
    return results


# ----------------------------------------------------------------------------------------------- the results table
def test_a_small_nonzero_delta_keeps_a_digit() -> None:
    """Before: ``4.76 (-0.00)`` for a perplexity that moved by 0.0012."""
    table = format_table(_results(4.7612, 4.7600))
    assert "4.76 (-0.0012)" in table and "(-0.00)" not in table
    assert format_delta(-1.234) == "-1.23" and format_delta(0.78) == "+0.78" and format_delta(0.0) == "+0.00"
    assert format_delta(0.004) == "+0.004" and format_delta(-0.005) == "-0.01"  # the first that rounds to a cent


def test_a_mixed_run_says_which_average_is_which() -> None:
    """Before: the log said 2.9795 weight bits per parameter and the table ``weights 2.9299 bits``, unlabelled."""
    mixed = {"avg_bits": 2.97953, "avg_element_bits": 2.9299, "target_bits": 3.0}
    title = format_table(_results(98.0, 97.0, mixed)).splitlines()[0]
    assert "weights 2.9299 bits per element, 2.9795 with scales" in title
    assert "weights 4 bits," in format_table(_results(98.0, 97.0)).splitlines()[0]  # a uniform run as before


# ----------------------------------------------------------------------------------------------- presets fit the model
class _TinyLM(nn.Module):
    """Only Linear and Embedding layers, as the char LM and Hugging Face decoders."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)


@pytest.mark.parametrize("preset", ["int4_per_group", "w4_rtn", "mxfp4"])
def test_a_presets_conv2d_entry_does_not_warn_on_an_lm(preset: str) -> None:
    """Before: ``Config.layer_type_quant_config entries name layer types the model does not have ... ['Conv2d']``
    on every LM run with these presets."""
    _, config = build_quant(compose_cfg(f"quant={preset}").quant)
    assert config is not None and "Conv2d" in config.layer_type_quant_config  # the preset's generic type table
    model = _TinyLM()
    fitted = fit_layer_types(config, model)
    assert "Conv2d" not in fitted.layer_type_quant_config
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plans = ModelQuantizer(fitted).resolve(model)
    assert {p.name for p in plans} == {"fc", "head"}
    assert fit_layer_types(config, DigitsCNN(width=4)) is config  # a model with convolutions keeps the entry


def test_the_engine_still_warns_about_a_type_entry_that_configures_nothing() -> None:
    """The engine (amd-quark's behaviour) keeps its warning; only the app fits a preset to its model."""
    _, config = build_quant(compose_cfg("quant=int4_per_group").quant)
    assert config is not None
    with pytest.warns(UserWarning, match=r"layer types the model does not have.*\['Conv2d'\]"):
        ModelQuantizer(config).resolve(_TinyLM())


# ----------------------------------------------------------------------------------------------- the layer table
@pytest.mark.parametrize("preset", ["w4a8_tqt", "w4a8_tqt_graph"])
def test_the_layer_table_of_a_tqt_preset_names_tqt(preset: str) -> None:
    """Before: the observer column said PerTensorMinMaxObserver, which a TQT quantizer never runs."""
    _, config = build_quant(compose_cfg(f"quant={preset}").quant)
    assert config is not None
    if ModelQuantizer(config).graph_mode:
        from quark.torch.quantization.graph import capture

        model = capture(DigitsCNN(width=4).eval(), (torch.rand(2, 1, 8, 8),))
    else:
        model = DigitsCNN(width=4)
    table = format_plans(ModelQuantizer(config).resolve(model))
    assert "TQT(learned,init=_3SD)" in table and "MinMaxObserver" not in table
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows and all(row[5] == "TQT(learned,init=_3SD)" for row in rows)


# ----------------------------------------------------------------------------------------------- ONNX export
class _Functional(nn.Module):
    """A Parameter used through ``F.linear`` (graph mode: a functional weight, stored as codes)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(nn.functional.linear(x, self.w)) + x)


_INT8_ACT = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
_INT8_W = {**_INT8_ACT, "qscheme": "per_channel", "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}
_INT4_G8 = {
    **_INT8_ACT,
    "dtype": "int4",
    "qscheme": "per_group",
    "ch_axis": 1,
    "group_size": 8,
    "observer_cls": "PerGroupMinMaxObserver",
}
_FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", "is_dynamic": False}


@pytest.mark.parametrize(
    "case",
    ["int8_per_tensor_act", "int4_per_group_weight", "fp8", "graph_functional_int4"],
)
def test_onnx_export_emits_no_tracer_warning(case: str, tmp_path: Path) -> None:
    """Before: a TracerWarning per per-tensor quantizer (float(scale) in forward), per stored weight (its shape check),
    per fp8 quantizer (the compiled-kernel size test) and per guard of a captured graph."""
    pytest.importorskip("onnx")
    from quark.torch.export import export_onnx
    from quark.torch.quantization.graph import capture

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    model, config = {
        "int8_per_tensor_act": (mlp, {"weight": _INT8_W, "input_tensors": _INT8_ACT}),
        "int4_per_group_weight": (mlp, {"weight": _INT4_G8, "input_tensors": _INT8_ACT}),
        "fp8": (mlp, {"weight": _FP8, "input_tensors": _FP8}),
        "graph_functional_int4": (
            capture(_Functional().eval(), (x,)),
            {"weight": {**_INT8_W, "dtype": "int4"}, "input_tensors": _INT8_ACT},
        ),
    }[case]
    full = {"global_quant_config": config, **({"quant_mode": "fx_graph_mode"} if case.startswith("graph") else {})}
    model = ModelQuantizer(full).quantize_model(model, [x])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_onnx(model, tmp_path, x)
    noise = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning | FutureWarning)
    ]
    assert not noise, noise


# ----------------------------------------------------------------------------------------------- Lightning's messages
def test_lightnings_litlogger_tip_is_not_printed(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Before: "💡 Tip: ... litlogger" once per Trainer (2-3 per run, once per search trial)."""
    _one_log_line_per_message()
    with caplog.at_level(logging.INFO):
        Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    assert "litlogger" not in caplog.text
    assert "GPU available" in caplog.text or "TPU available" in caplog.text  # Lightning's other messages still come


_LEAFSPEC_CHILD = """
import warnings
import quark_lightning.app.run  # its warning filters, as train.py has them
message = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead."
warnings.warn(message, FutureWarning, stacklevel=1)
warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)
"""


def test_lightnings_leafspec_deprecation_is_not_shown() -> None:
    """Before: a FutureWarning from Lightning's own pytree helper on every run (once per search trial). In a child
    process: pytest resets warning filters around each test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": ""}
    proc = subprocess.run([sys.executable, "-c", _LEAFSPEC_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "another FutureWarning" in proc.stderr and "LeafSpec" not in proc.stderr


def test_a_type_the_user_names_on_the_command_line_is_kept_and_warned_about() -> None:
    """Only a preset's table is fitted: ``+quant.layer_type_quant_config={Embedding:{...}}`` on a model without
    embeddings keeps the engine's warning (tests/app/test_reliability_checks.py checks it in train.log)."""
    from quark_lightning.app.run import _command_line_types

    _, config = build_quant(compose_cfg("quant=int4_per_group").quant)
    assert config is not None
    named = _command_line_types(["quant=int4_per_group", "+quant.layer_type_quant_config={Conv2d:{}}"])
    assert "Conv2d" in named and "Linear" not in named
    assert "Conv2d" in fit_layer_types(config, _TinyLM(), keep=named).layer_type_quant_config
    assert _command_line_types(["quant=int4_per_group", "trainer.max_epochs=1"]) == set()
