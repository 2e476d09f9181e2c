"""Mixed precision in the app: ``quant=mixed_auto``, or ``quant.target_bits`` + ``quant.candidates`` on any eager PTQ
preset (its activation specs, ``exclude``, ... kept).

After the float model is trained (or loaded from ``ckpt_path``) and tested, each weight layer's sensitivity to each
candidate is measured on ``quant.sensitivity_batches`` calibration batches with the engine
(``quark.torch.quantization.sensitivity``: one layer quantized at a time; the KL divergence or MSE of the outputs
against the float model's, or HAWQ's Hessian trace times the weight error), formats are allocated under the budget
(``allocate``: exact, never over ``target_bits`` average weight bits per parameter, scales counted), and the choice is
written as a quant preset (``mixed_precision.yaml``). The run then quantizes with the Config of that very preset, by
the ordinary PTQ path: a later run of the preset (``quant=<name>`` once the file is in ``conf/quant``) reproduces the
same formats and, from the same float weights, the same metric.

Files in the run directory: ``sensitivity.csv`` (layer, params, candidate, bits, loss, chosen), ``mixed_bits.png``
(bits per layer, and each candidate's loss per layer) and ``mixed_precision.yaml``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from callbacks.mixed_precision import plain_data, write_sensitivity_csv
from quark.torch import ModelQuantizer
from quark.torch.algorithm.sensitivity import (
    LayerSensitivity,
    allocate,
    average_bits,
    hessian_sensitivity,
    measure_sensitivity,
    model_output,
    weight_bits,
)
from quark.torch.export.files import write_atomically, write_text_atomically
from quark.torch.quantization.api import run_batch
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.hf import linear_weight
from quark.torch.quantization.state import preserve_modes
from quark_lightning.app.conf import (
    MIXED_KEYS,
    QCONFIG_KEYS,
    QuantFlow,
    build_quant,
    candidate_specs,
    flatten_layer_names,
    spec_bits,
)

__all__ = [
    "candidate_configs",
    "check_before_training",
    "choose",
    "preset_dict",
    "write_preset",
    "plot_bits",
    "run_mixed",
    "read_sensitivity_csv",
    "PRESET_NAME",
]

log = logging.getLogger(__name__)
PRESET_NAME = "mixed_precision"  # the name the written preset reports (rename it with the file)
_METHOD_TEXT = {
    "kl": "KL divergence of the outputs from the float model's, one layer quantized at a time",
    "mse": "MSE of the outputs against the float model's, one layer quantized at a time",
    "hessian": "Hessian trace x squared weight error (HAWQ), per layer",
}


def candidate_configs(config: Config, flow: QuantFlow) -> dict[str, QuantizationConfig]:
    """Name -> the global QuantizationConfig of ``config`` with the candidate's spec as its weight (the activation
    specs of the preset are part of what is measured)."""
    assert flow.candidates is not None
    specs = candidate_specs(flow.candidates)
    return {
        name: dataclasses.replace(config.global_quant_config, weight=QuantizationSpec.from_dict(spec))
        for name, spec in specs.items()
    }


def with_candidate(config: Config, qconfig: QuantizationConfig) -> Config:
    """``config`` whose global level is ``qconfig`` (the others kept): the Config a uniform run of that candidate has."""
    return dataclasses.replace(copy.deepcopy(config), global_quant_config=qconfig)


def weight_shapes(
    model: nn.Module, config: Config, candidates: dict[str, QuantizationConfig]
) -> dict[str, tuple[int, ...]]:
    """The layers whose weight the candidates quantize (model order) and their weights' [out, in...] shapes."""
    first = with_candidate(config, next(iter(candidates.values())))
    plans = [p for p in ModelQuantizer(first).resolve(model, warn=False) if p.qconfig.weight is not None]
    return {p.name: tuple(linear_weight(model.get_submodule(p.name)).shape) for p in plans}


