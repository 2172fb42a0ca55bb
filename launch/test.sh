#!/usr/bin/env bash
# The test command (README): lint, then the whole test suite. Run `bash launch/setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
.venv/bin/ruff check pipeline launch tests benchmarks
.venv/bin/python -m pytest -q "$@"
