#!/usr/bin/env bash
# Install what the notebook and browser tests need; safe to run again (each step checks first).
#
# Usage:  scripts/ci-setup.sh            # chromium (apt), playwright (pip), 3Dmol.js (npm)
#         eval "$(scripts/ci-setup.sh --print-env)"   # only print the exports (after a setup)
#
# Its last lines are `export` statements for the variables below. A script cannot change
# its caller's environment, so eval them if you want them set; the tests also find the
# files at these default locations with no variable set.
#
#   CHROMIUM          the browser binary (default /usr/bin/chromium)
#   WORKBENCH_3DMOL_JS  3Dmol.js for the app's 3D view, fetched from npm into a cache
#                     outside the repository (third-party files are never committed)
#
# Never `playwright install`: it downloads its own browser from the internet, which CI
# machines cannot reach. Debian's chromium works headless with SwiftShader WebGL.
set -euo pipefail

THREEDMOL_VERSION="3dmol@2.5.5"
CACHE_DIR="${DENSITY_WORKBENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/density-workbench}"
THREEDMOL_JS="$CACHE_DIR/3dmol-2.5.5/3Dmol-min.js"
PYTHON="${PYTHON:-python3}"

find_chromium() {
    for c in "${CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
        if [ -n "$c" ] && [ -x "$c" ]; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

print_env() {
    echo "export CHROMIUM=$(find_chromium || echo /usr/bin/chromium)"
    echo "export WORKBENCH_3DMOL_JS=$THREEDMOL_JS"
}

if [ "${1:-}" = "--print-env" ]; then
    print_env
    exit 0
elif [ -n "${1:-}" ]; then
    echo "usage: $0 [--print-env]" >&2
    exit 2
fi

# 1. Chromium from Debian (only when missing).
if chromium_path=$(find_chromium); then
    echo "ci-setup: chromium present: $chromium_path"
else
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "ci-setup: ERROR: chromium is not installed and apt-get is not available here." >&2
        echo "          Install Chromium with your system's package manager and set CHROMIUM=/path/to/chromium." >&2
        exit 1
    fi
    if [ "$(id -u)" -eq 0 ]; then
        SUDO=""
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ci-setup: ERROR: chromium is not installed and installing it needs root (apt-get install -y chromium)." >&2
        echo "          Run this script as root, or ask an administrator to install the 'chromium' package." >&2
        exit 1
    fi
    echo "ci-setup: installing chromium with apt-get"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    chromium_path=$(find_chromium) || {
        echo "ci-setup: ERROR: apt-get install chromium finished but no chromium binary was found" >&2
        exit 1
    }
    echo "ci-setup: chromium installed: $chromium_path"
fi

# 2. The Python driver of the browser tests (part of the test extra; checked for callers
#    that run this script on its own).
if "$PYTHON" -c "import playwright.sync_api" 2>/dev/null; then
    echo "ci-setup: playwright present"
else
    echo "ci-setup: pip install playwright>=1.45"
    "$PYTHON" -m pip install -q "playwright>=1.45"
fi

# 3. 3Dmol.js from npm into the cache (outside the repository).
if [ -s "$THREEDMOL_JS" ]; then
    echo "ci-setup: 3Dmol.js present: $THREEDMOL_JS"
else
    if ! command -v npm >/dev/null 2>&1; then
        echo "ci-setup: ERROR: npm is needed to fetch $THREEDMOL_VERSION (apt-get install -y npm)." >&2
        exit 1
    fi
    mkdir -p "$CACHE_DIR"
    tmp=$(mktemp -d "$CACHE_DIR/npm-pack.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    echo "ci-setup: npm pack $THREEDMOL_VERSION"
    (cd "$tmp" && npm pack --silent "$THREEDMOL_VERSION" >/dev/null 2>&1) || {
        echo "ci-setup: ERROR: 'npm pack $THREEDMOL_VERSION' failed (is the npm registry reachable?)" >&2
        exit 1
    }
    tar -xzf "$tmp"/3dmol-*.tgz -C "$tmp" package/build/3Dmol-min.js
    mkdir -p "$(dirname "$THREEDMOL_JS")"
    # Move into place last, so an interrupted run never leaves a half-written file.
    mv "$tmp/package/build/3Dmol-min.js" "$THREEDMOL_JS.part"
    mv "$THREEDMOL_JS.part" "$THREEDMOL_JS"
    echo "ci-setup: 3Dmol.js fetched: $THREEDMOL_JS ($(wc -c <"$THREEDMOL_JS") bytes)"
fi

print_env
