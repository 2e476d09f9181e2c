"""Train, quantize, evaluate and report, composed by Hydra from conf/.

    python train.py                                     # digits CNN, W8A8 int8 PTQ (under a minute on 2 cores)
    python train.py quant=w4a8_tqt                      # QAT with TQT learned thresholds
    python train.py quant=int4_per_group quant/weight=int4_per_channel_sym trainer.max_epochs=4
    python train.py ckpt_path=outputs/.../checkpoints/float-epoch11.ckpt quant=fp8_e4m3   # PTQ, no retraining
    python train.py -m quant=int8_per_channel,w4a8_tqt quant.weight_bits=2,3,4,6,8         # sweep + summary.png
    python train.py experiment=char_lm quant=int4_per_group   # byte-level LM on Python source (perplexity)
    python train.py experiment=hf_lm quant=w4_gptq export=[quark]   # HF LLaMA; amd-quark HF directory in export/quark

Writes results.json (metrics, per-layer SQNR, sizes, wall time, the resolved config), checkpoints and logs in the
Hydra run directory (``hydra.run.dir=...``; ``hydra.sweep.dir=...`` for -m).
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from app.conf import ConfigError, check_overrides, register_role_groups

register_role_groups()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Run one composed config; returns the quantized (else float) headline metric, for sweepers that optimise it."""
    from app.run import run  # imported here: `python train.py --help` stays fast
    from quark.torch.cpu_allocator import keep_freed_memory

    keep_freed_memory()  # eager fake quantization allocates full-size temporaries: reuse them (glibc)

    try:
        results = run(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as err:  # found before any training: the message says it all, no traceback
        sys.exit(f"error: {err}")
    metric = results["metric"]
    return metric["quantized"] if metric["quantized"] is not None else metric["float"]


if __name__ == "__main__":
    problem = check_overrides(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    main()
