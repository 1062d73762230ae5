# Shared by scripts/start.sh and scripts/test.sh: make (or reuse) a virtual environment
# and install torch first, then the project. Sourced, not run.
#   VENV=path        where the environment lives (default: .venv in the repository)
#   TORCH_SPEC=...   the torch requirement (default torch==2.13.0; a bare "torch" on a
#                    machine without it pulls a multi-GB CUDA build, so it is pinned)
#   NO_VENV=1        install into the current Python instead
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ "${NO_VENV:-0}" != "1" ]; then
    VENV="${VENV:-$ROOT/.venv}"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "==> creating virtual environment $VENV"
        "$PY" -m venv "$VENV"
    fi
    PY="$VENV/bin/python"
    export PATH="$VENV/bin:$PATH"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "==> installing $TORCH_SPEC (first, so nothing else pulls a CUDA build)"
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
echo "==> installing density-workbench ${EXTRAS:-} (compiles the C++ kernels)"
"$PY" -m pip install -q -e ".${EXTRAS:-}"
