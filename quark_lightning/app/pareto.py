"""The end of ``hparams_search=optuna_bits``: ``pareto.csv`` (every trial, failed ones with their error, the Pareto
front flagged) and ``pareto.png`` (metric against model size: the trials, the front, the uniform-width runs).

A Hydra callback (``hydra.callbacks.sweep_summary`` of conf/hparams_search/optuna_bits.yaml): after each job it
writes ``trial.json`` (overrides, status, error, returned values) into the job's folder, so a trial that raised is
recorded too; at the end of the multirun it reads those and the jobs' ``results.json``. By hand:
``python -m quark_lightning.app.pareto multirun/2026-11-22/10-00-00`` (a search sharing a storage: add its URL and
study name, and every worker's trials are listed). pareto.csv/png are recorded in the sweep's ``sweep_state.json``
(``quark_lightning.app.sweepdir``): a file of the user's under their names stops the search before its first trial.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from quark_lightning.app.summary import job_files, natural_key
from quark_lightning.app.sweepdir import SweepFiles

log = logging.getLogger(__name__)

TRIAL_FILE = "trial.json"
COLUMNS = (
    "trial",
    "status",
    "pareto",
    "uniform",
    "metric",
    "value",
    "float",
    "model_bits",
    "model_kib",
    "bits_per_param",
    "compression",
    "weight_formats",
    "error",
    "job",
)


class ParetoFront(SweepFiles):
    """Hydra callback: a ``trial.json`` per job, ``pareto.csv`` and ``pareto.png`` per multirun (the sweep directory
    claimed and its files recorded by ``SweepFiles``)."""

    products = ("pareto.csv", "pareto.png")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        out = Path(str(config.hydra.runtime.output_dir))
        status = getattr(job_return.status, "name", str(job_return.status))
        value = _job_value(job_return)
        record: dict[str, Any] = {
            "job": int(config.hydra.job.num),
            "trial": OmegaConf.select(config, "hparams_search.trial"),  # Optuna's number (workers.tag_trial)
            "overrides": list(job_return.overrides or []),
            "status": status,
        }
        if status == "COMPLETED":
            record["values"] = list(value) if isinstance(value, list | tuple) else value
        else:
            record["error"] = f"{type(value).__name__}: {value}"
            log.error(
                "trial %s failed: %s",
                record["job"],
                record["error"],
                exc_info=value if isinstance(value, BaseException) else None,
            )
        from quark_lightning.app.rundir import write_recorded  # here: importing quark takes a second

        write_recorded(out, TRIAL_FILE, json.dumps(record, indent=2, default=str))  # complete or absent, recorded
        super().on_job_end(config, job_return, **kwargs)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = collect(sweep_dir, _study_trials(config))
        if not rows:
            print(f"pareto: no trials under {sweep_dir}")
        elif written := write_pareto(rows, sweep_dir):
            front = sum(r["pareto"] for r in rows)
            failed = sum(r["status"] != "ok" for r in rows)
            print(
                f"pareto: {' and '.join(map(str, written))} ({len(rows)} trials, {front} on the front, {failed} failed)"
            )
        super().on_multirun_end(config, **kwargs)


# ----------------------------------------------------------------------------------------------- the front
def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    """``a`` is no worse than ``b`` in every objective and better in one (``maximize`` / ``minimize`` each)."""
    better = False
    for x, y, d in zip(a, b, directions, strict=True):
        if d == "maximize":
            x, y = -x, -y
        if x > y:
            return False
        better |= x < y
    return better


def pareto_mask(points: Sequence[Sequence[float] | None], directions: Sequence[str]) -> list[bool]:
    """For each point, whether no other point dominates it (ties: equal points are all on the front). ``None``
    (a failed trial) is never on it, and NaN objectives neither."""
    valid = [p is not None and all(not math.isnan(v) for v in p) for p in points]
    return [
        ok and not any(valid[j] and dominates(points[j], p, directions) for j in range(len(points)) if j != i)  # type: ignore[arg-type]
        for i, (p, ok) in enumerate(zip(points, valid, strict=True))
    ]


# ----------------------------------------------------------------------------------------------- the table
def collect(sweep_dir: Path, study: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per job folder of the sweep (one holding trial.json or results.json; of the sweep that last claimed
    ``sweep_dir``: ``quark_lightning.app.summary.job_files``), in job order, the front flagged. ``study``: the trials
    of a study other workers share (``quark_lightning.app.workers.study_trials``): theirs too, read from their
    workers' sweep directories, in trial order (one not finished, or whose folder is not found: a row without values)."""
    folders = {p.parent for name in (TRIAL_FILE, "results.json") for p in job_files(sweep_dir, name)}
    rows = [_row(folder, sweep_dir) for folder in sorted(folders, key=lambda p: natural_key(p.relative_to(sweep_dir)))]
    if study is not None:
        rows = _with_study(rows, study, sweep_dir)
    modes = {r["metric_mode"] for r in rows if r["metric_mode"]}
    directions = ["maximize" if modes == {"max"} else "minimize", "minimize"]
    points = [(r["value"], r["model_bits"]) if r["status"] == "ok" else None for r in rows]
    for row, on_front in zip(rows, pareto_mask(points, directions), strict=True):
        row["pareto"] = on_front
    return rows


