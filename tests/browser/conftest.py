"""Fixtures for the browser tests: Debian's Chromium through Playwright, offline, against
``workbench lab`` and ``workbench app`` started as a user would start them.

Needs ``scripts/ci-setup.sh`` (Chromium, playwright, 3Dmol.js in the cache). Without
Chromium, Playwright or 3Dmol.js these tests fail when ``CI=true`` — CI must run them —
and skip, saying what to install, on a developer's machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.signals import default_action

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DENSITY_WORKBENCH_CACHE", Path.home() / ".cache" / "density-workbench"))
THREEDMOL_JS = Path(os.environ.get("WORKBENCH_3DMOL_JS", CACHE / "3dmol-2.5.5" / "3Dmol-min.js"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",  # WebGL still works through SwiftShader, so 3Dmol.js canvases render
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SETUP_HINT = "run scripts/ci-setup.sh (Debian chromium, pip playwright, 3Dmol.js from npm)"


def _missing(what: str) -> None:
    """Fail in CI (the tests must run there), skip with the reason elsewhere."""
    message = f"{what}; {SETUP_HINT}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"browser tests cannot run in CI: {message}", pytrace=False)
    pytest.skip(message)


def chromium_path() -> str:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    _missing("Chromium is not installed (looked for $CHROMIUM, /usr/bin/chromium)")


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright Python package is not installed")
    executable = chromium_path()
    if not THREEDMOL_JS.is_file():
        _missing(f"3Dmol.js is not at {THREEDMOL_JS} (set WORKBENCH_3DMOL_JS)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class OfflinePage:
    """A Playwright page whose every request off 127.0.0.1 / data: / blob: is aborted and recorded."""

    def __init__(self, browser, width: int = 1500, height: int = 1400):
        self.context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
        self.blocked: list[str] = []
        self.console_errors: list[str] = []
        self.context.route(re.compile(r".*"), self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.console_errors.append(m.text))
        self.page.on("pageerror", lambda e: self.console_errors.append(f"page error: {e}"))

    def _route(self, route):
        url = route.request.url
        if url.startswith(("http://127.0.0.1:", "data:", "blob:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def close(self):
        self.context.close()


class Server:
    """``python -m workbench lab|app`` in a private Jupyter environment; ``url`` is the one it printed."""

    def __init__(self, command: str, tmp: Path, extra: list[str]):
        from tests.helpers import free_port

        self.log: list[str] = []
        for d in ("config", "data", "runtime", "workspaces", "settings"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        # No news or update checks (they would reach the internet and pop up over the page).
        notify = tmp / "settings" / "@jupyterlab" / "apputils-extension"
        notify.mkdir(parents=True, exist_ok=True)
        (notify / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(tmp / "config"),
            JUPYTER_DATA_DIR=str(tmp / "data"),
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
            JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
            WORKBENCH_3DMOL_JS=str(THREEDMOL_JS),
            PYTHONUNBUFFERED="1",
        )
        env.pop("JUPYTER_TOKEN", None)
        self.notebooks = tmp / "notebooks"
        args = [sys.executable, "-m", "workbench", command, "--no-browser", "--dir", str(self.notebooks)]
        args += ["--port", str(free_port(19000 if command == "lab" else 19500)), *extra]
        if hasattr(os, "geteuid") and os.geteuid() == 0 and command == "lab":
            args.append("--allow-root")  # CI containers run as root; Lab refuses root without it
        self.proc = subprocess.Popen(  # stopped with SIGTERM (stop), whatever action the launcher left it
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=default_action(signal.SIGTERM),
        )
        self.url = self._read_url(timeout=60)
        threading.Thread(target=self._drain, daemon=True).start()
        self.base = self.url.split("?")[0].rsplit("/lab/", 1)[0].rstrip("/")
        self.token = self.url.split("token=")[1]
        self._wait_listening(timeout=60)

    def _read_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            m = re.match(r"open\s+(http://127\.0\.0\.1:\S+)", line)
            if m:
                return m.group(1)
        self.stop()
        raise RuntimeError("the server printed no URL:\n" + "".join(self.log))

    def _drain(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_listening(self, timeout: float):
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # answering (Voilà has no /api/status): listening
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("the server did not start:\n" + "".join(self.log))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def lab_server(browser, tmp_path_factory):
    server = Server(
        "lab",
        tmp_path_factory.mktemp("lab"),
        [
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.extension_manager=readonly",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
    )
    yield server
    server.stop()


# One Voilà server for the session (a start is 8–11 s on a 2-core machine): every page load runs the app
# in a kernel of its own, which closes with the page. Lab stays one per module: a second page on the same
# Lab restores the first one's notebooks and their running kernels.
@pytest.fixture(scope="session")
def voila_server(browser, tmp_path_factory):
    server = Server("app", tmp_path_factory.mktemp("voila"), [])
    yield server
    server.stop()


def open_workbench(browser, server: Server, width: int, height: int):
    """A page on ``server``'s app, once it is ready and its 3D canvas drawn: ``(OfflinePage, WorkbenchUI)``."""
    from tests.browser.pages import WorkbenchUI

    op = OfflinePage(browser, width=width, height=height)
    op.page.goto(server.url, timeout=180_000)
    op.page.wait_for_selector(".wb-status", timeout=120_000)
    ui = WorkbenchUI(op.page)
    ui.wait_ready()
    ui.wait_canvas_drawn()
    return op, ui
