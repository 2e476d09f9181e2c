"""AWQ: ours against amd-quark's on the same LLaMA-style models, calibration data and scaling groups, in one run.

Models: ``LlamaForCausalLM`` (transformers ``LlamaConfig``, no download) of hidden 256..1024, 2 decoder layers,
64-dimensional heads, intermediate 2.75x hidden, byte vocabulary (256). Their weights are not a bare random init: a
few channels of every RMSNorm weight start large (4..16, about 1 in 64 channels), so the inputs of q/k/v and gate/up
have outlier channels as real LLMs do, and the model is then trained for a short while (``--train-steps`` AdamW steps
of 16 x 128 bytes) on the Python standard library's source (an offline corpus, ``quark_lightning.tasks.char_lm``); the trained weights
are cached under ``--cache-dir`` (first run: about a minute per size on 2 cores).

Quantization: weight-only uint4, groups of 128 along the input features, asymmetric, min-max, half-even rounding,
``lm_head`` excluded, AWQ with amd-quark's own LLaMA scaling groups (``AWQ_MAP["llama"]`` of
``quark.torch.quantization.config.algo_configs``: norm -> q/k/v inspected through self_attn, v -> o, norm -> gate/up
inspected through the mlp, up -> down) given explicitly to both sides. Calibration: ``--samples`` windows of
``--tokens`` bytes from the corpus' validation files, one window per batch; held-out: ``--eval`` windows from its test
files. Both sides read the same float weights and token ids from one file.

Each side runs in its own process (amd-quark's package is also named ``quark``) and times its AWQ step (ours:
``apply_pre_quant_and_awq``; amd-quark: ``apply_advanced_quant_algo``, which for AWQ also writes the quantized
weights) and the whole ``ModelQuantizer.quantize_model``, after an untimed warm-up on a small model. Timed runs are
interleaved (ours, amd-quark, amd-quark, ours, ...), one per process, and the median counts. Quality, on the held-out
windows: mean squared error of the logits against the float model, and perplexity; "RTN" is our engine without AWQ
(round-to-nearest with the min-max qparams), "calib MSE" the logits error on the calibration windows.

amd-quark is not a dependency of this project: it runs in its own venv::

    python3 -m venv /tmp/aqref/venv
    /tmp/aqref/venv/bin/pip install torch==2.13.0 amd-quark==0.13 transformers   # the CPU build of torch
    python bench/awq_speed.py --amd-python /tmp/aqref/venv/bin/python          # or AMD_QUARK_PYTHON=...
    python bench/awq_speed.py --hidden 256 512 --repeats 1                      # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from quark_side import REPO_ROOT, import_quark, run_worker  # bench/: the folder of this script, first on sys.path

GROUP = 128
VOCAB = 256
#: amd-quark 0.13's AWQ_MAP["llama"].scaling_layers (checked against it on the amd-quark side)
LLAMA_SCALING_LAYERS = [
    {
        "prev_op": "input_layernorm",
        "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "inp": "self_attn.q_proj",
        "module2inspect": "self_attn",
    },
    {"prev_op": "self_attn.v_proj", "layers": ["self_attn.o_proj"], "inp": "self_attn.o_proj"},
    {
        "prev_op": "post_attention_layernorm",
        "layers": ["mlp.gate_proj", "mlp.up_proj"],
        "inp": "mlp.gate_proj",
        "module2inspect": "mlp",
    },
    {"prev_op": "mlp.up_proj", "layers": ["mlp.down_proj"], "inp": "mlp.down_proj"},
]


def llama_config(hidden: int, layers: int) -> dict[str, Any]:
    """transformers.LlamaConfig fields: 64-dimensional heads, intermediate 2.75x hidden (a multiple of the group
    size), byte vocabulary."""
    intermediate = round(2.75 * hidden / GROUP) * GROUP
    return {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }


# ----------------------------------------------------------------------------------------------- the float models
def windows(tokens: Any, count: int, length: int, seed: int) -> Any:
    """``count`` windows of ``length`` tokens at seeded random offsets: [count, length] int64."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length - 1, (count,), generator=generator)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])


