"""Train, quantize, evaluate and report, composed by Hydra from conf/.

    python train.py                                     # digits CNN, W8A8 int8 PTQ (under a minute on 2 cores)
    python train.py quant=w4a8_tqt                      # QAT with TQT learned thresholds
    python train.py quant=int4_per_group quant/weight=int4_per_channel_sym trainer.max_epochs=4
    python train.py ckpt_path=outputs/.../checkpoints/float-epoch11.ckpt quant=fp8_e4m3   # PTQ, no retraining
    python train.py -m quant=int8_per_channel,w4a8_tqt quant.weight_bits=2,3,4,6,8         # sweep + summary.png
    python train.py hparams_search=optuna_bits ckpt_path=...float-epoch11.ckpt    # per-layer bits search + pareto.png
    python train.py quant=mixed_auto quant.target_bits=3   # per-layer formats from the sensitivity, within 3 bits
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
from app.search import check_search_args, objective_values, register_search

register_role_groups()
register_search()  # hparams_search=optuna_bits: the resolver of its directions, the sampler uniform_first


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | list[float] | None:
    """Run one composed config; returns the quantized (else float) headline metric, for sweepers that optimise it
    (with hparams_search: one value per ``hparams_search.objectives``, e.g. [metric, model bits])."""
    from app.run import run  # imported here: `python train.py --help` stays fast
    from quark.torch.cpu_allocator import keep_freed_memory

    keep_freed_memory()  # eager fake quantization allocates full-size temporaries: reuse them (glibc)

    try:
        results = run(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as err:  # found before any training: the message says it all, no traceback
        if cfg.get("hparams_search"):
            raise  # a search records the trial as failed and goes on (SystemExit would end the whole sweep)
        sys.exit(f"error: {err}")
    if cfg.get("hparams_search"):
        return objective_values(results, list(cfg.hparams_search.objectives))
    metric = results["metric"]
    return metric["quantized"] if metric["quantized"] is not None else metric["float"]


if __name__ == "__main__":
    problem = check_overrides(sys.argv[1:]) or check_search_args(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    main()
