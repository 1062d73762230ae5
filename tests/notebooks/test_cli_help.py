"""``workbench --help`` and every subcommand's: plain text, every option explained, and fast to import.

The import checks run in a fresh interpreter (a subprocess), as a person's shell would: what this
test process has already imported says nothing about what the command imports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import cli

ROOT = Path(__file__).resolve().parents[2]
# reStructuredText a terminal would print raw: ``literal``, :role:`target`, a table rule "==  ===".
RST = re.compile(r"``|:(mod|func|class|data|meth|attr):`|^\s*={2,}\s+={2,}", re.MULTILINE)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


SUBCOMMANDS = _subparsers(cli.build_parser())


def test_every_subcommand_is_walked():
    assert set(SUBCOMMANDS) == {"splat", "ensemble", "check", "sf", "lab", "app"}


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_plain_help_a_default_and_a_unit(name):
    parser = SUBCOMMANDS[name]
    text = parser.format_help()
    assert not RST.search(text), f"workbench {name} --help shows markup: {RST.search(text).group(0)!r}"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        what = f"workbench {name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), f"{what} has no help text"
        assert not RST.search(action.help), f"{what}: markup in {action.help!r}"
        if action.option_strings:  # an option (positionals say what they default to where they have one)
            assert "default" in action.help, f"{what} does not say its default: {action.help!r}"
        unit = getattr(action.type, "unit", None)
        if unit is not None:
            assert unit in action.help, f"{what} takes a number of {unit} but its help does not say so"


def test_the_top_level_help_is_plain_and_names_the_python():
    text = cli.build_parser().format_help()
    assert not RST.search(text)
    assert ".venv/bin/workbench" in text and "python -m workbench" in text


def _fresh(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


HEAVY = ("torch", "kernels", "numpy", "ipywidgets", "matplotlib", "gemmi")


@pytest.mark.parametrize("argv", [["--help"], ["splat", "--help"], ["splat", "--spacing", "-1"], ["nonsense"]])
def test_help_and_usage_errors_import_neither_torch_nor_kernels(argv):
    loaded = _fresh(
        "import contextlib, io, json, sys\n"
        "from workbench import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    try: cli.main({argv!r})\n"
        "    except SystemExit: pass\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    assert loaded == [], f"workbench {' '.join(argv)} imported {loaded}"


def test_import_kernels_leaves_dynamo_and_triton_out():
    loaded = _fresh(
        "import json, sys\nimport kernels\n"
        "print(json.dumps([m for m in ('torch._dynamo', 'triton', 'torch._inductor', 'sympy') if m in sys.modules]))"
    )
    assert loaded == [], f"import kernels imported {loaded}; import them where they are used"


def test_import_workbench_is_lazy_and_still_gives_the_app():
    loaded = _fresh(
        "import json, sys\nimport workbench\nfirst = [m for m in ('torch', 'ipywidgets') if m in sys.modules]\n"
        "from workbench import Workbench, WorkbenchState\n"
        "print(json.dumps([first, Workbench.__module__, WorkbenchState.__module__]))"
    )
    assert loaded == [[], "workbench.app", "workbench.state"]


def test_a_python_without_the_dependencies_gets_one_line_saying_which_python_to_use(tmp_path):
    # sys.modules[name] = None makes "import name" fail as in a Python that lacks the package
    code = "import sys; sys.modules['torch'] = None\nfrom workbench import cli\nsys.exit(cli.main(['splat']))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot import 'torch'" in r.stderr and ".venv/bin/workbench" in r.stderr and r.stderr.count("\n") == 1
