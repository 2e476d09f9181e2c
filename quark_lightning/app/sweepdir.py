"""A sweep directory (``hydra.sweep.dir``) holds only what a sweep of this app recorded writing there.

The callbacks that end a sweep (``quark_lightning.app.summary.SweepSummary``, ``quark_lightning.app.pareto.ParetoFront``) derive from ``SweepFiles``:
before the first job (Hydra's ``on_multirun_start``, which comes before the sweeper writes multirun.yaml) it checks
that no file of the user's is where the sweep writes at the top of the directory (its callback's ``products`` and
``quark_lightning.app.rundir.SWEEP_FILES``: the float-test cache, Hydra's multirun.yaml and optimization_results.yaml), locks the
directory and claims it (``sweep_state.json``): the previous sweep's recorded files, still as recorded, go. A file in
the way stops the sweep with one ``error:`` line, the directory as it was. The files are recorded (path, size, sha256)
as they are written: the summary and the cache when this app writes them, Hydra's after each job and at the end. The
jobs' folders below are runs with their own ``run_state.json`` (``quark_lightning.app.rundir``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from quark_lightning.app.conf import ConfigError
from quark_lightning.app.lock import KINDS
from quark_lightning.app.rundir import (
    SWEEP_FILES,
    SWEEP_STATE,
    add_job,
    check_free,
    check_writable,
    claim_sweep,
    finish,
    read_state,
    record,
    run_dir_lock,
)


class SweepFiles(Callback):
    """Hydra callback: the sweep directory is checked and claimed before the first job, its files recorded after each
    job, its state ``"complete"`` at the end. Subclasses name the files they write at its top in ``products`` and write
    them with ``quark_lightning.app.rundir.write_recorded(..., SWEEP_STATE)``."""

    products: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._held = contextlib.ExitStack()  # the sweep directory's lock, from the claim to the end of the sweep
        self._dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Check, lock and claim the sweep directory; a file of the user's in the way ends the process with one
        ``error:`` line (SystemExit: Hydra turns a callback's exceptions into warnings)."""
        from quark_lightning.app.workers import check_storage, shared_dir_hint

        out = Path(str(config.hydra.sweep.dir))
        try:
            check_job_folders(config)
            check_storage(config)
            self._take(out, [*self.products, *SWEEP_FILES], _overrides(config))
        except ConfigError as err:  # the directory's lock: another sweep (or search worker) holds it
            self._held.close()
            sys.exit(f"error: {err}{shared_dir_hint(config)}")
        except ValueError as err:
            self._held.close()
            sys.exit(f"error: {err}")
        self._dir = out

    def __getstate__(self) -> dict[str, Any]:
        """What a parallel launcher (joblib, submitit) sends to a job's process: the sweep directory, not its lock
        (the sweep process keeps that; the job updates the sweep's state under the state lock)."""
        return {k: v for k, v in self.__dict__.items() if k != "_held"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._held = contextlib.ExitStack()

    def _take(self, out: Path, files: list[str], overrides: list[str] | None) -> None:
        """Every check before anything is written (a refused sweep leaves the directory as it was), then the lock,
        the check again under it, and the claim."""
        check_free(out, files, (), SWEEP_STATE)
        check_writable(out, "sweep", KINDS[SWEEP_STATE][1])  # Hydra would create it after this, with a traceback

        self._held.enter_context(run_dir_lock(out))
        check_free(out, files, (), SWEEP_STATE)  # the directory may have changed before the lock
        claim_sweep(out, files, overrides)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """List the job's folder in the sweep's ``jobs``, and record what the sweeper wrote before it (multirun.yaml),
        so that a sweep stopped during the job leaves only recorded files."""
        if self._dir is not None:
            add_job(self._dir, Path(str(config.hydra.runtime.output_dir)))
            record(self._dir, SWEEP_STATE)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self._dir is not None:
            record(self._dir, SWEEP_STATE)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """The sweep's state ``"complete"`` with every file it wrote (optimization_results.yaml comes last), and the
        lock released."""
        if self._dir is not None:
            finish(self._dir, None, SWEEP_STATE)
        self._held.close()
        self._dir = None


def _overrides(config: DictConfig) -> list[str] | None:
    """The sweep's command-line overrides (``hydra.overrides.task``), for its state file."""
    task = OmegaConf.select(config, "hydra.overrides.task")
    return [str(o) for o in task] if task is not None else None


def sweep_jobs(folder: Path) -> set[Path] | None:
    """The job folders (resolved) of the sweep that last claimed ``folder`` (its ``sweep_state.json``); None when
    there is no such state (a sweep of an older version, a folder of results gathered by hand): every folder counts."""
    state = read_state(folder, SWEEP_STATE)
    jobs = state.get("jobs") if state is not None else None
    if not isinstance(jobs, list):
        return None
    return {(folder / job).resolve() for job in jobs if isinstance(job, str)}


def claimed_sweep(folder: Path) -> bool:
    """Whether a sweep holds ``folder`` now (its ``sweep_state.json`` says ``"running"`` and its lock is held): the
    jobs share the float-test cache there only then."""
    state = read_state(folder, SWEEP_STATE)
    return state is not None and state.get("state") == "running"


def check_job_folders(config: DictConfig) -> None:
    """ValueError when ``hydra.sweep.subdir`` names one folder for every job (no interpolation, e.g. ``.``): the jobs
    would share a run directory (the sweep's own, for ``.``), so each would replace the one before it; or when, with
    the default ``${hydra.job.num}``, something that is not a folder already has a job's number as its name in the
    sweep directory (Hydra would fail creating that job's folder, with a traceback, after the jobs before it ran)."""
    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")  # type: ignore[union-attr]
    if subdir == "${hydra.job.num}":
        check_numbered_folders(Path(str(config.hydra.sweep.dir)))
    if isinstance(subdir, str) and "${" not in subdir:
        raise ValueError(
            f"hydra.sweep.subdir={subdir!r} puts every job of the sweep into the same folder"
            f"{' (the sweep directory itself)' if Path(subdir) == Path('.') else ''}, so each job would replace the "
            "results of the one before it: give each job a folder of its own, e.g. hydra.sweep.subdir='${hydra.job.num}' "
            "(the default) or '${hydra.job.override_dirname}'"
        )


def check_numbered_folders(sweep_dir: Path) -> None:
    """ValueError naming the first entry of ``sweep_dir`` named by a number (a job's folder) that is not a folder."""
    try:
        entries = list(sweep_dir.iterdir())
    except OSError:
        return  # absent (the sweep creates it) or unreadable (check_writable names it)
    numbered = [p for p in entries if p.name.isascii() and p.name.isdigit() and str(int(p.name)) == p.name]
    blocking = sorted((p for p in numbered if not p.is_dir()), key=lambda p: int(p.name))
    if blocking:
        raise ValueError(
            f"the sweep directory {sweep_dir} cannot be used: {blocking[0]} is not a directory, and job "
            f"{blocking[0].name} of the sweep would get its folder there (hydra.sweep.subdir=${{hydra.job.num}}): move "
            f"it away, or give this sweep another directory: {KINDS[SWEEP_STATE][1]}"
        )
