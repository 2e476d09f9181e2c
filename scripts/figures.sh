#!/usr/bin/env bash
# The commands behind every figure and table quoted in README.md and docs/ (docs/figures.md lists them by page).
#   bash scripts/figures.sh             list them: page, expected time on this project's 2-core CPU machine, command
#   bash scripts/figures.sh quick       run the quick tier (seconds to a few minutes): the README's table and facts
#   bash scripts/figures.sh all         run everything, in order (float checkpoints first; about 3 hours on 2 cores)
# Runs write under runs/ (float checkpoints, sweeps) and print the tables; the PNGs land in runs/ and are copied to
# docs/ by the lines that say so. Figures vary with the thread count and the machine: compare like with like.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
CKPT_CNN=runs/cnn_float/checkpoints/float-epoch11.ckpt
CKPT_LM=runs/lm_float/checkpoints/float-epoch1.ckpt

# tier | page | expected time | command
FIGURES=(
  "quick|README, getting-started|15 s|/usr/bin/time -v $PY train.py hydra.run.dir=runs/default 2>&1 | grep -E '^\\||wall time|Maximum resident'"
  "quick|README, getting-started|15 s|OMP_NUM_THREADS=1 $PY train.py hydra.run.dir=runs/default_1thread | grep -E '^\\|'"
  "quick|getting-started|10 s|$PY -m pytest --collect-only -q -m 'not slow' | tail -1"
  "quick|README, getting-started|1 s|du -sh $VENV"
  "quick|amd-quark|15 s|$PY -m bench.mx_scale_modes"
  "full|hydra-app (Fashion-MNIST sweep, fashion_sweep.png)|20 min|$PY train.py data=fashion_mnist model.width=16 trainer.max_epochs=4 quant=none hydra.run.dir=runs/fashion_float && $PY train.py -m data=fashion_mnist model.width=16 ckpt_path=runs/fashion_float/checkpoints/float-epoch3.ckpt quant=int8_per_channel,int8_per_tensor,w4a8_tqt quant.weight_bits=2,3,4,6,8 quant.qat_epochs=2 hydra.sweep.dir=runs/fashion_sweep && cp runs/fashion_sweep/summary.png docs/fashion_sweep.png"
  "full|hydra-app, algorithms, mixed-precision (byte LM float)|3 min|$PY train.py experiment=char_lm quant=none hydra.run.dir=runs/lm_float"
  "full|hydra-app (byte LM sweep)|3 min|$PY train.py -m experiment=char_lm ckpt_path=$CKPT_LM quant=int4_per_group,int8_per_channel quant.weight_bits=2,3,4,6,8 hydra.sweep.dir=runs/lm_sweep"
  "full|hydra-app (hf_lm float)|3 min|OMP_NUM_THREADS=1 $PY train.py experiment=hf_lm quant=none hydra.run.dir=runs/hf_float"
  "full|hydra-app (hf_lm presets)|10 min|for q in int8_per_channel w8a8 w8a8_smoothquant w4_rtn w4_gptq w4_awq w3_rtn w3_gptq w3_awq w4a8_tqt int8_graph w4a8_tqt_graph; do OMP_NUM_THREADS=1 $PY train.py experiment=hf_lm quant=\$q ckpt_path=runs/hf_float/checkpoints/float-epoch1.ckpt hydra.run.dir=runs/hf_\$q; done"
  "full|lightning (QAT quality, digits)|1 min|$PY bench/qat_digits.py"
  "full|lightning (QAT quality, Fashion-MNIST)|6 min|$PY bench/qat_digits.py --data fashion"
  "full|quantize (PTQ quality)|1 min|$PY bench/ptq_digits.py"
  "full|graph-mode, lightning (quantizer_lr; needs the bench extra)|20 min|$PY -m bench.graph_mode"
  "full|mixed-precision (CNN float)|15 s|$PY train.py quant=none hydra.run.dir=runs/cnn_float"
  "full|mixed-precision (mixed vs uniform)|2 min|$PY train.py quant=mixed_auto quant.target_bits=3 ckpt_path=$CKPT_CNN && $PY train.py quant=int8_per_channel '~quant/input_tensors' quant.weight_bits=3 ckpt_path=$CKPT_CNN"
  "full|mixed-precision (byte LM, KL sensitivity)|10 min|$PY train.py experiment=char_lm quant=mixed_auto quant.target_bits=3.5 ckpt_path=$CKPT_LM"
  "full|mixed-precision (optuna_bits_cnn.png)|2 min|$PY train.py hparams_search=optuna_bits ckpt_path=$CKPT_CNN hydra.sweep.dir=runs/cnn_bits && cp runs/cnn_bits/pareto.png docs/optuna_bits_cnn.png"
  "full|mixed-precision (optuna_bits_lm.png)|11 min|$PY train.py experiment=char_lm quant=int4_per_group hparams_search=optuna_bits_lm ckpt_path=$CKPT_LM hydra.sweep.dir=runs/lm_bits && cp runs/lm_bits/pareto.png docs/optuna_bits_lm.png"
  "full|algorithms (GPTQ/AWQ/SmoothQuant on the byte LM)|3 min|$PY bench/algorithms.py --ckpt $CKPT_LM"
  "full|performance (fake quantization, float32)|3 min|$PY bench/fake_quant.py --repeats 9"
  "full|performance (fake quantization, bfloat16)|3 min|$PY bench/fake_quant.py --dtype bfloat16 --repeats 7"
  "full|performance (calibration)|2 min|$PY bench/calibration.py"
  "full|performance (QAT step, MLP / LLaMA block / CNN)|15 min|for m in mlp llama cnn; do $PY bench/qat_overhead.py --model \$m; done"
  "full|performance (qat_overhead_width.png)|10 min|$PY bench/qat_overhead.py --widths 256,512,1024,2048,4096 --rounds 11 --plot docs/qat_overhead_width.png"
  "full|performance (attention and LSTM)|2 min|$PY bench/attention_rnn.py"
  "full|performance (QAT under Trainer.fit, with the bounds and peers)|35 min|$PY bench/qat_lightning.py --widths 256,512,1024,2048,4096 --rounds 5"
  "full|performance (QAT under the user's torch.compile, with the bounds)|16 min|$PY bench/qat_compiled.py --bounds"
  "full|performance (the observing pass's skipped backward, paired)|6 min|$PY bench/observing_backward.py --widths 512,1024,4096"
  "full|performance (the integer GEMM of int8 Linears, paired)|6 min|$PY bench/integer_linear.py --widths 512,1024,2048,4096"
)
# Not regenerated here: the GPTQ/AWQ speed tables against amd-quark (bench/gptq_speed.py, bench/awq_speed.py need
# amd-quark 0.13 in its own venv, see their docstrings) and the CUDA checks (an H100).

tier="${1:-list}"
for entry in "${FIGURES[@]}"; do
    IFS='|' read -r level page duration command <<<"$entry"
    if [ "$tier" = list ]; then
        printf '%-5s %-8s %s\n      %s\n' "$level" "$duration" "$page" "$command"
    elif [ "$tier" = all ] || [ "$tier" = "$level" ]; then
        echo "== $page ($duration): $command"
        bash -c "$command"
    fi
done
