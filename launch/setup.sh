#!/usr/bin/env bash
# Create .venv/ and install the project with its test tools. Idempotent; safe to rerun.
#   bash launch/setup.sh                           # CPU machine: torch 2.13.0 as pinned, faiss-cpu
#   TORCH_CUDA=cu128 EXTRA=gpu bash launch/setup.sh  # GPU cluster: torch 2.13.0+cu128, faiss-gpu
#   DRY_RUN=1 TORCH_CUDA=cu126 bash launch/setup.sh  # print the commands, install nothing
#
# Environment:
#   EXTRA            cpu (default) or gpu: which faiss build (faiss-cpu, or Meta's faiss-gpu wheel,
#                    which needs the CUDA 12.6+ runtime and a driver for it; pyproject.toml says more).
#   TORCH_CUDA       the torch build for the cluster's CUDA driver: cu126, cu128, cu129, cu130 or cpu,
#                    installed from the PyTorch wheel index https://download.pytorch.org/whl/$TORCH_CUDA
#                    as torch==2.13.0+$TORCH_CUDA. Pick the newest CUDA your driver supports
#                    (`nvidia-smi` prints "CUDA Version: X.Y": the newest it runs). Unset: plain
#                    torch==2.13.0, which is the CPU build on our machines (a local wheel) but from PyPI
#                    on a Linux GPU host the CUDA 13.0 build, which needs a driver >= 580.
#   TORCH_INDEX_URL  another index for torch (a mirror of the PyTorch index); with TORCH_CUDA the
#                    version is pinned to +$TORCH_CUDA there too.
#   PYTHON           the interpreter for the venv (default python3).
#   CONSTRAINTS      the lock file every install is constrained by (default launch/constraints.txt: the
#                    exact versions CI and the README's figures were measured with); CONSTRAINTS= (empty)
#                    installs the newest releases pyproject.toml's ranges allow instead.
#   DRY_RUN=1        print each command instead of running it.
# With TORCH_CUDA, faiss-gpu's CUDA 12 runtime libraries are the ones cu126..cu129 torch already
# uses; with cu130 pip installs the CUDA 12 ones beside torch's CUDA 13 ones (both load under one
# driver >= 580). `python -m pipeline doctor` checks the result on the GPU node.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${EXTRA:-cpu}
TORCH_VERSION=2.13.0
TORCH_CUDA=${TORCH_CUDA:-}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
DRY_RUN=${DRY_RUN:-0}
CONSTRAINTS=${CONSTRAINTS-launch/constraints.txt}

die() { echo "setup.sh: error: $*" >&2; exit 2; }
case "$EXTRA" in cpu | gpu) ;; *) die "EXTRA=$EXTRA: use EXTRA=cpu or EXTRA=gpu" ;; esac
case "$TORCH_CUDA" in
    "" | cpu | cu126 | cu128 | cu129 | cu130) ;;
    *) die "TORCH_CUDA=$TORCH_CUDA: use cu126, cu128, cu129, cu130 or cpu (the newest your driver runs), or TORCH_INDEX_URL" ;;
esac
case "$DRY_RUN" in 0 | 1) ;; *) die "DRY_RUN=$DRY_RUN: use DRY_RUN=1 or leave it unset" ;; esac
LOCK=()
if [ -n "$CONSTRAINTS" ]; then
    [ -f "$CONSTRAINTS" ] || die "CONSTRAINTS=$CONSTRAINTS: no such file (CONSTRAINTS= installs unpinned)"
    LOCK=(-c "$CONSTRAINTS")
fi

run() {
    if [ "$DRY_RUN" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

# torch first, pinned: an unpinned or newer torch pulls a multi-GB CUDA build.
TORCH_ARGS=("${LOCK[@]}" "torch==$TORCH_VERSION")
if [ -n "$TORCH_CUDA" ]; then
    TORCH_ARGS=(--index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/$TORCH_CUDA}"
        "torch==$TORCH_VERSION+$TORCH_CUDA")
elif [ -n "$TORCH_INDEX_URL" ]; then
    TORCH_ARGS=(--index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION")
fi
if [ "$EXTRA" = gpu ] && [ -z "$TORCH_CUDA$TORCH_INDEX_URL" ]; then
    echo "setup.sh: note: EXTRA=gpu without TORCH_CUDA: torch is the default build (see the header)" >&2
fi

[ -x .venv/bin/python ] || run "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
run "${PIP[@]}" "${TORCH_ARGS[@]}"
# DeepSpeed's sdist imports torch in its build: build it against the torch installed above.
if [ "$DRY_RUN" = 1 ] || ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
    run "${PIP[@]}" "${LOCK[@]}" --no-build-isolation "deepspeed>=0.17"
fi
# One faiss in the venv: faiss-cpu and faiss-gpu install the same `faiss` package.
OTHER_FAISS=(faiss-gpu faiss-gpu-cu12)
[ "$EXTRA" = gpu ] && OTHER_FAISS=(faiss-cpu faiss-gpu-cu12)
for other in "${OTHER_FAISS[@]}"; do
    if [ "$DRY_RUN" = 0 ] && .venv/bin/python -m pip show --quiet "$other" >/dev/null 2>&1; then
        run .venv/bin/python -m pip uninstall --quiet --yes "$other"
    fi
done
run "${PIP[@]}" "${LOCK[@]}" -e ".[${EXTRA},test]"

if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: nothing installed"
    exit 0
fi
if [ -n "$TORCH_CUDA" ] && [ "$TORCH_CUDA" != cpu ]; then
    want="${TORCH_CUDA:2:2}.${TORCH_CUDA:4}"  # cu128 -> 12.8
    got=$(.venv/bin/python -c 'import torch; print(torch.version.cuda)')
    [ "$got" = "$want" ] || die "TORCH_CUDA=$TORCH_CUDA but the installed torch is built for CUDA $got: rerun, or remove .venv/"
fi
echo "setup done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "CUDA build", torch.version.cuda, "transformers", transformers.__version__)')"
