"""Every number on the command line is checked before any work, the same way in every subcommand.

``splat`` and ``ensemble`` share the argparse types of :mod:`workbench.cli`: a bad value is a usage
error (exit 2) naming the option, printed before a model or frame is read, and no map is written.
Subprocesses, as a user runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed._frames import write_models

ROOT = Path(__file__).resolve().parents[2]

BAD = [
    ("--blur", "-100"),
    ("--blur", "nan"),
    ("--blur", "five"),
    ("--spacing", "0"),
    ("--cutoff", "-2"),
    ("--radius", "inf"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return write_models(tmp_path_factory.mktemp("frames") / "models.pdb", 3)


@pytest.mark.parametrize("command", ["splat", "ensemble"])
@pytest.mark.parametrize(("option", "value"), BAD, ids=lambda v: str(v))
def test_a_bad_number_is_a_usage_error_before_any_work(models, tmp_path, command, option, value):
    out = tmp_path / "map.ccp4"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "workbench", command, str(models), option, value, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"argument {option}: must be" in proc.stderr and repr(value) in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout  # nothing read, nothing splatted
    assert not out.exists()
