"""The workbench: notebook controls and live views on the production kernels.

``Workbench(model=None)`` builds the app (a :class:`kernels.Model`, a bundled example
name or a model path; the 1ORC example by default); display it as the last expression
of a notebook cell.
"""

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
