"""Sweeps and searches spread over workers: Hydra's parallel launchers and an Optuna storage several searches share.

A bit-width sweep (``-m``) or a search runs its jobs in other processes with ``hydra/launcher=joblib`` (loky workers
on this machine) or ``hydra/launcher=submitit_local`` / ``submitit_slurm`` (the ``search`` extra): the sweep process
holds its directory's lock and claim (``quark_lightning.app.sweepdir``); each job updates the sweep's
``sweep_state.json`` and float-test cache under the directory's state lock (``quark_lightning.app.lock.state_lock``).

Several search processes (workers) share one study through ``hydra.sweeper.storage`` (``sqlite:///runs/bits.db``)
and ``hydra.sweeper.study_name``; each one has its own sweep directory (two on one directory: the second is refused
by the directory's lock). Optuna gives each trial its number once (no two workers run the same trial); the uniform-
first sampler draws a configuration unlike every other trial's, under this module's sampling lock for sqlite
storages (``hold_sampling`` / ``tag_trial``); each job gets its trial number (``hparams_search.trial``) and each trial
the sweep directory of its worker (user attribute ``sweep_dir``), so that a worker's ``pareto.csv`` lists every trial
of the study (``study_trials``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from quark.torch.extras import available, install_line

#: ``hydra/launcher=<name>`` -> the module of its plugin and the package that installs it (the ``search`` extra)
LAUNCHERS: dict[str, tuple[str, str]] = {
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "hydra-joblib-launcher"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
}
#: the job's Optuna trial number: an override the search adds to each job (``tag_trial``)
TRIAL_PARAM = "++hparams_search.trial"
#: a trial's user attribute: the sweep directory of the worker that ran it
SWEEP_DIR_ATTR = "sweep_dir"
#: the sweeper's ``custom_search_space`` that a search sharing a storage needs (conf/hparams_search/common/optuna.yaml)
TAG_TRIAL = "quark_lightning.app.workers.tag_trial"
#: beside an sqlite database: the lock its workers draw under (created when absent, never written)
SAMPLING_LOCK_SUFFIX = ".quarkl-sampling.lock"

_SAMPLING: dict[Path, int] = {}  # the sampling locks this process holds: lock file -> descriptor


# ----------------------------------------------------------------------------------------------- checks
def check_launcher_args(args: Iterable[str]) -> str | None:
    """A message when the command line asks for a parallel launcher whose Hydra plugin is not installed."""
    for arg in args:
        key, _, name = arg.lstrip("+").partition("=")
        if key == "hydra/launcher" and name in LAUNCHERS and not available(LAUNCHERS[name][0]):
            return f"hydra/launcher={name} needs Hydra's {LAUNCHERS[name][1]}: {install_line('search')}"
    return None


def sqlite_path(storage: str) -> Path | None:
    """The database file of an ``sqlite:///<path>`` URL (relative to the working directory; ``sqlite:////abs``);
    None for another database, or sqlite in memory."""
    rest = storage.removeprefix("sqlite:")
    if rest == storage or not rest.startswith("///"):  # another database; sqlite:// is sqlite in memory
        return None
    path = rest[3:].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def check_storage(config: DictConfig) -> None:
    """ValueError, before the sweep directory is touched, when ``hydra.sweeper.storage`` cannot be shared: sqlite in
    memory, a database in a folder that does not exist, no ``study_name``, or (with the uniform-first sampler) a
    ``custom_search_space`` other than ``tag_trial``."""
    storage = OmegaConf.select(config, "hydra.sweeper.storage")
    if not isinstance(storage, str) or not storage:
        return
    if storage.startswith("sqlite:") and sqlite_path(storage) is None:
        raise ValueError(
            f"hydra.sweeper.storage={storage} is a database in memory: each worker would have a study of its own. "
            "Name a file, e.g. hydra.sweeper.storage=sqlite:///runs/bits.db"
        )
    path = sqlite_path(storage)
    if path is not None and not path.parent.is_dir():
        raise ValueError(
            f"hydra.sweeper.storage={storage}: the folder {path.parent} does not exist (sqlite creates the database "
            f"file, not its folder): create it (mkdir -p {path.parent}) or name a file in an existing folder"
        )
    if not OmegaConf.select(config, "hydra.sweeper.study_name"):
        raise ValueError(
            f"hydra.sweeper.storage={storage} needs hydra.sweeper.study_name: without one each worker starts a study "
            "of its own (e.g. hydra.sweeper.study_name=optuna_bits)"
        )
    sampler = str(OmegaConf.select(config, "hydra.sweeper.sampler._target_", default=""))
    custom = OmegaConf.select(config, "hydra.sweeper.custom_search_space")
    if sampler.endswith("UniformFirstSampler") and custom != TAG_TRIAL:
        raise ValueError(
            f"hydra.sweeper.custom_search_space={custom}: a search sharing hydra.sweeper.storage needs {TAG_TRIAL} "
            "(conf/hparams_search/common/optuna.yaml): it gives each job its trial number and releases the lock "
            "the workers draw under"
        )
    _create_study(config, storage)


def _create_study(config: DictConfig, storage: str) -> None:
    """The storage's tables and the study, made (or found) by one worker at a time (two workers creating the tables of
    a new sqlite database at once: "table studies already exists"); its directions checked against the search's."""
    import optuna

    direction = OmegaConf.to_container(config.hydra.sweeper, resolve=True).get("direction")  # type: ignore[union-attr]
    directions = [str(d) for d in direction] if isinstance(direction, list) else [str(direction)]
    hold_sampling(storage)
    try:
        optuna.create_study(
            study_name=str(config.hydra.sweeper.study_name),
            storage=storage,
            directions=directions,
            load_if_exists=True,
        )
    except Exception as err:  # noqa: BLE001 - optuna's and the database's errors: named, before the sweep
        raise ValueError(f"hydra.sweeper.storage={storage}: the study cannot be created or loaded: {err}") from None
    finally:
        release_sampling()


