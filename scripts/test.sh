#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks CI runs: ruff, the layer contracts (lint-imports, configured in
# pyproject.toml), then the fast test suite (pytest -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
"$VENV/bin/python" -m pytest -m "not slow" -q "$@"