def _row(folder: Path, sweep_dir: Path) -> dict[str, Any]:
    trial = _read(folder / TRIAL_FILE) or {}
    results = _read(folder / "results.json")
    row: dict[str, Any] = {c: None for c in COLUMNS}
    number = trial.get("trial") if trial.get("trial") is not None else trial.get("job")
    row.update(job=Path(os.path.relpath(folder, sweep_dir)).as_posix(), trial=number, metric_mode=None)
    row["params"] = _params(trial)
    if results is not None:
        m, size = results["metric"], results["size"]
        value = m["quantized"] if m["quantized"] is not None else m["float"]
        n_params = size["fp32_bits"] / 32
        row.update(
            metric=m["name"],
            metric_mode=m["mode"],
            value=value,
            float=m["float"],
            model_bits=size["quantized_bits"],
            model_kib=round(size["quantized_bits"] / 8 / 1024, 3),
            bits_per_param=round(size["quantized_bits"] / n_params, 4),
            compression=round(size["compression"], 3) if size.get("compression") else None,
            weight_formats=_formats(results.get("layers") or {}),
            uniform=_uniform(results.get("layers") or {}),
        )
    status = trial.get("status", "COMPLETED" if results is not None else "UNKNOWN")
    if status == "COMPLETED" and results is not None and value_ok(row["value"]):
        row["status"] = "ok"
    else:
        row["status"] = "failed"
        row["error"] = trial.get("error") or ("no results.json" if results is None else f"objective is {row['value']}")
    if row["trial"] is None and row["job"].isdigit():
        row["trial"] = int(row["job"])
    return row


def _with_study(rows: list[dict[str, Any]], study: list[dict[str, Any]], sweep_dir: Path) -> list[dict[str, Any]]:
    """``rows`` (this worker's) and a row per other trial of the shared study, in trial order."""
    own = {r["trial"] for r in rows}
    found: dict[str, dict[int, Path]] = {}  # another worker's sweep directory -> trial number -> job folder
    for t in study:
        if t["number"] in own:
            continue
        where = t.get("sweep_dir")
        if where and where not in found:
            found[where] = _trial_folders(Path(where))
        folder = found.get(where or "", {}).get(t["number"])
        if folder is not None:
            rows.append(_row(folder, sweep_dir))
            continue
        row: dict[str, Any] = {c: None for c in COLUMNS}
        state = t["state"].lower()  # running (in another worker), waiting, or a trial whose folder is gone
        row.update(trial=t["number"], status=state if state in ("running", "waiting") else "failed", job=where)
        row.update(
            metric_mode=None, params={}, error=f"trial {t['number']} is {state} in the study; no job folder found"
        )
        rows.append(row)
    return sorted(rows, key=lambda r: (r["trial"] is None, r["trial"] if r["trial"] is not None else 0))


