#!/usr/bin/env bash
# Create .venv/ and install the project with its test tools. Idempotent; safe to rerun.
#   bash launch/setup.sh            # CPU machine: faiss-cpu
#   EXTRA=gpu bash launch/setup.sh  # GPU machine: faiss-gpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${EXTRA:-cpu}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: an unpinned or newer torch pulls a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
# DeepSpeed's sdist imports torch in its build: build it against the torch installed above.
.venv/bin/python -c "import deepspeed" 2>/dev/null || "${PIP[@]}" --no-build-isolation "deepspeed>=0.17"
"${PIP[@]}" -e ".[${EXTRA},test]"
echo "setup done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
