"""One run of the app: validate -> build -> fit (float) -> test float -> quantize (PTQ or QAT) -> test -> report.

``train.py`` calls ``run(cfg, output_dir)`` with the composed Hydra config; tests call it in-process the same way.
Every check that can fail (the quant config, the metric, the checkpoint, the layers' shapes, the data loaders, the
Trainer's arguments, files of the user's where the run writes) runs before the run directory is touched, so a mistake
costs seconds, not a training run, and leaves the directory as it was.

This module keeps the sequence; the checks live in ``quark_lightning.app.checks``, the Trainers, quantization phase
and report in ``quark_lightning.app.trainer``, the float-test cache in ``quark_lightning.app.float_cache``, the results
and the final table in ``quark_lightning.app.results``, the run directory in ``quark_lightning.app.rundir``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from callbacks.quant import as_model_input
from quark.torch import ModelQuantizer
from quark.torch.export import QUARK_SUBDIR, export_model
from quark.torch.export.files import write_atomically
from quark.torch.extras import MissingExtraError
from quark.torch.quantization.report import model_size_bits
from quark_lightning.app.checks import (
    build_node,
    check_activations,
    check_data,
    check_export,
    check_metric,
    check_mixed,
    check_names,
    check_plain_keys,
    check_quantizable,
    checked_trainer,
    command_line_types,
    fit_layer_types,
    graph_layers,
    load_float_weights,
    warnings_logged_once,
)
from quark_lightning.app.conf import ConfigError, QuantConfigError, build_quant
from quark_lightning.app.float_cache import float_test, float_test_cache, float_test_key
from quark_lightning.app.layer_bits import apply_layer_bits
from quark_lightning.app.mixed import run_mixed
from quark_lightning.app.results import build_results, format_delta, format_table, write_json
from quark_lightning.app.rundir import (
    busy_error,
    check_free,
    check_writable,
    claim,
    file_logs_held,
    locked,
    planned,
    record,
    recording,
    run_dir_lock,
    run_files,
)
from quark_lightning.app.streamed import run_streamed
from quark_lightning.app.trainer import (
    ScaleLearningRates,
    build_trainer,
    first_input,
    quant_report,
    quantize,
    run_test,
    save_tokenizer,
)

for _message in (
    ".*does not have many workers.*",
    ".*number of training batches.*",
    ".*GPU available but not used.*",
    ".*Checkpoint directory .* exists and is not empty.*",  # fp32 then ptq/qat checkpoints share the run folder
    # Lightning's own pytree helper on torch >= 2.10 (lightning/pytorch/utilities/_pytree.py), nothing a user can act on
    r"`isinstance\(treespec, LeafSpec\)` is deprecated.*",
):
    warnings.filterwarnings("ignore", message=_message)

#: loggers of Lightning's rank-zero messages, and the start of the advertisement they print for every Trainer
_LIGHTNING_RANK_ZERO = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
_LIGHTNING_TIP = "💡 Tip:"


def _no_tip(record: logging.LogRecord) -> bool:
    """Drops Lightning's "💡 Tip: ... try installing litlogger" (once per Trainer: 2-3 per run, one per search job)."""
    return not str(record.msg).startswith(_LIGHTNING_TIP)


def _one_log_line_per_message() -> None:
    """Lightning and torchmetrics attach their own stderr handlers *and* propagate to the root logger, where Hydra
    has its console and train.log handlers: drop theirs so each message is printed once (and still logged).
    Lightning's litlogger advertisement is dropped at its logger."""
    for name in _LIGHTNING_RANK_ZERO:
        if _no_tip not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_no_tip)
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics"):
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            if type(handler) is logging.StreamHandler:
                log.removeHandler(handler)
        log.propagate = True


