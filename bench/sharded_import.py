"""Importing a sharded amd-quark export directory against the single-file export of the same model: peak memory
and wall time, in one run (machine: 2 shared CPU cores).

A random ``LlamaForCausalLM`` (float32; by default 8 decoder layers, hidden 1024, intermediate 2816, 16 heads with 4
KV heads, vocabulary 8000: about 0.43 GB) is saved under /tmp and quantized weight-only (int8 per channel, RTN,
``lm_head`` included) by ``quark.torch.streaming.stream_quantize`` twice: into shards of 16 MiB (with
``model.safetensors.index.json``) and into one ``model.safetensors``. Each directory is then imported in its own
process by ``import_quark_dir(hf_skeleton(dir), dir)``; each process reports its peak resident memory
(``ru_maxrss``) above a baseline process that builds the same skeleton without importing, its wall time, and a hash
of the logits on fixed token ids; a third import of the single file reads every tensor up front (as the importer did
before it read tensors on lookup). Printed: each import's peak above the baseline, the sharded / single ratio of peaks
and of times, the on-lookup / up-front ratio, the export's size, and whether the imports' logits are equal bit for
bit. Everything written under
/tmp is removed at the end.

    PYTHONPATH=$PWD python bench/sharded_import.py
    PYTHONPATH=$PWD python bench/sharded_import.py --layers 2 --hidden 256 --intermediate 704   # a quick check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORK = Path(tempfile.gettempdir()) / f"sharded-import-bench.{os.getpid()}"
CONFIG = {
    "global_quant_config": {
        "weight": {
            "dtype": "int8",
            "qscheme": "per_channel",
            "ch_axis": 0,
            "observer_cls": "PerChannelMinMaxObserver",
            "symmetric": True,
            "scale_type": "float",
            "round_method": "half_even",
            "is_dynamic": False,
        }
    }
}


def child(mode: str, path: Path) -> None:
    """Import ``path`` (``mode == "eager"``: with every tensor read up front, as the import did before tensors were
    read on lookup; ``"baseline"``: only build the skeleton and give it storage); print JSON."""
    import torch

    from quark.torch.export import quark_format
    from quark.torch.export.quark_format import import_quark_dir
    from quark.torch.export.skeleton import hf_skeleton

    if mode == "eager":
        lazy = quark_format.read_weights
        quark_format.read_weights = lambda root: dict(lazy(root))  # type: ignore[assignment]

    start = time.perf_counter()
    model = hf_skeleton(path, attn_implementation="sdpa")
    if mode == "baseline":
        model.to_empty(device="cpu")
        digest = ""
    else:
        model = import_quark_dir(model, path)
        ids = torch.arange(32).reshape(2, 16) % model.config.vocab_size
        with torch.no_grad():
            digest = hashlib.sha256(model(input_ids=ids).logits.numpy().tobytes()).hexdigest()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "seconds": seconds, "digest": digest}))


MODES = {
    ("import", "sharded"): "sharded import (tensors read on lookup)",
    ("import", "single"): "single-file import (tensors read on lookup)",
    ("eager", "single"): "single-file import, every tensor read up front (the import before)",
}


def run_child(mode: str, which: str) -> dict[str, Any]:
    path = WORK / which
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--shard-mib", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    WORK.mkdir()
    import torch
    import transformers

    from quark.torch.streaming import stream_quantize

    work = WORK
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=128,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(work / "ckpt")
        sharded = stream_quantize(work / "ckpt", CONFIG, None, work / "sharded", max_shard_bytes=args.shard_mib << 20)
        single = stream_quantize(work / "ckpt", CONFIG, None, work / "single", max_shard_bytes=1 << 40)
        shards = len(list(sharded.glob("model-*.safetensors")))
        size = sum(f.stat().st_size for f in single.glob("*.safetensors"))
        runs = {m: [run_child(*m) for _ in range(args.repeat)] for m in MODES}  # type: ignore[misc]
        runs[("baseline", "single")] = [run_child("baseline", single) for _ in range(args.repeat)]
        base = statistics.median(r["peak"] for r in runs[("baseline", "single")])
        print(f"machine: 2 shared CPU cores (no GPU); one process per import; median of {args.repeat} runs [min, max]")
        print(
            f"export: {size / 2**20:.1f} MiB of safetensors; sharded into {shards} files (closed at {args.shard_mib} MiB)"
        )
        print(f"baseline (skeleton given storage, no import): peak {base / 2**20:.0f} MiB")
        over: dict[str, float] = {}
        for (mode, which), results in runs.items():
            if mode == "baseline":
                continue
            peaks = sorted((r["peak"] - base) / 2**20 for r in results)
            secs = statistics.median(r["seconds"] for r in results)
            over[f"{mode}/{which}"] = statistics.median(peaks)
            print(
                f"{MODES[(mode, which)]}: peak +{over[f'{mode}/{which}']:.0f} MiB [{peaks[0]:.0f}, {peaks[-1]:.0f}], {secs:.2f} s"
            )
        print(
            f"ratio sharded/single (both on lookup): peak above baseline {over['import/sharded'] / over['import/single']:.2f}"
        )
        print(
            f"ratio on lookup/up front (single file): peak above baseline {over['import/single'] / over['eager/single']:.2f}"
        )
        digests = {r["digest"] for m, results in runs.items() if m[0] != "baseline" for r in results}
        print(f"logits bit for bit equal across all imports: {len(digests) == 1}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
