"""Checks of the app that run before any training, and its warnings routed through logging.

* ``check_plain_keys``: the plain keys the app reads (``seed``, ``ckpt_path``, ``export``, ``metric.name``) and the
  arguments of the ``trainer`` / ``data`` / ``model`` nodes against the annotations of what they instantiate
  (``trainer.max_epochs=abc`` is named, with the type allowed), as a ConfigError.
* ``check_activations``: the activation specs (per_channel / per_group ``ch_axis``, per_block) of a prepared copy of
  the model against one training batch (a float forward under no_grad; only when some activation spec has an axis).
* ``warnings_logged_once``: inside a run, every warning goes to the logger ``py.warnings`` (so Hydra's handlers print
  it and write it to train.log), each distinct message once.
* the run's checks before it claims its directory (``quark_lightning.app.run``): the data and model built
  (``build_node``), the metric, the quant config's names and layer shapes (``check_names``, ``check_quantizable``,
  ``check_mixed``), the export formats, the float checkpoint (``load_float_weights``), the data loaders and the
  Trainer's arguments (``checked_trainer``).
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import dataclasses
import difflib
import inspect
import logging
import os
import re
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, Union

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import LightningModule, Trainer
from omegaconf import DictConfig, OmegaConf
from torch import nn

from callbacks.quant import read_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.algorithm import find_decoder_layers, scaling_groups
from quark.torch.algorithm.rotation.apply import check_rotation
from quark.torch.export import check_exportable, export_formats, get_format
from quark.torch.extras import MissingExtraError, require_extra
from quark.torch.quantization.api import activation_axes_to_check, check_activation_shapes, run_batch, unmatched_names
from quark.torch.quantization.config.config import (
    AWQConfig,
    Config,
    QuantizationConfig,
    RotationConfig,
    SmoothQuantConfig,
)
from quark.torch.quantization.state import quant_state
from quark_lightning.app.conf import ConfigError, QuantConfigError, QuantFlow, spec_bits
from quark_lightning.app.mixed import candidate_configs, check_before_training, with_candidate
from quark_lightning.app.trainer import build_trainer

SEED_RANGE = (0, 2**32 - 1)  # what numpy (and Lightning's seed_everything) accept
INSTANTIATED = ("trainer", "data", "model")  # nodes whose keys are the arguments of their _target_
_SCALARS = (bool, int, float, str, type(None))
_SHOWN_NAMES = 40  # layer names listed in an error message (as quant.layer_bits lists them)


# ----------------------------------------------------------------------------------------------- plain keys
def check_plain_keys(cfg: DictConfig) -> None:
    """ConfigError naming the first plain key whose value has the wrong type (the resolved config)."""
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as err:  # noqa: BLE001 - an interpolation that does not resolve: OmegaConf names the key
        raise ConfigError(f"the config does not resolve: {err}") from None
    assert isinstance(data, dict)
    seed = data.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ConfigError(f"seed={seed!r} must be an int in {SEED_RANGE[0]}..{SEED_RANGE[1]}")
    ckpt = data.get("ckpt_path")
    if ckpt is not None and not isinstance(ckpt, str):
        raise ConfigError(f"ckpt_path={ckpt!r} must be null or the path of a checkpoint file")
    export = data.get("export")
    if export is not None and not (isinstance(export, list) and all(isinstance(f, str) for f in export)):
        raise ConfigError(
            f"export={export!r} must be a list of format names, e.g. export=[onnx] or export=[safetensors,quark]"
        )
    metric = data.get("metric")
    if isinstance(metric, dict) and not isinstance(metric.get("name"), str):
        raise ConfigError(f"metric.name={metric.get('name')!r} must be the name of a logged metric (a string)")
    for key in INSTANTIATED:
        node = data.get(key)
        if isinstance(node, dict) and isinstance(node.get("_target_"), str):
            _check_arguments(key, node)


def _check_arguments(key: str, node: dict[str, Any]) -> None:
    """Each argument of ``node`` against the annotation of its ``_target_``'s parameter (what cannot be judged, e.g.
    a class the value would be instantiated into, passes)."""
    target = _locate(node["_target_"])
    if target is None:
        return  # instantiation reports a target that does not import
    function = target.__init__ if inspect.isclass(target) else target
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - annotations that do not evaluate: nothing to check against
        return
    params = {n: p for n, p in signature.parameters.items() if n != "self"}
    open_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    owner = getattr(target, "__name__", str(target))
    for name, value in node.items():
        if name.startswith("_"):
            continue  # _target_, _recursive_, _partial_, ...
        if name not in params:
            if not open_kwargs:
                close = difflib.get_close_matches(name, list(params), n=1)
                hint = f"; did you mean {key}.{close[0]}?" if close else ""
                raise ConfigError(f"unknown key {key}.{name}: {owner} takes no argument {name!r}{hint}")
            continue
        hint = hints.get(name)
        if hint is None:
            continue
        if _fits(value, hint) is False:
            raise ConfigError(f"{key}.{name}={value!r} must be {_describe(hint)} ({owner} argument {name!r})")


def _locate(path: str) -> Any:
    from hydra.utils import get_object

    try:
        return get_object(path)
    except Exception:  # noqa: BLE001
        return None


def _fits(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` (plain data from the config) fits the annotation; None when that cannot be judged."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        verdicts = [_fits(value, a) for a in args]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (os.PathLike,) or (inspect.isclass(hint) and issubclass(hint, os.PathLike)):
        return isinstance(value, str)
    sequences = (list, tuple, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)
    if hint in sequences or origin in sequences:
        if not isinstance(value, list):
            return False if isinstance(value, _SCALARS) and not isinstance(value, str) else None
        if origin in (list, collections.abc.Sequence) and len(args) == 1:
            verdicts = [_fits(v, args[0]) for v in value]
            return False if False in verdicts else (None if None in verdicts else True)
        return True
    if hint in (dict, collections.abc.Mapping) or origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict) or (None if not isinstance(value, _SCALARS) else False)
    return None  # a class (Accelerator, Logger, torch.dtype, ...): the value may be converted or instantiated into it


_NAMES = {int: "an int", float: "a number", bool: "a bool (true/false)", str: "a string", type(None): "null"}


def _describe(hint: Any) -> str:
    """``max_epochs: int | None`` -> "an int or null"; Literals merged into one "one of ..." list."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    members = list(args) if origin is Union or origin is types.UnionType else [hint]
    literals = [a for m in members if typing.get_origin(m) is Literal for a in typing.get_args(m)]
    parts = [f"one of {literals}"] if literals else []
    for m in members:
        if typing.get_origin(m) is not Literal:
            parts.append(_NAMES.get(m) or f"a {getattr(typing.get_origin(m) or m, '__name__', str(m))}")
    return " or ".join(dict.fromkeys(parts))