def trained_state(hidden: int, layers: int, steps: int, cache_dir: Path) -> dict[str, Any]:
    """The float weights: outlier channels in every RMSNorm, then ``steps`` of training on the stdlib corpus
    (cached on disk by size and steps)."""
    import torch
    import transformers

    path = cache_dir / f"llama_h{hidden}_l{layers}_s{steps}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    from quark_lightning.tasks.char_lm import load_python_corpus

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(hidden, layers)))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # activation outliers: about 1 in 64 channels of each norm 4..16x larger
        for name, module in model.named_modules():
            if name.endswith("layernorm"):
                channels = torch.randperm(hidden, generator=generator)[: max(2, hidden // 64)]
                module.weight[channels] = 4 + 12 * torch.rand(len(channels), generator=generator)
    if steps:
        corpus = load_python_corpus(train_bytes=2_000_000)["train"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        model.train()
        for step in range(steps):
            batch = windows(corpus, 16, 128, seed=100 + step)
            for group in optimizer.param_groups:
                group["lr"] = 2e-3 * min(1.0, (step + 1) / 10)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 20 == 0 or step == steps - 1:
                print(
                    f"  train hidden {hidden}: step {step + 1}/{steps} loss {loss.item():.3f}",
                    file=sys.stderr,
                    flush=True,
                )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def make_job(
    hidden: int, layers: int, steps: int, samples: int, tokens: int, evals: int, cache_dir: Path, path: Path
) -> None:
    """Float weights, calibration and held-out token ids, written once so that every side reads the same ones."""
    import torch

    from quark_lightning.tasks.char_lm import load_python_corpus

    corpus = load_python_corpus(train_bytes=1, val_bytes=400_000, test_bytes=400_000)
    calib = windows(corpus["val"], samples, tokens, seed=3)
    held = windows(corpus["test"], evals, tokens, seed=4)
    state = trained_state(hidden, layers, steps, cache_dir)
    torch.save(
        {"config": llama_config(hidden, layers), "state": state, "calib": [c[None] for c in calib], "eval": held}, path
    )


# ----------------------------------------------------------------------------------------------- one side, one process
def quantize(side: str, job: dict[str, Any]) -> tuple[Any, float, float]:
    """(quantized model, seconds of the AWQ step, seconds of quantize_model) with ``side``'s quark."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**job["config"])).eval()
    model.load_state_dict(job["state"])
    batches = [{"input_ids": ids} for ids in job["calib"]]
    from quark.torch import ModelQuantizer

    timed: list[float] = []

    def timing(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timed.append(time.perf_counter() - start)

        return wrapper

    if side in ("ours", "rtn"):
        import quark.torch.algorithm  # noqa: F401 - registers the handlers
        from quark.torch.quantization.config.config import AWQConfig, Config

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
        algo = {
            "algo_config": {
                "name": "awq",
                "scaling_layers": LLAMA_SCALING_LAYERS,
                "model_decoder_layers": "model.layers",
            }
        }
        config = Config.from_dict(
            {"global_quant_config": {"weight": weight}, "exclude": ["lm_head"], **(algo if side == "ours" else {})}
        )
        from quark.torch.quantization.algo_registry import algorithm_entry, register_algorithm

        real = algorithm_entry(AWQConfig(), need_handler=True).handler  # the engine runs AWQ through the registry
        register_algorithm(AWQConfig, stage="before_calibration", handler=timing(real))
    else:
        from quark.torch.quantization.config.algo_configs import AWQ_MAP

        import quark.torch.quantization.api as api
        from quark.torch.quantization.config.config import AWQConfig, QConfig, QLayerConfig, Uint4PerGroupSpec

        if AWQ_MAP["llama"].scaling_layers != LLAMA_SCALING_LAYERS:
            raise SystemExit(
                f"amd-quark's llama scaling layers differ from this bench's: {AWQ_MAP['llama'].scaling_layers}"
            )
        weight = Uint4PerGroupSpec(
            ch_axis=1, group_size=GROUP, symmetric=False, scale_type="float", round_method="half_even"
        ).to_quantization_spec()
        algo = AWQConfig(scaling_layers=LLAMA_SCALING_LAYERS, model_decoder_layers="model.layers")
        config = QConfig(global_quant_config=QLayerConfig(weight=weight), exclude=["lm_head"], algo_config=[algo])
        real, api.apply_advanced_quant_algo = api.apply_advanced_quant_algo, timing(api.apply_advanced_quant_algo)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            model = ModelQuantizer(config).quantize_model(model, batches)
    finally:
        if side == "amd":
            api.apply_advanced_quant_algo = real
        else:
            register_algorithm(AWQConfig, stage="before_calibration", handler=real)
    total = time.perf_counter() - start
    return model, sum(timed), total


def quality(model: Any, job: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Held-out logits MSE against the float model, held-out perplexity, calibration logits MSE."""
    import torch

    with torch.no_grad():
        held = model(input_ids=job["eval"]).logits
        calib = torch.cat([model(input_ids=ids).logits for ids in job["calib"]])
    ids = job["eval"]
    nll = torch.nn.functional.cross_entropy(held[:, :-1].reshape(-1, held.shape[-1]).float(), ids[:, 1:].reshape(-1))
    return {
        "mse": float(((held - reference["eval"]) ** 2).mean()),
        "ppl": float(nll.exp()),
        "calib_mse": float(((calib - reference["calib"]) ** 2).mean()),
    }


def float_logits(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**job["config"])).eval()
    model.load_state_dict(job["state"])
    with torch.no_grad():
        return {
            "eval": model(input_ids=job["eval"]).logits,
            "calib": torch.cat([model(input_ids=i).logits for i in job["calib"]]),
        }


def worker(
    side: str, job_path: Path, out_path: Path, warmup_path: Path | None, threads: int | None, measure: bool
) -> None:
    """One quantization (after an untimed warm-up) with ``side``'s quark; its times, and its quality if asked."""
    import_quark(side, threads)
    import torch

    if warmup_path is not None:
        quantize(side, torch.load(warmup_path, weights_only=True))
    job = torch.load(job_path, weights_only=True)
    model, awq_s, total_s = quantize(side, job)
    result: dict[str, Any] = {"awq_s": awq_s, "total_s": total_s, "threads": torch.get_num_threads()}
    if measure:
        reference = float_logits(job)
        result.update(quality(model, job, reference))
        if side == "ours":  # the float model's own perplexity, once
            ids = job["eval"]
            logits = reference["eval"]
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            )
            result["float_ppl"] = float(nll.exp())
    torch.save(result, out_path)


# ----------------------------------------------------------------------------------------------- driver
def run_side(
    python: str, side: str, job: Path, out: Path, warmup: Path | None, threads: int | None, measure: bool
) -> dict[str, Any]:
    import torch

    command = [python, str(Path(__file__).resolve()), "--worker", side, str(job), str(out)]
    command += ["--warmup-job", str(warmup)] if warmup else []
    command += ["--threads", str(threads)] if threads else []
    command += ["--measure"] if measure else []
    run_worker(command, side)
    return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 768, 1024])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=60, help="AdamW steps on the stdlib corpus (0: random init)")
    parser.add_argument("--samples", type=int, default=32, help="calibration windows (one per batch)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per calibration / held-out window")
    parser.add_argument("--eval", type=int, default=16, help="held-out windows")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3, help="timed quantizations per side and size (median)")
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "outputs" / "awq_bench")
    parser.add_argument("--amd-python", default=os.environ.get("AMD_QUARK_PYTHON", "/tmp/aqref/venv/bin/python"))
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "JOB", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--warmup-job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, job, out = args.worker
        worker(side, Path(job), Path(out), args.warmup_job, args.threads, args.measure)
        return
    if not Path(args.amd_python).exists():
        raise SystemExit(f"no amd-quark python at {args.amd_python}; see this script's docstring")
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warmup = Path(tmp) / "warmup.pt"
        make_job(min(args.hidden), args.layers, 0, 2, args.tokens, 1, Path(tmp), warmup)
        print(
            "| hidden | params | AWQ s ours | amd-quark | ratio | quantize_model s ours | amd-quark | held-out logits MSE "
            "float / RTN / ours / amd-quark | perplexity float / RTN / ours / amd-quark | calib MSE RTN / ours / amd-quark |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for hidden in args.hidden:
            job = Path(tmp) / f"job{hidden}.pt"
            make_job(hidden, args.layers, args.train_steps, args.samples, args.tokens, args.eval, args.cache_dir, job)
            runs: dict[str, list[dict[str, Any]]] = {"ours": [], "amd": []}
            rtn = run_side(sys.executable, "rtn", job, Path(tmp) / "rtn.pt", None, args.threads, True)
            for r in range(args.repeats):  # interleaved: ours, amd, amd, ours, ...
                for side in ("ours", "amd") if r % 2 == 0 else ("amd", "ours"):
                    python = sys.executable if side == "ours" else args.amd_python
                    runs[side].append(
                        run_side(python, side, job, Path(tmp) / f"{side}.pt", warmup, args.threads, r == 0)
                    )
            ours, amd = runs["ours"][0], runs["amd"][0]
            med = {s: {k: statistics.median(x[k] for x in runs[s]) for k in ("awq_s", "total_s")} for s in runs}
            params = sum(t.numel() for t in torch.load(job, weights_only=True)["state"].values())
            ratio = med["ours"]["awq_s"] / med["amd"]["awq_s"]
            row = {
                "hidden": hidden,
                "params_m": params / 1e6,
                "ours_awq_s": med["ours"]["awq_s"],
                "amd_awq_s": med["amd"]["awq_s"],
                "ratio": ratio,
                "ours_total_s": med["ours"]["total_s"],
                "amd_total_s": med["amd"]["total_s"],
                "mse_rtn": rtn["mse"],
                "mse_ours": ours["mse"],
                "mse_amd": amd["mse"],
                "ppl_float": ours["float_ppl"],
                "ppl_rtn": rtn["ppl"],
                "ppl_ours": ours["ppl"],
                "ppl_amd": amd["ppl"],
                "calib_rtn": rtn["calib_mse"],
                "calib_ours": ours["calib_mse"],
                "calib_amd": amd["calib_mse"],
                "ours_awq_runs": [x["awq_s"] for x in runs["ours"]],
                "amd_awq_runs": [x["awq_s"] for x in runs["amd"]],
            }
            rows.append(row)
            print(
                f"| {hidden} | {params / 1e6:.1f}M | {row['ours_awq_s']:.2f} | {row['amd_awq_s']:.2f} | {ratio:.2f} | "
                f"{row['ours_total_s']:.2f} | {row['amd_total_s']:.2f} | 0 / {rtn['mse']:.3e} / {ours['mse']:.3e} / "
                f"{amd['mse']:.3e} | {ours['float_ppl']:.3f} / {rtn['ppl']:.3f} / {ours['ppl']:.3f} / {amd['ppl']:.3f} | "
                f"{rtn['calib_mse']:.3e} / {ours['calib_mse']:.3e} / {amd['calib_mse']:.3e} |",
                flush=True,
            )
        print(
            f"\n{args.layers} decoder layers, {args.train_steps} training steps; {args.samples} x {args.tokens} calibration "
            f"tokens, {args.eval} x {args.tokens} held-out; {ours['threads']} torch threads per side; median of "
            f"{args.repeats} interleaved runs after a warm-up; python {sys.version.split()[0]}, torch {torch.__version__}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
