"""Low-bit LLM quality, issue 37: perplexity of every method on the byte LM (``experiment=char_lm``) and the tiny
Hugging Face LLaMA (``experiment=hf_lm``), each row one run of the app as a user runs it.

One float model per experiment is trained first (``quant=none``, the experiment's own epochs and seed); every row then
starts from that float checkpoint (``ckpt_path=``), so the rows share the float weights, the data, the calibration
batches and the seed, and the QAT rows share their number of steps (``quant.qat_epochs``):

- at A8 (int8 activations as ``quant=w4a8_qad`` has them) with int4 and int3 weights in groups of 32: PTQ round to
  nearest, PTQ GPTQ, QAT, QAT + distillation (``quant=w4a8_qad``, the copy teacher) with the distillation loss alone
  (``weight`` 1.0) and half and half with the task loss (0.5, the preset's);
- at W4A4 (int4 per-channel weights, int4 per-token dynamic activations): round to nearest, GPTQ, Hadamard rotation
  + GPTQ (``quant=w4a4_rotated``), learned rotation + GPTQ (``quant=w4a4_spinquant``).

Printed: test perplexity per row and, for the targets of the issue, distillation's gain over plain QAT at each width
and the share of GPTQ's W4A4 gap to float that each rotation closes. 2 CPU cores; run directories under ``--out``.

    python bench/low_bit_llm.py                          # both experiments (about an hour on 2 cores)
    python bench/low_bit_llm.py --qat-batches 60           # what README reports: 60 QAT steps per QAT row
    python bench/low_bit_llm.py --experiments char_lm --rows qat_w4 qad_w4
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GPTQ = "{name: gptq, damp_percent: 0.01, desc_act: true, static_groups: false, true_sequential: true}"
_A8_PTQ = ["quant=w4a8_qad", "quant.mode=ptq", "quant.distill=null"]
_W4A4 = ["quant=w4a4_rotated"]
#: row name -> (label, app overrides); every row starts from the experiment's float checkpoint
ROWS: dict[str, tuple[str, list[str]]] = {}
for _bits in (4, 3):
    _width = [] if _bits == 4 else [f"quant.weight_bits={_bits}"]
    ROWS[f"rtn_w{_bits}"] = (f"W{_bits}A8 g32 PTQ RTN", [*_A8_PTQ, *_width])
    ROWS[f"gptq_w{_bits}"] = (f"W{_bits}A8 g32 PTQ GPTQ", [*_A8_PTQ, *_width, f"quant.algo_config={GPTQ}"])
    ROWS[f"qat_w{_bits}"] = (f"W{_bits}A8 g32 QAT", ["quant=w4a8_qad", "quant.distill=null", *_width])
    ROWS[f"qad_w{_bits}"] = (
        f"W{_bits}A8 g32 QAT + distillation 1.0",
        ["quant=w4a8_qad", "quant.distill.weight=1.0", *_width],
    )
    ROWS[f"qadmix_w{_bits}"] = (
        f"W{_bits}A8 g32 QAT + distillation 0.5 (preset)",
        ["quant=w4a8_qad", *_width],
    )
ROWS["rtn_w4a4"] = ("W4A4 RTN", [*_W4A4, "quant.algo_config=null"])
ROWS["gptq_w4a4"] = ("W4A4 GPTQ", [*_W4A4, f"quant.algo_config=[{GPTQ}]"])
ROWS["hadamard_w4a4"] = ("W4A4 Hadamard + GPTQ", _W4A4)
ROWS["learned_w4a4"] = ("W4A4 learned rotation + GPTQ", ["quant=w4a4_spinquant"])


def run_app(out: Path, overrides: list[str]) -> dict:
    """One ``python train.py`` run into ``out`` (kept: a rerun reads its results.json); its results."""
    results = out / "results.json"
    if not results.exists():
        command = [sys.executable, "train.py", f"hydra.run.dir={out}", *overrides]
        print("  $ " + " ".join(command[1:]), flush=True)
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"run failed ({out}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(results.read_text())


def float_checkpoint(out: Path, experiment: str, extra: list[str]) -> tuple[str, float]:
    """The experiment's float model (trained once, cached in ``out``): its checkpoint and test perplexity."""
    results = run_app(out / f"{experiment}-float", [f"experiment={experiment}", "quant=none", *extra])
    return results["checkpoints"]["float"], results["metric"]["float"]


def gap_closed(rotated: float, gptq: float, float_ppl: float) -> float:
    """The share of GPTQ's perplexity gap to float that a rotation closes (1: all of it; log perplexity)."""
    gap = math.log(gptq) - math.log(float_ppl)
    return (math.log(gptq) - math.log(rotated)) / gap if gap > 0 else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", nargs="+", default=["char_lm", "hf_lm"])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "scratch" / "low_bit_llm")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for every run (data size, epochs)")
    parser.add_argument(
        "--qat-batches", type=int, default=None, help="training batches per QAT epoch (every QAT row alike; None: all)"
    )
    args = parser.parse_args()
    print("machine: 2 shared CPU cores; each row is `python train.py experiment=<exp> ckpt_path=<float> <overrides>`")
    for experiment in args.experiments:
        start = time.perf_counter()
        ckpt, float_ppl = float_checkpoint(args.out, experiment, args.extra)
        ppl: dict[str, float] = {}
        print(f"\n{experiment}: float test perplexity {float_ppl:.3f}")
        for row in args.rows:
            label, overrides = ROWS[row]
            extra = [f"experiment={experiment}", f"ckpt_path={ckpt}", *overrides, *args.extra]
            if args.qat_batches is not None and row.startswith(("qat_", "qad")):
                extra.append(f"+trainer.limit_train_batches={args.qat_batches}")
            results = run_app(args.out / f"{experiment}-{row}", extra)
            ppl[row] = results["metric"]["quantized"]
            print(f"  {label:<34} {ppl[row]:9.3f}   ({ppl[row] / float_ppl:.3f}x float)", flush=True)
        for bits in (4, 3):
            for qad_row in (f"qad_w{bits}", f"qadmix_w{bits}"):
                if f"qat_w{bits}" in ppl and qad_row in ppl:
                    qat, qad = ppl[f"qat_w{bits}"], ppl[qad_row]
                    verdict = "better" if qad < qat else "NOT better"
                    print(f"  W{bits}A8: {ROWS[qad_row][0]} {qad:.3f} vs QAT {qat:.3f}: {verdict}")
        if "gptq_w4a4" in ppl:
            for row in ("hadamard_w4a4", "learned_w4a4"):
                if row in ppl:
                    closed = gap_closed(ppl[row], ppl["gptq_w4a4"], float_ppl)
                    print(f"  W4A4: {ROWS[row][0]} closes {closed:.2f} of GPTQ's gap to float (target >= 0.5)")
        print(f"  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