# ----------------------------------------------------------------------------------------------- activations
def check_activations(prepared: nn.Module | None, datamodule: Any, feedable: Callable[[nn.Module, Any], Any]) -> bool:
    """The activation specs with an axis of the ``prepared`` copy against the first batch of the train loader (the
    data training and calibration see), fed as calibration feeds it (``feedable(module, batch)``). ValueError naming
    the layer, role, axis and shape. Nothing is loaded or run when no activation spec has an axis."""
    if prepared is None or not activation_axes_to_check(prepared):
        return False
    setup = getattr(datamodule, "setup", None)
    if callable(setup):
        setup("fit")  # the train split, as calibration sets it up
    try:
        batch = next(iter(datamodule.train_dataloader()))
    except StopIteration:
        raise ValueError(
            "the train dataloader yielded no batch (calibration and the activation checks need one)"
        ) from None
    return check_activation_shapes(prepared, lambda m: run_batch(m, feedable(m, batch)))


# ----------------------------------------------------------------------------------------------- warnings
@contextlib.contextmanager
def warnings_logged_once(logger_name: str = "py.warnings") -> Iterator[None]:
    """Inside: each warning is logged (``logging.getLogger(logger_name).warning``, the logger of
    ``logging.captureWarnings``) instead of printed to stderr, each distinct message (category and text) once; warning
    filters that ignore a message still do. Filters and ``warnings.showwarning`` are restored on exit."""
    log = logging.getLogger(logger_name)
    seen: set[str] = set()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        text = f"{category.__name__}: {message}"
        if text not in seen:
            seen.add(text)
            log.warning("%s", text)

    with warnings.catch_warnings():  # entering it resets the once-per-location memory: each run logs its own warnings
        warnings.showwarning = show
        yield


