"""What ``workbench lab`` prints while it starts, on a machine without a browser: one plain line saying
so, and no warning a user cannot act on (jupyter-server's ``ServerApp.token`` deprecation, its own
"No web browser found" log line)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.notebooks._lab import lab_command


def _headless(env: dict[str, str]) -> dict[str, str]:
    """``env`` as a machine without a browser: no display, no ``BROWSER``, and a ``PATH`` holding only
    this Python's folder (so no console browser such as w3m or lynx is found either)."""
    env = {k: v for k, v in env.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER")}
    env["PATH"] = str(Path(sys.executable).parent)
    return env


def test_headless_lab_says_no_browser_once_and_prints_no_deprecation_warning(tmp_path):
    env, args = lab_command(tmp_path, 18750)
    env = _headless(env)
    args.remove("--no-browser")  # the default: open one if there is one
    check = subprocess.run(
        [sys.executable, "-c", "from workbench import cli; print(cli.browser_available())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.stdout.strip() == "False", check.stdout + check.stderr  # the premise: no browser here
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.match(r"open\s+(http://127\.0\.0\.1:\d+)/lab/\S*\?token=(\S+)", line)
            url = m and f"{m.group(1)}/api/status?token={m.group(2)}"
        assert url, "workbench lab printed no URL:\n" + "".join(lines)
        answered = False
        while not answered and time.monotonic() < deadline:  # serving: every start-up line is out
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    answered = r.status == 200
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        assert answered, "the server never answered:\n" + "".join(lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    out = "".join(lines) + rest
    assert sum("browser    none found" in line for line in out.splitlines()) == 1, out
    assert "No web browser found" not in out, out
    assert "DeprecationWarning" not in out and "ServerApp.token config is deprecated" not in out, out


def test_the_server_process_drops_the_token_warning_and_no_other(tmp_path):
    """``python -m workbench._server MODULE`` runs MODULE as ``__main__`` (where Python shows
    DeprecationWarnings) with the token warning filtered, after voila's import has set its own filters."""
    (tmp_path / "probe_server.py").write_text(
        "import sys, warnings\n"
        "import voila  # as the server imports it, as an extension\n"
        "warnings.warn('ServerApp.token config is deprecated in jupyter-server 2.0. Use IdentityProvider.token',"
        " DeprecationWarning)\n"
        "warnings.warn('another deprecation', DeprecationWarning)\n"
        "print('ARGV', sys.argv[1:])\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    done = subprocess.run(
        [sys.executable, "-m", "workbench._server", "probe_server", "--flag", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ARGV ['--flag', 'x']" in done.stdout
    assert "another deprecation" in done.stderr and "ServerApp.token" not in done.stderr, done.stderr
