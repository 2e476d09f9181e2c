"""One run of the app: validate -> build -> fit (float) -> test float -> quantize (PTQ or QAT) -> test -> report.

``train.py`` calls ``run(cfg, output_dir)`` with the composed Hydra config; tests call it in-process the same way.
Every check that can fail (the quant config, the metric, the checkpoint, the layers' shapes, the data loaders, the
Trainer's arguments, files of the user's where the run writes) runs before the run directory is touched, so a mistake
costs seconds, not a training run, and leaves the directory as it was.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from callbacks import AtomicCheckpointIO, QuantCallback
from callbacks.quant import as_model_input, read_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.algorithm import find_decoder_layers, scaling_groups
from quark.torch.export import QUARK_SUBDIR, check_exportable, export_formats, export_model, get_format
from quark.torch.export.files import write_atomically, write_files_atomically, write_text_atomically
from quark.torch.extras import MissingExtraError, require_extra
from quark.torch.quantization.api import run_batch, unmatched_names
from quark.torch.quantization.config.config import AWQConfig, Config, QuantizationConfig, SmoothQuantConfig
from quark.torch.quantization.report import activation_sqnr, model_size_bits, weight_sqnr
from quark.torch.quantization.state import preserve_modes
from quark_lightning.app.checks import check_activations, check_plain_keys, warnings_logged_once
from quark_lightning.app.conf import ConfigError, QuantConfigError, QuantFlow, build_quant, nominal_bits, spec_bits
from quark_lightning.app.layer_bits import apply_layer_bits
from quark_lightning.app.mixed import candidate_configs, check_before_training, run_mixed, with_candidate
from quark_lightning.app.rundir import (
    FLOAT_TEST_CACHE,
    SWEEP_STATE,
    busy_error,
    check_free,
    check_writable,
    claim,
    file_logs_held,
    locked,
    planned,
    read_recorded,
    record,
    recording,
    run_dir_lock,
    run_files,
    write_recorded,
)

try:
    import fcntl
except ImportError:  # not POSIX (Windows): runs are not locked
    fcntl = None  # type: ignore[assignment]

_SHOWN_NAMES = 40  # layer names listed in an error message (as quant.layer_bits lists them)

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


class ScaleLearningRates(Callback):
    """Multiply every optimizer's learning rates by ``factor`` when training starts (QAT fine-tunes trained weights)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor
                if "initial_lr" in group:  # schedulers restart from the scaled rate
                    group["initial_lr"] *= self.factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * self.factor for lr in scheduler.base_lrs]


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
    check_plain_keys(cfg)  # seed=abc, trainer.max_epochs=abc, ...: named, before anything is built
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        datamodule = _build(cfg.data, "data")
        model = _build(cfg.model, "model")
        check_data = getattr(model, "check_datamodule", None)
        if callable(check_data):  # e.g. the data's vocabulary and window length fit the model
            check_data(datamodule)
        metric, higher_is_better = _metric(cfg, model)
        if qconfig is not None:  # exclude / layer_quant_config names matching no layer stop here (the engine warns)
            _check_names(qconfig, model)
            qconfig = fit_layer_types(qconfig, model, keep=_command_line_types())  # a preset's Conv2d entry on an LM
        if qconfig is not None and flow.layer_bits:  # per-layer widths: names checked against the built model
            qconfig = apply_layer_bits(qconfig, model, flow.layer_bits)
        uniform: dict[str, float] = {}
        if qconfig is not None and flow.target_bits is not None:  # mixed precision: every candidate is checked
            layers, prepared, uniform = _check_mixed(cfg, flow, qconfig, model)
        else:
            layers, prepared = _check_quantizable(qconfig, model) if qconfig is not None else ({}, None)
        formats = _check_export(cfg, prepared)
        check_activations(prepared, datamodule, as_model_input)  # activation ch_axis vs one batch (a dry forward)
        if cfg.get("ckpt_path"):
            _load_float_weights(model, str(cfg.ckpt_path))
        _check_data(cfg, datamodule)  # data.batch_size=0: its loaders are built (not iterated) here
        quantizing = qconfig is not None
        plan = planned(
            cfg, flow.mode if quantizing else None, quantizing and flow.target_bits is not None, bool(formats)
        )
        check_free(out, *plan)  # a file of the user's where this run writes: named, the run stops
    except (ValueError, FileNotFoundError, MissingExtraError) as err:  # before any Trainer: the config cannot run
        raise ConfigError(str(err)) from err
    trainer = _checked_trainer(cfg, out)  # trainer.max_epochs=-2 stops here, before the directory is touched
    take(plan, [cfg.get("ckpt_path"), flow.sensitivity_csv])  # the last check has passed: the directory is this run's

    timings: dict[str, float] = {}
    if not cfg.get("ckpt_path"):
        t0 = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
        timings["fit_s"] = time.perf_counter() - t0
    float_metrics = float_test(_float_test_cache(cfg), _float_test_key(cfg), lambda: _test(trainer, model, datamodule))
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
            layers = _check_quantizable(qconfig, model)[0]
        qtrainer, model = _quantize(cfg, flow, qconfig, model, datamodule, out)
        quant_metrics = _test(qtrainer, model, datamodule)
        if ModelQuantizer(qconfig).graph_mode:
            layers = _graph_layers(qconfig, model)
        timings["quantize_s"] = time.perf_counter() - t0
        report = _report(model, datamodule, qtrainer)
        quantized_ckpt = str(out / "checkpoints" / "quantized.ckpt")
        qtrainer.save_checkpoint(quantized_ckpt, weights_only=False)  # with the callback state (its Config)
        record(out)
        if formats:
            example = qtrainer.precision_plugin.convert_input(_first_input(datamodule))  # the model's dtype
            report["export"] = export_model(model, out / "export", formats, example)
            if "quark" in formats:
                _save_tokenizer(datamodule, out / "export" / QUARK_SUBDIR)
            record(out)
    timings["total_s"] = time.perf_counter() - start

    results = _results(
        cfg, flow, qconfig, metric, higher_is_better, float_metrics, quant_metrics, report, float_bits, timings
    )
    results["layers"] = layers
    if mixed is not None:  # the weights' width is the choice's average (element bits; scales in mixed_precision)
        results["quant"]["weight_bits"] = mixed["avg_element_bits"]
        results["mixed_precision"] = mixed
    results["checkpoints"] = {"float": float_ckpt or cfg.get("ckpt_path"), "quantized": quantized_ckpt}
    results["files"] = run_files(out)  # this run's files in its directory (relative paths), by kind
    _write_json(out / "results.json", results)
    print(format_table(results))
    print(f"results: {out / 'results.json'}")
    return results


