"""The float model's test metrics, shared by the jobs of a sweep that all start from one float checkpoint: the cache
file lives in the sweep directory and is recorded in its ``sweep_state.json`` (``quark_lightning.app.rundir``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from quark_lightning.app.rundir import (
    FLOAT_TEST_CACHE,
    SWEEP_STATE,
    read_recorded,
    state_lock,
    write_recorded,
)


def float_test(cache: Path | None, key: str, test: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The float model's test metrics: ``test()``, or what ``cache`` (a JSON file) holds under ``key`` from an earlier
    job of the same sweep, which tested the same model on the same data. The cache is a file of the sweep, recorded in
    its ``sweep_state.json``: read only while it is as recorded, new results added atomically and recorded; an
    unreadable cache is ignored (the test runs again), one that is not the sweep's is neither read nor written over.
    Jobs running at once (a parallel launcher) may each test a model the cache does not hold yet; each adds its entry
    under the sweep directory's state lock, to the cache as it is then: no entry is lost."""
    if cache is None:
        return test()
    stored = _stored(cache)
    try:
        cached = {str(k): float(v) for k, v in stored[key].items()} if isinstance(stored.get(key), dict) else None
    except (TypeError, ValueError):  # not numbers: tested again
        cached = None
    if cached is not None:
        logging.getLogger(__name__).info(
            "float test metrics read from %s (an earlier job of this sweep tested this float model)", cache
        )
        return cached
    with _rng_kept():  # a cache hit consumes no randomness: neither does the test that fills it
        metrics = test()
    with state_lock(cache.parent):  # jobs in other processes add theirs meanwhile: read again, add, write
        stored = {**_stored(cache), key: metrics}
        write_recorded(cache.parent, cache.name, json.dumps(stored, indent=1, sort_keys=True) + "\n", SWEEP_STATE)
    return metrics


def _stored(cache: Path) -> dict[str, object]:
    """The cache's entries (empty when it is absent, unreadable or not the sweep's)."""
    text = read_recorded(cache.parent, cache.name, SWEEP_STATE)
    try:
        stored = json.loads(text) if text is not None else {}
    except ValueError:
        return {}
    return stored if isinstance(stored, dict) else {}


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Torch's (CPU and CUDA), Python's and numpy's random states as they were before the block."""
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def float_test_cache(cfg: DictConfig) -> Path | None:
    """In a multirun whose jobs all start from one float checkpoint (``ckpt_path``: a search over quantization
    settings), the sweep directory's float-test cache, when the sweep holds that directory (``quark_lightning.app.sweepdir``: its end
    callback claimed it); None otherwise (each run tests its own float model)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from quark_lightning.app.sweepdir import claimed_sweep

    if not cfg.get("ckpt_path") or not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    folder = Path(HydraConfig.get().sweep.dir)
    return folder / FLOAT_TEST_CACHE if claimed_sweep(folder) else None


def float_test_key(cfg: DictConfig) -> str:
    """What the float test depends on: the checkpoint file (path, size, modification time) and the data, model,
    trainer, metric and seed settings."""
    path = Path(str(cfg.get("ckpt_path") or ""))
    stat = path.stat() if path.is_file() else None
    parts = {
        "ckpt": [str(path.resolve()), stat.st_size if stat else None, stat.st_mtime_ns if stat else None],
        **{
            k: OmegaConf.to_container(cfg[k], resolve=True) if k in cfg else None
            for k in ("data", "model", "trainer", "metric")
        },
        "seed": cfg.get("seed"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
