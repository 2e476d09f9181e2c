"""Streamed PTQ holds one decoder layer, not the model: the peak resident memory of a process that streams a random
LLaMA checkpoint (16 decoder layers, ~0.75 GB of float32 weights, written layer by layer by ``bench/stream_ptq.py``'s
generator) stays below the model's size, above a process that imports the same libraries and quantizes nothing.
Each is measured in its own process (``ru_maxrss``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stream_ptq import CONFIG, write_random_llama

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[3]
FIELDS = {
    "vocab_size": 4000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SCRIPT = """
import json, resource, sys
import torch, transformers
from quark.torch.streaming import stream_quantize
torch.set_num_threads(2)
if sys.argv[1] == "stream":
    ids = [{"input_ids": torch.randint(0, 4000, (1, 64), generator=torch.Generator().manual_seed(i))} for i in range(2)]
    stream_quantize(sys.argv[2], json.loads(sys.argv[4]), ids, sys.argv[3])
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
"""


def peak(role: str, checkpoint: Path, out: Path, config: dict) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", SCRIPT, role, str(checkpoint), str(out), json.dumps(config)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=REPO)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("algorithm", ["rtn", "gptq"])
def test_streaming_peak_memory_is_below_the_models_size(tmp_path: Path, algorithm: str) -> None:
    size = write_random_llama(tmp_path / "ckpt", FIELDS)
    config = CONFIG if algorithm == "gptq" else {"global_quant_config": CONFIG["global_quant_config"]}
    base = peak("baseline", tmp_path / "ckpt", tmp_path / "unused", config)
    streamed = peak("stream", tmp_path / "ckpt", tmp_path / "out", config)
    assert (tmp_path / "out" / "config.json").is_file()
    assert streamed - base < size, f"streamed peak {streamed - base} bytes above the imports, model {size} bytes"
