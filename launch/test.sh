#!/usr/bin/env bash
# The test command (README): lint, then the whole test suite. Run `bash launch/setup.sh` first.
# The SLURM tests need a local one-node cluster: started here when this machine allows it (root, or
# slurm-wlm and munge already installed); otherwise they skip with the reason (under CI=true they fail).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! bash launch/slurm/local_cluster.sh start >/tmp/local_cluster.log 2>&1; then
  echo "test.sh: no local SLURM cluster ($(tail -n 1 /tmp/local_cluster.log)); the SLURM tests will skip" >&2
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
.venv/bin/ruff check pipeline launch tests benchmarks
# Two worker processes (pytest-xdist), a test file's tests on one worker (module fixtures built once);
# TEST_WORKERS=1 runs them in this process, one after another. A worker that crashes (a signal, not a
# failed assert) ends the run naming the test it ran: pytest-xdist 3.8 hangs replacing a crashed worker
# under --dist loadfile.
WORKERS=${TEST_WORKERS:-2}
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile --max-worker-restart 0); fi
.venv/bin/python -m pytest -q "${PARALLEL[@]}" "$@"
