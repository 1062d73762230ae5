"""What an installation receives: the sdist's and the wheel's contents, what an edit rebuilds, and
environment.yml in step with pyproject.toml."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import kernels

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# conda-forge's names where they differ from PyPI's.
CONDA_NAMES = {"torch": "pytorch", "py3dmol": "py3dmol", "matplotlib": "matplotlib-base"}


# What a checkout holds that is not source: build outputs would leak stale modules into the sdist and wheel.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.pyd", "artifacts", ".whl", ".gl"
)


@dataclass
class Built:
    sdist: tarfile.TarFile  # the sdist of a copy of this source tree
    wheel: zipfile.ZipFile  # the wheel pip builds from that sdist
    source: Path  # the sdist unpacked: the wheel's sources
    build_dir: Path  # the CMake build folder the wheel was built in (kept)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """An sdist and the wheel built from it, as ``python -m build`` makes them (here without build
    isolation: the build requirements are in the test extra), the wheel's build folder kept."""
    src = tmp_path_factory.mktemp("src") / "density-workbench"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    dist = tmp_path_factory.mktemp("dist")
    make_sdist = f"from scikit_build_core.build import build_sdist; print(build_sdist({str(dist)!r}))"
    done = subprocess.run([sys.executable, "-c", make_sdist], cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"build_sdist failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (sdist_path,) = dist.glob("density_workbench-*.tar.gz")
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist_path) as tf:
        tf.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    build_dir = tmp_path_factory.mktemp("build")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)]
    cmd += [f"-Cbuild-dir={build_dir}", str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (wheel_path,) = dist.glob("density_workbench-*.whl")
    with tarfile.open(sdist_path) as sdist, zipfile.ZipFile(wheel_path) as wheel:
        yield Built(sdist, wheel, source, build_dir)


@pytest.fixture(scope="module")
def wheel(built) -> zipfile.ZipFile:
    return built.wheel


def test_wheel_ships_every_notebook(wheel):
    names = set(wheel.namelist())
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks in notebooks/"
    missing = [n for n in notebooks if f"workbench/notebooks/{n}" not in names]
    assert not missing, f"notebooks missing from the wheel: {missing}"
    for n in notebooks:
        assert wheel.read(f"workbench/notebooks/{n}") == (ROOT / "notebooks" / n).read_bytes()


def test_wheel_ships_every_cpp_source_and_its_compiled_module(wheel):
    names = set(wheel.namelist())
    sources = sorted(
        p.relative_to(ROOT).as_posix() for ext in ("*.cpp", "*.hpp", "*.h") for p in (ROOT / "kernels").rglob(ext)
    )
    assert sources, "no C++ sources found under kernels/"
    missing = [s for s in sources if s not in names]
    assert not missing, f"C++ sources missing from the wheel: {missing}"
    # CMakeLists.txt compiles every kernels/**/_*.cpp into the extension module of the same name.
    modules = [s[: -len(".cpp")] for s in sources if Path(s).name.startswith("_") and s.endswith(".cpp")]
    assert modules
    for module in modules:
        assert any(n.startswith(module + ".") and n.endswith((".so", ".pyd")) for n in names), (
            f"no compiled module for {module}.cpp in the wheel"
        )


def test_wheel_metadata_version_and_licence(wheel):
    names = wheel.namelist()
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    assert re.search(rf"^Version: {re.escape(kernels.__version__)}$", text, re.M), (
        "wheel version != kernels.__version__"
    )
    assert re.search(r"^License-Expression: BSD-3-Clause$", text, re.M)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
    # Triton is torch's to choose (its Linux GPU builds pin the one they were built with).
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if re.match(r"Requires-Dist: triton\b", r)]


def test_sdist_holds_the_sources_and_no_build_output(built):
    names = {n.split("/", 1)[1] for n in built.sdist.getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    wanted = [n for n in tracked if (ROOT / n).is_file()]
    assert "CMakeLists.txt" in wanted and "pyproject.toml" in wanted
    missing = [n for n in wanted if n not in names]
    assert not missing, f"tracked files missing from the sdist: {missing[:20]}"
    built_files = [n for n in names if n.endswith((".so", ".pyd")) or "__pycache__" in n or n.startswith("build/")]
    assert not built_files, f"build outputs in the sdist: {built_files[:20]}"


def _includes(path: Path) -> set[Path]:
    """The headers ``path`` includes from its own folder, directly or through other headers."""
    seen: set[Path] = set()
    todo = [path]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop().read_text(), re.M):
            header = path.parent / name
            if header.is_file() and header not in seen:
                seen.add(header)
                todo.append(header)
    return seen


def _cmake(build_dir: Path) -> str:
    """The cmake that configured ``build_dir`` (a Python package's, where the machine has none)."""
    (line,) = re.findall(r"^CMAKE_COMMAND:INTERNAL=(.*)$", (build_dir / "CMakeCache.txt").read_text(), re.M)
    return line