def run(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """Run the composed config; writes ``results.json`` (and checkpoints, logs) under ``output_dir``; returns it.
    The directory is locked from the moment every check has passed to the end of the run: a second run on it meanwhile
    stops (ConfigError). A run refused by a check leaves the directory as it was (``quark_lightning.app.rundir``)."""
    start = time.perf_counter()
    _one_log_line_per_message()
    out = Path(output_dir)
    try:
        check_writable(out)  # a read-only directory: named, before anything
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # train.log is held back until the run claims the directory; each warning once, through logging (so into train.log)
    with file_logs_held(out) as release_logs, contextlib.ExitStack() as lock, warnings_logged_once():
        if locked(out):  # at once; the lock itself is taken when every check has passed (a refused run leaves no .lock)
            raise busy_error(out)

        def take(plan: tuple[list[str], list[str]], inputs: list[str | None]) -> None:
            """Lock the directory, check again under the lock that no file of anybody else's is in the way, claim."""
            lock.enter_context(run_dir_lock(out))
            try:
                check_free(out, *plan)  # the directory may have changed while the checks ran
            except ValueError as err:
                raise ConfigError(str(err)) from None
            claim(cfg, out, inputs=inputs)  # run_state.json "running"; the files the previous run recorded go
            release_logs()
            _save_composed_config(cfg, out)

        with recording(out):  # run_state.json: complete, or failed with the error (once the run claimed the dir)
            return _run_checked(cfg, out, start, take)


def _save_composed_config(cfg: DictConfig, out: Path) -> None:
    """``.hydra/config.yaml`` and ``overrides.yaml``, written by us once the directory is ours (``hydra.output_subdir``
    is null: Hydra would write them before any code of ours runs, over a running job's or beside a refused run's)."""
    from hydra.core.hydra_config import HydraConfig

    folder = out / ".hydra"
    folder.mkdir(exist_ok=True)
    write_atomically(folder, "config.yaml", lambda tmp: OmegaConf.save(cfg, tmp))
    if HydraConfig.initialized():
        overrides = OmegaConf.create(list(HydraConfig.get().overrides.task))
        write_atomically(folder, "overrides.yaml", lambda tmp: OmegaConf.save(overrides, tmp))


def _run_checked(cfg: DictConfig, out: Path, start: float, take: Callable[..., None]) -> dict[str, Any]:
    """Every check (the quant config, the data, the model, the checkpoint, the Trainer, the files in the way), then
    ``take`` the directory (lock and claim), then the run."""
    flow, qconfig = build_quant(cfg.quant)  # first: a bad quant config stops here
    if cfg.get("ptq_from"):  # a Hugging Face checkpoint quantized one decoder layer at a time: no model built
        return run_streamed(cfg, out, start, take, flow, qconfig)
    check_plain_keys(cfg)  # seed=abc, trainer.max_epochs=abc, ...: named, before anything is built
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        datamodule = build_node(cfg.data, "data")
        model = build_node(cfg.model, "model")
        check_datamodule = getattr(model, "check_datamodule", None)
        if callable(check_datamodule):  # e.g. the data's vocabulary and window length fit the model
            check_datamodule(datamodule)
        metric, higher_is_better = check_metric(cfg, model)
        if qconfig is not None:  # exclude / layer_quant_config names matching no layer stop here (the engine warns)
            check_names(qconfig, model)
            qconfig = fit_layer_types(qconfig, model, keep=command_line_types())  # a preset's Conv2d entry on an LM
        if qconfig is not None and flow.layer_bits:  # per-layer widths: names checked against the built model
            qconfig = apply_layer_bits(qconfig, model, flow.layer_bits)
        uniform: dict[str, float] = {}
        if qconfig is not None and flow.target_bits is not None:  # mixed precision: every candidate is checked
            layers, prepared, uniform = check_mixed(cfg, flow, qconfig, model)
        else:
            layers, prepared = check_quantizable(qconfig, model) if qconfig is not None else ({}, None)
        formats = check_export(cfg, prepared)
        check_activations(prepared, datamodule, as_model_input)  # activation ch_axis vs one batch (a dry forward)
        if cfg.get("ckpt_path"):
            load_float_weights(model, str(cfg.ckpt_path))
        check_data(cfg, datamodule)  # data.batch_size=0: its loaders are built (not iterated) here
        quantizing = qconfig is not None
        plan = planned(
            cfg, flow.mode if quantizing else None, quantizing and flow.target_bits is not None, bool(formats)
        )
        check_free(out, *plan)  # a file of the user's where this run writes: named, the run stops
    except (ValueError, FileNotFoundError, MissingExtraError) as err:  # before any Trainer: the config cannot run
        raise ConfigError(str(err)) from err
    trainer = checked_trainer(cfg, out)  # trainer.max_epochs=-2 stops here, before the directory is touched
    take(plan, [cfg.get("ckpt_path"), flow.sensitivity_csv])  # the last check has passed: the directory is this run's

    timings: dict[str, float] = {}
    if not cfg.get("ckpt_path"):
        t0 = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
        timings["fit_s"] = time.perf_counter() - t0
    float_metrics = float_test(float_test_cache(cfg), float_test_key(cfg), lambda: run_test(trainer, model, datamodule))
    model = trainer.precision_plugin.convert_module(model).to(trainer.strategy.root_device)  # as a test leaves it
    float_ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
    float_bits = model_size_bits(model)[1]
    record(out)  # so far: a killed run's files are removed by the next run too

    quant_metrics: dict[str, float] | None = None
    mixed: dict[str, Any] | None = None
    report: dict[str, Any] = {}
    quantized_ckpt = None
    if qconfig is not None:
        t0 = time.perf_counter()
        if flow.target_bits is not None:  # sensitivity -> allocation -> mixed_precision.yaml, whose Config PTQ uses
            quant_node = OmegaConf.to_container(cfg.quant, resolve=True)
            device = trainer.strategy.root_device  # where the float model was tested
            qconfig, mixed = run_mixed(
                quant_node,
                flow,
                qconfig,
                model,
                datamodule,
                out,
                uniform,
                flow.name,
                device,  # type: ignore[arg-type]
                convert=trainer.precision_plugin.convert_input,  # batches as training saw them (64-true, bf16-true)
            )
            timings["sensitivity_s"] = time.perf_counter() - t0
            layers = check_quantizable(qconfig, model)[0]
        qtrainer, model = quantize(cfg, flow, qconfig, model, datamodule, out)
        quant_metrics = run_test(qtrainer, model, datamodule)
        if ModelQuantizer(qconfig).graph_mode:
            layers = graph_layers(qconfig, model)
        timings["quantize_s"] = time.perf_counter() - t0
        report = quant_report(model, datamodule, qtrainer)
        quantized_ckpt = str(out / "checkpoints" / "quantized.ckpt")
        qtrainer.save_checkpoint(quantized_ckpt, weights_only=False)  # with the callback state (its Config)
        record(out)
        if formats:
            example = qtrainer.precision_plugin.convert_input(first_input(datamodule))  # the model's dtype
            report["export"] = export_model(model, out / "export", formats, example)
            if "quark" in formats:
                save_tokenizer(datamodule, out / "export" / QUARK_SUBDIR)
            record(out)
    timings["total_s"] = time.perf_counter() - start

    results = build_results(
        cfg, flow, qconfig, metric, higher_is_better, float_metrics, quant_metrics, report, float_bits, timings
    )
    results["layers"] = layers
    if mixed is not None:  # the weights' width is the choice's average (element bits; scales in mixed_precision)
        results["quant"]["weight_bits"] = mixed["avg_element_bits"]
        results["mixed_precision"] = mixed
    results["checkpoints"] = {"float": float_ckpt or cfg.get("ckpt_path"), "quantized": quantized_ckpt}
    results["files"] = run_files(out)  # this run's files in its directory (relative paths), by kind
    write_json(out / "results.json", results)
    print(format_table(results))
    print(f"results: {out / 'results.json'}")
    return results


#: the old names of what moved to the modules above (building blocks, checks, results), kept importable from here
__all__ = [
    "ConfigError",
    "QuantConfigError",
    "ScaleLearningRates",
    "float_test",
    "fit_layer_types",
    "format_delta",
    "format_table",
    "run",
]
_trainer = build_trainer
_command_line_types = command_line_types
_report = quant_report
