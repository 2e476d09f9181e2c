#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: python train.py [Hydra overrides...]
# e.g. bash scripts/run.sh quant=w4a8_tqt
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
"$VENV/bin/python" train.py "$@"
