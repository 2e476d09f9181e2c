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

    ``distinct``: a later trial's ``layer_bits`` values are drawn together (at its first ``layer_bits`` parameter)
    and, while they repeat another trial's (finished, failed or running), drawn again (then one value moved at random;
    ``retries`` times at most): PTQ is deterministic, so a repeat would spend a trial to learn nothing (TPE alone
    repeated 5 of 24 configurations of the LM search).

    ``storage``: the search's ``hydra.sweeper.storage``. Workers sharing an sqlite storage draw one at a time: the
    draw takes the storage's sampling lock (``quark_lightning.app.workers.hold_sampling``), released once the trial's
    parameters are in the storage (``quark_lightning.app.workers.tag_trial``, the sweeper's ``custom_search_space``),
    so that a worker never draws a configuration another worker is running.
    """

    def __init__(
        self,
        widths: Sequence[Any] = (2, 3, 4, 8),
        base: Any = None,
        seed: int | None = None,
        distinct: bool = True,
        retries: int = 50,
        storage: Any = None,
    ) -> None:
        self.widths = list(widths or [])
        self.base = base if base is not None else TPESampler(seed=seed)
        self.distinct = distinct
        self.retries = retries
        self.storage = storage
        self._rng = np.random.RandomState(seed)
        self._relative: tuple[int, dict[str, Any]] = (-1, {})  # the base's relative picks of layer_bits
        self._draw: tuple[int, dict[str, Any]] = (-1, {})  # (trial number, the layer_bits values drawn together)

    def _width(self, trial: Any) -> Any:
        return self.widths[trial.number] if trial.number < len(self.widths) else None

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return dict(self.base.infer_relative_search_space(study, trial))

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        sampled = self.base.sample_relative(study, trial, search_space)  # always: its bookkeeping
        if self._width(trial) is None and not self.distinct:
            return sampled
        self._relative = (trial.number, {k: v for k, v in sampled.items() if "layer_bits" in k})
        return {k: v for k, v in sampled.items() if "layer_bits" not in k}  # a width, or the draw: sample_independent

    def _distinct(self, study: Any, trial: Any, space: dict[str, Any]) -> dict[str, Any]:
        """The trial's ``layer_bits`` values (``space``: the parameters every finished trial has), unlike every other
        trial's while ``retries`` allow: the base's picks, then the base again, then a neighbour of its pick."""
        from quark_lightning.app.workers import hold_sampling

        hold_sampling(self.storage)  # released by tag_trial once this trial's values are in the storage
        names = sorted(space)
        seen = {
            tuple(t.params.get(k) for k in names) for t in study.get_trials(deepcopy=False) if t.number != trial.number
        }
        relative = self._relative[1] if self._relative[0] == trial.number else {}
        draw = {
            k: relative[k] if k in relative else self.base.sample_independent(study, trial, k, space[k]) for k in names
        }
        values = {k: _values(space[k]) for k in names}
        mutable = [k for k in names if values[k] and len(values[k]) > 1]
        for attempt in range(self.retries):
            if tuple(draw[k] for k in names) not in seen:
                break
            if attempt < 3:  # the base again (TPE picks the best of its candidates: often the same values)
                draw = {k: self.base.sample_independent(study, trial, k, space[k]) for k in names}
            elif mutable:  # then a neighbour of its pick: one parameter moved to another value
                k = mutable[self._rng.randint(len(mutable))]
                others = [v for v in values[k] if v != draw[k]]
                draw = {**draw, k: others[self._rng.randint(len(others))]}
        return draw

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        width = self._width(trial)
        if "layer_bits" not in param_name:
            return self.base.sample_independent(study, trial, param_name, param_distribution)
        if width is None:
            if not self.distinct:
                return self.base.sample_independent(study, trial, param_name, param_distribution)
            if self._draw[0] != trial.number:  # the trial's first layer_bits parameter: all of them drawn now
                space = {k: d for k, d in intersection_search_space(study).items() if "layer_bits" in k}
                self._draw = (trial.number, self._distinct(study, trial, space) if space else {})
            if param_name in self._draw[1]:
                return self._draw[1][param_name]
            relative = self._relative[1] if self._relative[0] == trial.number else {}
            if param_name in relative:  # not a parameter of every finished trial: the base's own pick
                return relative[param_name]
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
