"""Build the C++ kernels (plain C++17 + OpenMP, no torch headers) at install time.

Every ``kernels/**/_*.cpp`` becomes an extension module next to its source
(``kernels/density/_scatter.cpp`` -> ``kernels.density._scatter``). The modules use only
the CPython C API, so building needs a C++17 compiler and nothing else: no torch, no
network. OpenMP is used when the compiler supports ``-fopenmp``; otherwise the sources
fall back to ``std::thread``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent

COMPILER_HELP = (
    "\n\ndensity-workbench: building its C++ kernels failed. They need a C++17 compiler:\n"
    "  Debian/Ubuntu: apt-get install g++      Fedora: dnf install gcc-c++\n"
    "  macOS: xcode-select --install           conda: conda install -c conda-forge cxx-compiler\n"
    "then install again. (OpenMP is optional: without it the kernels use std::thread.)\n"
)


def _extensions() -> list[Extension]:
    exts = []
    for src in sorted((HERE / "kernels").rglob("_*.cpp")):
        rel = src.relative_to(HERE).with_suffix("")
        exts.append(Extension(".".join(rel.parts), [str(src.relative_to(HERE))], language="c++"))
    return exts


class BuildExt(build_ext):
    """Adds C++17/OpenMP flags the compiler accepts and turns failures into advice."""

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

    def build_extensions(self):
        if self.compiler.compiler_type == "msvc":
            base, omp = ["/std:c++17", "/O2"], ["/openmp"]
        else:
            base = ["-std=c++17", "-O3", "-fno-math-errno", "-Wall"]
            omp = ["-fopenmp"]
        use_omp = self._accepts(omp)
        for ext in self.extensions:
            ext.extra_compile_args = base + (omp if use_omp else [])
            ext.extra_link_args = (omp if use_omp else []) + ([] if sys.platform == "win32" else ["-pthread"])
            if not use_omp:
                ext.define_macros.append(("KERNELS_NO_OPENMP", "1"))
        try:
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
