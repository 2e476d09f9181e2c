"""The end of a sweep: ``summary.csv`` and ``summary.png`` (metric against weight bits, a line per scheme, the float
baseline as a reference line) from the ``results.json`` of every job of a Hydra multirun.

Runs as a Hydra callback (``hydra.callbacks.sweep_summary`` in conf/config.yaml) or by hand:
``python -m quark_lightning.app.summary multirun/2026-11-22/10-00-00``. Both files are recorded in the sweep's ``sweep_state.json``
(``quark_lightning.app.sweepdir``): a file of the user's under their names is never written over.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from quark_lightning.app.sweepdir import SweepFiles

COLUMNS = (
    "job",
    "task",
    "scheme",
    "mode",
    "weight_bits",
    "act_bits",
    "metric",
    "float",
    "quantized",
    "delta",
    "quantized_bytes",
    "fp32_bytes",
    "wall_s",
)


class SweepSummary(SweepFiles):
    """Hydra callback: after a multirun, summarise the jobs' results in the sweep directory. The directory is claimed
    at the start (``SweepFiles``): an earlier sweep's recorded files go, its float-test cache too (a new sweep tests its
    float model again: code or data may have changed)."""

    products = ("summary.csv", "summary.png")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """After each job of a multirun, the summary of the jobs so far: a later job that fails (a bad value in the
        sweep) or a sweep stopped by hand leaves the summary of those that finished."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra = HydraConfig.get()
        if hydra.mode == RunMode.MULTIRUN:
            rows = collect(Path(str(hydra.sweep.dir)))
            if rows:
                write_summary(rows, Path(str(hydra.sweep.dir)))
        super().on_job_end(config, job_return, **kwargs)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = collect(sweep_dir)
        if not rows:
            print(f"sweep summary: no results.json under {sweep_dir}")
        elif written := write_summary(rows, sweep_dir):
            print(f"sweep summary: {' and '.join(map(str, written))} ({len(rows)} runs)")
        super().on_multirun_end(config, **kwargs)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per ``results.json`` under ``sweep_dir`` (sorted by job folder): of the jobs of the sweep that last
    claimed it (``sweep_state.json``), not those an earlier sweep left there."""
    rows = []
    for path in sorted(job_files(sweep_dir, "results.json"), key=lambda p: natural_key(p.relative_to(sweep_dir))):
        r = json.loads(path.read_text())
        m, q, size = r["metric"], r["quant"], r["size"]
        rows.append(
            {
                "job": str(path.parent.relative_to(sweep_dir)),
                "task": f"{_short(r['task']['model'])} on {_short(r['task']['data'])}",
                "scheme": q["name"],
                "mode": q["mode"],
                "weight_bits": q["weight_bits"],
                "act_bits": q["act_bits"],
                "metric": m["name"],
                "metric_mode": m["mode"],
                "float": m["float"],
                "quantized": m["quantized"],
                "delta": m["delta"],
                "quantized_bytes": size["quantized_bytes"],
                "fp32_bytes": size["fp32_bytes"],
                "wall_s": round(r["wall_time_s"]["total_s"], 2),
            }
        )
    return rows


def job_files(sweep_dir: Path, name: str) -> list[Path]:
    """The files ``name`` under ``sweep_dir`` in the folders of its sweep's jobs (``quark_lightning.app.sweepdir.sweep_jobs``; every
    folder when no sweep state lists them)."""
    from quark_lightning.app.sweepdir import sweep_jobs

    jobs = sweep_jobs(sweep_dir)
    return [p for p in sweep_dir.glob(f"**/{name}") if jobs is None or p.parent.resolve() in jobs]


def write_summary(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Write ``summary.csv`` and ``summary.png`` into ``folder`` (each complete or absent), recorded in its
    ``sweep_state.json``; returns the paths written (a file of the user's there is not written over: an error is
    logged, and it is not in the list)."""
    from quark_lightning.app.rundir import SWEEP_STATE, write_recorded  # here: importing quark takes a second

    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    files = {
        "summary.csv": lambda tmp: Path(tmp).write_text(text.getvalue(), encoding="utf-8", newline=""),  # csv's \r\n
        "summary.png": lambda tmp: plot(rows, Path(tmp)),
    }
    return [folder / name for name, content in files.items() if write_recorded(folder, name, content, SWEEP_STATE)]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Metric against weight bits: one panel per task and metric, one line per scheme (and mode), float as a
    dashed reference; perplexity-like metrics (lower is better) on a log axis when they span a decade."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        panels[(row["task"], row["metric"])].append(row)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False)
    for ax, ((task, metric), panel) in zip(axes[0], sorted(panels.items()), strict=True):
        _panel(ax, task, metric, panel)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format="png")  # the format named: ``path`` may be a temporary (.tmp)
    plt.close(fig)


def _panel(ax: Any, task: str, metric: str, rows: list[dict[str, Any]]) -> None:
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        if row["quantized"] is not None:
            lines[f"{row['scheme']} ({row['mode']})"].append((float(row["weight_bits"]), float(row["quantized"])))
    markers = "osD^v<>ph*"
    for i, (label, points) in enumerate(sorted(lines.items())):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker=markers[i % len(markers)], linewidth=1.8, markersize=6, label=label)
    floats = [float(r["float"]) for r in rows if r["float"] is not None]
    if floats:
        baseline = sum(floats) / len(floats)
        ax.axhline(baseline, color="0.35", linestyle="--", linewidth=1.2, label=f"float ({baseline:.4g})")
    values = [y for points in lines.values() for _, y in points] + floats
    if rows[0]["metric_mode"] == "min" and values and min(values) > 0 and max(values) / min(values) > 10:
        ax.set_yscale("log")
    bits = sorted({x for points in lines.values() for x, _ in points})
    if bits:
        ax.set_xticks(bits)
        ax.set_xticklabels([f"{b:g}" for b in bits])
    better = "higher" if rows[0]["metric_mode"] == "max" else "lower"
    ax.set_xlabel("weight bits per element")
    ax.set_ylabel(f"{metric} ({better} is better)")
    ax.set_title(task)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def natural_key(path: Path) -> tuple[tuple[int, int | str], ...]:
    """Sort key of a job folder: Hydra numbers jobs 0, 1, ..., 10, so numeric parts compare as numbers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in path.parts)


def _short(target: str | None) -> str:
    return (target or "?").rsplit(".", 1)[-1]


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    found = collect(folder)
    if not found:
        sys.exit(f"no results.json under {folder}")
    print(*write_summary(found, folder) or ["nothing written (see the error above)"])
