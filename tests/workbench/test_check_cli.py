"""``workbench check MODULE:FUNCTION``: exit codes a user's CI can rely on.

Run in-process through :func:`workbench.cli.main` (the fresh-process check still starts
its own interpreter in the one test that keeps it) on a 12-atom triclinic PDB file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kernels import user_backends as ub
from tests.signals import default_action
from workbench.check_cli import EXIT_CANNOT_RUN, EXIT_CHECK_FAILED, EXIT_LOAD, EXIT_USAGE
from workbench.cli import main

ROOT = Path(__file__).resolve().parents[2]

FAST = ["--spacing", "1.0", "--no-fresh-process"]


@pytest.fixture(scope="module")
def pdb(tmp_path_factory):
    """The user_backends example model as a PDB file (so gemmi is compared too)."""
    m = ub.example_atoms()
    a, b, c, al, be, ga = m.cell.parameters
    lines = [f"CRYST1{a:9.3f}{b:9.3f}{c:9.3f}{al:7.2f}{be:7.2f}{ga:7.2f} P 1           1"]
    for i, (el, (x, y, z), occ, bb) in enumerate(
        zip(m.atoms.elements, m.atoms.xyz.tolist(), m.atoms.occ.tolist(), m.atoms.b_iso.tolist()), start=1
    ):
        name = f" {el}{i}".ljust(4)
        lines.append(f"ATOM  {i:5d} {name} UNL A{i:4d}    {x:8.3f}{y:8.3f}{z:8.3f}{occ:6.2f}{bb:6.2f}          {el:>2}")
    path = tmp_path_factory.mktemp("model") / "tiny.pdb"
    path.write_text("\n".join(lines + ["END", ""]))
    return str(path)


def test_a_correct_kernel_exits_0_and_writes_the_page(pdb, tmp_path, capsys):
    page = tmp_path / "check.html"
    code = main(["check", "tests.kernels.user_backends:correct", pdb, "--spacing", "1.0", "--html", str(page)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS    gemmi" in out and "PASS    first call" in out
    assert page.read_text().startswith("<!doctype html>")


def test_progress_says_what_each_check_does_and_the_speed_line_which_way_it_reads(pdb, capsys):
    from workbench.check_cli import _STEPS

    assert main(["check", "tests.kernels.user_backends:correct", pdb, *FAST, "--no-gradients"]) == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("workbench check: ")]
    assert progress and "running runs" not in captured.err
    for line in progress:  # each a phrase of what runs, on the model
        assert any(line == f"workbench check: {doing} on tiny.pdb …" for doing in _STEPS.values()), line
    speed = next(line for line in captured.out.splitlines() if "speed" in line)
    found = re.search(
        r"([\d.]+) ms per call; our cpu backend ([\d.]+) ms: yours takes ([\d.]+)× our CPU time "
        r"\((slower|faster|about as fast); the median of (\d+) alternating calls of each\)",
        speed,
    )
    assert found, speed
    ratio, how, calls = float(found[3]), found[4], int(found[5])
    assert calls >= 1
    assert how == ("slower" if ratio > 1.05 else "faster" if ratio < 0.95 else "about as fast")


def test_a_buggy_kernel_exits_1_and_says_which_check_failed(pdb, capsys):
    code = main(["check", "tests/kernels/user_backends.py:no_occupancy", pdb, *FAST])
    out = capsys.readouterr().out
    assert code == EXIT_CHECK_FAILED
    assert "FAIL    reference" in out and "FAIL    gemmi" in out


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_such_module_xyz:splat", "cannot import no_such_module_xyz"),
        ("tests.kernels.user_backends:missing", "has no 'missing'"),
        ("tests.kernels.user_backends:_SHIFTS", "not a function"),
        ("tests.kernels.user_backends", "is not MODULE:FUNCTION"),
        ("nowhere/kernel.py:splat", "no file"),
    ],
)
def test_a_kernel_that_cannot_be_loaded_exits_3(target, message, capsys):
    assert main(["check", target, *FAST]) == EXIT_LOAD
    assert message in capsys.readouterr().err


def test_an_unreadable_model_exits_4(tmp_path, capsys):
    bad = tmp_path / "bad.pdb"
    bad.write_text("not a model\n")
    assert main(["check", "tests.kernels.user_backends:correct", str(bad), *FAST]) == EXIT_CANNOT_RUN
    assert "cannot run the check" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["check"])
    assert exc.value.code == 2


def test_device_cuda_checks_on_the_gpu_or_exits_4_saying_why(pdb, capsys):
    """On a GPU machine the whole check runs on CUDA (fresh process included); without one, exit 4."""
    import torch

    code = main(["check", "tests.kernels.user_backends:correct", pdb, "--device", "cuda", "--spacing", "1.0"])
    captured = capsys.readouterr()
    if torch.cuda.is_available():
        assert code == 0, captured.out
        assert "PASS    first call" in captured.out
    else:
        assert code == EXIT_CANNOT_RUN
        assert "needs a CUDA GPU" in captured.err


def _cli(*args, timeout=120):
    """``python -m workbench check ARGS`` in a new process: (exit status, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "workbench", "check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "kernel, failing, says",
    [
        ("sys_exit_zero", "runs", "SystemExit(0)"),
        ("os_exit_zero", "runs", "ended (exit status 0)"),
        ("kills_itself", "runs", "killed by SIGKILL"),
        ("meta_map", "runs", "returned a map on meta"),
        ("os_exit_in_a_new_process", "first call", "ended (exit status 0)"),
    ],
)
def test_a_kernel_that_exits_kills_itself_or_returns_no_data_exits_1_with_a_report(pdb, kernel, failing, says):
    args = ["--spacing", "1.0"] + (["--no-fresh-process"] if failing != "first call" else [])
    code, out, err = _cli(f"tests.kernels.user_backends:{kernel}", pdb, *args)
    assert code == EXIT_CHECK_FAILED, (out, err)
    assert f"FAIL    {failing}" in out and says in out, out
    assert "Traceback" not in err


