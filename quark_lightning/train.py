"""The ``quark-lightning`` command (and ``python train.py``): train, quantize, evaluate and report, composed by Hydra
from conf/ (see train.py for examples; any ``python train.py ...`` line works as ``quark-lightning ...``)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from quark_lightning.app.conf import CONF_DIR, ConfigError, check_overrides, register_role_groups
from quark_lightning.app.search import check_search_args, objective_values, register_search
from quark_lightning.app.workers import check_launcher_args

register_role_groups()
register_search()  # hparams_search=optuna_bits: the resolver of its directions, the sampler uniform_first


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def run_config(cfg: DictConfig) -> float | list[float] | None:
    """Run one composed config; returns the quantized (else float) headline metric, for sweepers that optimise it
    (with hparams_search: one value per ``hparams_search.objectives``, e.g. [metric, model bits])."""
    from quark.torch.cpu_allocator import keep_freed_memory
    from quark_lightning.app.run import run  # imported here: `python train.py --help` stays fast

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


def main() -> None:
    """Check the command line (a mistake: one ``error:`` line, no traceback), then run Hydra's main."""
    problem = check_overrides(sys.argv[1:]) or check_search_args(sys.argv[1:]) or check_launcher_args(sys.argv[1:])
    if problem:
        sys.exit(f"error: {problem}")
    run_config()


if __name__ == "__main__":
    main()