def _trial_folders(sweep_dir: Path) -> dict[int, Path]:
    """The job folders of a worker's sweep directory by the trial number their trial.json holds."""
    folders = {}
    for path in job_files(sweep_dir, TRIAL_FILE):
        number = (_read(path) or {}).get("trial")
        if isinstance(number, int):
            folders[number] = path.parent
    return folders


def _study_trials(config: DictConfig) -> list[dict[str, Any]] | None:
    """The shared study's trials (``quark_lightning.app.workers.study_trials``); None without a storage, or when it
    cannot be read (logged: the table is this worker's trials)."""
    from quark_lightning.app.workers import study_trials

    try:
        return study_trials(config)
    except Exception as err:  # noqa: BLE001 - the storage's own errors (sqlalchemy, optuna): this worker's table
        log.error("pareto: the study in hydra.sweeper.storage could not be read (%s): this worker's trials only", err)
        return None


def value_ok(value: Any) -> bool:
    return value is not None and not math.isnan(float(value))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _params(trial: dict[str, Any]) -> dict[str, str]:
    """The trial's overrides as columns: ``++quant.layer_bits.fc1=3`` -> ``layer_bits.fc1``: ``3``."""
    out = {}
    for override in trial.get("overrides") or []:
        key, _, value = str(override).partition("=")
        key = key.lstrip("+~")
        if not key.startswith("hparams_search."):  # the trial's number (a column of its own)
            out[key.removeprefix("quant.")] = value
    return out


def _weight_key(entry: dict[str, Any]) -> str | None:
    w = entry.get("weight")
    if not w:
        return None
    group = f"/g{w['group_size']}" if w.get("group_size") else ""
    return f"{w['dtype']}{group}"


def _formats(layers: dict[str, Any]) -> str:
    """``int4:2 int8:2``: the layers of each weight format."""
    counts = Counter(k for k in (_weight_key(e) for e in layers.values()) if k)
    return " ".join(f"{k}:{n}" for k, n in sorted(counts.items()))


def _uniform(layers: dict[str, Any]) -> str:
    """The weight format every quantized layer has (``int4``), else empty; the bit width of each layer's format
    decides (``int4`` per channel and per group of 32 are both 4-bit)."""
    bits = {e["weight"]["bits"] for e in layers.values() if e.get("weight")}
    keys = {e["weight"]["dtype"] for e in layers.values() if e.get("weight")}
    return keys.pop() if len(bits) == 1 and len(keys) == 1 else ""


def write_pareto(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """``pareto.csv`` (COLUMNS, then one column per searched parameter: a ``layer_bits`` key, or an override whose
    value differs between trials) and ``pareto.png`` in ``folder``, each complete or absent and recorded in its
    ``sweep_state.json``; returns the paths written (a file of the user's is not written over: an error is logged)."""
    keys = sorted({k for r in rows for k in r["params"]})
    listed = [r for r in rows if r["params"]]  # a trial of another worker not finished yet has none
    params = [k for k in keys if "layer_bits" in k or len({r["params"].get(k) for r in listed}) > 1]
    from quark_lightning.app.rundir import SWEEP_STATE, write_recorded  # here: importing quark takes a second

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=[*COLUMNS, *params], extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, **row["params"]})
    files = {
        "pareto.csv": lambda tmp: Path(tmp).write_text(text.getvalue(), encoding="utf-8", newline=""),  # csv's \r\n
        "pareto.png": lambda tmp: plot(rows, Path(tmp)),
    }
    return [folder / name for name, content in files.items() if write_recorded(folder, name, content, SWEEP_STATE)]