# ----------------------------------------------------------------------------------------------- checks
def _checked_trainer(cfg: DictConfig, out: Path) -> Trainer:
    """The float phase's Trainer (building it writes nothing), or ConfigError for an argument Lightning refuses
    (trainer.max_epochs=-2, trainer.accelerator=gpu without one)."""
    try:
        return _trainer(cfg, out, "fp32", checkpoint_name="float-epoch{epoch}")
    except InstantiationException as err:
        raise ConfigError(
            f"the Trainer (or a logger) could not be built from the config: {err.__cause__ or err}"
        ) from err


def _check_data(cfg: DictConfig, datamodule: Any) -> None:
    """The data's train and validation loaders can be built (set up as fit sets them up, not iterated): a
    mistake such as data.batch_size=0 stops the run before the directory is touched, not after the float training."""
    setup = getattr(datamodule, "setup", None)
    if callable(setup):
        setup("fit")
    for name in ("train_dataloader", "val_dataloader"):
        make = getattr(datamodule, name, None)
        try:
            if callable(make):
                make()
        except (ValueError, TypeError) as err:
            raise ValueError(f"data ({cfg.data.get('_target_')}): {name}() cannot be built: {err}") from err


def _build(node: DictConfig, key: str) -> Any:
    """``instantiate`` whose failure in the target's own code is raised as that error (Hydra wraps it in an
    InstantiationException whose message repeats the full traceback text); bad targets keep Hydra's error."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError | TypeError | FileNotFoundError | RuntimeError | MissingExtraError):
            raise type(cause)(f"{key} ({node.get('_target_')}): {cause}") from cause
        raise


def fit_layer_types(config: Config, model: torch.nn.Module, keep: Iterable[str] = ()) -> Config:
    """``config`` without the ``layer_type_quant_config`` entries of layer types the model does not have, except those
    in ``keep`` (the types the user named on the command line: the engine's warning about them stays). Presets carry
    a generic type table (int4_per_group keeps Conv2d weights int8): on a model without convolutions that entry
    configures nothing, and the engine would warn about it on every run. Type names are validated by the Config, so
    a typo still stops; the entries dropped are logged at debug level. Graph mode keeps its table: its type names
    also match the captured graph's ops."""
    quantizer = ModelQuantizer(config)
    kept_by_user = set(keep)
    absent = [] if quantizer.graph_mode else [t for t in quantizer.absent_layer_types(model) if t not in kept_by_user]
    if not absent:
        return config
    logging.getLogger(__name__).debug(
        "quant.layer_type_quant_config: %s not in %s, left out", absent, type(model).__name__
    )
    kept = {k: v for k, v in config.layer_type_quant_config.items() if k not in absent}
    return dataclasses.replace(config, layer_type_quant_config=kept)


def _command_line_types(overrides: Iterable[str] | None = None) -> set[str]:
    """The words of the command-line overrides (Hydra's, else ``overrides``) that touch ``layer_type_quant_config``:
    the layer types a user configured there, as opposed to a preset's table."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return {w for o in overrides if "layer_type_quant_config" in o for w in re.findall(r"[A-Za-z_]\w*", o)}


def _metric(cfg: DictConfig, model: LightningModule) -> tuple[str, bool]:
    name, mode = str(cfg.metric.name), str(cfg.metric.mode)
    if mode not in ("max", "min"):
        raise ValueError(f"metric.mode={mode!r} is not allowed; allowed: ['max', 'min']")
    logged = getattr(model, "metrics", None)
    if logged is not None and name not in logged:
        raise ValueError(
            f"metric.name={name!r} is not logged by {type(model).__name__}; it logs {list(logged)} "
            "(for an LM use experiment=char_lm or experiment=hf_lm, which set data, model and metric together)"
        )
    return name, mode == "max"


def _check_names(config: Config, model: LightningModule) -> None:
    """Every ``quant.exclude`` / ``quant.layer_quant_config`` entry matches a module of the built model (eager mode;
    graph mode names its units at capture): a typo would quantize the layer the user meant to keep or configure.
    QuantConfigError naming each unmatched entry with the closest layer names, as ``quant.layer_bits`` does."""
    if ModelQuantizer(config).graph_mode:
        return
    names = [n for n, _ in model.named_modules() if n]
    problems = [
        f"quant.{field_name}: {key!r} {_closest(key, names)}"
        for field_name, keys in unmatched_names(config, names).items()
        for key in keys
    ]
    if problems:
        raise QuantConfigError(
            "; ".join(problems)
            + f" (an entry is an fnmatch pattern of a module's full name in {type(model).__name__}, "
            "e.g. net.fc1 or '*fc1')"
        )


def _closest(key: str, names: list[str]) -> str:
    """'matches no layer', with the layer names closest to ``key`` (or the first ones, when none is close)."""
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    if close:
        return f"matches no layer; closest: {close}"
    return f"matches no layer; the layers: {names[:_SHOWN_NAMES] + (['...'] if len(names) > _SHOWN_NAMES else [])}"


def _check_quantizable(config: Config, model: LightningModule) -> tuple[dict[str, dict[str, Any]], LightningModule]:
    """The config must match a layer, and each layer's tensors must fit its specs (checked on a copy).
    Returns what each layer resolves to (per role the spec's main fields and the level it came from) and that
    prepared copy (the export check inspects its quantizers)."""
    quantizer = ModelQuantizer(config)
    if quantizer.graph_mode:  # the graph is captured on the first batch: QuantCallback.setup checks it before training
        return {}, copy.deepcopy(model)
    plans = quantizer.resolve(model)
    if not plans:
        layers = [f"{n} ({type(m).__name__})" for n, m in model.named_modules() if n]
        raise ValueError(f"the quant config matches no layer of {type(model).__name__}; its layers: {layers}")
    prepared = quantizer.prepare(copy.deepcopy(model))  # shape errors (group sizes, channel axes) name the layer
    for algo in config.algo_configs + config.pre_quant_opt_configs:  # AWQ and SmoothQuant work on a decoder stack
        if isinstance(algo, AWQConfig | SmoothQuantConfig):
            found = find_decoder_layers(model, algo.model_decoder_layers)
            if found is None:
                raise ValueError(
                    f"quant.{'algo_config' if isinstance(algo, AWQConfig) else 'pre_quant_opt_config'} ({algo.name}) needs "
                    f"a decoder stack and {type(model).__name__} has none (use experiment=char_lm or hf_lm, or set model_decoder_layers)"
                )
            scaling_groups(found[1][0], algo.scaling_layers)  # derivable or valid, else the modules are listed
    return _layer_table(plans), prepared


def _graph_layers(config: Config, model: LightningModule) -> dict[str, dict[str, Any]]:
    """Graph mode: what each captured child's compute ops resolved to (known once the callback captured them)."""
    quantizer = ModelQuantizer(config)
    plans = [
        dataclasses.replace(plan, name=f"{name}.{plan.name}")
        for name, child in model.named_children()
        if hasattr(child, "_graph_units")
        for plan in quantizer.resolve(child)
    ]
    return _layer_table(plans)


def _layer_table(plans: list[Any]) -> dict[str, dict[str, Any]]:
    """Per layer: its type and, per role, the spec's main fields and the config level it came from."""
    layers: dict[str, dict[str, Any]] = {}
    for plan in plans:
        entry: dict[str, Any] = {"type": plan.layer_type}
        for role in QuantizationConfig.ROLES:
            spec = getattr(plan.qconfig, role)
            if spec is not None:
                entry[role] = {
                    "dtype": spec.dtype.name,
                    "qscheme": spec.qscheme.name if spec.qscheme else None,
                    "ch_axis": spec.ch_axis,
                    "group_size": spec.group_size,
                    "bits": spec_bits(spec),
                    "from": plan.source.get(role),
                }
        layers[plan.name] = entry
    return layers


def _check_mixed(
    cfg: DictConfig, flow: QuantFlow, config: Config, model: LightningModule
) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """Mixed precision, before training: each candidate as the global weight spec fits every layer (and the export
    formats), and the budget can be met. Returns the layers and prepared copy of the first candidate, and each
    candidate's average bits when used everywhere."""
    layers: dict[str, Any] = {}
    prepared = None
    for name, qconfig in candidate_configs(config, flow).items():
        try:
            found, copy_ = _check_quantizable(with_candidate(config, qconfig), model)
            _check_export(cfg, copy_)
        except ValueError as err:
            raise ValueError(f"quant.candidates: {name}: {err}") from None
        if prepared is None:
            layers, prepared = found, copy_
    return layers, prepared, check_before_training(model, config, flow)


def _check_export(cfg: DictConfig, prepared: LightningModule | None) -> list[str]:
    """The ``export`` list: known formats, a quantized run, and (ONNX) Q/DQ-expressible quantizers of the
    ``prepared`` copy (None: a float run)."""
    formats = list(cfg.get("export") or [])
    unknown = [f for f in formats if f not in export_formats()]
    if unknown:
        raise ValueError(f"export={unknown} is not known; allowed: {list(export_formats())}")
    if formats and prepared is None:
        raise ValueError("export needs a quantized run (quant.mode ptq or qat), not quant=none")
    for fmt in formats:  # a core install (no extras): stop now, not after training
        require_extra("export", f"export=[{fmt}]", get_format(fmt).modules)
    check_exportable(prepared, formats)  # e.g. a format amd-quark's layout cannot hold, named before training
    return formats


def _save_tokenizer(datamodule: Any, directory: Path) -> None:
    """The data's tokenizer (when it has one) beside amd-quark's Hugging Face directory, each file written whole."""
    tokenizer = getattr(datamodule, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        write_files_atomically(directory, "tokenizer", lambda tmp: tokenizer.save_pretrained(tmp))


def _first_input(datamodule: Any) -> torch.Tensor:
    batch = next(iter(datamodule.test_dataloader()))
    return batch[0] if isinstance(batch, tuple | list) else batch


def _load_checkpoint(path: str) -> Any:
    """The user's ``ckpt_path`` file, read without running code in it (``read_checkpoint``)."""
    return read_checkpoint(
        path,
        name=f"ckpt_path={path!r}",
        if_trusted="Pass a Lightning checkpoint of this model (the app's float-epochN.ckpt), or weights saved as plain "
        "tensors by the code that trained them: torch.save({'state_dict': model.state_dict()}, 'weights.ckpt'), "
        "then ckpt_path=weights.ckpt",
    )


def _load_float_weights(model: LightningModule, path: str) -> None:
    """Weights of a Lightning checkpoint (read only: the file is never written) into the freshly built model."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ckpt_path={path!r} does not exist")
    checkpoint = _load_checkpoint(path)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"ckpt_path={path!r} holds no state_dict")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(
            f"ckpt_path={path!r} does not fit {type(model).__name__} (a float checkpoint of this model?): {err}"
        ) from None


# ----------------------------------------------------------------------------------------------- building blocks
def _loggers(cfg: DictConfig, out: Path, phase: str) -> list[Any]:
    loggers = []
    for node in (cfg.get("logger") or {}).values():
        if node is None:
            continue
        extra: dict[str, Any] = {"version": phase}
        if node.get("save_dir") is None:
            extra["save_dir"] = str(out)
        loggers.append(instantiate(node, **extra))
    return loggers


def _trainer(
    cfg: DictConfig,
    out: Path,
    phase: str,
    checkpoint_name: str,
    callbacks: list[Callback] | None = None,
    **overrides: Any,
) -> Trainer:
    callbacks = list(callbacks or [])
    if cfg.trainer.get("enable_checkpointing", True) is not False:
        # no "=" in file names: they are passed back as ckpt_path=... overrides, where "=" would need quoting
        callbacks.append(
            ModelCheckpoint(dirpath=str(out / "checkpoints"), filename=checkpoint_name, auto_insert_metric_name=False)
        )
    kwargs: dict[str, Any] = {"callbacks": callbacks, "logger": _loggers(cfg, out, phase) or False, **overrides}
    if cfg.trainer.get("default_root_dir") is None:
        kwargs["default_root_dir"] = str(out)
    if not cfg.trainer.get("plugins"):  # checkpoints complete under their name or absent (a full disk, a kill)
        kwargs["plugins"] = [AtomicCheckpointIO()]
    return instantiate(cfg.trainer, **kwargs)


def _quantize(
    cfg: DictConfig, flow: QuantFlow, config: Config, model: LightningModule, datamodule: Any, out: Path
) -> tuple[Trainer, LightningModule]:
    """PTQ: a Trainer whose QuantCallback calibrates before testing. QAT: fine-tune with fake quantization."""
    if flow.mode == "ptq":
        callback = QuantCallback(config, mode="ptq", calib_batches=flow.calib_batches, save_quantized=False)
        return _trainer(cfg, out, "ptq", "ptq-epoch{epoch}", [callback]), model  # its test calibrates first
    callback = QuantCallback(
        config,
        mode="qat",
        observer_steps=flow.observer_steps,
        freeze_bn_epoch=flow.freeze_bn_epoch,
        quantizer_lr=flow.quantizer_lr,
    )
    trainer = _trainer(
        cfg,
        out,
        "qat",
        "qat-epoch{epoch}",
        [callback, ScaleLearningRates(flow.qat_lr_scale)],
        max_epochs=flow.qat_epochs,
    )
    trainer.fit(model, datamodule=datamodule)
    return trainer, model


def float_test(cache: Path | None, key: str, test: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The float model's test metrics: ``test()``, or what ``cache`` (a JSON file) holds under ``key`` from an earlier
    job of the same sweep, which tested the same model on the same data. The cache is a file of the sweep, recorded in
    its ``sweep_state.json``: read only while it is as recorded, new results added atomically and recorded; an
    unreadable cache is ignored (the test runs again), one that is not the sweep's is neither read nor written over."""
    if cache is None:
        return test()
    text = read_recorded(cache.parent, cache.name, SWEEP_STATE)
    try:
        stored = json.loads(text) if text is not None else {}
    except ValueError:
        stored = {}
    if not isinstance(stored, dict):
        stored = {}
    try:
        cached = {str(k): float(v) for k, v in stored[key].items()} if isinstance(stored.get(key), dict) else None
    except (TypeError, ValueError):  # not numbers: tested again
        cached = None
    if cached is not None:
        logging.getLogger(__name__).info(
            "float test metrics read from %s (an earlier job of this sweep tested this float model)", cache
        )
        return cached
    with _rng_kept():  # a cache hit consumes no randomness: neither does the test that fills it
        metrics = test()
    stored[key] = metrics
    write_recorded(cache.parent, cache.name, json.dumps(stored, indent=1, sort_keys=True) + "\n", SWEEP_STATE)
    return metrics


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """torch's (CPU and CUDA), Python's and numpy's random states as they were before the block."""
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _float_test_cache(cfg: DictConfig) -> Path | None:
    """In a multirun whose jobs all start from one float checkpoint (``ckpt_path``: a search over quantization
    settings), the sweep directory's float-test cache, when the sweep holds that directory (``quark_lightning.app.sweepdir``: its end
    callback claimed it); None otherwise (each run tests its own float model)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from quark_lightning.app.sweepdir import claimed_sweep

    if not cfg.get("ckpt_path") or not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    folder = Path(HydraConfig.get().sweep.dir)
    return folder / FLOAT_TEST_CACHE if claimed_sweep(folder) else None


def _float_test_key(cfg: DictConfig) -> str:
    """What the float test depends on: the checkpoint file (path, size, modification time) and the data, model,
    trainer, metric and seed settings."""
    path = Path(str(cfg.get("ckpt_path") or ""))
    stat = path.stat() if path.is_file() else None
    parts = {
        "ckpt": [str(path.resolve()), stat.st_size if stat else None, stat.st_mtime_ns if stat else None],
        **{
            k: OmegaConf.to_container(cfg[k], resolve=True) if k in cfg else None
            for k in ("data", "model", "trainer", "metric")
        },
        "seed": cfg.get("seed"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _test(trainer: Trainer, model: LightningModule, datamodule: Any) -> dict[str, float]:
    (metrics,) = trainer.test(model, datamodule=datamodule, verbose=False)
    return {k: float(v) for k, v in metrics.items()}


@torch.no_grad()
def _report(model: LightningModule, datamodule: Any, trainer: Trainer) -> dict[str, Any]:
    """Per-layer SQNR (dB) of weights and of activations on the first test batch (cast as the ``trainer``'s
    precision casts batches: trainer.precision=64-true / bf16-true), and the model size."""
    batch = trainer.precision_plugin.convert_input(next(iter(datamodule.test_dataloader())))
    with preserve_modes(model, mode=False):  # per module: a frozen BatchNorm stays in eval
        act = activation_sqnr(model, lambda m: run_batch(m, batch, device=model.device))
    quantized_bits, float_bits = model_size_bits(model)
    return {
        "sqnr_db": {"weight": weight_sqnr(model), "activation": act},
        "size": {
            "fp32_bits": float_bits,
            "quantized_bits": quantized_bits,
            "fp32_bytes": math.ceil(float_bits / 8),
            "quantized_bytes": math.ceil(quantized_bits / 8),
            "compression": float_bits / quantized_bits if quantized_bits else None,
        },
    }


# ----------------------------------------------------------------------------------------------- results
def _results(
    cfg: DictConfig,
    flow: QuantFlow,
    config: Config | None,
    metric: str,
    higher_is_better: bool,
    float_metrics: dict[str, float],
    quant_metrics: dict[str, float] | None,
    report: dict[str, Any],
    float_bits: int,
    timings: dict[str, float],
) -> dict[str, Any]:
    if metric not in float_metrics:
        raise ValueError(f"metric.name={metric!r} was not logged by the test step; logged: {sorted(float_metrics)}")
    float_value = float_metrics[metric]
    quant_value = quant_metrics.get(metric) if quant_metrics else None
    size = report.get("size") or {
        "fp32_bits": float_bits,
        "quantized_bits": float_bits,
        "fp32_bytes": math.ceil(float_bits / 8),
        "quantized_bytes": math.ceil(float_bits / 8),
        "compression": 1.0,
    }
    return {
        "task": {"data": cfg.data.get("_target_"), "model": cfg.model.get("_target_")},
        "quant": {
            "name": flow.name,
            "mode": flow.mode,
            "weight_bits": nominal_bits(config, "weight"),
            "act_bits": nominal_bits(config, "input_tensors"),
            "weight_bits_knob": flow.weight_bits,
            "act_bits_knob": flow.act_bits,
        },
        "metric": {
            "name": metric,
            "mode": "max" if higher_is_better else "min",
            "float": float_value,
            "quantized": quant_value,
            "delta": None if quant_value is None else quant_value - float_value,
        },
        "float_metrics": float_metrics,
        "quantized_metrics": quant_metrics,
        "size": size,
        "sqnr_db": report.get("sqnr_db"),
        "export": report.get("export"),
        "wall_time_s": timings,
        "quark_config": config.to_dict() if config is not None else None,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write: a temporary file in the same folder, synced, then a rename (``write_atomically``)."""
    write_text_atomically(path, json.dumps(data, indent=2, default=str))


def format_table(results: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    m, q, size = results["metric"], results["quant"], results["size"]
    label = f"{q['name']} ({q['mode']}, weights {_weight_bits(results)}, activations {q['act_bits']:g} bits)"
    rows = [("model", m["name"], "size")]
    rows.append(("float", f"{m['float']:.2f}", _bytes(size["fp32_bytes"])))
    if m["quantized"] is not None:
        rows.append((q["name"], f"{m['quantized']:.2f} ({format_delta(m['delta'])})", _bytes(size["quantized_bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{label}; wall time {results['wall_time_s']['total_s']:.1f} s"]
    for i, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_delta(delta: float, decimals: int = 2) -> str:
    """A signed difference with ``decimals`` decimals, or two significant digits when it is nonzero but would round
    to zero there (a perplexity moving by 0.004 prints -0.004, not -0.00)."""
    if delta != 0 and abs(delta) < 0.5 * 10**-decimals:
        return f"{delta:+.2g}"
    return f"{delta:+.{decimals}f}"


def _weight_bits(results: dict[str, Any]) -> str:
    """The weights' width in the table's title: a mixed run names both of its averages, per element and with the
    per-channel / per-group scales counted (the budget quant.target_bits counts the scales)."""
    mixed = results.get("mixed_precision")
    if mixed:
        return f"{mixed['avg_element_bits']:g} bits per element, {mixed['avg_bits']:.4f} with scales"
    return f"{results['quant']['weight_bits']:g} bits"


def _bytes(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.2f} MiB"
