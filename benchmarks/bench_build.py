"""What a developer waits for while installing and rebuilding: whole-process times of the install
scripts and of the C++ rebuild after an edit, for one or more checkouts side by side.

Each ``--tree NAME=PATH`` is exported from its git ``HEAD`` (``git archive``: the committed sources,
no build outputs) into a temporary folder, and each step below runs there as a fresh process, on
every tree before the next step (so background load on a shared machine meets every tree alike):

- ``clean install``: a new virtual environment and ``scripts/_install.sh`` in it, as the first
  ``scripts/start.sh`` runs it (torch from the pip configuration's wheels included);
- ``second start``: the same again with nothing changed (the install stamp skips pip);
- ``test extras``: ``scripts/test.sh``'s install (``EXTRAS=[test]``, ``TRITON_SPEC=triton==3.7.1``);
- ``start after test``: ``scripts/start.sh``'s install again;
- ``edit <file>``: one comment line appended to a C++ file, the tree's rebuild command (``--rebuild``,
  default: ``scripts/build.sh`` where the tree has it, else ``python setup.py build_ext --inplace``),
  then ``python -c "import <module>"`` — the time from the edit to an importable module;
- ``revert <file>``: the line removed again and the same rebuild.

For every step: wall seconds, the CPU seconds of the step's processes (user + system of the
children), and which compiled modules were rewritten (by modification time). Wall time on a loaded
shared machine moves with the load; CPU seconds much less.

Usage::

    python benchmarks/bench_build.py --tree new=. --tree old=/path/to/older/checkout \\
        [--edits kernels/tricubic/tricubic.cpp kernels/planarity/plane_fit.hpp] [--out FILE]

Writes ``benchmarks/results/build_devvm_<date>.json`` by default (after every step).

``python benchmarks/bench_build.py --edit-loop`` instead measures a kernel developer's loop in this
checkout, in its real build folder: for every C++ source of the package in turn (``--files`` to choose),
one comment line appended, then ``scripts/build.sh && python -c "import <its module>"`` as one shell
process (the time from the edit to an importable module), then the line removed and the same again
(``revert``). Before the first file it runs the build once, so that no earlier edit is pending. For
each step: wall and CPU seconds and the objects ninja compiled; the load average before and after the
run. It prints a table and writes ``benchmarks/results/build_edit_<machine>_<date>.json``
(``--machine``, default ``devvm``). The sources are restored even when a step fails.
``python benchmarks/bench_build.py --table FILE`` prints a record as the Markdown table of README's
"Development" section. ``--units BUILD_DIR`` instead compiles each translation unit of the package
once more, one at a time, as ninja would in that (configured) build folder (the object goes to a
temporary file), and records its wall and CPU seconds: the floor of an edit's rebuild. A source that
CMakeLists.txt compiles once per variant (``kernels/density/forward.cpp``, ``backward.cpp``) is timed
per variant, keyed ``source [KERNELS_ISA=…]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_PYTHON = shutil.which("python3") or sys.executable


def _modules(tree: Path) -> dict[str, float]:
    """Compiled module -> modification time, for every ``kernels/**/_*.so`` in ``tree``."""
    return {str(p.relative_to(tree)): p.stat().st_mtime for p in (tree / "kernels").rglob("_*.so")}


def _run(cmd: list[str] | str, cwd: Path, env: dict, log: Path) -> dict:
    """Run ``cmd`` (a shell line when a string) to its end; its wall and CPU seconds and exit status.

    The CPU seconds are those of the finished children (``RUSAGE_CHILDREN``), so steps must run one
    at a time in this process.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {cmd}\n")
        out.flush()
        r = subprocess.run(cmd, cwd=cwd, env=env, shell=isinstance(cmd, str), stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "returncode": r.returncode}