# ----------------------------------------------------------------------------------------------- the plot
def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Metric against bits per parameter: every trial, the front as a staircase, uniform-width runs as a dashed
    reference line, the float model as a horizontal line; failed trials are counted in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    if ok:
        ax.scatter(
            [r["bits_per_param"] for r in ok],
            [r["value"] for r in ok],
            s=22,
            color="tab:blue",
            alpha=0.55,
            label=f"trials ({len(ok)})",
        )
        front = sorted((r for r in ok if r["pareto"]), key=lambda r: (r["bits_per_param"], r["value"]))
        xs, ys = [r["bits_per_param"] for r in front], [r["value"] for r in front]
        ax.step(xs, ys, where="post", color="tab:red", linewidth=1.6)
        ax.scatter(xs, ys, s=46, color="tab:red", zorder=3, label=f"Pareto front ({len(front)})")
        labels: dict[tuple[float, float], list[str]] = {}
        for r in front:  # one label per point: a repeated configuration lists its trials
            labels.setdefault((r["bits_per_param"], r["value"]), []).append(str(r["trial"]))
        for xy, trials in labels.items():
            ax.annotate(",".join(trials), xy, textcoords="offset points", xytext=(4, 4), fontsize=7, color="tab:red")
        uniform = sorted((r for r in ok if r["uniform"]), key=lambda r: r["bits_per_param"])
        if uniform:
            ax.plot(
                [r["bits_per_param"] for r in uniform],
                [r["value"] for r in uniform],
                "s--",
                color="0.15",
                markersize=6,
                linewidth=1.1,
                label="uniform widths",
            )
            for r in uniform:
                ax.annotate(
                    r["uniform"],
                    (r["bits_per_param"], r["value"]),
                    textcoords="offset points",
                    xytext=(4, -11),
                    fontsize=7,
                )
        floats = [r["float"] for r in ok if r["float"] is not None]
        if floats:
            baseline = sum(floats) / len(floats)
            ax.axhline(baseline, color="0.45", linestyle=":", linewidth=1.2, label=f"float ({baseline:.4g})")
        values = [r["value"] for r in ok] + floats
        if ok[0]["metric_mode"] == "min" and min(values) > 0 and max(values) / min(values) > 10:
            ax.set_yscale("log")
    first = ok[0] if ok else rows[0]
    better = {"max": "higher", "min": "lower"}.get(first["metric_mode"] or "", "?")
    failed = len(rows) - len(ok)
    ax.set_xlabel("model size: bits per parameter (quantized weights, float biases and norms)")
    ax.set_ylabel(f"{first['metric'] or 'metric'} ({better} is better)")
    ax.set_title(f"per-layer bit widths: {len(rows)} trials" + (f", {failed} failed (pareto.csv)" if failed else ""))
    ax.grid(True, alpha=0.3)
    if ok:  # every trial failed: nothing to label
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")  # the format named: ``path`` may be a temporary (.tmp)
    plt.close(fig)


if __name__ == "__main__":  # python -m quark_lightning.app.pareto SWEEP_DIR [STORAGE_URL STUDY_NAME]
    sweep = Path(sys.argv[1])
    shared = OmegaConf.create({"hydra": {"sweeper": {"storage": sys.argv[2], "study_name": sys.argv[3]}}})
    found = collect(sweep, _study_trials(shared) if len(sys.argv) > 3 else None)
    if not found:
        sys.exit(f"no trials under {sweep}")
    print(*write_pareto(found, sweep) or ["nothing written (see the error above)"])


def _job_value(job_return: Any) -> Any:
    """A job's return value, or its exception when it failed: Hydra's public ``return_value`` re-raises that after
    writing an "Error executing job" line, which the sweeper writes again when it checks the job (kept out here)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return job_return.return_value
    except Exception as err:  # noqa: BLE001 - a failed trial is recorded, not raised: the sweeper decides
        return err
