"""Every shipped notebook, executed end to end in a fresh kernel, as a user would run it.

The notebooks run from a copy made by ``workbench.cli.install_notebooks`` (what
``workbench lab`` does), so a notebook that reaches for a file next to itself in the
source tree fails here. nbclient rather than nbmake: the test sets the environment and
working folder per notebook, and ``pytest tests`` collects it with no extra flags.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from workbench.cli import install_notebooks

# The repository's notebooks, the one copy every install ships.
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
# Each notebook is meant to run in seconds; a cell that takes a minute on 2 cores is a bug.
CELL_TIMEOUT_S = 120


def execute(path: Path, env: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """Run ``path`` in a fresh python3 kernel in its own folder; raise on the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ.update(env or {})
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    try:
        client = NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def text_output(nb: nbformat.NotebookNode) -> str:
    """All stream and text/plain output of a notebook, joined."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "text/plain" in out.get("data", {}):
                parts.append(out["data"]["text/plain"])
    return "\n".join(parts)


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user-notebooks")
    copied, _ = install_notebooks(folder)
    assert sorted(p.name for p in copied) == NAMES
    return folder


@pytest.fixture(scope="module")
def executed(user_folder):
    """executed(name): the notebook run once in the user folder, as a user runs it (no extra
    environment); the tests that read one notebook's output share that run."""
    runs: dict[str, nbformat.NotebookNode] = {}

    def run(name: str) -> nbformat.NotebookNode:
        if name not in runs:
            start = time.perf_counter()
            runs[name] = execute(user_folder / name)
            print(f"{name}: {time.perf_counter() - start:.1f} s")
        return runs[name]

    return run


def test_notebooks_are_stripped_and_shipped():
    """Committed notebooks carry no outputs or execution counts, and the eight are all there."""
    assert NAMES == [
        "01_quickstart.ipynb",
        "02_how_a_map_arises.ipynb",
        "03_planarity.ipynb",
        "04_kernel_debugging.ipynb",
        "05_benchmarks.ipynb",
        "06_ensembles.ipynb",
        "07_fit_loop.ipynb",
        "08_reciprocal_space.ipynb",
    ], NAMES
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has outputs"
        assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), f"{name} has no title"


def test_notebooks_import_only_public_api():
    """No notebook reaches into a private module (``kernels.density.cpu``, ``workbench.compute._x``)."""
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        for line in code.splitlines():
            stripped = line.strip()
            if stripped.startswith(("import kernels", "from kernels", "import workbench", "from workbench")):
                module = stripped.split()[1]
                assert module in ("kernels", "workbench"), f"{name}: {stripped!r} imports a submodule"
        assert "._" not in code.replace("__", ""), f"{name} touches a private name"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, executed):
    nb = executed(name)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors


def _newest_density_cuda_record() -> Path:
    """The repository's newest H100 density record, ``density_cuda_h100_<date>.json`` (no suffixed variants)."""
    results = NOTEBOOKS.parent / "benchmarks" / "results"
    plain = [
        p
        for p in results.glob("density_cuda_h100_*.json")
        if re.fullmatch(r"density_cuda_h100_\d{4}-\d{2}-\d{2}\.json", p.name)
    ]
    assert plain, f"no density_cuda_h100_<date>.json in {results}"
    return max(plain, key=lambda p: p.name)


