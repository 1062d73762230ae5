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


def test_the_top_level_help_names_each_command_once_with_a_capital():
    text = cli.build_parser().format_help()
    for name in SUBCOMMANDS:  # a line that starts with the command's name, once; not in the usage line either
        starts = re.findall(rf"^\s+(?:workbench )?{name}\b", text, re.MULTILINE)
        assert len(starts) == 1 and name not in text.splitlines()[0], f"{name!r} listed more than once:\n{text}"
    commands = text.split("commands:")[1].split("Exit status:")[0]
    listed = re.findall(r"^    ([a-z]+)\s+(\S)", commands, re.MULTILINE)
    assert {name for name, _ in listed} == set(SUBCOMMANDS)
    assert all(first.isupper() for _, first in listed), listed


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_description_starts_with_a_capital_and_spells_voila_one_way(name):
    parser = SUBCOMMANDS[name]
    assert parser.description[0].isupper(), f"workbench {name}: {parser.description[:40]!r}"
    texts = [cli.build_parser().format_help(), parser.format_help()]
    for text in texts:
        assert not re.search(r"\bVoila\b", text), "Voilà is spelled with its accent"
    if name == "app":
        assert "Voilà" in parser.format_help()


def test_the_exit_status_list_holds_every_status_a_command_gives():
    from workbench import check_cli
    from workbench._cli_shared import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

    text = cli.build_parser().format_help()
    listed = {int(code) for code in re.findall(r"^\s+(\d+)  ", text.split("Exit status:")[1], re.MULTILINE)}
    statuses = {EXIT_OK, EXIT_FAILURE, EXIT_USAGE, 130}
    statuses |= {check_cli.EXIT_CHECK_FAILED, check_cli.EXIT_USAGE, check_cli.EXIT_LOAD, check_cli.EXIT_CANNOT_RUN}
    assert listed == statuses
    check_text = SUBCOMMANDS["check"].format_help()
    assert {int(c) for c in re.findall(r"^\s+(\d+)  ", check_text, re.MULTILINE)} == statuses - {0} | {0}


def test_the_chunk_default_is_a_number_with_its_unit_and_the_kernels_constant():
    import kernels
    from workbench.ensemble_cli import DEFAULT_CHUNK_MIB

    assert DEFAULT_CHUNK_MIB << 20 == kernels.DEFAULT_CHUNK_BYTES
    chunk = next(a for a in SUBCOMMANDS["ensemble"]._actions if "--chunk" in a.option_strings)
    assert f"{DEFAULT_CHUNK_MIB} MiB of positions" in chunk.help


@pytest.mark.parametrize(
    "argv, command",
    [
        (["splat", "--bogus"], "splat"),
        (["ensemble", "models.pdb", "--nope", "1"], "ensemble"),
        (["check", "m:f", "--spacing", "x"], "check"),
        (["check", "m:f", "--what"], "check"),
        (["splat", "--spacing", "0"], "splat"),
    ],
)
def test_a_usage_error_shows_its_commands_usage_then_one_line(argv, command):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "workbench", *argv], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith(f"usage: workbench {command} "), r.stderr
    assert lines[-1].startswith(f"workbench {command}: error: ") and "Traceback" not in r.stderr
    assert not any(line.startswith("workbench: error") for line in lines)
