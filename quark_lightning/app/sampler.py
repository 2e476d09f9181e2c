"""``hydra/sweeper/sampler=uniform_first`` (conf/hparams_search/optuna_bits.yaml): uniform-width trials first.

Imported by Hydra's Optuna sweeper through the sampler's ``_target_`` only: needs optuna (the ``search`` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from optuna.samplers import BaseSampler, TPESampler, intersection_search_space


class UniformFirstSampler(BaseSampler):
    """An Optuna sampler whose trial ``i < len(widths)`` sets every ``layer_bits`` parameter to ``widths[i]`` (a
    uniform-width run, the reference of the Pareto plot, which also seeds the search); the other parameters of those
    trials, and every parameter of later trials, come from ``base`` (default: TPE, multi-objective).

    ``distinct``: a later trial's ``layer_bits`` values are drawn together and, while they repeat an earlier trial's,
    drawn again (then one value moved at random; ``retries`` times at most): PTQ is deterministic, so a repeat would
    spend a trial to learn nothing (TPE alone repeated 5 of 24 configurations of the LM search).
    """

    def __init__(
        self,
        widths: Sequence[Any] = (2, 3, 4, 8),
        base: Any = None,
        seed: int | None = None,
        distinct: bool = True,
        retries: int = 50,
    ) -> None:
        self.widths = list(widths or [])
        self.base = base if base is not None else TPESampler(seed=seed)
        self.distinct = distinct
        self.retries = retries
        self._rng = np.random.RandomState(seed)

    def _width(self, trial: Any) -> Any:
        return self.widths[trial.number] if trial.number < len(self.widths) else None

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        space = dict(self.base.infer_relative_search_space(study, trial))
        if self.distinct:  # the layer_bits parameters every finished trial has: drawn together in sample_relative
            space.update(
                {k: d for k, d in intersection_search_space(study).items() if "layer_bits" in k and k not in space}
            )
        return space

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        own = self.base.infer_relative_search_space(study, trial)  # the base sees only its own space (TPE asserts)
        sampled = self.base.sample_relative(
            study, trial, {k: d for k, d in search_space.items() if k in own}
        )  # always: its bookkeeping
        if self._width(trial) is not None:
            return {k: v for k, v in sampled.items() if "layer_bits" not in k}
        names = sorted(k for k in search_space if "layer_bits" in k)
        if not self.distinct or not names:
            return sampled
        seen = {
            tuple(t.params.get(k) for k in names) for t in study.get_trials(deepcopy=False) if t.number != trial.number
        }
        draw = {
            k: sampled[k] if k in sampled else self.base.sample_independent(study, trial, k, search_space[k])
            for k in names
        }
        values = {k: _values(search_space[k]) for k in names}
        mutable = [k for k in names if values[k] and len(values[k]) > 1]
        for attempt in range(self.retries):
            if tuple(draw[k] for k in names) not in seen:
                break
            if attempt < 3:  # the base again (TPE picks the best of its candidates: often the same values)
                draw = {k: self.base.sample_independent(study, trial, k, search_space[k]) for k in names}
            elif mutable:  # then a neighbour of its pick: one parameter moved to another value
                k = mutable[self._rng.randint(len(mutable))]
                others = [v for v in values[k] if v != draw[k]]
                draw = {**draw, k: others[self._rng.randint(len(others))]}
        return {**sampled, **draw}

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        width = self._width(trial)
        if width is None or "layer_bits" not in param_name:
            return self.base.sample_independent(study, trial, param_name, param_distribution)
        if not _admits(param_distribution, width):
            raise ValueError(
                f"hparams_search.uniform: width {width!r} is not a value of the search parameter {param_name} "
                f"({param_distribution}); add it to that parameter's choices or drop it from hparams_search.uniform"
            )
        return width

    def after_trial(self, study: Any, trial: Any, state: Any, values: Sequence[float] | None) -> None:
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()


def _values(distribution: Any) -> list[Any] | None:
    """The values of a discrete distribution (categorical or int), else None."""
    choices = getattr(distribution, "choices", None)
    if choices is not None:
        return list(choices)
    low, high, step = (getattr(distribution, k, None) for k in ("low", "high", "step"))
    if isinstance(low, int) and isinstance(high, int) and not getattr(distribution, "log", False):
        return list(range(low, high + 1, step or 1))
    return None


def _admits(distribution: Any, value: Any) -> bool:
    choices = getattr(distribution, "choices", None)
    if choices is not None:
        return value in choices
    low, high, step = (getattr(distribution, k, None) for k in ("low", "high", "step"))
    if isinstance(value, bool) or not isinstance(value, int) or low is None or high is None:
        return False
    return low <= value <= high and (value - low) % (step or 1) == 0
