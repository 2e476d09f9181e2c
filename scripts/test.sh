#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks CI runs: the documentation site built with warnings as errors
# (mkdocs build --strict, into a temporary folder), ruff (lint, and the formatter in check mode), the layer contracts (lint-imports, configured in
# pyproject.toml), then the fast test suite (pytest -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
# (not --quiet: it hides warnings from --strict, which then passes a broken link; the log is shown when it fails)
if ! log="$(NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --site-dir "$SITE" 2>&1)"; then
    echo "$log" >&2
    exit 1
fi
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/lint-imports"
"$VENV/bin/python" -m pytest -m "not slow" -q "$@"
