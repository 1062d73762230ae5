"""``workbench lab`` / ``workbench app``: the notebook copy and a real JupyterLab launch."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.notebooks._lab import lab_command
from tests.signals import default_action
from workbench import cli

SHIPPED = cli.shipped_notebooks_dir()
PACKAGED = sorted(p.name for p in SHIPPED.glob("*.ipynb"))


def test_first_launch_copies_every_notebook(tmp_path):
    dest = tmp_path / "deep" / "notebooks"
    copied, edited = cli.install_notebooks(dest)
    assert sorted(p.name for p in copied) == PACKAGED and edited == []
    for name in PACKAGED:
        assert (dest / name).read_bytes() == (SHIPPED / name).read_bytes()
    assert not [p for p in dest.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_never_overwrites_edits_and_restores_deleted(tmp_path):
    cli.install_notebooks(tmp_path)
    edited_nb = tmp_path / cli.QUICKSTART
    edited_nb.write_text('{"my": "edits"}')
    deleted = tmp_path / PACKAGED[-1]
    deleted.unlink()
    before = edited_nb.stat().st_mtime_ns
    copied, edited = cli.install_notebooks(tmp_path)
    assert [p.name for p in copied] == [deleted.name]
    assert [p.name for p in edited] == [cli.QUICKSTART]
    assert edited_nb.read_text() == '{"my": "edits"}' and edited_nb.stat().st_mtime_ns == before
    # A third launch changes nothing and copies nothing.
    assert cli.install_notebooks(tmp_path) == ([], [edited_nb])


def test_dir_option_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv(cli.NOTEBOOK_DIR_ENV, str(tmp_path / "from-env"))
    assert cli.notebook_dir() == (tmp_path / "from-env").resolve()
    assert cli.notebook_dir(tmp_path / "flag") == (tmp_path / "flag").resolve()
    monkeypatch.delenv(cli.NOTEBOOK_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.notebook_dir() == (tmp_path / "home" / "density-workbench" / "notebooks").resolve()


def test_dir_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli.main(["lab", "--dir", str(blocker), "--no-browser"]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and str(blocker) in err


def test_app_unknown_notebook_lists_the_choices(tmp_path, capsys):
    assert cli.main(["app", "nope.ipynb", "--dir", str(tmp_path), "--no-browser"]) == 2
    err = capsys.readouterr().err
    assert "nope.ipynb" in err and cli.QUICKSTART in err


def test_splat_rejects_unknown_options():
    with pytest.raises(SystemExit):
        cli.main(["splat", "--allow-root"])


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:  # not listening yet
        return 0


def test_lab_serves_the_quickstart_with_token_auth(tmp_path):
    """A real ``workbench lab``: prints a 127.0.0.1 URL with a token; the token is needed and enough."""
    env, args = lab_command(tmp_path, 18900)
    # stopped with SIGTERM below, whatever action the launcher left it
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_action(signal.SIGTERM),
    )
    try:
        url = None
        lines = []
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.match(r"open\s+(http://127\.0\.0\.1:\d+/lab/tree/01_quickstart\.ipynb\?token=\S+)", line)
            url = m.group(1) if m else None
        assert url, "no URL printed:\n" + "".join(lines)
        assert (tmp_path / "nb" / cli.QUICKSTART).is_file()
        base, token = url.split("/lab/tree/")[0], url.split("token=")[1]
        status = 0
        while time.monotonic() < deadline:  # the server needs a few seconds to listen
            status = _get(f"{base}/api/contents/{cli.QUICKSTART}?token={token}")
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, f"quickstart not served with the token (HTTP {status})"
        assert _get(f"{base}/api/contents/{cli.QUICKSTART}") == 403, "served without the token"
        assert _get(f"{base}/api/contents/{cli.QUICKSTART}?token=wrong") == 403
        assert token not in " ".join(proc.args), "the token must not appear on the command line"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
