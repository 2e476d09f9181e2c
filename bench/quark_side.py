"""Which ``quark`` a bench worker process imports: this repository's, or amd-quark's (the package has the same name),
for the benches that time both in separate processes (``awq_speed.py``, ``gptq_speed.py``)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


def import_quark(side: str, threads: int | None) -> None:
    """Import ``side``'s quark ("amd": amd-quark's installed package, never this repository's; anything else: ours),
    set torch's thread count when ``threads`` is given, and quiet logging and warnings for the timed work."""
    if side == "amd":
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (REPO_ROOT, HERE)]
        os.environ.setdefault("QUARK_LOG_LEVEL", "error")
    import torch

    import quark

    if side == "amd" and "site-packages" not in (quark.__file__ or ""):
        raise SystemExit(f"imported quark from {quark.__file__}: the amd-quark venv is needed")
    if threads:
        torch.set_num_threads(threads)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
