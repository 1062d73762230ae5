#!/usr/bin/env bash
# Install the workbench and run the main job on the bundled example structure (1ORC).
set -euo pipefail
EXTRAS=""
source "$(dirname "${BASH_SOURCE[0]}")/_install.sh"
if "$PY" -m workbench lab --help >/dev/null 2>&1; then
    exec "$PY" -m workbench lab "$@"
fi
exec "$PY" -m workbench splat --out example-1orc.ccp4 "$@"
