#!/usr/bin/env bash
# Install the workbench and run the main job: JupyterLab on 127.0.0.1 with the quickstart
# notebook (the workbench on the bundled 1ORC example) open. Extra arguments go to
# `workbench lab` (e.g. --port 9000 --no-browser).
set -euo pipefail
EXTRAS=""
source "$(dirname "${BASH_SOURCE[0]}")/_install.sh"
extra=()
if [ "$(id -u)" -eq 0 ]; then
    extra+=(--allow-root)   # JupyterLab refuses to start as root without it
fi
BIN="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
echo "==> the workbench command: $BIN/workbench (--help lists the subcommands); or put $BIN on your PATH"
exec "$PY" -m workbench lab "${extra[@]}" "$@"
