"""Streamed PTQ against the in-memory path: peak memory, wall time and bit equality, in one run.

A random ``LlamaForCausalLM`` checkpoint (float32; by default 12 decoder layers, hidden 2048, intermediate 5632,
16 heads with 4 KV heads, vocabulary 8000: about 2.3 GB) is written under /tmp as a sharded Hugging Face checkpoint,
layer by layer (two shards per decoder layer, so every layer is read from two files; the generator holds one layer at
a time). It is quantized weight-only with GPTQ (uint4, groups of 128 along the input features, asymmetric, min-max;
``lm_head`` included) on random token ids, twice, each in its own process:

- in memory: ``from_pretrained``, ``ModelQuantizer(config).quantize_model(model, batches)``, ``export_quark_dir``;
- streamed: ``quark.torch.streaming.stream_quantize(checkpoint, config, batches, out)``.

Each process reports its wall time (from before loading to the written directory) and its peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``); a third process that only imports torch gives the baseline. Printed:
streamed peak above the baseline / the model's float size (target <= 1/3), streamed time / in-memory time (target
<= 1.2), and whether every tensor of the two export directories is equal bit for bit (dtype, shape, bytes) and their
config.json documents equal. Everything written under /tmp is removed at the end.

    python bench/stream_ptq.py                      # the measurement above (about 10 minutes on 2 cores)
    python bench/stream_ptq.py --layers 2 --hidden 256 --intermediate 704 --vocab 1000   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

WEIGHT = {
    "dtype": "uint4",
    "qscheme": "per_group",
    "group_size": 128,
    "ch_axis": 1,
    "symmetric": False,
    "observer_cls": "PerGroupMinMaxObserver",
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
CONFIG = {
    "global_quant_config": {"weight": WEIGHT},
    "algo_config": {"name": "gptq", "damp_percent": 0.01, "desc_act": True, "static_groups": True},
}


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    """The transformers.LlamaConfig fields of the model."""
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 128,
        "num_key_value_heads": max(1, args.hidden // 512),
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def write_random_llama(path: Path, fields: dict[str, Any], seed: int = 0) -> int:
    """A random LLaMA checkpoint in ``path``, written module by module (never the whole model in memory): config.json,
    shards and model.safetensors.index.json. Returns the float size in bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    path.mkdir(parents=True)
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    h, inter, heads, kv = (
        fields[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    kv_dim = h // heads * kv

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(h, generator=g)

    size = 0
    weight_map: dict[str, str] = {}
    total = 2 + 2 * fields["num_hidden_layers"]
    shard = 0

    def write(tensors: dict[str, torch.Tensor]) -> None:
        nonlocal shard, size
        shard += 1
        file = f"model-{shard:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = file
            size += v.numel() * v.element_size()

    write({"model.embed_tokens.weight": rand(fields["vocab_size"], h)})
    for i in range(fields["num_hidden_layers"]):
        p = f"model.layers.{i}."
        write(
            {
                p + "input_layernorm.weight": norm(),
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv_dim, h),
                p + "self_attn.v_proj.weight": rand(kv_dim, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "post_attention_layernorm.weight": norm(),
            }
        )
        write(
            {
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
            }
        )
    write({"model.norm.weight": norm(), "lm_head.weight": rand(fields["vocab_size"], h)})
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return size


def batches(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Random token ids, one sample per batch."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, args.vocab, (1, args.tokens), generator=g)} for _ in range(args.batches)]


def warm_up() -> None:
    """The same untimed work in both measured processes first: transformers' lazy LLaMA modules imported, torch's
    kernels run once (GPTQ of a 1-layer model of 64 features)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quark.torch import ModelQuantizer

    tiny = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(tiny).eval()
    ModelQuantizer(CONFIG).quantize_model(model, [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}])


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def role_main(role: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measured process: ``baseline`` (import torch), ``memory`` or ``stream``."""
    import torch

    torch.set_num_threads(args.threads)
    if role == "baseline":
        return {"peak": peak_rss_bytes()}
    import warnings

    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM

    from quark.torch import ModelQuantizer
    from quark.torch.export.quark_format import export_quark_dir
    from quark.torch.streaming import stream_quantize

    warm_up()
    data = batches(args)
    start = time.perf_counter()
    if role == "memory":
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        ModelQuantizer(CONFIG).quantize_model(model, data)
        export_quark_dir(model, args.out)
    else:
        stream_quantize(args.checkpoint, CONFIG, data, args.out)
    return {"seconds": time.perf_counter() - start, "peak": peak_rss_bytes()}


def run_role(role: str, args: argparse.Namespace, out: Path | None = None) -> dict[str, Any]:
    """``role_main`` in a fresh process (one at a time: the in-memory one holds the whole model)."""
    cmd = [sys.executable, __file__, "--role", role, "--checkpoint", str(args.checkpoint), "--out", str(out or "")]
    cmd += ["--vocab", str(args.vocab), "--tokens", str(args.tokens), "--batches", str(args.batches)]
    cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(a: Path, b: Path) -> tuple[int, list[str]]:
    """(tensor count, keys that differ or are missing on one side) of two export directories, read one tensor at a
    time; config.json compared as documents."""
    import torch
    from safetensors import safe_open

    def where(root: Path) -> dict[str, Path]:
        return {k: f for f in sorted(root.glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}  # noqa: SIM118

    left, right = where(a), where(b)
    bad = sorted(set(left) ^ set(right))
    for key in sorted(set(left) & set(right)):
        x = safe_open(str(left[key]), "pt").get_tensor(key)
        y = safe_open(str(right[key]), "pt").get_tensor(key)
        same = x.dtype == y.dtype and x.shape == y.shape
        if not (same and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))):
            bad.append(key)
    if json.loads((a / "config.json").read_text()) != json.loads((b / "config.json").read_text()):
        bad.append("config.json")
    return len(left), bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--role", choices=["baseline", "memory", "stream"], help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        print(json.dumps(role_main(args.role, args)))
        return
    work = Path(tempfile.mkdtemp(prefix="stream_ptq.", dir="/tmp"))
    try:
        args.checkpoint = work / "checkpoint"
        size = write_random_llama(args.checkpoint, llama_config(args))
        print(
            f"machine: 2 shared CPU cores, {args.threads} torch thread(s); random LLaMA, {args.layers} decoder layers, "
            f"hidden {args.hidden}, {size / 1e9:.2f} GB float32 in {len(list(args.checkpoint.glob('*.safetensors')))} "
            f"shards; GPTQ uint4 g128, {args.batches} x {args.tokens} tokens"
        )
        base = run_role("baseline", args)
        memory = run_role("memory", args, work / "memory")
        stream = run_role("stream", args, work / "stream")
        count, bad = compare(work / "memory", work / "stream")
        above = stream["peak"] - base["peak"]
        print(f"bare `import torch` peak RSS        {base['peak'] / 1e6:9.1f} MB")
        print(f"in memory: {memory['seconds']:7.1f} s, peak RSS {memory['peak'] / 1e6:9.1f} MB")
        print(f"streamed:  {stream['seconds']:7.1f} s, peak RSS {stream['peak'] / 1e6:9.1f} MB")
        print(f"streamed peak above bare torch / model float size: {above / size:.3f} (target <= 0.333)")
        print(
            f"streamed time / in-memory time:                    {stream['seconds'] / memory['seconds']:.3f} (target <= 1.2)"
        )
        print(f"bit-identical: {not bad} ({count} tensors compared{'' if not bad else f'; differ: {bad[:5]}'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