def _would_rebuild(build_dir: Path) -> tuple[set[str], set[str]]:
    """What ninja would do now in ``build_dir`` (a dry run): the sources it would compile, the modules it would link."""
    cache = (build_dir / "CMakeCache.txt").read_text()
    assert "CMAKE_GENERATOR:INTERNAL=Ninja" in cache, "the build needs ninja (scripts/_install.sh installs it)"
    cmd = [_cmake(build_dir), "--build", str(build_dir), "--", "-n"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    compiled = set(re.findall(r"Building CXX object \S+?/(kernels/\S+?)\.o\b", done.stdout))
    linked = {Path(m).name.split(".")[0] for m in re.findall(r"Linking CXX shared module (\S+)", done.stdout)}
    return compiled, linked


def test_an_edit_rebuilds_its_translation_units_and_their_modules_only(built):
    """Every C++ file of the package, edited in turn (a comment line added) in the wheel's sources: the
    build compiles exactly the .cpp files that are or include it, and links exactly their modules."""
    src = built.source
    assert _would_rebuild(built.build_dir) == (set(), set()), "a finished build has work left"
    cpps = sorted((src / "kernels").rglob("*.cpp"))
    files = cpps + sorted((src / "kernels").rglob("*.hpp")) + sorted((src / "kernels").rglob("*.h"))
    assert any(f.suffix == ".hpp" for f in files)
    for edited in files:
        stat = edited.stat()
        text = edited.read_text()
        edited.write_text(text + "// an edit\n")
        try:
            compiled, linked = _would_rebuild(built.build_dir)
        finally:
            edited.write_text(text)
            os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        units = {c for c in cpps if c == edited or edited in _includes(c)}
        assert units, f"nothing compiles {edited.relative_to(src)}"
        assert compiled == {u.relative_to(src).as_posix() for u in units}, (
            f"{edited.relative_to(src)}: compiles {sorted(compiled)}"
        )
        assert linked == {next(u.parent.glob("_*.cpp")).stem for u in units}, (
            f"{edited.relative_to(src)}: links {linked}"
        )
    assert _would_rebuild(built.build_dir) == (set(), set())


def test_configuring_again_compiles_nothing(built):
    """Every ``pip install`` configures the build folder again (an install with the test extra, a new
    stamp): with the same compiler flags that recompiles nothing."""
    done = subprocess.run([_cmake(built.build_dir), str(built.build_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _would_rebuild(built.build_dir) == (set(), set())


@pytest.mark.parametrize("openmp", ["ON", "OFF"])
def test_every_kernel_unit_is_built_with_openmp_or_with_kernels_no_openmp(tmp_path, openmp):
    """Configure only (no compile): with -DKERNELS_OPENMP=OFF, or where the compiler has no OpenMP, every
    kernel translation unit gets KERNELS_NO_OPENMP (the std::thread build, which
    tests/kernels/test_density_cpu.py compares with the OpenMP one); otherwise every one gets -fopenmp."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake is a build requirement (scikit-build-core installs it where it is missing)"
    cmd = [cmake, "-S", str(ROOT), "-B", str(tmp_path), "-G", "Ninja", f"-DPython_EXECUTABLE={sys.executable}"]
    cmd += [f"-DKERNELS_OPENMP={openmp}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    commands = subprocess.run(["ninja", "-C", str(tmp_path), "-t", "commands"], capture_output=True, text=True)
    assert commands.returncode == 0, commands.stderr
    units = [c for c in commands.stdout.splitlines() if re.search(r" -c \S*/kernels/\S+\.cpp$", c)]
    sources = {re.search(r" -c \S*/(kernels/\S+\.cpp)$", u).group(1) for u in units}
    assert sources == {p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels").rglob("*.cpp")}
    # the sources of the hot loops once per variant (instruction set), the others once
    per_variant = {s for s in sources if "// Compiled once per variant" in (ROOT / s).read_text()}
    assert per_variant, "no source is compiled per variant (kernels/density/forward.cpp, backward.cpp)"
    for source in sources:
        compiles = [u for u in units if u.endswith("/" + source)]
        variants = {tuple(re.findall(r"-DKERNELS_ISA=\w+", u)) for u in compiles}
        assert len(compiles) == len(variants) == (3 if source in per_variant else 1), (source, compiles)
    with_openmp = [u for u in units if "-fopenmp" in u]
    without = [u for u in units if "-DKERNELS_NO_OPENMP=1" in u]
    if openmp == "OFF":
        assert not with_openmp and len(without) == len(units)
    else:
        assert "threaded with OpenMP" in done.stdout or "threaded with std::thread" in done.stdout
        assert (len(with_openmp), len(without)) in ((len(units), 0), (0, len(units)))


def _requirement_names(reqs: list[str]) -> dict[str, str]:
    """``name -> version specifier`` of PEP 508 requirement strings (markers dropped)."""
    out = {}
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*([^;]*)", req)
        out[m.group(1).lower()] = m.group(2).replace(" ", "")
    return out


def test_environment_yml_lists_what_pyproject_requires():
    text = (ROOT / "environment.yml").read_text()
    conda = {}
    for line in text.splitlines():
        m = re.match(r"\s*-\s+([A-Za-z0-9_.\-]+)\s*([^#]*)", line)
        if m:
            conda[m.group(1).lower()] = m.group(2).strip().replace(" ", "")
    wanted = {
        **_requirement_names(PYPROJECT["project"]["dependencies"]),
        **_requirement_names(PYPROJECT["build-system"]["requires"]),
        **_requirement_names(PYPROJECT["project"]["optional-dependencies"]["test"]),
    }
    for name, spec in wanted.items():
        conda_name = CONDA_NAMES.get(name, name)
        assert conda_name in conda, f"environment.yml lacks {conda_name} (pyproject.toml: {name}{spec})"
        # conda writes ==X.* as "X.*"
        expected = spec[2:] if spec.startswith("==") else spec
        assert conda[conda_name] == expected, (
            f"environment.yml has {conda_name} {conda[conda_name]!r}, pyproject.toml {name}{spec}"
        )
