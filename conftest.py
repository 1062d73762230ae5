"""Root pytest configuration.

Triton kernels run under the interpreter when no CUDA GPU is present; the variable must
be set before any kernel module is imported, so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--failures-now",
        action="store_true",
        help="print each failure's traceback the moment it happens (with pytest-xdist too), not only at the end",
    )


def _runs_on_gpu(item) -> bool:
    """Whether a test exercises a GPU path when one is present: the GPU tier (``-m gpu``).

    A test is in the tier when it needs CUDA (a skip mark whose reason names CUDA), lives in a
    Triton backend's module, or names CUDA, Triton or the GPU in its name or parameters.
    """
    if "triton" in item.path.name:
        return True
    if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
        return True
    name = item.name.lower()
    return any(word in name for word in ("cuda", "triton", "gpu"))


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if _runs_on_gpu(item):
            item.add_marker(pytest.mark.gpu)


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    if _config is None or not _config.getoption("--failures-now") or not report.failed:
        return
    terminal = _config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line("")
        terminal.write_sep("!", f"FAILED {report.nodeid} ({report.when})", red=True)
        terminal.write_line(str(report.longrepr))
