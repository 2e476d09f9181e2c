"""PTQ time on a small model: ours against amd-quark 0.13 on amd-quark's own recipes, first call in a fresh process
and warm, with the output error of each side.

The model, data and recipes are those of ``bench/amd_quark_reference/`` (its README): a 4-layer CNN (conv 1->8,
conv 8->16, linear 1024->32, 32->10), 4 calibration batches of 16 x 1 x 8 x 8, and six recipes (W8A8 min-max, uint8
asymmetric activations, int4 per-group weights, fp8, percentile and MSE activation observers). Ours:
``reference_recipes.CONFIGS``; amd-quark's: the factories of ``make_reference.py``.

Every (side, recipe) runs in its own fresh worker process, which reports

* **first**: what a new user waits for after ``import torch``: importing the quark package and its API (ours:
  ``quark.torch`` and the config module; amd-quark: ``quark.torch`` with its observers and configs, which loads its
  C++ extension, built once into ``~/.cache/torch_extensions`` beforehand, and transformers' model modules), building
  the config, and ``ModelQuantizer(config).quantize_model(model, batches)`` (preparation and calibration, including
  anything compiled on first use). Not counted: the interpreter, ``import torch``, reading the data files, building
  the float model. Also shown apart: the import alone and the first ``quantize_model`` alone.
* **warm**: the median of ``--repeats`` further quantizations in the same process (a fresh float model each time).
* the number of frames ``torch.compile`` compiled during all that (dynamo's counter; 0 when dynamo was never used).
* the output error on the evaluation batch: ``sum((y - y_float)^2) / sum(y_float^2)``, and the largest difference
  from amd-quark's reference output (``reference_<recipe>.pt``).

The sides are interleaved recipe by recipe and their order alternates each round, so drift hits both; the table shows
the median over ``--rounds`` rounds. Both sides run torch on one thread by default (``--threads``): on a shared machine
idle-waiting OpenMP threads stretch millisecond-sized ops by up to 100x, on either side. amd-quark is not a dependency: it runs in its own venv (its package is also
named ``quark``)::

    python3 -m venv /tmp/aqref/venv && /tmp/aqref/venv/bin/pip install torch==2.13.0 amd-quark==0.13 transformers
    PYTHONPATH=$PWD python bench/ptq_vs_amd_quark.py --amd-python /tmp/aqref/venv/bin/python   # or AMD_QUARK_PYTHON
    PYTHONPATH=$PWD python bench/ptq_vs_amd_quark.py --recipes a8_mse w8a8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from quark_side import prepare_side, run_worker  # bench/: the folder of this script, first on sys.path

REFERENCE_DIR = Path(__file__).resolve().parent / "amd_quark_reference"
RECIPES = ("w8a8", "w8a8_uint8_asym", "w4_per_group", "fp8_e4m3", "a8_percentile", "a8_mse")


# ----------------------------------------------------------------------------------------------- one side, one process
def _import_side(side: str) -> Any:
    """Import ``side``'s quark API; return a function recipe -> (ModelQuantizer, config) (the timed import)."""
    if side == "ours":
        from reference_recipes import CONFIGS

        from quark.torch import ModelQuantizer
        from quark.torch.quantization.config.config import Config

        return lambda recipe: (ModelQuantizer, Config.from_dict(CONFIGS[recipe]))
    import make_reference  # amd-quark's quark.torch, its observers and configs

    factories = {**make_reference.CONFIGS, "w4_per_group": make_reference.config_w4_per_group_linear_only}
    return lambda recipe: (make_reference.ModelQuantizer, factories[recipe]()[0])


def _check_side(side: str) -> None:
    """Refuse a worker whose ``quark`` is not the side it was asked for."""
    import quark

    installed = "site-packages" in (quark.__file__ or "")
    if installed != (side == "amd"):
        raise SystemExit(f"{side}: imported quark from {quark.__file__}; see this script's docstring")


