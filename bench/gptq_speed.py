"""GPTQ wall time: ours against amd-quark's on the same LLaMA-style models and calibration data, in one run.

A ``LlamaForCausalLM`` with random weights (transformers ``LlamaConfig``, no download: 2 decoder layers,
intermediate size 2.75x hidden, vocabulary 1000, ``lm_head`` excluded on both sides) is quantized weight-only with
GPTQ: uint4, groups of 128 along the input features, asymmetric, min-max, ``desc_act`` with static groups (amd-quark
refuses ``desc_act`` without them), damp_percent 0.01, blocks of 128 columns; calibration on random token ids
(16 samples x 128 tokens, one sample per batch). Both sides time ``ModelQuantizer(config).quantize_model(model,
batches)`` (preparation, calibration and GPTQ) in their own process, after an untimed warm-up quantization of the
smallest model (torch.compile of kernels, amd-quark's C++ extension). Quality: the relative error of the logits
against the float model on held-out random tokens, and how many quantized decoder weights the two sides agree on.

amd-quark is not a dependency of this project: it runs in its own venv (its package is also named ``quark``)::

    python3 -m venv /tmp/aqref/venv
    /tmp/aqref/venv/bin/pip install torch==2.13.0 amd-quark==0.13 transformers   # the CPU build of torch
    python bench/gptq_speed.py --amd-python /tmp/aqref/venv/bin/python          # or AMD_QUARK_PYTHON=...
    python bench/gptq_speed.py --hidden 256 512 --threads 1                     # a subset, one thread each
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from quark_side import import_quark, run_worker  # bench/: the folder of this script, first on sys.path

MODULES = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
GPTQ = {"damp_percent": 0.01, "desc_act": True, "static_groups": True, "block_size": 128}
GROUP = 128


def llama_config(hidden: int) -> dict[str, Any]:
    """The model's transformers.LlamaConfig fields: 64-dimensional heads, intermediate 2.75x hidden (a multiple of
    the group size), 2 layers, vocabulary 1000."""
    intermediate = round(2.75 * hidden / GROUP) * GROUP
    return {
        "vocab_size": 1000,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": 2,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }


def make_job(hidden: int, samples: int, tokens: int, path: Path) -> None:
    """The float weights, calibration and evaluation token ids, written once so both sides read the same ones."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(hidden)))
    generator = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 1000, (1, tokens), generator=generator) for _ in range(samples)]
    evals = torch.randint(0, 1000, (4, tokens), generator=generator)
    torch.save({"config": llama_config(hidden), "state": model.state_dict(), "calib": calib, "eval": evals}, path)


