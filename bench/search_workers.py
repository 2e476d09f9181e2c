"""A per-layer bit-width search (hparams_search=optuna_bits, digits CNN, PTQ trials from one float checkpoint) run by
1 worker against 2 workers sharing one sqlite storage: wall time for the same number of trials of the same preset.

python bench/search_workers.py [--trials 8] [--float-epochs 2]

Each configuration starts from a new storage and new sweep directories under a temporary folder; the 2-worker runs
start both ``python train.py`` processes at once, each with half the trials (and its own sampler seed), and end when
both have. The trials' configurations differ from run to run (the sampler's order), their cost hardly does (PTQ of
the same model, calibration and test sets). Torch's intra-op threads per worker are set with OMP_NUM_THREADS; the
figures printed name the machine: on 2 shared CPU cores two workers share the cores a single worker already uses,
so expect well under 2x (what a second worker overlaps is each trial's start, float-cache read, Python work and I/O).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the search: the preset optuna_bits (conv1, conv2, fc1, fc2; 6 x 6 x 8 x 6 configurations), uniform trials 2 and 8
SEARCH = ("hparams_search=optuna_bits", "hparams_search.uniform=[2,8]", "trainer.accelerator=cpu")


def _train(args: list[str], cwd: Path, threads: int | None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def float_checkpoint(folder: Path, epochs: int) -> str:
    """Train the float digits CNN once; its checkpoint is what every trial quantizes."""
    proc = _train(
        ["quant=none", "trainer.accelerator=cpu", f"trainer.max_epochs={epochs}", f"hydra.run.dir={folder / 'float'}"],
        folder,
        None,
    )
    _, err = proc.communicate()
    if proc.returncode:
        sys.exit(err.decode()[-3000:])
    return json.loads((folder / "float" / "results.json").read_text())["checkpoints"]["float"]


def search(folder: Path, name: str, ckpt: str, trials: int, workers: int, threads: int | None) -> float:
    """Wall time (s) of ``trials`` trials spread over ``workers`` processes sharing one sqlite storage."""
    storage = f"sqlite:///{folder / name}.db"
    per_worker = [trials // workers + (i < trials % workers) for i in range(workers)]
    t0 = time.perf_counter()
    procs = [
        _train(
            [
                *SEARCH,
                f"ckpt_path={ckpt}",
                f"hparams_search.n_trials={n}",
                f"hparams_search.sampler_seed={i}",
                f"hydra.sweeper.storage={storage}",
                f"hydra.sweep.dir={folder / name / f'w{i}'}",
            ],
            folder,
            threads,
        )
        for i, n in enumerate(per_worker)
    ]
    errors = [p.communicate()[1] for p in procs]
    elapsed = time.perf_counter() - t0
    for proc, err in zip(procs, errors, strict=True):
        if proc.returncode:
            sys.exit(err.decode()[-3000:])
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    done = optuna.load_study(study_name="optuna_bits", storage=storage).trials
    assert len(done) == trials and all(t.state.name == "COMPLETE" for t in done), [t.state for t in done]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--float-epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every configuration, interleaved")
    opts = parser.parse_args()
    import torch

    print(f"machine: {os.cpu_count()} CPU cores (shared with other work), torch {torch.__version__}, ", end="")
    print(f"default intra-op threads {torch.get_num_threads()}")
    configs = [  # (label, workers, OMP_NUM_THREADS per worker: None = torch's default)
        ("1 worker, default threads", 1, None),
        ("1 worker, 1 thread", 1, 1),
        ("2 workers, default threads each", 2, None),
        ("2 workers, 1 thread each", 2, 1),
    ]
    times: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = float_checkpoint(folder, opts.float_epochs)
        for round_ in range(opts.repeats):  # interleaved: drift of a shared machine hits every configuration
            for i, (label, workers, threads) in enumerate(configs):
                times[label].append(search(folder, f"r{round_}c{i}", ckpt, opts.trials, workers, threads))
    base = statistics.median(times[configs[0][0]])
    print(f"\n{opts.trials} trials of hparams_search=optuna_bits (digits CNN, PTQ from one float checkpoint)")
    print("| run | wall s (each round) | median s | median s per trial | speed-up vs 1 worker (medians) |")
    print("|---|---|---|---|---|")
    for label, seconds in times.items():
        median = statistics.median(seconds)
        rounds = ", ".join(f"{t:.1f}" for t in seconds)
        print(f"| {label} | {rounds} | {median:.1f} | {median / opts.trials:.2f} | {base / median:.2f}x |")
    for threads in ("default threads", "1 thread"):  # the same threads per worker: what a second worker adds
        one = statistics.median(times[f"1 worker, {threads}"])
        two = statistics.median(times[f"2 workers, {threads} each"])
        print(
            f"2 workers against 1 worker, {threads} per worker: {one / two:.2f}x (median {two:.1f} s against {one:.1f} s)"
        )


if __name__ == "__main__":
    main()
