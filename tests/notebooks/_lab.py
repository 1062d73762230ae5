"""How the launch tests start a real ``workbench lab``: its own Jupyter folders, a free port, no browser."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.helpers import free_port


def lab_command(tmp_path: Path, first_port: int) -> tuple[dict[str, str], list[str]]:
    """``(env, argv)`` for ``python -m workbench lab`` with its Jupyter state under ``tmp_path``.

    ``JUPYTER_TOKEN`` is removed so the command makes its own token; as root (CI containers) it
    passes ``--allow-root``, without which Lab refuses to start.
    """
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "run"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
    )
    env.pop("JUPYTER_TOKEN", None)
    args = [sys.executable, "-m", "workbench", "lab", "--no-browser", "--dir", str(tmp_path / "nb")]
    args += ["--port", str(free_port(first_port)), "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")
    return env, args
