#!/usr/bin/env bash
# Installs the project with its dev tools into .venv and runs the checks and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" > .venv/install.log 2>&1; then
  cat .venv/install.log >&2
  exit 1
fi
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
