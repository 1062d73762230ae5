"""``workbench check MODULE:FUNCTION``: exit codes a user's CI can rely on.

Run in-process through :func:`workbench.cli.main` (the fresh-process check still starts
its own interpreter in the one test that keeps it) on a 12-atom triclinic PDB file.
"""

from __future__ import annotations

import pytest

from tests.kernels import user_backends as ub
from workbench.check_cli import EXIT_CANNOT_RUN, EXIT_CHECK_FAILED, EXIT_LOAD
from workbench.cli import main

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
