"""Run a Jupyter server module (``jupyterlab`` or ``voila``) as ``python -m MODULE`` would, less one
warning: the process ``workbench lab`` and ``workbench app`` start (``python -m workbench._server MODULE
ARGS``).

jupyter-server warns that ``ServerApp.token`` is deprecated whenever its own login code reads that
trait, on every start, although the token comes from ``JUPYTER_TOKEN``, its supported route: the
warning tells a user nothing to act on. A warning filter cannot hold it back, neither one in the
environment (``PYTHONWARNINGS``) nor one set here, because importing ``voila`` (which the server does,
as an extension) puts a filter that shows traitlets' deprecation warnings in front of every earlier
one. So this process leaves the filters alone and does not show that one warning when it comes.
"""

from __future__ import annotations

import runpy
import sys
import warnings

#: The start of the warning's message.
TOKEN_WARNING = "ServerApp.token config is deprecated"


def _show_all_but_the_token_warning(show):
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DeprecationWarning) and str(message).startswith(TOKEN_WARNING):
            return
        show(message, category, filename, lineno, file, line)

    return showwarning


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``, the token warning not shown.

    Parameters
    ----------
    argv : list of str
        The server module's name and its arguments.
    """
    warnings.showwarning = _show_all_but_the_token_warning(warnings.showwarning)
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
