"""The sweep summary from results.json files: rows, CSV columns, and a plot with a line per scheme."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from quark_lightning.app.summary import COLUMNS, collect, plot, write_summary


def _result(folder: Path, scheme: str, mode: str, bits: float, quantized: float | None, fp: float = 90.0) -> None:
    folder.mkdir(parents=True)
    results = {
        "task": {
            "data": "quark_lightning.tasks.lightning_digits.DigitsDataModule",
            "model": "quark_lightning.tasks.lightning_digits.DigitsClassifier",
        },
        "quant": {"name": scheme, "mode": mode, "weight_bits": bits, "act_bits": 8.0},
        "metric": {
            "name": "test_acc",
            "mode": "max",
            "float": fp,
            "quantized": quantized,
            "delta": None if quantized is None else quantized - fp,
        },
        "size": {"quantized_bytes": int(bits * 100), "fp32_bytes": 3200},
        "wall_time_s": {"total_s": 1.234},
    }
    (folder / "results.json").write_text(json.dumps(results))


def _sweep(tmp_path: Path) -> Path:
    for i, (scheme, mode, bits, value) in enumerate(
        [
            ("int8_per_channel", "ptq", 8, 89.5),
            ("int8_per_channel", "ptq", 2, 40.0),
            ("int8_per_channel", "ptq", 4, 85.0),
            ("w4a8_tqt", "qat", 4, 88.0),
            ("w4a8_tqt", "qat", 2, 70.0),
            ("none", "none", 32, None),
        ]
    ):
        _result(tmp_path / str(i), scheme, mode, bits, value)
    return tmp_path


def test_collect_reads_every_job_in_order(tmp_path: Path) -> None:
    _result(tmp_path / "10", "bf16", "ptq", 16, 90.0)  # Hydra's eleventh job comes after the second
    rows = collect(_sweep(tmp_path))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "4", "5", "10"]
    assert rows[1]["weight_bits"] == 2 and rows[1]["delta"] == -50.0
    assert rows[0]["task"] == "DigitsClassifier on DigitsDataModule"


def test_write_summary_csv_and_png(tmp_path: Path) -> None:
    csv_path, png_path = write_summary(collect(_sweep(tmp_path)), tmp_path)
    with csv_path.open() as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == COLUMNS
    assert [(r["scheme"], r["weight_bits"], r["quantized"]) for r in table][:2] == [
        ("int8_per_channel", "8", "89.5"),
        ("int8_per_channel", "2", "40.0"),
    ]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_a_line_per_scheme_sorted_by_bits_and_the_float_baseline(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved = {}
    original = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: saved.setdefault("fig", fig))
    plot(collect(_sweep(tmp_path)), tmp_path / "s.png")
    ax = saved["fig"].axes[0]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines["int8_per_channel (ptq)"] == ([2.0, 4.0, 8.0], [40.0, 85.0, 89.5])
    assert lines["w4a8_tqt (qat)"] == ([2.0, 4.0], [70.0, 88.0])
    baseline = lines["float (90)"]
    assert set(baseline[1]) == {90.0}
    assert "higher is better" in ax.get_ylabel() and ax.get_xlabel() == "weight bits per element"
    original(saved["fig"])
