"""The folders Hydra creates before any code of the app runs: a run directory that cannot be created gets one
``error:`` line, not Hydra's traceback.

Hydra makes ``hydra.run.dir`` (and ``hydra.output_subdir`` in it, when set) in ``hydra.core.utils.run_job``, before the
task function; its ``on_run_start`` callbacks come before that. ``RunDirCheck`` (``hydra.callbacks.run_dir`` in
conf/config.yaml) creates the same folders there, as Hydra would a moment later (the same path: Hydra's ``${now:...}``
resolver caches its value in the config), or stops the process with the folder, the reason (read-only, not a
directory, cannot be created) and what to do. A multirun's ``hydra.sweep.dir`` is checked the same way by the sweep's
callback (``quark_lightning.app.sweepdir.SweepFiles``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from quark_lightning.app.lock import check_writable


class RunDirCheck(Callback):
    """Hydra callback: before a single run, its directory (and ``hydra.output_subdir``) created, or one ``error:`` line
    naming it and a non-zero exit (SystemExit: Hydra turns a callback's exceptions into warnings)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Create ``hydra.run.dir`` (and its ``hydra.output_subdir``) or exit with the reason."""
        problem = run_dir_problem(config)
        if problem:
            sys.exit(f"error: {problem}")


def run_dir_problem(config: DictConfig) -> str:
    """The message about the first of the run's folders that cannot be created or written; empty when they exist or
    were created (a value only Hydra can resolve is left to Hydra, as before)."""
    try:
        run_dir = OmegaConf.select(config, "hydra.run.dir", throw_on_missing=True)
        subdir = OmegaConf.select(config, "hydra.output_subdir")
    except Exception:  # noqa: BLE001 - an interpolation only Hydra resolves: its own error, as before
        return ""
    if run_dir is None:
        return ""
    instead = "hydra.run.dir=<another dir>"
    try:
        check_writable(Path(str(run_dir)), "run", instead)
        if subdir is not None:
            where = "hydra.output_subdir=<another dir> (or null: the app writes its .hydra/ itself)"
            check_writable(Path(str(run_dir)) / str(subdir), "Hydra output", where)
    except ValueError as err:
        return str(err)
    return ""
