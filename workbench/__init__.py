"""The workbench: notebook controls and live views on the production kernels.

``Workbench(model=None)`` builds the app (a :class:`kernels.Model`, a bundled example
name or a model path; the 1ORC example by default); display it as the last expression
of a notebook cell.
"""

import os as _os
import sys as _sys

# The views are drawn by a Python thread right after each OpenMP splat. With OpenMP's
# default (active) waiting, the splat's idle threads spin and starve that thread on a
# small machine, about tripling the slider-to-image latency on two cores (the figures
# are in benchmarks/README.md, "Workbench").
# OpenMP reads the variable when torch loads it, so this only applies when the
# workbench is imported first, and never overrides a value the user set.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["Workbench", "WorkbenchError", "WorkbenchState"]

# Imported on first use: the command line (``workbench --help``, ``workbench splat``) imports
# this package, and must not pay for ipywidgets, matplotlib or the kernels it does not use.
_LAZY = {
    "Workbench": "workbench.app",
    "WorkbenchError": "workbench.compute",
    "WorkbenchState": "workbench.state",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