def shared_dir_hint(config: DictConfig) -> str:
    """What to add to a refusal of a busy sweep directory when the search shares a storage."""
    storage = OmegaConf.select(config, "hydra.sweeper.storage")
    if not storage:
        return ""
    return (
        f" Workers sharing hydra.sweeper.storage={storage} each need a sweep directory of their own, e.g. "
        "hydra.sweep.dir=runs/bits/w0 and hydra.sweep.dir=runs/bits/w1."
    )


# ----------------------------------------------------------------------------------------------- the sampling lock
def hold_sampling(storage: Any) -> None:
    """Take (waiting) the sampling lock of an sqlite ``storage``, unless this process holds it: the workers sharing it
    draw one at a time. Released by ``release_sampling`` (``tag_trial``), or when the process ends. Nothing for
    another storage (a database server: configurations drawn at the same moment by two workers may repeat)."""
    from quark_lightning.app.lock import open_lock

    path = sqlite_path(storage) if isinstance(storage, str) else None
    if path is None:
        return
    lock = path.with_name(path.name + SAMPLING_LOCK_SUFFIX)
    if lock in _SAMPLING:
        return
    import fcntl

    fd = open_lock(lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    _SAMPLING[lock] = fd


def release_sampling() -> None:
    """Release the sampling locks this process holds."""
    while _SAMPLING:
        os.close(_SAMPLING.popitem()[1])


def tag_trial(config: DictConfig, trial: Any) -> None:
    """The sweeper's ``custom_search_space`` (called once a trial's parameters are set): the job gets its trial number
    (``hparams_search.trial``, a parameter of a single value), the trial the sweep directory of this worker, and the
    sampling lock is released (the trial's configuration is in the storage: other workers now see it)."""
    try:
        trial.suggest_int(TRIAL_PARAM, trial.number, trial.number)
        trial.set_user_attr(SWEEP_DIR_ATTR, str(Path(str(config.hydra.sweep.dir)).resolve()))
    finally:
        release_sampling()


# ----------------------------------------------------------------------------------------------- the study
def study_trials(config: DictConfig) -> list[dict[str, Any]] | None:
    """Every trial of the study the search shares (number, state, values, the worker's sweep directory); None when
    there is no storage (the trials are this sweep's jobs) or it cannot be read (logged by the caller)."""
    storage = OmegaConf.select(config, "hydra.sweeper.storage")
    name = OmegaConf.select(config, "hydra.sweeper.study_name")
    if not storage or not name:
        return None
    import optuna

    study = optuna.load_study(study_name=str(name), storage=str(storage))
    return [
        {
            "number": t.number,
            "state": t.state.name,
            "values": t.values,
            SWEEP_DIR_ATTR: t.user_attrs.get(SWEEP_DIR_ATTR),
        }
        for t in study.get_trials(deepcopy=False)
    ]
