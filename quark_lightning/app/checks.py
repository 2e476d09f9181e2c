"""Checks of the app that run before any training, and its warnings routed through logging.

* ``check_plain_keys``: the plain keys the app reads (``seed``, ``ckpt_path``, ``export``, ``metric.name``) and the
  arguments of the ``trainer`` / ``data`` / ``model`` nodes against the annotations of what they instantiate
  (``trainer.max_epochs=abc`` is named, with the type allowed), as a ConfigError.
* ``check_activations``: the activation specs (per_channel / per_group ``ch_axis``, per_block) of a prepared copy of
  the model against one training batch (a float forward under no_grad; only when some activation spec has an axis).
* ``warnings_logged_once``: inside a run, every warning goes to the logger ``py.warnings`` (so Hydra's handlers print
  it and write it to train.log), each distinct message once.
"""

from __future__ import annotations

import collections.abc
import contextlib
import difflib
import inspect
import logging
import os
import types
import typing
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, Union

from omegaconf import DictConfig, OmegaConf
from torch import nn

from quark.torch.quantization.api import activation_axes_to_check, check_activation_shapes, run_batch
from quark_lightning.app.conf import ConfigError

SEED_RANGE = (0, 2**32 - 1)  # what numpy (and Lightning's seed_everything) accept
INSTANTIATED = ("trainer", "data", "model")  # nodes whose keys are the arguments of their _target_
_SCALARS = (bool, int, float, str, type(None))


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