def test_benchmarks_notebook_plots_the_latest_record_and_picks_up_torchref(tmp_path, user_folder):
    """Notebook 5 lists and plots the latest JSON per op and device with readable labels (not
    older dates, probes, sweeps or other files) and draws torchref rows when a density record carries ``torchref_<version>_..._ms`` keys."""
    record = _newest_density_cuda_record()
    results = tmp_path / "results"
    results.mkdir()
    data = json.loads(record.read_text())
    (results / "density_cuda_h100_2026-11-20.json").write_text(json.dumps(data))  # older: left out
    (results / "density_cuda_h100_2026-11-25_probe.json").write_text(json.dumps(data))  # a probe: left out
    for case in data["cases"]:
        case["torchref_seed_fwd_ms"] = 40 * case["triton_fwd_ms"]
        case["torchref_0.7.0_fwd_ms"] = 4 * case["triton_fwd_ms"]
        case["torchref_0.7.0_rel_l2_vs_gemmi_1e-7"] = 2e-5
    (results / "density_cuda_h100_2026-11-25.json").write_text(json.dumps(data))
    (results / "notes.json").write_text("{}")  # not a record: not mentioned
    (results / "cluster_sweep_h100_2026-11-26.json").write_text("{}")  # a design sweep: not listed
    nb = execute(user_folder / "05_benchmarks.ipynb", env={"WORKBENCH_BENCHMARKS_DIR": str(results)})
    text = text_output(nb)
    assert re.search(r"density splat +GPU, NVIDIA H100 +2026-11-25 +density_cuda_h100_2026-11-25\.json", text), text
    assert "_2026-11-20" not in text and "_probe" not in text, text
    assert "notes.json" not in text and "cluster_sweep" not in text and "skipped" not in text, text
    assert "torchref rows: shown" in text, text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2, f"expected the speed and the accuracy plot of one GPU record, got {len(images)}"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "torchref {m['version']}" in code  # the legend names each torchref version


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a GPU is present: the notebook runs the live check"
)
def test_debugging_notebook_without_a_gpu_says_so_and_shows_the_recorded_h100_run(executed):
    """Run as a user runs it, the notebook finds the repository's record by itself (the installed
    package's checkout): no ``WORKBENCH_BENCHMARKS_DIR``."""
    results = NOTEBOOKS.parent / "benchmarks" / "results"
    nb = executed("04_kernel_debugging.ipynb")
    text = text_output(nb)
    assert "No CUDA GPU on this machine" in text and "compare CPU backends only" in text, text
    assert f"Recorded instead: {_newest_density_cuda_record().name} — NVIDIA H100" in text, text
    logs = sorted(results.glob("tests_cuda_*.log"))
    plain = [p for p in logs if re.fullmatch(r"tests_cuda_\w+?_\d{4}-\d{2}-\d{2}\.log", p.name)]
    newest = max(plain or logs, key=lambda p: re.findall(r"\d{4}-\d{2}-\d{2}", p.name))
    summary = [line.strip() for line in newest.read_text().splitlines() if re.search(r"\d+ passed", line)][-1]
    assert "2nd call" in text and "3wip" in text and f"({newest.name}): {summary}" in text, text


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU: the live Triton check")
def test_debugging_notebook_on_a_gpu_checks_triton_in_a_fresh_process(executed):
    """With a GPU, notebook 4 runs the Triton splat in a fresh process with an empty Triton cache:
    calls 1-3 against the float64 reference and the position gradient, inside the contract."""
    nb = executed("04_kernel_debugging.ipynb")
    text = text_output(nb)
    print(text)
    assert "fresh process, empty Triton cache" in text, text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1orc"], ["1aki"])]
    assert [r[0] for r in rows] == ["1orc", "1aki"], text
    for r in rows:
        rel_calls, grad_rel = [float(v) for v in r[-4:-1]], float(r[-1])
        assert max(rel_calls) < 1e-4 and grad_rel < 1e-3, r


def test_debugging_notebook_leaves_each_difference_result_under_its_own_pair(executed):
    """After Run All, every difference view in notebook 4's saved widget state shows a result only
    for the pair its dropdowns name (cell 23 unregisters the planted backends under a shown result)."""
    nb = executed("04_kernel_debugging.ipynb")
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]

    def by_class(css):
        return [k for k, m in state.items() if css in m["state"].get("_dom_classes", ())]

    def ref(k):
        return f"IPY_MODEL_{k}"

    views = 0
    for stats in by_class("wb-diff-stats"):
        box = next(m for m in state.values() if ref(stats) in m["state"].get("children", ()))
        row = state[box["state"]["children"][0].removeprefix("IPY_MODEL_")]["state"]["children"]
        a, b = (state[c.removeprefix("IPY_MODEL_")]["state"] for c in row[:2])
        pair = (a["_options_labels"][a["index"]], b["_options_labels"][b["index"]])
        shown = re.findall(r"<b>(\S+) vs (\S+)</b>", state[stats]["state"]["value"])
        assert shown in ([], [pair]), f"the dropdowns say {pair}, the result is for {shown}"
        views += 1
    assert views >= 1


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
def test_quickstart_cells_print_the_unit_of_the_radiation_chosen(radiation, user_folder, tmp_path):
    """The quickstart's cells after the app, run with the radiation switched as a person switches it
    (``wb.set``, what the control does): every unit printed is that radiation's."""
    import kernels

    nb = nbformat.read(user_folder / "01_quickstart.ipynb", as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell(f"wb.set(radiation={radiation!r})"))
    path = tmp_path / "01_quickstart.ipynb"
    nbformat.write(nb, path)
    text = text_output(execute(path))
    unit = kernels.density_unit(radiation)
    assert re.search(rf"density +max -?\d+\.\d+ {re.escape(unit)}\n", text), text
    others = {kernels.density_unit(r) for r in ("xray", "electron", "neutron")} - {unit}
    assert not [u for u in others if u in text], text