def test_a_kernel_that_closes_its_output_exits_0_with_the_report(pdb):
    code, out, err = _cli("tests.kernels.user_backends:closes_stdout", pdb, *FAST)
    assert code == 0, (out, err)
    assert "PASS    reference" in out


def test_a_kernel_raising_keyboard_interrupt_stops_the_check_with_130(pdb):
    code, out, err = _cli("tests.kernels.user_backends:keyboard_interrupt", pdb, *FAST)
    assert code == 130, (out, err)
    assert "PASS" not in out and "FAIL" not in out


def test_a_hanging_kernel_fails_at_the_timeout(pdb):
    # which check is running shows on stderr: see the Ctrl-C test, which waits for it
    start = time.monotonic()
    code, out, err = _cli("tests.kernels.user_backends:never_returns", pdb, *FAST, "--timeout", "10")
    assert time.monotonic() - start < 70
    assert code == EXIT_CHECK_FAILED, (out, err)
    assert "FAIL    runs" in out and "still running after 10 s" in out


def test_ctrl_c_during_a_hanging_kernel_exits_130_and_leaves_no_process(pdb):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench", "check", "tests.kernels.user_backends:never_returns", pdb, *FAST],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_action(signal.SIGINT),  # a background job's SIGINT is ignored
    )
    try:
        line = ""
        while "calling the kernel" not in line:  # the kernel is running (in the check's child process)
            line = proc.stderr.readline()
            assert line, "the check ended before its kernel ran"
        children = [
            int(p)
            for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert children  # the check's child process, running the kernel
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in children:  # the child was stopped and reaped, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--html", "no/such/folder/check.html"], "the folder no/such/folder does not exist"),
        (["--html", "."], "--html .: a folder, not a file"),
        (["--html", "/dev/null"], "--html /dev/null: the null device, not a regular file"),
        (["--html", "/dev/zero"], "a character device, not a regular file"),
        (["--html", "x" * 300 + ".html"], "bytes long, more than the 255 this file system takes"),
        (["--name", "a:b"], "--name: a backend name"),
        (["--name", "CPU"], "differs only in case from the built-in name 'cpu'"),
        (["--name", " x"], "surrounding spaces"),
    ],
)
def test_usage_errors_exit_2_before_any_check_runs(args, message, capsys):
    start = time.monotonic()
    if not args[1].startswith("/dev/"):
        assert not os.path.lexists(args[1]) or os.path.isdir(args[1])
    assert main(["check", "tests.kernels.user_backends:correct", *args, *FAST]) == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert time.monotonic() - start < 5  # refused before any check ran


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_timeout_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "tests.kernels.user_backends:correct", "--timeout", value])
    assert exc.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_a_kernel_named_like_a_builtin_in_another_case_is_registered_under_a_user_name(pdb, tmp_path, capsys):
    (tmp_path / "mine.py").write_text(
        "from tests.kernels.user_backends import correct\n\ndef CPU(atoms, grid, *, radius, cutoff):\n"
        "    return correct(atoms, grid, radius=radius, cutoff=cutoff)\n"
    )
    assert main(["check", f"{tmp_path / 'mine.py'}:CPU", pdb, *FAST, "--no-gradients"]) == 0
    assert "backend 'user_CPU'" in capsys.readouterr().out
