"""Build the C++ kernels (C++17 + OpenMP, nanobind bindings, no torch headers) at install time.

Every ``kernels/**/_*.cpp`` is a thin nanobind binding and becomes an extension module next
to its source (``kernels/density/_scatter.cpp`` -> ``kernels.density._scatter``), linked with
the algorithm sources of its directory (the ``*.cpp`` files without a leading underscore,
e.g. ``kernels/density/forward.cpp``) and with nanobind's runtime library, which is compiled
once from nanobind's ``nb_combined.cpp`` and shared by every module. Building needs a C++17
compiler and the ``nanobind`` package, nothing else: no torch, no network. OpenMP is used when
the compiler supports ``-fopenmp``; otherwise the sources fall back to ``std::thread``.

The sources of a module compile in parallel, one compiler process per core (``MAX_JOBS=n`` caps it).
"""

from __future__ import annotations

import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

COMPILER_HELP = (
    "\n\ndensity-workbench: building its C++ kernels failed. They need a C++17 compiler:\n"
    "  Debian/Ubuntu: apt-get install g++      Fedora: dnf install gcc-c++\n"
    "  macOS: xcode-select --install           conda: conda install -c conda-forge cxx-compiler\n"
    "and the nanobind package (pip install 'nanobind>=2.0'; pip's isolated build installs it), then\n"
    "install again. (OpenMP is optional: without it the kernels use std::thread.)\n"
)

try:
    import nanobind
except ImportError as exc:  # only reachable with --no-build-isolation in an environment without it
    raise SystemExit(f"{exc}{COMPILER_HELP}") from exc

# include/, src/ and ext/ lie side by side in the nanobind package (nanobind.source_dir() names
# src/ only from nanobind 2.2 on)
NB_DIR = Path(nanobind.include_dir()).parent
NB_INCLUDES = [str(NB_DIR / "include"), str(NB_DIR / "ext" / "robin_map" / "include")]
NB_SOURCE = str(NB_DIR / "src" / "nb_combined.cpp")


def _extensions() -> list[Extension]:
    exts = []
    for binding in sorted((HERE / "kernels").rglob("_*.cpp")):
        rel = binding.relative_to(HERE)
        algorithms = sorted(p.relative_to(HERE) for p in binding.parent.glob("[!_]*.cpp"))
        sources = [str(rel)] + [str(p) for p in algorithms]
        depends = [str(p.relative_to(HERE)) for p in binding.parent.glob("*.hpp")]
        name = ".".join(rel.with_suffix("").parts)
        exts.append(Extension(name, sources, include_dirs=NB_INCLUDES, depends=depends, language="c++"))
    return exts


def _jobs() -> int:
    """Compiler processes at once: ``MAX_JOBS`` if set (a positive integer), else the usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = os.environ.get("MAX_JOBS", "").strip()
    if not env:
        return cores
    if not env.isdigit() or int(env) < 1:
        raise SystemExit(f"density-workbench: MAX_JOBS must be a positive integer, got {env!r}")
    return int(env)


def _compile_in_parallel(compiler, jobs: int) -> None:
    """Make ``compiler.compile`` run one compiler process per source, ``jobs`` at a time.

    distutils compiles a module's sources one after another; each compile is a subprocess, so threads
    overlap them. The objects come back in the sources' order, as the serial call returns them.
    """
    serial = compiler.compile

    def compile(sources, *args, **kwargs):
        if jobs <= 1 or len(sources) <= 1:
            return serial(sources, *args, **kwargs)
        with ThreadPoolExecutor(min(jobs, len(sources))) as pool:
            return [obj for objs in pool.map(lambda src: serial([src], *args, **kwargs), sources) for obj in objs]

    compiler.compile = compile


class BuildExt(build_ext):
    """Adds C++17/OpenMP flags the compiler accepts, builds nanobind once, turns failures into advice."""

    def _accepts(self, flags: list[str]) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.cpp")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=flags)
                self.compiler.link_executable(objs, os.path.join(tmp, "probe"), extra_postargs=flags)
            except Exception:
                return False
        return True

    def _nanobind_objects(self, msvc: bool) -> list[str]:
        """nanobind's runtime, compiled once per build directory (it does not change between builds).

        Size-optimised with compact assertions, as nanobind's own CMake build does for release builds:
        it runs once per call at the boundary, never in a kernel's loop.
        """
        out_dir = os.path.join(self.build_temp, "nanobind")
        if msvc:
            flags, macros = ["/std:c++17", "/O1", "/EHsc"], [("NB_COMPACT_ASSERTIONS", None), ("NDEBUG", None)]
        else:
            flags = ["-std=c++17", "-Os", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing"]
            flags += ["-ffunction-sections", "-fdata-sections"]
            macros = [("NB_COMPACT_ASSERTIONS", None), ("NDEBUG", None)]
        expected = self.compiler.object_filenames([NB_SOURCE], output_dir=out_dir)
        if not self.force and all(
            os.path.exists(o) and os.path.getmtime(o) >= os.path.getmtime(NB_SOURCE) for o in expected
        ):
            return expected
        py_include = self.include_dirs or []
        return self.compiler.compile(
            [NB_SOURCE],
            output_dir=out_dir,
            macros=macros,
            include_dirs=NB_INCLUDES + py_include,
            extra_postargs=flags,
        )

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        if msvc:
            base, omp = ["/std:c++17", "/O2", "/EHsc"], ["/openmp"]
            link = []
        else:
            base = ["-std=c++17", "-O3", "-fno-math-errno", "-Wall", "-fvisibility=hidden"]
            omp = ["-fopenmp"]
            link = [] if sys.platform == "darwin" else ["-Wl,--gc-sections"]
        use_omp = self._accepts(omp)
        _compile_in_parallel(self.compiler, _jobs())
        try:
            nb_objects = self._nanobind_objects(msvc)
            for ext in self.extensions:
                ext.extra_compile_args = base + (omp if use_omp else [])
                ext.extra_link_args = (
                    (omp if use_omp else []) + link + ([] if sys.platform == "win32" else ["-pthread"])
                )
                ext.extra_objects = list(nb_objects)
                if not use_omp:
                    ext.define_macros.append(("KERNELS_NO_OPENMP", "1"))
            super().build_extensions()
        except Exception as exc:
            raise RuntimeError(f"{exc}{COMPILER_HELP}") from exc


class BuildPy(build_py):
    """Ships the repository's ``notebooks/*.ipynb`` inside the package as ``workbench/notebooks``.

    The repository keeps one copy of each notebook, at the top level; ``workbench lab``
    finds them in either place (``workbench.cli.shipped_notebooks_dir``).
    """

    def run(self):
        super().run()
        notebooks = sorted((HERE / "notebooks").glob("*.ipynb"))
        if not notebooks:
            raise RuntimeError(f"density-workbench: no notebooks in {HERE / 'notebooks'}; the package would ship none")
        dest = Path(self.build_lib) / "workbench" / "notebooks"
        self.mkpath(str(dest))
        for nb in notebooks:
            self.copy_file(str(nb), str(dest / nb.name))


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
