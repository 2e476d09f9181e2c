"""The optional extras of ``pyproject.toml`` (``pip install -e .`` installs none): whether a module of one is there,
and the one error a feature that needs it raises, naming the extra's install line.

A core install runs the engine and the app; each feature below stops at once when its extra is missing:
``export`` (safetensors, ONNX), ``hf`` (Hugging Face models), ``brevitas`` (the Brevitas backend), ``search``
(``hparams_search=...``: Hydra's Optuna sweeper).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: extra -> the modules it installs that features import (pyproject.toml's [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "export": ("safetensors", "onnx", "onnxruntime"),
    "hf": ("transformers",),
    "brevitas": ("brevitas",),
    "search": ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
}


class MissingExtraError(ImportError):
    """A feature whose optional extra is not installed; the message names the feature, the module and the install line."""


def install_line(extra: str) -> str:
    """The command that installs ``extra`` into an editable checkout."""
    if extra not in EXTRAS:
        raise ValueError(f"extra {extra!r} is not known; allowed: {list(EXTRAS)}")
    return f'pip install -e ".[{extra}]"'


def available(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (False also when a parent package is absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # find_spec imports the parents: ModuleNotFoundError when one is missing
        return False


def missing_extra(extra: str, feature: str, module: str) -> MissingExtraError:
    """The error of ``feature`` when ``module`` (of ``extra``) is not installed."""
    return MissingExtraError(f"{feature} needs the {extra!r} extra ({module} is not installed): {install_line(extra)}")


def require_extra(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise MissingExtraError when a module of ``extra`` (``modules``, default: all of them) cannot be found."""
    for module in modules if modules is not None else EXTRAS[extra]:
        if not available(module):
            raise missing_extra(extra, feature, module)


def import_extra(module: str, extra: str, feature: str) -> ModuleType:
    """``module`` imported, or MissingExtraError naming ``feature`` and the install line of ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise missing_extra(extra, feature, module) from err
