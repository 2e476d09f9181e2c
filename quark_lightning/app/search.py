"""The search side of ``hparams_search=optuna_bits``: the objectives a job returns to Hydra's Optuna sweeper, their
directions, and the sampler option ``uniform_first`` (quark_lightning/app/sampler.py: the first trials are uniform-width runs).

Needs the ``search`` extra (``pip install -e ".[search]"``: hydra-optuna-sweeper, which pins optuna 2.x). Without it
(a core install: no ``hydra_plugins`` package at all) the app runs as before; ``hparams_search=...`` then stops at once
with that install line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from quark.torch.extras import EXTRAS, available, install_line

#: objective name -> (how it is read from results.json, its direction: None = the metric's own mode)
OBJECTIVES: dict[str, str | None] = {"metric": None, "model_bits": "minimize"}
INSTALL = f"{install_line('search')} (hydra-optuna-sweeper, optuna 2.x)"


def sweeper_installed() -> bool:
    """Whether Hydra's Optuna sweeper and optuna are there; False on a core install (no ``hydra_plugins`` package)."""
    return all(available(module) for module in EXTRAS["search"])


def check_search_args(args: Iterable[str]) -> str | None:
    """A message when the command line asks for ``hparams_search=...`` and the sweeper plugin is not installed."""
    asked = [a for a in args if a.lstrip("+").startswith("hparams_search=") and not a.endswith("=null")]
    if asked and not sweeper_installed():
        return f"{asked[0]} needs Hydra's Optuna sweeper: {INSTALL}"
    return None


def objective_values(results: dict[str, Any], objectives: Sequence[str]) -> list[float]:
    """The values a search job returns, one per name of ``hparams_search.objectives``: ``metric`` (the headline
    metric of the quantized model, else the float one) and ``model_bits`` (the quantized model's size in bits,
    results.json's ``size.quantized_bits``). A NaN raises: the sweeper records the trial as failed."""
    values = []
    for name in objectives:
        if name == "metric":
            m = results["metric"]
            value = m["quantized"] if m["quantized"] is not None else m["float"]
        elif name == "model_bits":
            value = results["size"]["quantized_bits"]
        else:
            raise ValueError(f"hparams_search.objectives: {name!r} is not known; allowed: {list(OBJECTIVES)}")
        if value is None or math.isnan(float(value)):
            raise ValueError(f"objective {name} is {value} (the quantized model diverged?)")
        values.append(float(value))
    return values


def directions(objectives: Sequence[str], metric_mode: str) -> list[str]:
    """Optuna's direction of each objective (resolver ``optuna_directions`` of conf/hparams_search)."""
    if metric_mode not in ("max", "min"):
        raise ValueError(f"metric.mode={metric_mode!r} is not allowed; allowed: ['max', 'min']")
    out = []
    for name in objectives:
        if name not in OBJECTIVES:
            raise ValueError(f"hparams_search.objectives: {name!r} is not known; allowed: {list(OBJECTIVES)}")
        out.append(OBJECTIVES[name] or ("maximize" if metric_mode == "max" else "minimize"))
    return out


def register_search() -> None:
    """The resolver ``optuna_directions`` and (with the plugin installed) the sampler option
    ``hydra/sweeper/sampler=uniform_first``; call before Hydra composes (train.py does, at import)."""
    if not OmegaConf.has_resolver("optuna_directions"):
        OmegaConf.register_new_resolver(
            "optuna_directions", lambda objectives, mode: directions(list(objectives), str(mode))
        )
    if not sweeper_installed():
        return
    from hydra.core.config_store import ConfigStore
    from hydra_plugins.hydra_optuna_sweeper.config import SamplerConfig

    @dataclass
    class UniformFirstSamplerConfig(SamplerConfig):
        _target_: str = "quark_lightning.app.sampler.UniformFirstSampler"
        widths: list[Any] = field(default_factory=lambda: [2, 3, 4, 8])
        base: Any = None  # the sampler of the other trials (a _target_ node); None: TPE (multi-objective) with seed
        seed: Any = None
        distinct: bool = True  # redraw a configuration an earlier trial already ran
        storage: Any = None  # hydra.sweeper.storage: workers sharing an sqlite storage draw one at a time

    ConfigStore.instance().store(
        group="hydra/sweeper/sampler", name="uniform_first", node=UniformFirstSamplerConfig, provider="quark-lightning"
    )
