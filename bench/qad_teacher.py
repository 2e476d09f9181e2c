"""Quantization-aware distillation: step time and memory of teacher="copy" and teacher="self" against plain QAT.

Each run is a fresh subprocess (``--child``) that trains the char LM (``quark_lightning.tasks.char_lm.CharLM``,
4 layers, d_ff = 3 * d_model, byte vocabulary, windows of 64 random bytes, batch 2) with ``QuantCallback`` in QAT
under the ``quant=w4a8_qad`` formats (int4 per-group g32 symmetric weights, int8 per-tensor dynamic activations)
for ``--warmup`` + ``--steps`` optimizer steps, at d_model 128 (the experiment's default) and 512:

- ``plain QAT``: no distillation (the peer every ratio is against);
- ``copy``: ``distill={"teacher": "copy"}`` (KL, weight 1): a frozen float copy of the module;
- ``self``: ``distill={"teacher": "self"}``: the module itself with its quantizers off, no gradients.

Time: the median wall time of the steps after the warm-up (``on_train_batch_start`` to ``on_train_batch_end``: the
forward(s), the backward, the optimizer step), each contender run ``--rounds`` times in a rotated order; ``x plain``
is the median over rounds of the contender's median over plain QAT's in the same round.
Memory: peak RSS growth of the process over the fit (``VmHWM`` at the end minus ``VmRSS`` just before ``fit``, from
/proc/self/status: weights and optimizer state, the teacher copy, activations saved for backward, the allocator's
caching), plus the exact bytes of the teacher copy's parameters and buffers.

Machine: run on 2 shared CPU cores (other jobs may run beside it; the ratios compare runs of the same round).

    PYTHONPATH=$PWD python bench/qad_teacher.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONTENDERS = ("plain QAT", "copy", "self")
BATCH, SEQ = 2, 64
ROOT = Path(__file__).resolve().parents[1]


def status_kib(key: str) -> int:
    """A ``VmRSS`` / ``VmHWM`` line of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def child(contender: str, d_model: int, warmup: int, steps: int) -> dict[str, float]:
    """One training run; its step times, RSS growth and teacher bytes."""
    import warnings

    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from callbacks.quant import QuantCallback
    from quark.torch.quantization.config.config import Config
    from quark_lightning.tasks.char_lm import CharLM
    from quark_lightning.tasks.recipes import INT4_G32_WEIGHT

    warnings.filterwarnings("ignore")
    act = {
        "dtype": "int8",
        "qscheme": "per_tensor",
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": True,
    }
    config = Config.from_dict({"global_quant_config": {"weight": INT4_G32_WEIGHT, "input_tensors": act}})
    torch.manual_seed(0)
    model = CharLM(d_model=d_model, n_layers=4, n_heads=4, d_ff=3 * d_model, max_seq_len=128)
    n = BATCH * (warmup + steps)
    x = torch.randint(0, 256, (n, SEQ))
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=BATCH)
    distill = None if contender == "plain QAT" else {"teacher": contender}

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    cb = QuantCallback(config, distill=distill, log_sqnr=False, observer_steps=1)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[cb, clock],
    )
    rss0 = status_kib("VmRSS")
    trainer.fit(model, data)
    teacher = cb._teacher
    teacher_bytes = (
        0 if teacher is None else sum(t.numel() * t.element_size() for t in [*teacher.parameters(), *teacher.buffers()])
    )
    return {
        "step_s": statistics.median(clock.times[warmup:]),
        "rss_mb": (status_kib("VmHWM") - rss0) / 1024,
        "teacher_mb": teacher_bytes / 2**20,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def run_child(contender: str, d_model: int, args: argparse.Namespace) -> dict[str, float]:
    """``child`` in a fresh process (its peak RSS is its own)."""
    cmd = [sys.executable, __file__, "--child", contender, str(d_model), str(args.warmup), str(args.steps)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        contender, d_model, warmup, steps = args.child
        print(json.dumps(child(contender, int(d_model), int(warmup), int(steps))))
        return
    print(
        "machine: 2 shared CPU cores; peer: plain QAT in the same round; memory: peak RSS growth over the fit",
        flush=True,
    )
    for width in args.widths:
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
        for r in range(args.rounds):
            order = CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]
            for c in order:
                runs[c].append(run_child(c, width, args))
        params = runs["plain QAT"][0]["params_m"]
        print(
            f"\nd_model {width} ({params:.2f} M parameters), {args.steps} steps after {args.warmup}, {args.rounds} rounds"
        )
        print(f"{'contender':<10} {'step ms':>9} {'x plain':>8} {'RSS MB':>8} {'x plain':>8} {'teacher MB':>11}")
        for c in CONTENDERS:
            step = statistics.median(x["step_s"] for x in runs[c]) * 1e3
            ratio = statistics.median(
                x["step_s"] / p["step_s"] for x, p in zip(runs[c], runs["plain QAT"], strict=True)
            )
            rss = statistics.median(x["rss_mb"] for x in runs[c])
            rss_ratio = rss / statistics.median(x["rss_mb"] for x in runs["plain QAT"])
            teacher = runs[c][0]["teacher_mb"]
            print(f"{c:<10} {step:9.1f} {ratio:8.2f} {rss:8.1f} {rss_ratio:8.2f} {teacher:11.1f}", flush=True)


if __name__ == "__main__":
    main()