# ----------------------------------------------------------------------------------------------- the run's checks
def checked_trainer(cfg: DictConfig, out: Path) -> Trainer:
    """The float phase's Trainer (building it writes nothing), or ConfigError for an argument Lightning refuses
    (trainer.max_epochs=-2, trainer.accelerator=gpu without one)."""
    try:
        return build_trainer(cfg, out, "fp32", checkpoint_name="float-epoch{epoch}")
    except InstantiationException as err:
        raise ConfigError(
            f"the Trainer (or a logger) could not be built from the config: {err.__cause__ or err}"
        ) from err


def check_data(cfg: DictConfig, datamodule: Any) -> None:
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


def build_node(node: DictConfig, key: str) -> Any:
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


def command_line_types(overrides: Iterable[str] | None = None) -> set[str]:
    """The words of the command-line overrides (Hydra's, else ``overrides``) that touch ``layer_type_quant_config``:
    the layer types a user configured there, as opposed to a preset's table."""
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return {w for o in overrides if "layer_type_quant_config" in o for w in re.findall(r"[A-Za-z_]\w*", o)}


def check_metric(cfg: DictConfig, model: LightningModule) -> tuple[str, bool]:
    """``metric.name`` (logged by the model, when it lists its metrics) and whether higher is better (``metric.mode``)."""
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


def check_names(config: Config, model: LightningModule) -> None:
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


def check_quantizable(config: Config, model: LightningModule) -> tuple[dict[str, dict[str, Any]], LightningModule]:
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
        elif isinstance(algo, RotationConfig):  # a LLaMA-like decoder stack, refused fields, buildable sizes
            check_rotation(model, algo)
    return _layer_table(plans), prepared


def graph_layers(config: Config, model: LightningModule) -> dict[str, dict[str, Any]]:
    """Graph mode: what each captured child's compute ops resolved to (known once the callback captured them)."""
    quantizer = ModelQuantizer(config)
    plans = [
        dataclasses.replace(plan, name=f"{name}.{plan.name}")
        for name, child in model.named_children()
        if (state := quant_state(child)) is not None and state.graph_units is not None
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


def check_mixed(
    cfg: DictConfig, flow: QuantFlow, config: Config, model: LightningModule
) -> tuple[dict[str, Any], Any, dict[str, float]]:
    """Mixed precision, before training: each candidate as the global weight spec fits every layer (and the export
    formats), and the budget can be met. Returns the layers and prepared copy of the first candidate, and each
    candidate's average bits when used everywhere."""
    layers: dict[str, Any] = {}
    prepared = None
    for name, qconfig in candidate_configs(config, flow).items():
        try:
            found, copy_ = check_quantizable(with_candidate(config, qconfig), model)
            check_export(cfg, copy_)
        except ValueError as err:
            raise ValueError(f"quant.candidates: {name}: {err}") from None
        if prepared is None:
            layers, prepared = found, copy_
    return layers, prepared, check_before_training(model, config, flow)


def check_export(cfg: DictConfig, prepared: LightningModule | None) -> list[str]:
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


def _load_checkpoint(path: str) -> Any:
    """The user's ``ckpt_path`` file, read without running code in it (``read_checkpoint``)."""
    return read_checkpoint(
        path,
        name=f"ckpt_path={path!r}",
        if_trusted="Pass a Lightning checkpoint of this model (the app's float-epochN.ckpt), or weights saved as plain "
        "tensors by the code that trained them: torch.save({'state_dict': model.state_dict()}, 'weights.ckpt'), "
        "then ckpt_path=weights.ckpt",
    )


def load_float_weights(model: LightningModule, path: str) -> None:
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
