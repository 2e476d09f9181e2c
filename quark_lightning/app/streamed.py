"""``ptq_from=<dir>``: PTQ of a Hugging Face checkpoint directory one decoder layer at a time, without loading it.

No model is built and nothing is trained or tested (the model need not fit in memory): the quant preset's Config
(weight-only or dynamic activations; RTN, GPTQ, AWQ, SmoothQuant) is applied by ``quark.torch.streaming`` to the
checkpoint's shards, on ``quant.calib_batches`` batches of the data's train loader, into ``<run dir>/export/quark``.
Every check runs before the run directory is touched, as for any run; ``results.json`` reports the export."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig

from quark.torch.export import QUARK_SUBDIR
from quark.torch.extras import MissingExtraError
from quark.torch.quantization.config.config import Config
from quark.torch.streaming import check_stream, stream_quantize
from quark_lightning.app.checks import build_node, check_data, check_plain_keys
from quark_lightning.app.conf import ConfigError, QuantFlow
from quark_lightning.app.results import write_json
from quark_lightning.app.rundir import check_free, record, run_files

__all__ = ["run_streamed"]

#: what a ``ptq_from`` run writes in its directory (files, folders), as ``rundir.planned`` gives it for other runs
PLAN = (["results.json", ".hydra/config.yaml", ".hydra/overrides.yaml"], ["export"])


def check_streamed(cfg: DictConfig, flow: QuantFlow, qconfig: Config | None) -> Any:
    """Every check of a ``ptq_from`` run; returns the data module. ConfigError names what is wrong."""
    try:
        if qconfig is None or flow.mode != "ptq":
            raise ValueError(
                f"ptq_from={cfg.ptq_from!r} quantizes a checkpoint after training (PTQ): pick a PTQ preset such as "
                f"quant=w4_rtn, quant=w4_gptq or quant=w4_awq; got quant.mode={flow.mode!r}"
            )
        if flow.target_bits is not None or flow.layer_bits:
            raise ValueError(
                "ptq_from streams one Config over the checkpoint: mixed precision (quant.target_bits) and "
                "quant.layer_bits measure or name layers of a built model; drop them"
            )
        check_stream(str(cfg.ptq_from), qconfig, [None])  # files, tensors, family, what cannot stream (on meta)
        check_plain_keys(cfg)
        datamodule = build_node(cfg.data, "data")
        check_data(cfg, datamodule)
    except (ValueError, FileNotFoundError, MissingExtraError) as err:
        raise ConfigError(str(err)) from err
    return datamodule


def calibration_batches(datamodule: Any, count: int | None) -> list[Any]:
    """The first ``count`` batches (all for None) of the data module's train loader."""
    datamodule.setup("fit")
    return list(itertools.islice(datamodule.train_dataloader(), count))


def run_streamed(
    cfg: DictConfig, out: Path, start: float, take: Callable[..., None], flow: QuantFlow, qconfig: Config | None
) -> dict[str, Any]:
    """A ``ptq_from`` run: checks, then the directory taken, then the streamed PTQ; returns the results."""
    datamodule = check_streamed(cfg, flow, qconfig)
    try:
        check_free(out, *PLAN)  # a file of the user's where this run writes: named, the run stops
    except ValueError as err:
        raise ConfigError(str(err)) from None
    take(PLAN, [str(cfg.ptq_from)])
    t0 = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # the train loader's order, as a run's calibration has it
    batches = calibration_batches(datamodule, flow.calib_batches)
    path = stream_quantize(str(cfg.ptq_from), qconfig, batches, out / "export" / QUARK_SUBDIR)  # type: ignore[arg-type]
    record(out)
    files = sorted(p.name for p in path.iterdir())
    results = {
        "mode": "streamed_ptq",
        "quant": {"name": flow.name, "mode": flow.mode},
        "ptq_from": str(cfg.ptq_from),
        "export": {
            "path": str(path),
            "files": files,
            "bytes": sum(p.stat().st_size for p in path.iterdir()),
            "calib_batches": len(batches),
        },
        "timings": {"quantize_s": time.perf_counter() - t0, "total_s": time.perf_counter() - start},
    }
    results["files"] = run_files(out)
    write_json(out / "results.json", results)
    print(f"streamed PTQ ({flow.name}) of {cfg.ptq_from}: {path} ({len(files)} files)")
    print(f"results: {out / 'results.json'}")
    return results
