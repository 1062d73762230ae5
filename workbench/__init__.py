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

from workbench.app import Workbench  # noqa: E402
from workbench.compute import WorkbenchError  # noqa: E402
from workbench.state import WorkbenchState  # noqa: E402

__all__ = ["Workbench", "WorkbenchError", "WorkbenchState"]