def _rebuilt(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return sorted(m for m, t in after.items() if before.get(m) != t)


def _module_of(tree: Path, edited: str) -> str:
    """The module a source file belongs to: the binding ``_*.cpp`` of its folder, as a dotted name."""
    (binding,) = sorted((tree / edited).parent.glob("_*.cpp"))
    return ".".join(binding.relative_to(tree).with_suffix("").parts)


class Tree:
    """One checkout exported into ``work/name``, with its own virtual environment and step records."""

    def __init__(self, name: str, src: Path, work: Path, rebuild: str | None, steps: int | None = None):
        self.name, self.src, self.tree = name, src, work / name
        self.max_steps = steps  # None: every step; n: the first n install steps, no edits
        self.tree.mkdir()
        archive = subprocess.run(["git", "-C", str(src), "archive", "HEAD"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(self.tree)], input=archive, check=True)
        self.commit = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip()
        self.py = str(self.tree / ".venv" / "bin" / "python")
        self.log = work / f"{name}.log"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.env |= {"VENV": str(self.tree / ".venv"), "PYTHON": BASE_PYTHON}
        if rebuild is None:
            if (self.tree / "scripts" / "build.sh").exists():
                rebuild = f"PYTHON={self.py} bash scripts/build.sh"
            else:
                rebuild = f"{self.py} setup.py -q build_ext --inplace"
        self.rebuild = rebuild
        self.steps: dict[str, dict] = {}

    def step(self, label: str, cmd) -> None:
        before = _modules(self.tree)
        res = _run(cmd, self.tree, self.env, self.log)
        res["modules_rewritten"] = _rebuilt(before, _modules(self.tree))
        self.steps[label] = res
        print(
            f"  {self.name:>6} {label:<46} {res['wall_s']:8.1f} s wall {res['cpu_s']:8.1f} s cpu  "
            f"rc={res['returncode']} rewritten={res['modules_rewritten']}",
            flush=True,
        )

    def runs(self, index: int) -> bool:
        """Whether this tree runs install step ``index`` (the edits come after every install step)."""
        return self.max_steps is None or index < self.max_steps

    def record(self) -> dict:
        return {"path": str(self.src), "commit": self.commit, "rebuild": self.rebuild, "steps": self.steps}


INSTALL = "source scripts/_install.sh"
INSTALL_STEPS = [
    ("clean install", f"EXTRAS='' {INSTALL}"),
    ("second start", f"EXTRAS='' {INSTALL}"),
    ("test extras", f"EXTRAS='[test]' TRITON_SPEC=triton==3.7.1 {INSTALL}"),
    ("start after test", f"EXTRAS='' {INSTALL}"),
]


def run_all(trees: list[Tree], edits: list[str], save) -> None:
    """Every step on every tree, step by step (tree A, tree B, then the next step); ``save()`` after each."""
    for index, (label, line) in enumerate(INSTALL_STEPS):
        for t in trees:
            if t.runs(index):
                t.step(label, ["bash", "-c", line])
                save()
    trees = [t for t in trees if t.runs(len(INSTALL_STEPS))]
    for edited in edits:
        texts = {t.name: (t.tree / edited).read_text() for t in trees}
        for t in trees:
            module = _module_of(t.tree, edited)
            (t.tree / edited).write_text(texts[t.name] + "// one comment line added by benchmarks/bench_build.py\n")
            t.step(f"edit {edited}", f"{t.rebuild} && {t.py} -c 'import {module}'")
            save()
        for t in trees:
            module = _module_of(t.tree, edited)
            (t.tree / edited).write_text(texts[t.name])
            t.step(f"revert {edited}", f"{t.rebuild} && {t.py} -c 'import {module}'")
            save()


def units(build_dir: Path, match: str = "") -> dict:
    """Wall and CPU seconds of compiling each ``kernels/`` translation unit of ``build_dir`` alone (those
    whose path contains a match of the regular expression ``match``)."""
    commands = subprocess.run(["ninja", "-C", str(build_dir), "-t", "commands"], capture_output=True, text=True)
    commands.check_returncode()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for line in commands.stdout.splitlines():
            m = re.search(r" -c (\S*/(kernels/\S+\.cpp))$", line)
            if not m or not re.search(match, m.group(2)):
                continue
            variant = ",".join(re.findall(r"-D(KERNELS_ISA=\w+)", line))
            key = f"{m.group(2)} [{variant}]" if variant else m.group(2)
            if key in out:
                continue
            cmd = re.sub(r" -MD -MT \S+ -MF \S+", "", line)
            cmd = re.sub(r" -o \S+", f" -o {tmp}/unit.o", cmd)
            res = _run(cmd, build_dir, dict(os.environ), Path(tmp) / "log")
            out[key] = res
            print(f"  {key:<70} {res['wall_s']:8.1f} s wall {res['cpu_s']:8.1f} s cpu rc={res['returncode']}")
    return out


EDIT_LINE = "// one comment line added by benchmarks/bench_build.py --edit-loop\n"


def edit_loop(files: list[str], python: str, save) -> dict:
    """The edit loop of this checkout, in its own build folder: each file edited, rebuilt and imported,
    then restored, rebuilt and imported again. Returns ``{"warm-up": step, "<file>": {"edit": step,
    "revert": step}}``; ``save(record)`` after every step."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": python}
    log = Path(tempfile.mkdtemp(prefix="bench_build_edit_")) / "build.log"

    def step(module: str) -> dict:
        start = log.stat().st_size if log.exists() else 0
        cmd = f"bash scripts/build.sh && {python} -c 'import {module}'"
        res = _run(cmd, ROOT, env, log)
        text = log.read_text()[start:]
        res["compiled"] = re.findall(r"Building CXX object (\S+)", text)
        res["linked"] = [Path(m).name.split(".")[0] for m in re.findall(r"Linking CXX shared module (\S+)", text)]
        return res

    record: dict = {"log": str(log)}
    record["warm-up"] = step("kernels")
    save(record)
    for edited in files:
        path = ROOT / edited
        text = path.read_text()
        module = _module_of(ROOT, edited)
        try:
            path.write_text(text + EDIT_LINE)
            record[edited] = {"module": module, "edit": step(module)}
            save(record)
        finally:
            path.write_text(text)
        record[edited]["revert"] = step(module)
        save(record)
        for label in ("edit", "revert"):
            r = record[edited][label]
            print(
                f"  {label:<6} {edited:<36} {r['wall_s']:6.1f} s wall {r['cpu_s']:6.1f} s cpu  "
                f"{len(r['compiled']):2d} objects  rc={r['returncode']}",
                flush=True,
            )
    return record


def edit_table(record: dict) -> str:
    """The edit loop record as a Markdown table: one row per file, edit and revert."""
    rows = [
        "| edited file | objects compiled | edit: wall s | edit: CPU s | revert: wall s | revert: CPU s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in record["steps"].items():
        if name in ("warm-up", "log"):
            continue
        e, v = r["edit"], r.get("revert", {})
        bad = "" if e["returncode"] == 0 and v.get("returncode", 0) == 0 else " (failed)"
        rows.append(
            f"| `{name}`{bad} | {len(e['compiled'])} | {e['wall_s']:.1f} | {e['cpu_s']:.1f} | "
            f"{v.get('wall_s', float('nan')):.1f} | {v.get('cpu_s', float('nan')):.1f} |"
        )
    return "\n".join(rows)


def table(record: dict) -> str:
    """A record as a Markdown table: one row per step, wall and CPU seconds per checkout."""
    names = list(record["trees"])
    head = "| step | " + " | ".join(f"{n}: wall s | {n}: CPU s | {n}: modules linked" for n in names) + " |"
    rows = [head, "| --- |" + " ---: | ---: | --- |" * len(names)]
    labels = list(dict.fromkeys(label for t in record["trees"].values() for label in t["steps"]))
    for label in labels:
        cells = []
        for n in names:
            step = record["trees"][n]["steps"].get(label)
            if step is None:
                cells += ["", "", ""]
                continue
            failed = "" if step["returncode"] == 0 else f" (exit {step['returncode']})"
            linked = ", ".join(Path(m).name.split(".")[0] for m in step["modules_rewritten"]) or "none"
            cells += [f"{step['wall_s']:.1f}{failed}", f"{step['cpu_s']:.1f}", linked]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        help="NAME=PATH of a git checkout (its HEAD); NAME=PATH:N runs only its first N install steps, no edits",
    )
    ap.add_argument(
        "--edits",
        nargs="*",
        default=["kernels/tricubic/tricubic.cpp", "kernels/planarity/plane_fit.hpp", "kernels/density/forward.cpp"],
    )
    ap.add_argument("--rebuild", help="the rebuild command for every tree (default: per tree, see above)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="print this record as a Markdown table, run nothing")
    ap.add_argument("--units", type=Path, help="time each translation unit's compile in this build folder")
    ap.add_argument("--units-match", default="", help="with --units: only the units whose path matches this")
    ap.add_argument(
        "--edit-loop", action="store_true", help="edit, rebuild and import each C++ source of this checkout"
    )
    ap.add_argument("--files", nargs="*", help="with --edit-loop: these files (default: every kernels/**/*.cpp)")
    ap.add_argument(
        "--python", default=sys.executable, help="with --edit-loop: the Python to build for and import with"
    )
    ap.add_argument("--machine", default="devvm", help="with --edit-loop: the machine's name in the JSON file name")
    args = ap.parse_args()
    if args.table:
        record = json.loads(args.table.read_text())
        print(edit_table(record) if "steps" in record else table(record))
        return
    day = datetime.date.today().isoformat()
    if args.units:
        record = {"date": day, "build_dir": str(args.units), "loadavg_before": os.getloadavg()}
        record["units"] = units(args.units, args.units_match)
        record["loadavg_after"] = os.getloadavg()
        out = args.out or ROOT / "benchmarks" / "results" / f"build_units_devvm_{day}.json"
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
        return
    if args.edit_loop:
        files = args.files or sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels").rglob("*.cpp"))
        out = args.out or ROOT / "benchmarks" / "results" / f"build_edit_{args.machine}_{day}.json"
        record = {
            "date": day,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "commit": subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "command": "bash scripts/build.sh && python -c 'import <module>'",
            "loadavg_before": os.getloadavg(),
        }

        def save_edit(steps: dict) -> None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record | {"steps": steps, "loadavg_now": os.getloadavg()}, indent=1) + "\n")

        start = time.perf_counter()
        steps = edit_loop(files, args.python, save_edit)
        record |= {
            "steps": steps,
            "loadavg_after": os.getloadavg(),
            "total_wall_s": round(time.perf_counter() - start, 1),
        }
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(edit_table(record))
        print(f"load average before {record['loadavg_before']}, after {record['loadavg_after']}; wrote {out}")
        return
    if not args.tree:
        ap.error("give --tree NAME=PATH (one or more), --edit-loop, --units BUILD_DIR or --table FILE")
    out = args.out or ROOT / "benchmarks" / "results" / f"build_devvm_{day}.json"
    work = Path(tempfile.mkdtemp(prefix="bench_build_"))
    print(f"working in {work}", flush=True)
    trees: list[Tree] = []

    def save() -> None:
        record = {
            "date": day,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "loadavg_at_save": os.getloadavg(),
            },
            "trees": {t.name: t.record() for t in trees},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")

    try:
        for spec in args.tree:
            name, _, rest = spec.partition("=")
            path, _, steps = rest.partition(":")
            trees.append(Tree(name, Path(path).resolve(), work, args.rebuild, int(steps) if steps else None))
        run_all(trees, args.edits, save)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