def check_before_training(model: nn.Module, config: Config, flow: QuantFlow) -> dict[str, float]:
    """What can be checked on the built model: the budget can be met (ValueError naming ``quant.target_bits``, with
    each candidate's size on this model), and a ``quant.sensitivity_csv`` fits it. Returns each candidate's average
    weight bits per parameter when used everywhere (scales counted, as the allocator counts them)."""
    candidates = candidate_configs(config, flow)
    shapes = weight_shapes(model, config, candidates)
    total = sum(math.prod(s) for s in shapes.values()) or 1
    uniform = {
        name: sum(math.prod(s) * weight_bits(qc.weight, s) for s in shapes.values()) / total
        for name, qc in candidates.items()
    }
    cheapest = (
        sum(math.prod(s) * min(weight_bits(qc.weight, s) for qc in candidates.values()) for s in shapes.values())
        / total
    )
    target = float(flow.target_bits or 0.0)
    if target < cheapest - 1e-9:
        raise ValueError(
            f"quant.target_bits={target:g} is below what the cheapest candidates store on {type(model).__name__}: "
            f"{cheapest:.4f} weight bits per parameter, scales counted (each candidate everywhere: "
            + ", ".join(f"{n} {b:.4f}" for n, b in uniform.items())
            + f"); allowed: >= {cheapest:.4f}"
        )
    if flow.sensitivity_csv is not None:
        read_sensitivity_csv(flow.sensitivity_csv, shapes, candidates)
    return uniform


def read_sensitivity_csv(
    path: str | Path, shapes: dict[str, tuple[int, ...]], candidates: dict[str, QuantizationConfig]
) -> list[LayerSensitivity]:
    """The losses of an earlier run's ``sensitivity.csv`` for these layers and candidates (bits recomputed from the
    specs); ValueError naming ``quant.sensitivity_csv`` when the file lacks a layer or a candidate, or holds other
    layers (another model)."""
    where = f"quant.sensitivity_csv={str(path)!r}"
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as err:
        raise ValueError(f"{where}: {err.strerror or err}") from None
    if not rows or not {"layer", "candidate", "loss"} <= set(rows[0]):
        raise ValueError(f"{where}: not a sensitivity.csv (columns layer, params, candidate, bits, loss, chosen)")
    losses: dict[str, dict[str, float]] = {}
    for row in rows:
        losses.setdefault(row["layer"], {})[row["candidate"]] = float(row["loss"])
    other = sorted(set(losses) - set(shapes))
    missing = sorted(set(shapes) - set(losses))
    if other or missing:
        raise ValueError(f"{where} is not of this model: layers {missing} missing, layers {other} unknown")
    out = []
    for layer, shape in shapes.items():
        absent = [c for c in candidates if c not in losses[layer]]
        if absent:
            raise ValueError(
                f"{where} has no loss of candidates {absent} for layer '{layer}' (it measured {sorted(losses[layer])})"
            )
        entry = LayerSensitivity(layer, math.prod(shape))
        for name, qc in candidates.items():
            entry.loss[name] = losses[layer][name]
            entry.bits[name] = weight_bits(qc.weight, shape)
        out.append(entry)
    return out