def _compiled_frames() -> int:
    """Frames dynamo compiled in this process so far (0 when torch._dynamo was never imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def worker(side: str, recipe: str, repeats: int, threads: int | None, out_path: Path) -> None:
    """Time the first and ``repeats`` warm quantizations of ``recipe`` with ``side``'s quark; write a JSON report."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    prepare_side(side)  # quark_side.import_quark's first part: the import itself is timed below

    sys.path.insert(0, str(REFERENCE_DIR))
    from load import load_reference
    from reference_recipes import SmallCNN

    ref = load_reference(recipe)

    def fresh_model() -> torch.nn.Module:
        model = SmallCNN().eval()
        model.load_state_dict(ref["model_state"])
        return model

    model = fresh_model()
    start = time.perf_counter()
    make = _import_side(side)
    imported = time.perf_counter()
    _check_side(side)
    quantizer_cls, config = make(recipe)
    quantized = quantizer_cls(config).quantize_model(model, ref["calib_batches"])
    first = time.perf_counter()
    frames_first = _compiled_frames()
    warm = []
    for _ in range(repeats):
        model = fresh_model()
        t0 = time.perf_counter()
        quantizer_cls, config = make(recipe)
        quantized = quantizer_cls(config).quantize_model(model, ref["calib_batches"])
        warm.append(time.perf_counter() - t0)
    with torch.no_grad():
        out = quantized(ref["eval_batch"])
    expected = ref["float_output"]
    report = {
        "import_s": imported - start,
        "first_quantize_s": first - imported,
        "first_s": first - start,
        "warm_s": statistics.median(warm),
        "compiled_frames_first": frames_first,
        "compiled_frames": _compiled_frames(),
        "rel_error": float(((out - expected) ** 2).sum() / (expected**2).sum()),
        "max_diff_vs_amd": float((out - ref["output"]).abs().max()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    out_path.write_text(json.dumps(report))


# ----------------------------------------------------------------------------------------------- driver
def run_side(python: str, side: str, recipe: str, repeats: int, threads: int, out: Path) -> dict[str, Any]:
    """One fresh worker process for (side, recipe); its JSON report."""
    command = [python, str(Path(__file__).resolve()), "--worker", side, recipe, str(out), "--repeats", str(repeats)]
    command += ["--threads", str(threads)]
    run_worker(command, side, f"{side} {recipe}")
    return json.loads(out.read_text())


def _median(reports: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in reports)


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side and recipe (median shown)")
    parser.add_argument("--repeats", type=int, default=7, help="warm quantizations per process (median)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on both sides (default 1: on a shared machine, idle-waiting OpenMP threads make "
        "millisecond-sized ops take up to 100x longer, on both sides; 0: torch's default)",
    )
    parser.add_argument("--amd-python", default=os.environ.get("AMD_QUARK_PYTHON", "/tmp/aqref/venv/bin/python"))
    parser.add_argument("--json", type=Path, help="also write every worker's report here")
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "RECIPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, recipe, out = args.worker
        worker(side, recipe, args.repeats, args.threads, Path(out))
        return
    if not Path(args.amd_python).exists():
        raise SystemExit(f"no amd-quark python at {args.amd_python}; see this script's docstring")
    import tempfile

    reports: dict[tuple[str, str], list[dict[str, Any]]] = {}
    loads = [_load()]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            sides = ("ours", "amd") if round_ % 2 == 0 else ("amd", "ours")
            for recipe in args.recipes:
                for side in sides:
                    python = sys.executable if side == "ours" else args.amd_python
                    report = run_side(python, side, recipe, args.repeats, args.threads, Path(tmp) / f"{side}.json")
                    reports.setdefault((side, recipe), []).append(report)
            loads.append(_load())
            print(f"round {round_ + 1}/{args.rounds} done, load average {loads[-1]}", file=sys.stderr, flush=True)
    print(
        "| recipe | first: ours s | amd-quark s | ratio | of which import: ours | amd-quark | first quantize_model: "
        "ours | amd-quark | ratio | warm: ours ms | amd-quark ms | ratio | compiled frames ours / amd | output error "
        "ours | amd-quark | max diff from amd's output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for recipe in args.recipes:
        ours, amd = reports[("ours", recipe)], reports[("amd", recipe)]
        first_o, first_a = _median(ours, "first_s"), _median(amd, "first_s")
        fq_o, fq_a = _median(ours, "first_quantize_s"), _median(amd, "first_quantize_s")
        warm_o, warm_a = _median(ours, "warm_s"), _median(amd, "warm_s")
        frames = f"{max(r['compiled_frames'] for r in ours)} / {max(r['compiled_frames'] for r in amd)}"
        print(
            f"| {recipe} | {first_o:.2f} | {first_a:.2f} | {first_o / first_a:.3f} | {_median(ours, 'import_s'):.2f} | "
            f"{_median(amd, 'import_s'):.2f} | {fq_o:.3f} | {fq_a:.3f} | {fq_o / fq_a:.2f} | {warm_o * 1e3:.1f} | "
            f"{warm_a * 1e3:.1f} | {warm_o / warm_a:.2f} | {frames} | {ours[-1]['rel_error']:.3e} | "
            f"{amd[-1]['rel_error']:.3e} | {ours[-1]['max_diff_vs_amd']:.1e} |"
        )
    sample = next(iter(reports.values()))[0]
    print(
        f"\nmedians over {args.rounds} fresh processes per side and recipe (warm: median of {args.repeats} per "
        f"process); {sample['threads']} torch threads; torch {sample['torch']}, python {sys.version.split()[0]}; "
        f"{os.cpu_count()} CPUs; load average (1, 5, 15 min) before: {loads[0]}, after: {loads[-1]}"
    )
    if args.json:
        args.json.write_text(json.dumps({f"{s}:{r}": v for (s, r), v in reports.items()}, indent=1))


if __name__ == "__main__":
    main()