# ----------------------------------------------------------------------------------------------- one side, one process
def quantize(side: str, job: dict[str, Any]) -> tuple[Any, float]:
    """(quantized model, seconds of quantize_model) with ``side``'s quark, which is the one importable here."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**job["config"])).eval()
    model.load_state_dict(job["state"])
    batches = [{"input_ids": ids} for ids in job["calib"]]
    from quark.torch import ModelQuantizer

    if side == "ours":
        from quark.torch.quantization.config.config import Config

        weight = {
            "dtype": "uint4",
            "qscheme": "per_group",
            "ch_axis": 1,
            "group_size": GROUP,
            "symmetric": False,
            "observer_cls": "PerGroupMinMaxObserver",
            "scale_type": "float",
            "round_method": "half_even",
            "is_dynamic": False,
        }
        config = Config.from_dict(
            {"global_quant_config": {"weight": weight}, "exclude": ["lm_head"], "algo_config": {"name": "gptq", **GPTQ}}
        )
    else:
        from quark.torch.quantization.config.config import GPTQConfig, QConfig, QLayerConfig, Uint4PerGroupSpec

        weight = Uint4PerGroupSpec(
            ch_axis=1, group_size=GROUP, symmetric=False, scale_type="float", round_method="half_even"
        ).to_quantization_spec()
        algo = GPTQConfig(**GPTQ, inside_layer_modules=MODULES, model_decoder_layers="model.layers")
        config = QConfig(global_quant_config=QLayerConfig(weight=weight), exclude=["lm_head"], algo_config=[algo])
    start = time.perf_counter()
    with torch.no_grad():
        model = ModelQuantizer(config).quantize_model(model, batches)
    return model, time.perf_counter() - start


def worker(
    side: str, job_path: Path, out_path: Path, warmup_path: Path | None, threads: int | None, repeats: int
) -> None:
    """Quantize the job's model ``repeats`` times with ``side``'s quark (a fresh float model each time); write the
    times, the logits error and the decoder weights of the last one."""
    import_quark(side, threads)
    import torch

    if warmup_path is not None:
        quantize(side, torch.load(warmup_path, weights_only=True))
    job = torch.load(job_path, weights_only=True)
    times = []
    for _ in range(repeats):
        model, seconds = quantize(side, job)
        times.append(seconds)
    import transformers

    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**job["config"])).eval()
    reference.load_state_dict(job["state"])
    with torch.no_grad():
        expected = reference(input_ids=job["eval"]).logits
        logits = model(input_ids=job["eval"]).logits
    error = float(((logits - expected) ** 2).mean() / (expected**2).mean())
    weights = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)
    }
    torch.save(
        {
            "seconds": min(times),
            "times": times,
            "logits_error": error,
            "weights": weights,
            "threads": torch.get_num_threads(),
        },
        out_path,
    )


# ----------------------------------------------------------------------------------------------- driver
def run_side(
    python: str, side: str, job: Path, out: Path, warmup: Path | None, threads: int | None, repeats: int
) -> dict[str, Any]:
    import torch

    command = [python, str(Path(__file__).resolve()), "--worker", side, str(job), str(out), "--repeats", str(repeats)]
    command += ["--warmup-job", str(warmup)] if warmup else []
    command += ["--threads", str(threads)] if threads else []
    run_worker(command, side)
    return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 768, 1024])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed quantizations per side and size; the fastest counts"
    )
    parser.add_argument("--amd-python", default=os.environ.get("AMD_QUARK_PYTHON", "/tmp/aqref/venv/bin/python"))
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "JOB", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--warmup-job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, job, out = args.worker
        worker(side, Path(job), Path(out), args.warmup_job, args.threads, args.repeats)
        return
    if not Path(args.amd_python).exists():
        raise SystemExit(f"no amd-quark python at {args.amd_python}; see this script's docstring")
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warmup = Path(tmp) / "warmup.pt"
        make_job(min(args.hidden), 2, args.tokens, warmup)
        print("| hidden | params | ours s | amd-quark s | ratio | logits rel. error ours | amd-quark | same weights |")
        print("|---|---|---|---|---|---|---|---|")
        for hidden in args.hidden:
            job = Path(tmp) / f"job{hidden}.pt"
            make_job(hidden, args.samples, args.tokens, job)
            ours = run_side(sys.executable, "ours", job, Path(tmp) / "ours.pt", warmup, args.threads, args.repeats)
            amd = run_side(args.amd_python, "amd", job, Path(tmp) / "amd.pt", warmup, args.threads, args.repeats)
            same = sum(int((ours["weights"][n] == amd["weights"][n]).sum()) for n in ours["weights"])
            total = sum(w.numel() for w in ours["weights"].values())
            params = sum(t.numel() for t in torch.load(job, weights_only=True)["state"].values())
            ratio = ours["seconds"] / amd["seconds"]
            rows.append((hidden, ours["seconds"], amd["seconds"], ratio))
            print(
                f"| {hidden} | {params / 1e6:.1f}M | {ours['seconds']:.2f} | {amd['seconds']:.2f} | {ratio:.2f} | "
                f"{ours['logits_error']:.3e} | {amd['logits_error']:.3e} | {same / total:.2%} |",
                flush=True,
            )
        print(
            f"\n{args.samples} x {args.tokens} calibration tokens; {ours['threads']} torch threads per side; fastest of "
            f"{args.repeats} after a warm-up; python {sys.version.split()[0]}, torch {torch.__version__}"
        )
    print(json.dumps([dict(zip(("hidden", "ours_s", "amd_s", "ratio"), r, strict=True)) for r in rows]))


if __name__ == "__main__":
    main()
