#!/usr/bin/env bash
# Build the C++ modules into the source tree (kernels/**/_*.so beside their sources), incrementally:
# ninja recompiles what an edit touched (the .cpp, or every .cpp that includes an edited header) and
# relinks the modules that use it, nothing else. The edit loop of a kernel developer, and the build of
# a machine that runs a checkout from PYTHONPATH without installing it (the GPU tier).
#
#   bash scripts/build.sh              # configure once, then build what changed
#   PYTHON=python3.12 bash scripts/build.sh
#
#   PYTHON=...      the Python the modules are built for (default: .venv's if there is one, else python3)
#   BUILD_DIR=...   the CMake build folder (default build/<cache tag>, e.g. build/cpython-311: the one
#                   scripts/_install.sh's editable install builds in, so each reuses the other's objects)
#   CMAKE_ARGS=...  extra configure options, e.g. -DKERNELS_OPENMP=OFF (the std::thread build)
#
# Needs a C++17 compiler, cmake >= 3.18 and nanobind (and ninja, else make). On a machine without
# cmake or ninja and without network, put their wheels in .whl/build/ (pip download cmake ninja) and
# they are installed from there into that Python first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-python3}"
BIN="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
export PATH="$PATH:$BIN"   # cmake/ninja installed as Python packages land there

cmake_ok() {  # cmake on PATH, version >= 3.18
    command -v cmake >/dev/null || return 1
    local v
    v="$(cmake --version | head -n 1 | grep -oE '[0-9]+\.[0-9]+' | head -n 1)"
    [ "${v%%.*}" -gt 3 ] || { [ "${v%%.*}" -eq 3 ] && [ "${v#*.}" -ge 18 ]; }
}
missing=()
cmake_ok || missing+=("cmake>=3.18")
command -v ninja >/dev/null || missing+=(ninja)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ -d .whl/build ]; then
        echo "==> installing ${missing[*]} from .whl/build"
        "$PY" -m pip install -q --no-index --find-links .whl/build "${missing[@]}"
    elif ! cmake_ok; then
        echo "scripts/build.sh: needs cmake >= 3.18: pip install cmake ninja (or put their wheels in .whl/build)" >&2
        exit 1
    fi
fi

BUILD_DIR="${BUILD_DIR:-build/$("$PY" -c 'import sys; print(sys.implementation.cache_tag)')}"
if [ ! -f "$BUILD_DIR/build.ninja" ] && [ ! -f "$BUILD_DIR/Makefile" ]; then  # not configured (or it failed)
    mkdir -p "$BUILD_DIR"
    generator=()
    if command -v ninja >/dev/null; then generator=(-G Ninja); fi
    echo "==> configuring $BUILD_DIR (log: $BUILD_DIR/configure.log)"
    # shellcheck disable=SC2086  # CMAKE_ARGS holds several options
    cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" -DKERNELS_INPLACE=ON ${CMAKE_ARGS:-} \
        >"$BUILD_DIR/configure.log" 2>&1 || { tail -n 30 "$BUILD_DIR/configure.log" >&2; exit 1; }
elif [ -n "${CMAKE_ARGS:-}" ] || [ "$(find kernels -name '*.cpp' | LC_ALL=C sort)" != "$(cat "$BUILD_DIR/sources.txt" 2>/dev/null)" ]; then
    # new options, or a .cpp added or removed since the last configure (CMakeLists.txt globs them then)
    # shellcheck disable=SC2086
    cmake "$BUILD_DIR" ${CMAKE_ARGS:-} >/dev/null
fi
find kernels -name '*.cpp' | LC_ALL=C sort >"$BUILD_DIR/sources.txt"
cmake --build "$BUILD_DIR" --parallel "${MAX_JOBS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)}"
