"""The workbench: notebook controls and live views on the production kernels.

``Workbench(model=None)`` builds the app (a :class:`kernels.Model`, a bundled example
name or a model path; the 1ORC example by default); display it as the last expression
of a notebook cell.
"""

from workbench.app import Workbench
from workbench.compute import WorkbenchError
from workbench.state import WorkbenchState

__all__ = ["Workbench", "WorkbenchError", "WorkbenchState"]