# ----------------------------------------------------------------------------------------------- the choice
def _task_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of the model's logits against the batch's targets: the loss whose Hessian HAWQ traces."""
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError(
            "quant.sensitivity=hessian needs (input, target) batches, whose cross entropy it differentiates; use kl or mse"
        )
    device = next(model.parameters()).device
    x, y = batch[0], batch[1].to(device)
    logits = model_output(run_batch(model, x, device=device)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def choose(
    model: nn.Module,
    datamodule: Any,
    flow: QuantFlow,
    config: Config,
    device: torch.device | None = None,
    convert: Callable[[Any], Any] | None = None,
) -> tuple[dict[str, str], list[LayerSensitivity]]:
    """(candidate per layer, the sensitivities) of the float ``model``, measured on the first
    ``quant.sensitivity_batches`` batches of the train loader (the calibration data), on ``device`` (the Trainer's;
    the model goes back where it was after)."""
    assert flow.target_bits is not None
    candidates = candidate_configs(config, flow)
    if flow.sensitivity_csv is not None:  # measured by an earlier run
        sensitivities = read_sensitivity_csv(flow.sensitivity_csv, weight_shapes(model, config, candidates), candidates)
        return allocate(sensitivities, float(flow.target_bits)), sensitivities
    setup = getattr(datamodule, "setup", None)
    if callable(setup):
        setup("fit")  # the train split, as calibration sets it up
    batches = list(itertools.islice(datamodule.train_dataloader(), flow.sensitivity_batches))
    if not batches:
        raise ValueError("mixed precision: the train dataloader yielded no batch to measure the sensitivity on")
    if convert is not None:  # the Trainer's precision plugin: float64 / bf16 batches for trainer.precision=64-true
        batches = [convert(b) for b in batches]
    home = next(model.parameters()).device
    device = device or home
    model.to(device)
    try:
        with preserve_modes(model, mode=False):  # per module: a frozen BatchNorm stays in eval
            if flow.sensitivity == "hessian":
                sensitivities = hessian_sensitivity(model, candidates, batches, _task_loss, base_config=config)
            else:
                sensitivities = measure_sensitivity(
                    model,
                    candidates,
                    batches,
                    method=flow.sensitivity,
                    base_config=config,
                    run=lambda m, b: run_batch(m, b, device=device),
                )
    finally:
        model.to(home)
    choice = allocate(sensitivities, float(flow.target_bits))
    return choice, sensitivities


# ----------------------------------------------------------------------------------------------- the preset
def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"net.fc1": {...}}`` -> ``{"net": {"fc1": {...}}}`` (as Hydra writes ``layer_quant_config.net.fc1``, so that a
    command-line override reaches the entry); names with wildcards or a part named like a role stay flat."""
    out: dict[str, Any] = {}
    for name, entry in flat.items():
        parts = name.split(".")
        if any(c in name for c in "*?[]") or any(p in QCONFIG_KEYS or not p for p in parts):
            out[name] = entry
            continue
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node.setdefault(parts[-1], {}).update(entry)
    return out


_KEEP = ("global_quant_config", "layer_quant_config")


def preset_dict(quant_node: dict[str, Any], config: Config, flow: QuantFlow, choice: dict[str, str]) -> dict[str, Any]:
    """The quant preset (conf/quant format) of the choice: the composed ``quant`` node without the mixed-precision
    keys, each chosen layer's weight spec in ``layer_quant_config`` (with the global roles too when
    ``inherit_roles`` is false, where a layer's entry is its whole config)."""
    assert flow.candidates is not None
    specs = candidate_specs(flow.candidates)
    preset: dict[str, Any] = {"name": PRESET_NAME}
    for key, value in quant_node.items():  # null / empty keys are left to conf/config.yaml's defaults
        if key not in (*MIXED_KEYS, "name") and (value not in (None, {}, []) or key in _KEEP):
            preset[key] = copy.deepcopy(value)
    layers = flatten_layer_names(dict(preset.get("layer_quant_config") or {}))
    rest = {}
    if not config.inherit_roles:
        rest = {
            role: spec for role, spec in plain_data(config.global_quant_config.to_dict()).items() if spec is not None
        }
    for layer, name in choice.items():
        layers[layer] = {**rest, "weight": copy.deepcopy(specs[name])}
    preset["layer_quant_config"] = _nest(layers)
    return preset


