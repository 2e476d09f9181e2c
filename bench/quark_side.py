"""Which ``quark`` a bench worker process imports: this repository's, or amd-quark's (the package has the same name),
for the benches that time both in separate processes (``awq_speed.py``, ``gptq_speed.py``, ``ptq_vs_amd_quark.py``),
and how they start those processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


def prepare_side(side: str) -> None:
    """What a worker does before importing ``side``'s quark: amd-quark's side ("amd") loses this repository from
    ``sys.path`` (the package has the same name) and quiets amd-quark's log; both quiet logging and warnings for the
    timed work."""
    if side == "amd":
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (REPO_ROOT, HERE)]
        os.environ.setdefault("QUARK_LOG_LEVEL", "error")
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")


def import_quark(side: str, threads: int | None) -> None:
    """Import ``side``'s quark ("amd": amd-quark's installed package, never this repository's; anything else: ours),
    set torch's thread count when ``threads`` is given, and quiet logging and warnings for the timed work."""
    prepare_side(side)
    import torch

    import quark

    if side == "amd" and "site-packages" not in (quark.__file__ or ""):
        raise SystemExit(f"imported quark from {quark.__file__}: the amd-quark venv is needed")
    if threads:
        torch.set_num_threads(threads)


def run_worker(command: list[str], side: str, label: str | None = None) -> None:
    """Run a worker process for ``side``: ours with this repository on ``PYTHONPATH`` and as its working directory,
    amd-quark's ("amd") with neither; SystemExit with the tail of its output (``label`` names it) when it fails."""
    ours = side != "amd"
    env = (
        {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        if ours
        else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    )
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(REPO_ROOT) if ours else "/")
    if done.returncode:
        raise SystemExit(f"{label or side} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
