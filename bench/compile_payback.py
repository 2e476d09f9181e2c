"""Where compiling the format kernels pays back within one QAT fit: whole fits of the MLP of ``qat_overhead.py``
under ``Trainer.fit`` with ``QuantCallback`` (QAT, observers on for the first half), by fit length, eagerly against
compiled, with torch's caches empty (cold) and filled by an earlier process (warm).

    python bench/compile_payback.py --width 1024 --steps 100,300,1000
    python bench/compile_payback.py --width 512,4096 --steps 100,300 --format fp8

Each fit runs in a fresh Python process (imports not timed: the span is ``trainer.fit`` itself, so the fit's
kernel compiles and loads are inside it). Modes, per (width, steps):

- ``eager``: auto mode whose warm-up never ends (``Backend.warmup_numel`` past any fit): the eager kernels the
  default runs before it compiles, and what it runs all along where it does not; it counts the elements of every step.
- ``compiled``: auto mode with ``Backend.payback_numel = 0``: the kernels compile once auto mode's warm-up
  (``Backend.warmup_numel`` elements) is over, however little of the fit is left (the policy before the run plan).
- ``default``: auto mode as shipped (the run plan: compile only where at least ``Backend.payback_numel`` elements are
  still to come once the warm-up is over).
- ``untold`` (with ``--untold``): auto mode as shipped for a run that tells nothing of its length (the callback's
  plan calls made no-ops, as in a training loop of the user's own): compile once ``Backend.payback_numel`` elements
  have been counted.

- ``stored`` (with ``--stored``): the default again, on the cache folder ``compiled`` filled (its kernels stored, as
  after an earlier long run or one made with ``QUARK_COMPILE=1``): a fit long enough to pay a load back
  (``Backend.stored_payback_numel``) but not a compile runs the stored kernels (``Backend.loading``). Also with
  ``--stored``, ``prebuilt``: the default on a new cache folder that a 10-step fit with ``QUARK_COMPILE=1
  QUARK_DIRECT_KERNELS=2`` filled first (kernels built ahead of a run; that fit's process is timed whole).

``compiled``, ``default`` and ``untold`` run twice on one new cache folder (``TORCHINDUCTOR_CACHE_DIR``, which holds
quark's kernel store too): the first run is cold, the second warm. The rounds alternate the modes. Printed: the fit's
seconds per mode (median over rounds), each over eager's in the same round, the elements a QAT step counts toward the
warm-up (``Backend.seen_numel``) and the elements the fit counts in all, which is what ``Backend.payback_numel`` is
compared with. Machine: 2 shared CPU cores; ``uptime``'s load is printed beside the figures.
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
MODES = ("eager", "compiled", "default", "untold", "prebuilt")  # (each one's cache folder)


def child(width: int, steps: int, fmt: str, payback: int | None, eager: bool, untold: bool = False) -> dict:
    """One fit in this process: the fit's wall seconds and what the compile policy counted."""
    import logging
    import warnings

    import torch
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    import callbacks.quant
    from bench.qat_overhead import FP8_W8A8, MLP, MX_W4A8, W8A8
    from callbacks import QuantCallback
    from quark.torch.cpu_allocator import keep_freed_memory
    from quark.torch.quantization.formats import Backend

    keep_freed_memory()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if payback is not None:
        Backend.payback_numel = payback
    if eager:
        Backend.warmup_numel = 1 << 62
    if untold:  # the fit tells the compile policy nothing, as a training loop of the user's own
        callbacks.quant.plan_step_start = callbacks.quant.plan_run_end = lambda: None
        callbacks.quant.plan_step_end = lambda steps_left: None
    config = {"int8": W8A8, "fp8": FP8_W8A8, "mx": MX_W4A8}[fmt]
    torch.manual_seed(0)

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP(width)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    data = TensorDataset(torch.randn(32 * steps, 1024), torch.randint(0, 10, (32 * steps,)))
    counted: list[int] = []

    class Count(QuantCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            counted.append(Backend.seen_numel)

    trainer = Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Count(config, mode="qat", observer_steps=steps // 2)],
    )
    start = time.perf_counter()
    trainer.fit(Module(), DataLoader(data, batch_size=32))
    seconds = time.perf_counter() - start
    per_step = counted[2] - counted[1] if len(counted) > 2 else 0
    return {"seconds": seconds, "compiled": Backend.compile_logged, "loading": Backend.loading, "step_numel": per_step}


PREBUILD = {"QUARK_COMPILE": "1", "QUARK_DIRECT_KERNELS": "2"}  # every kernel compiled, exact-shape ones too
PREBUILD_STEPS = 10


def run(width: int, steps: int, fmt: str, mode: str, cache: str, env_extra: dict[str, str] | None = None) -> dict:
    """One fit in a fresh process, in ``mode``, with torch's caches in ``cache`` (``env_extra``: more variables; the
    process's wall time is returned as ``process_seconds``)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    env.pop("QUARK_COMPILE", None)
    env.update(env_extra or {})
    start = time.perf_counter()
    extra = {"eager": ["--eager"], "compiled": ["--payback", "0"], "default": [], "untold": ["--told-nothing"]}[mode]
    args = ["--child", "--width", str(width), "--steps", str(steps), "--format", fmt, *extra]
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return {**json.loads(out.strip().splitlines()[-1]), "process_seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", default="1024", help="comma-separated MLP hidden widths")
    parser.add_argument("--steps", default="100,300,1000", help="comma-separated fit lengths (training batches)")
    parser.add_argument("--format", choices=("int8", "fp8", "mx"), default="int8")
    parser.add_argument("--rounds", type=int, default=2, help="cold/warm rounds per (width, steps)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--payback", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--told-nothing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--untold", action="store_true", help="also time the fit telling the policy nothing")
    parser.add_argument("--stored", action="store_true", help="also time the default on the compiled mode's caches")
    args = parser.parse_args()
    widths = [int(w) for w in args.width.split(",")]
    lengths = [int(s) for s in args.steps.split(",")]
    if args.child:
        print(json.dumps(child(widths[0], lengths[0], args.format, args.payback, args.eager, args.told_nothing)))
        return
    print(f"# {args.format} QAT fits, MLP 1024 -> width -> 1024 -> 10, batch 32, Adam; load {os.getloadavg()[0]:.2f}")
    modes = ("compiled", "default", "untold") if args.untold else ("compiled", "default")
    print(
        "| width | steps | elements per step | fit elements | eager s | "
        + " | ".join(f"{m} cold / warm s (x eager)" for m in modes)
        + (" | stored s (x eager) | prebuild s | prebuilt s (x eager) | loaded" if args.stored else "")
        + " | default compiled |"
    )
    print("|---|---|---|---|---|" + "---|" * len(modes) + ("---|---|---|---|" if args.stored else "") + "---|")
    for width in widths:
        for steps in lengths:
            seconds: dict[str, list[float]] = {}
            ratios: dict[str, list[float]] = {}
            step_numel, default_compiled, stored_loaded = 0, False, False
            for r in range(args.rounds):
                with tempfile.TemporaryDirectory(prefix="payback_") as tmp:
                    caches = {m: str(Path(tmp) / m) for m in MODES}
                    eager = run(width, steps, args.format, "eager", caches["eager"])
                    seconds.setdefault("eager", []).append(eager["seconds"])
                    step_numel = max(step_numel, eager["step_numel"])
                    for mode in modes if r % 2 == 0 else modes[::-1]:
                        for phase in ("cold", "warm"):
                            res = run(width, steps, args.format, mode, caches[mode])
                            seconds.setdefault(f"{mode} {phase}", []).append(res["seconds"])
                            ratios.setdefault(f"{mode} {phase}", []).append(res["seconds"] / eager["seconds"])
                            default_compiled |= mode == "default" and res["compiled"]
                    if args.stored:  # after ``compiled`` filled its caches; then after a short prebuilding fit
                        res = run(width, steps, args.format, "default", caches["compiled"])
                        seconds.setdefault("stored", []).append(res["seconds"])
                        ratios.setdefault("stored", []).append(res["seconds"] / eager["seconds"])
                        pre = run(width, PREBUILD_STEPS, args.format, "default", caches["prebuilt"], PREBUILD)
                        seconds.setdefault("prebuild", []).append(pre["process_seconds"])
                        res2 = run(width, steps, args.format, "default", caches["prebuilt"])
                        seconds.setdefault("prebuilt", []).append(res2["seconds"])
                        ratios.setdefault("prebuilt", []).append(res2["seconds"] / eager["seconds"])
                        stored_loaded |= res["loading"] and res2["loading"]

            def cell(mode: str, seconds: dict = seconds, ratios: dict = ratios) -> str:
                cold, warm = f"{mode} cold", f"{mode} warm"
                return (
                    f"{statistics.median(seconds[cold]):.1f} / {statistics.median(seconds[warm]):.1f} "
                    f"({statistics.median(ratios[cold]):.2f} / {statistics.median(ratios[warm]):.2f})"
                )

            total = step_numel * steps
            print(
                f"| {width} | {steps} | {step_numel / 1e6:.1f}M | {total / 2**30:.2f} x 2^30 "
                f"| {statistics.median(seconds['eager']):.1f} | "
                + " | ".join(cell(m) for m in modes)
                + (
                    f" | {statistics.median(seconds['stored']):.1f} ({statistics.median(ratios['stored']):.2f}) "
                    f"| {statistics.median(seconds['prebuild']):.1f} "
                    f"| {statistics.median(seconds['prebuilt']):.1f} ({statistics.median(ratios['prebuilt']):.2f}) "
                    f"| {'yes' if stored_loaded else 'no'}"
                    if args.stored
                    else ""
                )
                + f" | {'yes' if default_compiled else 'no'} |",
                flush=True,
            )
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