def write_preset(path: str | Path, preset: dict[str, Any], header: str) -> Path:
    """The preset as YAML, headed by ``header`` (comment lines). ``build_quant`` of the file's content gives the
    Config the run used."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return write_text_atomically(path, comment + yaml.safe_dump(preset, sort_keys=False))


def preset_config(preset: dict[str, Any]) -> Config:
    """The quark Config of a written preset, through the same validation as ``quant=<the preset>``."""
    _, config = build_quant(preset)
    assert config is not None
    return config


# ----------------------------------------------------------------------------------------------- report
def report(
    flow: QuantFlow,
    choice: dict[str, str],
    sensitivities: Sequence[LayerSensitivity],
    uniform: dict[str, float],
    files: dict[str, str],
) -> dict[str, Any]:
    """The ``mixed_precision`` block of results.json."""
    assert flow.candidates is not None
    elements = {
        name: spec_bits(QuantizationSpec.from_dict(spec)) for name, spec in candidate_specs(flow.candidates).items()
    }
    table = {s.layer: s for s in sensitivities}
    total = sum(table[n].numel for n in choice) or 1
    return {
        "target_bits": float(flow.target_bits or 0.0),
        "avg_bits": average_bits(choice, sensitivities),
        "avg_element_bits": round(sum(table[n].numel * elements[c] for n, c in choice.items()) / total, 4),
        "sensitivity": flow.sensitivity,
        "sensitivity_batches": flow.sensitivity_batches,
        "sensitivity_csv": flow.sensitivity_csv,
        "candidates": list(flow.candidates),
        "choice": dict(choice),
        "layers": {
            n: {"candidate": c, "params": table[n].numel, "bits": table[n].bits[c], "loss": table[n].loss[c]}
            for n, c in choice.items()
        },
        "predicted_loss": sum(table[n].loss[c] for n, c in choice.items()),
        "uniform": {
            c: {"avg_bits": uniform.get(c), "predicted_loss": sum(s.loss[c] for s in sensitivities)}
            for c in flow.candidates
        },
        "files": files,
    }


def plot_bits(
    path: str | Path,
    sensitivities: Sequence[LayerSensitivity],
    choice: dict[str, str],
    target_bits: float,
    candidates: Sequence[str],
    title: str = "",
) -> Path:
    """``mixed_bits.png``: the chosen bits per parameter of each layer (bars coloured by candidate), then one hatched
    bar for the average of all layers, under the budget drawn as a line (so the two never hide each other, however
    close), above each candidate's measured loss per layer (log scale; the chosen one circled). The legend sits
    beside the bars and the title is wrapped to the figure's width."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [s for s in sensitivities if s.layer in choice]
    x = list(range(len(layers)))
    mean_x = len(layers) + 0.5  # the average's bar, set apart from the layers'
    colours = {c: plt.get_cmap("viridis")(i / max(len(candidates) - 1, 1)) for i, c in enumerate(candidates)}
    width = max(6.0, 0.35 * len(layers) + 2.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, 7.0), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    bits = [s.bits[choice[s.layer]] for s in layers]
    top.bar(x, bits, color=[colours[choice[s.layer]] for s in layers])
    avg = average_bits(choice, layers)
    top.bar([mean_x], [avg], color="lightgrey", edgecolor="black", hatch="//", label=f"average of all layers {avg:.3f}")
    top.annotate(
        f"{avg:.3f}", (mean_x, avg), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8
    )
    top.axhline(target_bits, color="crimson", linestyle="--", label=f"target {target_bits:g}")
    for c in candidates:
        top.bar([0], [0], color=colours[c], label=c)  # legend entries
    top.set_ylabel("weight bits per parameter (scales counted)")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    text = title or "mixed precision: chosen format per layer"
    columns = int(width * 13)  # characters of fontsize 9 that fit the figure's width
    top.set_title("\n".join(textwrap.fill(line, columns) for line in text.splitlines()), fontsize=9)
    for c in candidates:
        losses = [max(s.loss[c], 1e-12) for s in layers]
        bottom.plot(x, losses, marker="o", linestyle="-", color=colours[c], label=c, markersize=4)
    chosen = [max(s.loss[choice[s.layer]], 1e-12) for s in layers]
    bottom.scatter(x, chosen, s=90, facecolors="none", edgecolors="crimson", label="chosen", zorder=3)
    bottom.set_yscale("log")
    bottom.set_ylabel("sensitivity (loss, this layer only)")
    bottom.set_xticks([*x, mean_x])
    bottom.set_xticklabels([*(s.layer for s in layers), "average"], rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    try:  # bbox_inches="tight": the legend beside the axes is part of the image
        write_atomically(out.parent, out.name, lambda tmp: fig.savefig(tmp, dpi=110, format="png", bbox_inches="tight"))
    finally:
        plt.close(fig)
    return out


def _measured(flow: QuantFlow) -> str:
    if flow.sensitivity_csv is not None:
        return f"sensitivity from {flow.sensitivity_csv}"
    return f"sensitivity {flow.sensitivity} on {flow.sensitivity_batches} batches"


def write_outputs(
    out: Path,
    quant_node: dict[str, Any],
    config: Config,
    flow: QuantFlow,
    choice: dict[str, str],
    sensitivities: Sequence[LayerSensitivity],
    run_name: str,
) -> tuple[Config, dict[str, str]]:
    """sensitivity.csv, mixed_bits.png and mixed_precision.yaml in ``out``; returns the Config of the written preset
    (what the run quantizes with) and the files' paths."""
    assert flow.candidates is not None and flow.target_bits is not None
    avg = average_bits(choice, sensitivities)
    csv_path = write_sensitivity_csv(out / "sensitivity.csv", sensitivities, choice)
    title = f"{run_name}: {avg:.3f} weight bits per parameter, scales counted (target {flow.target_bits:g})\nsensitivity: {_METHOD_TEXT[flow.sensitivity] if flow.sensitivity_csv is None else flow.sensitivity_csv}"
    png_path = plot_bits(out / "mixed_bits.png", sensitivities, choice, float(flow.target_bits), flow.candidates, title)
    preset = preset_dict(quant_node, config, flow, choice)
    header = (
        f"Mixed precision chosen by quant={run_name} ({_measured(flow)}, target {flow.target_bits:g}):\n{avg:.4f} weight bits per parameter on average, scales counted; "
        f"candidates {list(flow.candidates)}.\n"
        "A quant preset: copy it into conf/quant/ under a name of yours (and set `name:` to it), then\n"
        "  python train.py quant=<name> ckpt_path=<the same float checkpoint>\n"
        "quantizes with these formats again (PTQ, no new sensitivity measurement); or keep it elsewhere:\n"
        "  mkdir -p presets/quant && cp mixed_precision.yaml presets/quant/<name>.yaml\n"
        "  python train.py --config-dir presets quant=<name> ..."
    )
    preset_path = write_preset(out / "mixed_precision.yaml", preset, header)
    files = {"sensitivity": str(csv_path), "plot": str(png_path), "preset": str(preset_path)}
    for s in sensitivities:
        if s.layer in choice:
            c = choice[s.layer]
            log.info("mixed precision: %-40s %-24s %6.3f bits  loss %.3g", s.layer, c, s.bits[c], s.loss[c])
    log.info(
        "mixed precision: %.4f weight bits per parameter with scales (target %g, scales counted); preset %s",
        avg,
        flow.target_bits,
        preset_path,
    )  # the results table also gives the bits per element, without scales
    return preset_config(preset), files


def run_mixed(
    quant_node: dict[str, Any],
    flow: QuantFlow,
    config: Config,
    model: nn.Module,
    datamodule: Any,
    out: Path,
    uniform: dict[str, float],
    run_name: str,
    device: torch.device | None = None,
    convert: Callable[[Any], Any] | None = None,
) -> tuple[Config, dict[str, Any]]:
    """Measure (on ``device``), allocate, write the files: (the Config to quantize with, the results.json block)."""
    choice, sensitivities = choose(model, datamodule, flow, config, device, convert)
    mixed_config, files = write_outputs(out, quant_node, config, flow, choice, sensitivities, run_name)
    return mixed_config, report(flow, choice, sensitivities, uniform, files)
