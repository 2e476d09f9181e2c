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

from quark_lightning.train import main

if __name__ == "__main__":
    main()
