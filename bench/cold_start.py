"""Cold first run against warm run of ``python train.py`` (README's main command, default config).

python bench/cold_start.py [--repo .] [--runs 1] [-- extra train.py overrides]

The cold run starts from a fresh ``git clone`` of ``--repo`` (no ``__pycache__``) with empty torch inductor / triton
caches (``TORCHINDUCTOR_CACHE_DIR`` & co. pointed at a new temporary directory); the warm run repeats it in the same
clone with the same caches, as a user's second ``python train.py`` does. Each run writes its run directory under the
temporary directory (``hydra.run.dir=``) and is wrapped so that at exit it reports what torch compiled: dynamo's
frames and compile time (``torch._dynamo.utils.compile_times``), inductor's FX-graph cache and AOTAutograd cache hits
and misses (``torch._dynamo.utils.counters``), and the quark log line that announces the first compile.

Prints the wall and CPU (user + system) time of each run, the cold / warm ratios (the target of issue 38 is <= 1.3) and the load average
before and after (machine: 2 shared CPU cores; the ratio is against a peer, the warm run, measured in the same
invocation). ``--runs N`` repeats the cold/warm pair N times, each with new caches and a new clone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: runs train.py as ``python train.py`` would, then writes torch's compile statistics as JSON to $COLD_START_STATS
WRAPPER = r"""
import atexit, json, os, runpy, sys

def _stats():
    import torch._dynamo.utils as du
    counters = {k: dict(v) for k, v in du.counters.items() if k in ("inductor", "aot_autograd", "stats")}
    metrics = getattr(du, "compilation_time_metrics", {})
    times = {k: [float(t) for t in v] for k, v in metrics.items()}
    with open(os.environ["COLD_START_STATS"], "w") as f:
        json.dump({"counters": counters, "compile_times": times}, f)

atexit.register(_stats)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""

#: the environment variables that point torch's on-disk compile caches somewhere
CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def load() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run_once(
    clone: Path, caches: Path, run_dir: Path, overrides: list[str], threads: int | None = None, compile_mode: str = ""
) -> dict:
    """One ``python train.py`` in ``clone`` with torch's caches under ``caches`` (``threads``: OMP_NUM_THREADS;
    ``compile_mode``: QUARK_COMPILE, empty for the default): wall and CPU time, torch's compile statistics, the quark
    log lines about compiling."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.pop("QUARK_COMPILE", None)  # the default (auto) policy is what a user gets, unless --quark-compile says
    if compile_mode:
        env["QUARK_COMPILE"] = compile_mode
    env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
    env["TRITON_CACHE_DIR"] = str(caches / "triton")
    env["COLD_START_STATS"] = str(run_dir.with_suffix(".json"))
    env["PYTHONPATH"] = str(clone)
    cmd = [sys.executable, "-c", WRAPPER, f"hydra.run.dir={run_dir}", *overrides]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"train.py failed (exit {proc.returncode}) in {clone}")
    stats_path = run_dir.with_suffix(".json")
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    log = proc.stdout + proc.stderr
    stats["quark_compile_log"] = [line.strip() for line in log.splitlines() if "compil" in line and "quark" in line]
    return {"wall": wall, "cpu": cpu, **stats}


def summary(name: str, result: dict) -> str:
    """One line: wall time, dynamo frames and compile seconds, cache hits/misses."""
    inductor = result.get("counters", {}).get("inductor", {})
    aot = result.get("counters", {}).get("aot_autograd", {})
    times = result.get("compile_times", {})
    compiles = times.get("_compile.compile_inner", [])
    graphs = result.get("counters", {}).get("stats", {}).get("unique_graphs", 0)
    return (
        f"{name}: {result['wall']:.1f} s wall, {result['cpu']:.1f} s CPU | dynamo graphs {graphs} "
        f"({len(compiles)} by torch.compile's path, {sum(compiles):.1f} s; aot_compile's are not timed) | "
        f"fxgraph cache hit {inductor.get('fxgraph_cache_hit', 0)} miss {inductor.get('fxgraph_cache_miss', 0)} | "
        f"aot autograd cache hit {aot.get('autograd_cache_hit', 0)} miss {aot.get('autograd_cache_miss', 0)}"
    )


def pair_dirs(root: Path, repo: Path, tag: str) -> tuple[Path, Path]:
    """A fresh clone of ``repo`` and an empty cache directory under ``root``, named by ``tag``."""
    clone = root / f"clone_{tag}"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    return clone, root / f"caches_{tag}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=".", help="the git repository to clone (its committed HEAD)")
    parser.add_argument("--baseline", default=None, help="a second repository (e.g. main), run interleaved as a peer")
    parser.add_argument("--runs", type=int, default=1, help="cold/warm pairs, each with new caches and clone")
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the runs (1: steadier on a loaded machine, where idle OpenMP threads spin)",
    )
    parser.add_argument("--quark-compile", default="", help="QUARK_COMPILE for the runs (default: unset, auto)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (default: none, README's main command)")
    args = parser.parse_args()
    repos = {"repo": Path(args.repo).resolve()}
    if args.baseline:
        repos["baseline"] = Path(args.baseline).resolve()
    for tag, repo in repos.items():
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(f"{tag}: {repo} at {head.stdout.strip()}")
    threads = f"OMP_NUM_THREADS={args.omp_threads} " if args.omp_threads else ""
    threads += f"QUARK_COMPILE={args.quark_compile} " if args.quark_compile else ""
    print(f"machine: 2 shared CPU cores; command: {threads}python train.py {' '.join(args.overrides)}")
    ratios: dict[str, list[float]] = {tag: [] for tag in repos}
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="cold_start_") as tmp:
            root = Path(tmp)
            dirs = {tag: pair_dirs(root, repo, tag) for tag, repo in repos.items()}
            print(f"[pair {i + 1}] load before: {load()}")
            walls: dict[str, dict] = {tag: {} for tag in repos}
            for phase in ("cold", "warm"):  # interleaved: every repo's cold run, then every repo's warm run
                for tag, (clone, caches) in dirs.items():
                    result = run_once(
                        clone, caches, root / f"run_{tag}_{phase}", args.overrides, args.omp_threads, args.quark_compile
                    )
                    walls[tag][phase] = result
                    print(f"  {tag} " + summary(phase, result) + f" | load {load()}")
                    if phase == "cold":
                        for line in result["quark_compile_log"][:2]:
                            print(f"    log: {line[:240]}")
            for tag in repos:
                ratio = walls[tag]["cold"]["wall"] / walls[tag]["warm"]["wall"]
                cpu_ratio = walls[tag]["cold"]["cpu"] / walls[tag]["warm"]["cpu"]
                ratios[tag].append(ratio)
                print(f"  {tag}: cold / warm = {ratio:.2f} wall, {cpu_ratio:.2f} CPU time (target <= 1.3)")
    for tag, values in ratios.items():
        if len(values) > 1:
            print(f"{tag}: cold / warm over {len(values)} pairs: " + ", ".join(f"{r:.2f}" for r in values))


if __name__ == "__main__":
    main()
