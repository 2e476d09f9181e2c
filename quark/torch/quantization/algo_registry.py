"""The algorithm registry: each algorithm config type (GPTQConfig, AWQConfig, SmoothQuantConfig, CLEConfig, ...) with
the stage it runs at and its handler, looked up by ``type(config)``.

``quark.torch.quantization.config.config`` declares the stage of each of its config types (Config validation needs it:
graph-stage algorithms run in fx_graph_mode only); the handler comes with the code that runs it, registered on import
(``quark.torch.algorithm`` for GPTQ / AWQ / SmoothQuant, ``quark.torch.quantization.graph`` for CLE), so the engine
never imports the algorithms (they depend on it). Stages, in the order ModelQuantizer runs them:

- ``"graph"``: on the captured, BatchNorm-folded float graph, before any statistic (CLE);
- ``"before_calibration"``: on the prepared model's float function, quantizers paused (SmoothQuant, AWQ);
- ``"after_calibration"``: on the calibrated model (GPTQ writes the weights and their qparams).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = [
    "STAGES",
    "AlgorithmContext",
    "AlgorithmEntry",
    "register_algorithm",
    "algorithm_entry",
    "algorithm_stage",
    "registered_algorithms",
    "check_algorithms",
    "run_stage",
]

STAGES = ("graph", "before_calibration", "after_calibration")


@dataclass(frozen=True)
class AlgorithmContext:
    """What a handler gets besides the model and its config: the calibration batches, how to run one
    (``run(model, batch)``) and, where the caller knows them, the layers' weight specs as seen [out, in] (None: the
    handler reads them from the model's quantizers); graph-stage handlers get no context."""

    batches: list[Any]
    run: Callable[[nn.Module, Any], Any]
    weight_spec_of: Callable[[str], QuantizationSpec | None] | None = None


#: handler(model, algo_config, context): runs one algorithm config on the model in place
Handler = Callable[["nn.Module", Any, "AlgorithmContext | None"], None]
#: check(model, algo_config): validates the config against the model before any algorithm changes it
Check = Callable[["nn.Module", Any], None]


@dataclass(frozen=True)
class AlgorithmEntry:
    """One registered algorithm config type: its stage, handler (None until its module is imported) and check."""

    config_type: type
    stage: str
    handler: Handler | None = None
    check: Check | None = None


_REGISTRY: dict[type, AlgorithmEntry] = {}


def register_algorithm(
    config_type: type, stage: str, handler: Handler | None = None, check: Check | None = None
) -> None:
    """Register ``config_type`` to run at ``stage`` with ``handler`` (and ``check``). Registering a type again keeps
    its stage (a different one is refused) and installs the handler and check given."""
    if stage not in STAGES:
        raise ValueError(
            f"register_algorithm({config_type.__name__}): stage={stage!r} is not known; allowed: {list(STAGES)}"
        )
    known = _REGISTRY.get(config_type)
    if known is not None and known.stage != stage:
        raise ValueError(
            f"register_algorithm({config_type.__name__}): stage={stage!r}, but it is registered at {known.stage!r}"
        )
    handler = handler if handler is not None else known.handler if known else None
    check = check if check is not None else known.check if known else None
    _REGISTRY[config_type] = AlgorithmEntry(config_type, stage, handler, check)


def registered_algorithms() -> dict[type, AlgorithmEntry]:
    """Every registered config type and its entry, in registration order."""
    return dict(_REGISTRY)


def algorithm_entry(config: Any, need_handler: bool = False) -> AlgorithmEntry:
    """The entry of ``type(config)``. ValueError for an unregistered type (naming the registered ones), and with
    ``need_handler`` for a type whose handler's module has not been imported."""
    entry = _REGISTRY.get(type(config))
    if entry is None:
        allowed = [t.__name__ for t in _REGISTRY]
        raise ValueError(
            f"algorithm config {type(config).__name__} is not registered; allowed: {allowed} (register a new one with "
            "quark.torch.quantization.algo_registry.register_algorithm(ConfigType, stage=..., handler=...))"
        )
    if need_handler and entry.handler is None:
        raise ValueError(
            f"{type(config).__name__} has no handler: `import quark.torch` registers GPTQ, AWQ and SmoothQuant"
        )
    return entry


def algorithm_stage(config: Any) -> str:
    """The stage ``config`` runs at (ValueError for an unregistered type)."""
    return algorithm_entry(config).stage


def check_algorithms(model: nn.Module, configs: list[Any]) -> None:
    """Every config's check against ``model`` (before any algorithm changes it)."""
    for config in configs:
        check = algorithm_entry(config, need_handler=True).check
        if check is not None:
            check(model, config)


def run_stage(stage: str, model: nn.Module, configs: list[Any], context: AlgorithmContext | None) -> None:
    """Run the handlers of the ``configs`` that run at ``stage``, in their order."""
    for config in configs:
        if algorithm_stage(config) == stage:
            algorithm_entry(config, need_handler=True).handler(model, config, context)  # type: ignore[misc]
