#!/usr/bin/env bash
# Create the virtual environment $VENV (default .venv) if it is missing and install the project into it:
# torch pinned to 2.13.0 (the CPU build here; any other spec may pull a multi-GB CUDA build), then this project
# with its dev (tests, lint), export (safetensors, onnx), brevitas, hf (transformers, for Hugging Face models and
# amd-quark's HF-style export directories), search (Hydra's Optuna sweeper: hparams_search=optuna_bits) and docs
# (MkDocs, Material, mkdocstrings: the documentation site) extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
"$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet -e ".[dev,export,brevitas,hf,search,docs]"
