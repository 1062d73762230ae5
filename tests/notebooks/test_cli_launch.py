"""``workbench lab`` / ``workbench app`` as launchers: run notebooks are not "edits", and
SIGTERM stops the server with its kernels (issue 19)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil

from tests.notebooks._lab import lab_command
from tests.signals import default_action
from workbench import cli


def test_a_notebook_that_was_only_run_is_not_your_edits(tmp_path, capsys):
    cli.install_notebooks(tmp_path)
    nb_path = tmp_path / cli.QUICKSTART
    nb = json.loads(nb_path.read_text())
    # what running it in Lab or Voilà leaves in the file: outputs, counts, kernel and widget metadata
    for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        cell["execution_count"] = i + 1
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ready\n"]}]
        cell["metadata"]["execution"] = {"iopub.status.idle": "2026-11-25T10:00:00Z"}
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nb_path.write_text(json.dumps(nb, indent=1))
    assert cli.install_notebooks(tmp_path) == ([], [])
    assert cli.main(["app", "nope.ipynb", "--dir", str(tmp_path), "--no-browser"]) == 2
    assert "your edits" not in capsys.readouterr().out
    # a changed cell is an edit, and is kept
    nb["cells"][0]["source"] = ["# my notes\n"]
    nb_path.write_text(json.dumps(nb, indent=1))
    assert cli.install_notebooks(tmp_path) == ([], [nb_path])
    assert json.loads(nb_path.read_text())["cells"][0]["source"] == ["# my notes\n"]


def _request(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def test_sigterm_stops_lab_with_its_server_and_kernels(tmp_path):
    env, args = lab_command(tmp_path, 18700)
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_action(signal.SIGTERM),  # the test's SIGTERM, whatever the launcher left
    )
    tree: list[psutil.Process] = []
    try:
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.match(r"open\s+(http://127\.0\.0\.1:\d+)/lab/\S*\?token=(\S+)", line)
            url = m and (m.group(1), m.group(2))
        assert url, "workbench lab printed no URL"
        base, token = url
        status = 0
        while status != 201 and time.monotonic() < deadline:  # start a kernel once it listens
            status, body = _request(f"{base}/api/kernels?token={token}", "POST")
            time.sleep(0.5 if status != 201 else 0)
        assert status == 201, f"could not start a kernel (HTTP {status})"
        while time.monotonic() < deadline:  # the kernel process appears under the server
            tree = psutil.Process(proc.pid).children(recursive=True)
            if any("ipykernel" in " ".join(p.cmdline()) for p in tree if p.is_running()):
                break
            time.sleep(0.3)
        assert any("ipykernel" in " ".join(p.cmdline()) for p in tree), [p.cmdline() for p in tree]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert alive == [], f"still running after SIGTERM to workbench lab: {[p.cmdline() for p in alive]}"
    finally:
        for p in [*tree, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None and p.is_running():
                p.kill()
        proc.wait()


_REPORT_ENV = (
    "import os, sys\n"
    "sys.exit(0 if (os.environ.get('OMP_WAIT_POLICY'), os.environ.get('JUPYTER_TOKEN')) == tuple(sys.argv[1:]) else 3)"
)


def test_the_server_and_its_kernels_start_with_passive_openmp_waiting(monkeypatch, capsys):
    """The launcher gives the process it starts OMP_WAIT_POLICY=PASSIVE (before that process loads torch),
    keeps a value the user set, and importing workbench sets nothing (tests/packaging/test_import_graph.py)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cmd = [sys.executable, "-c", _REPORT_ENV]
    assert cli._serve([*cmd, "PASSIVE", "tok"], "http://127.0.0.1:1/", "tok") == 0
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli._serve([*cmd, "ACTIVE", "tok"], "http://127.0.0.1:1/", "tok") == 0
    assert cli._serve([*cmd, "PASSIVE", "tok"], "http://127.0.0.1:1/", "tok") == 3  # the check can fail
    assert "open       http://127.0.0.1:1/" in capsys.readouterr().out


def test_lab_saves_notebooks_without_widget_views_that_would_reopen_as_model_not_found(tmp_path, monkeypatch):
    """``workbench lab`` gives the server a pre-save hook (the real contents manager runs it here): a
    saved notebook keeps its text output and says where a live widget was, so reopening it shows no
    "Error displaying widget: model not found"."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    served = []
    monkeypatch.setattr(cli, "_serve", lambda cmd, url, token: served.append(cmd) or 0)
    assert cli.main(["lab", "--dir", str(tmp_path / "nb"), "--no-browser"]) == 0
    (hook,) = [a.split("=", 1)[1] for a in served[0] if a.startswith("--ContentsManager.pre_save_hook=")]
    manager = FileContentsManager(root_dir=str(tmp_path), pre_save_hook=hook)
    nb = json.loads((tmp_path / "nb" / cli.QUICKSTART).read_text())
    widget = {"model_id": "0a1b", "version_major": 2, "version_minor": 0}
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    code[0]["outputs"] = [
        {"output_type": "execute_result", "execution_count": 1, "metadata": {},
         "data": {"application/vnd.jupyter.widget-view+json": widget, "text/plain": "Workbench(children=(…))"}},
    ]  # fmt: skip
    code[1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "density  max 3.81 e/Å³\n"}]
    manager.save({"type": "notebook", "format": "json", "content": nb}, "saved.ipynb")
    saved = json.loads((tmp_path / "saved.ipynb").read_text())
    outs = [c["outputs"] for c in saved["cells"] if c["cell_type"] == "code"]
    assert outs[0][0]["data"].keys() == {"text/plain"}
    assert "".join(outs[0][0]["data"]["text/plain"]) == cli.WIDGET_SAVED_NOTE  # nbformat splits text in lines
    assert "".join(outs[1][0]["text"]) == code[1]["outputs"][0]["text"]
    assert "widget-view" not in (tmp_path / "saved.ipynb").read_text()
