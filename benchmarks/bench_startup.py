"""What a person waits for at the shell: whole-process times of the ``workbench`` command.

Each command runs in a fresh process, ``--repeats`` times, interleaved round by round (every
round runs each command once, in the same order), so background load on a shared machine meets
every command alike. Wall time from ``subprocess`` start to exit; medians, minima and maxima.

- ``workbench --help`` and a usage error (``splat --spacing -1``): the Target is ≤ 0.7 s, with
  neither torch nor ``kernels`` imported (tests/notebooks/test_cli_help.py checks the imports).
- ``workbench splat`` on the bundled 1ORC (0.667 Å, cpu backend, a map written to a temporary
  folder) against ``python -c "import torch, gemmi, numpy"``: the Target is splat ≤ that + 0.5 s.
- ``python -c "import kernels"``: the package's own import cost beside torch's.
- With ``--start-sh VENV``: ``bash scripts/start.sh --no-browser`` with ``VENV`` as its
  environment, timed to the line that prints the URL and to the URL answering an HTTP request,
  then stopped (its process group gets SIGTERM). Run it once before timing so the environment is installed; the Target for a
  second start with nothing changed is ≤ 10 s.

Usage::

    python benchmarks/bench_startup.py [--repeats 7] [--start-sh /tmp/venv] [--out FILE]

Writes ``benchmarks/results/startup_cpu_<date>.json`` by default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(tmp: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "workbench --help": [py, "-m", "workbench", "--help"],
        "workbench splat --spacing -1 (usage error)": [py, "-m", "workbench", "splat", "--spacing", "-1"],
        "workbench splat (bundled 1ORC, 0.667 Å)": [py, "-m", "workbench", "splat", "--out", str(tmp / "map.ccp4")],
        'python -c "import torch, gemmi, numpy"': [py, "-c", "import torch, gemmi, numpy"],
        'python -c "import kernels"': [py, "-c", "import kernels"],
    }


def _time(cmd: list[str], env: dict) -> tuple[float, int]:
    start = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, r.returncode


def _answers(url: str) -> bool:
    """True when the server at ``url`` gives any HTTP answer (JupyterLab's page, a redirect)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _start_sh(venv: Path, env: dict, timeout: float = 600.0) -> tuple[float, float]:
    """Seconds from ``bash scripts/start.sh --no-browser`` to its ``open  URL`` line, and to the URL answering."""
    env = dict(env, VENV=str(venv), WORKBENCH_NOTEBOOK_DIR=tempfile.mkdtemp(prefix="bench-startup-nb-"))
    start = time.perf_counter()
    proc = subprocess.Popen(
        ["bash", "scripts/start.sh", "--no-browser"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: JupyterLab is stopped with it
    )
    try:
        for line in proc.stdout:
            if line.startswith("open "):
                printed = time.perf_counter() - start
                url = line.split()[1]
                while not _answers(url):
                    if time.perf_counter() - start > timeout or proc.poll() is not None:
                        raise RuntimeError(f"{url} never answered (start.sh exit {proc.poll()})")
                    time.sleep(0.05)
                return printed, time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                break
        raise RuntimeError(f"start.sh printed no URL (exit {proc.poll()})")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds; every command runs once per round (default 7)")
    parser.add_argument("--start-sh", type=Path, help="also time scripts/start.sh to its URL with this VENV")
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/startup_cpu_<date>.json)")
    args = parser.parse_args()
    load_before = os.getloadavg()  # other work on a shared machine slows every command alike
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # Byte-code is cached as in an installed package (the untimed first runs write it): without
    # the cache every run compiles the sources it imports again (0.3 s of kernels alone).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        commands = _commands(Path(tmp))
        for cmd in commands.values():  # one untimed run each: the page cache holds the files
            _time(cmd, env)
        for _ in range(args.repeats):
            for name, cmd in commands.items():
                seconds, code = _time(cmd, env)
                expected = 2 if "usage error" in name else 0
                if code != expected:
                    raise SystemExit(f"{name}: exit status {code}, expected {expected}")
                times.setdefault(name, []).append(seconds)
            if args.start_sh:
                printed, answered = _start_sh(args.start_sh, env)
                times.setdefault("bash scripts/start.sh to the URL printed (installed, unchanged)", []).append(printed)
                times.setdefault("bash scripts/start.sh to the URL answering (installed, unchanged)", []).append(
                    answered
                )
    rows = {
        name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "runs_s": t}
        for name, t in times.items()
    }
    base = rows['python -c "import torch, gemmi, numpy"']["median_s"]
    splat = rows["workbench splat (bundled 1ORC, 0.667 Å)"]["median_s"]
    targets = {
        "help_le_0.7_s": rows["workbench --help"]["median_s"] <= 0.7,
        "usage_error_le_0.7_s": rows["workbench splat --spacing -1 (usage error)"]["median_s"] <= 0.7,
        "splat_le_imports_plus_0.5_s": splat <= base + 0.5,
    }
    if args.start_sh:
        key = "bash scripts/start.sh to the URL answering (installed, unchanged)"
        targets["start_sh_le_10_s"] = rows[key]["median_s"] <= 10
    print(f"{'command':68s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for name, r in rows.items():
        print(f"{name:68s} {r['median_s']:8.3f} {r['min_s']:8.3f} {r['max_s']:8.3f}")
    print(f"splat − imports: {splat - base:+.3f} s;  targets: {targets}")
    record = {
        "benchmark": "startup",
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "repeats": args.repeats,
        "method": "fresh process per run, rounds interleaved, wall time from start to exit (start.sh: to its URL "
        "printed and answering); byte-code cached",
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "commands": rows,
        "splat_minus_imports_s": splat - base,
        "targets_met": targets,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"startup_cpu_{record['date']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
