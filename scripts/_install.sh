# Shared by scripts/start.sh and scripts/test.sh: make (or reuse) a virtual environment
# and install torch first, then the project. Sourced, not run.
#   VENV=path        where the environment lives (default: .venv in the repository)
#   TORCH_SPEC=...   the torch requirement (default torch==2.13.0; a bare "torch" on a
#                    machine without it pulls a multi-GB CUDA build, so it is pinned)
#   TRITON_SPEC=...  installed with torch, or alone where torch is present without Triton;
#                    scripts/test.sh sets triton==3.7.1 (what torch 2.13's Linux GPU build
#                    requires, so the interpreter in CI runs the Triton GPU users run). An
#                    existing Triton (brought by a GPU build of torch) is left alone.
#   NO_VENV=1        install into the current Python instead
# The project is installed editable and without build isolation, its C++ built by CMake + ninja in
# build/<cache tag> (build/cpython-311), a folder that persists: a later install (new extras, an
# edited source) recompiles only what changed, and scripts/build.sh builds in the same folder.
# A second run with nothing changed skips pip (scripts/_install_stamp.sh).
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
TRITON_SPEC="${TRITON_SPEC:-}"
if [ "$(uname -s)" != "Linux" ]; then
    TRITON_SPEC=""   # Triton ships Linux wheels only
fi
source "$ROOT/scripts/_install_stamp.sh"
STAMP="$(stamp_path)"
HASH="$(source_hash)"
if install_is_current "$STAMP" "$HASH"; then
    echo "==> density-workbench${EXTRAS:-} is installed and its sources are unchanged (delete $STAMP to reinstall)"
    return 0
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "==> installing $TORCH_SPEC $TRITON_SPEC (first, so nothing else pulls a CUDA build)"
    # shellcheck disable=SC2086  # TRITON_SPEC may be empty
    "$PY" -m pip install -q "$TORCH_SPEC" $TRITON_SPEC
elif [ -n "$TRITON_SPEC" ] && ! "$PY" -c "import triton" >/dev/null 2>&1; then
    echo "==> installing $TRITON_SPEC (for the Triton interpreter)"
    "$PY" -m pip install -q "$TRITON_SPEC"
fi
# The build requirements go into the environment (its nanobind and cmake paths then stay the same from
# one install to the next, so the build folder's objects stay valid), then whatever the backend asks
# for beyond them (cmake or ninja, where none recent enough is on PATH).
echo "==> installing the build requirements"
read -r -a build_requires <<<"$("$PY" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])')"
"$PY" -m pip install -q "${build_requires[@]}"
read -r -a backend_needs <<<"$("$PY" -c 'from scikit_build_core.build import get_requires_for_build_editable as r; print(*r())')"
if [ "${#backend_needs[@]}" -gt 0 ]; then
    "$PY" -m pip install -q "${backend_needs[@]}"
fi
echo "==> installing density-workbench ${EXTRAS:-} (compiles the C++ kernels that changed)"
"$PY" -m pip install -q --no-build-isolation -e ".${EXTRAS:-}" -Cbuild-dir="build/{cache_tag}"
record_install "$STAMP" "$HASH"
