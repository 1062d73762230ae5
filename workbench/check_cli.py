"""``workbench check MODULE:FUNCTION``: register a user's kernel and check it from the shell.

The exit status is 0 only when every check that ran passed, so the command can gate a user's
CI; :data:`DESCRIPTION`, the subcommand's help, lists the statuses. The checks run in a child
process limited to --timeout seconds; stderr shows which check is running.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

__all__ = ["EXIT_CHECK_FAILED", "EXIT_USAGE", "EXIT_LOAD", "EXIT_CANNOT_RUN", "add_parser", "load_function"]

EXIT_PASSED, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_LOAD, EXIT_CANNOT_RUN = 0, 1, 2, 3, 4

#: ``workbench check --help``'s description (plain text).
DESCRIPTION = """\
Register a density kernel MODULE:FUNCTION as a backend and check it as the project's own are
checked: against the float64 reference and gemmi, first call in a fresh process, repeated
calls, gradients, speed. The report goes to stdout.

Exit status (0 only when every check that ran passed, so the command can gate your CI):
    0  every check that ran passed (skipped and informational checks do not fail)
    1  a check failed (the report says which, and where); a kernel that raises, calls sys.exit,
       ends or kills its process, or outlives --timeout fails a check
    2  a usage error (bad arguments, an --html path that cannot be written; nothing was run)
    3  the kernel could not be loaded: its module does not import, or the function is missing
       or not callable
    4  the check could not run: a model unreadable, the device or backend unavailable
  130  interrupted (Ctrl-C)"""


class LoadError(Exception):
    """MODULE:FUNCTION does not name a callable that can be imported."""


def load_function(target: str):
    """The function ``MODULE:FUNCTION`` names; MODULE is a dotted module name or a ``.py`` file.

    A file's folder is put first on ``sys.path`` and the file imported by its name, so the
    check's fresh process imports it the same way.

    Raises
    ------
    LoadError
        With what is wrong and what to do.
    """
    module_name, sep, func = target.rpartition(":")
    if not sep or not module_name or not func:
        raise LoadError(f"{target!r} is not MODULE:FUNCTION (e.g. mykernels:splat or path/to/mykernels.py:splat)")
    if module_name.endswith(".py") or Path(module_name).is_file():
        path = Path(module_name).resolve()
        if not path.is_file():
            raise LoadError(f"no file {path}")
        sys.path.insert(0, str(path.parent))
        module_name = path.stem
    elif "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error importing the user's module is a load error
        raise LoadError(f"cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    fn = module
    for part in func.split("."):
        if not hasattr(fn, part):
            raise LoadError(f"module {module_name} has no {func!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise LoadError(f"{target} is a {type(fn).__name__}, not a function")
    return fn


def _html_problem(path: Path) -> str | None:
    """Why the report page cannot be written at ``path``, or None (checked before any check runs)."""
    from workbench._cli_shared import _check_out

    return _check_out(path, "--html")


#: What stderr says while each check of :func:`kernels.check_backend` runs (its ``progress`` names the check).
_STEPS = {
    "runs": "calling the kernel (4 calls)",
    "reference": "comparing with the float64 reference",
    "gemmi": "comparing with gemmi",
    "first call": "timing the first call in a fresh process",
    "determinism": "checking that repeated calls agree",
    "gradients": "comparing the gradients",
    "finite differences": "checking the gradients against finite differences",
    "speed": "timing it against our backend",
}


def _show_progress(check: str, structure: str) -> None:
    doing = _STEPS.get(check, f"running the {check} check")
    print(f"workbench check: {doing} on {structure} …", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    import kernels
    from kernels.dispatch import check_backend_name

    if args.html is not None:
        problem = _html_problem(args.html)
        if problem is not None:
            print(f"workbench check: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if args.name is not None:
        try:
            check_backend_name(args.op, args.name)
        except (kernels.BackendError, ValueError) as exc:
            print(f"workbench check: --name: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        fn = load_function(args.target)
    except LoadError as exc:
        print(f"workbench check: {exc}", file=sys.stderr)
        return EXIT_LOAD
    name = args.name or _default_name(args.op, fn)
    caps = {"gradients": not args.no_gradients}
    try:
        kernels.register_backend(args.op, name, fn, devices=(args.device,), capabilities=caps)
    except (kernels.BackendError, ValueError, TypeError) as exc:
        print(f"workbench check: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    try:
        report = kernels.check_backend(
            args.op,
            name,
            structures=args.models or None,
            device=args.device,
            spacing=args.spacing,
            fresh_process=not args.no_fresh_process,
            timeout=args.timeout,
            progress=_show_progress,
        )
    except (kernels.BackendError, kernels.ModelError, kernels.GridError, OSError, ValueError) as exc:
        print(f"workbench check: cannot run the check: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    finally:
        kernels.unregister_backend(args.op, name)
    print(report)
    if args.html:
        try:
            print(f"report written to {report.save(args.html)}")
        except OSError as exc:  # the folder was checked before the run; it can still go or fill up
            print(f"workbench check: cannot write the page: {exc}", file=sys.stderr)
            return EXIT_CANNOT_RUN if report.ok else EXIT_CHECK_FAILED
    return EXIT_PASSED if report.ok else EXIT_CHECK_FAILED


def _default_name(op: str, fn) -> str:
    """The function's name as a backend name: ``user_`` before one a built-in has (in any case) or an unusable one."""
    import kernels
    from kernels.dispatch import check_backend_name

    name = getattr(fn, "__name__", "user")
    try:
        check_backend_name(op, name)
    except (kernels.BackendError, ValueError):
        name = "user_" + "".join(ch if ch.isalnum() else "_" for ch in str(name))
    return name


def add_parser(sub, positive) -> None:
    """Add the ``check`` subcommand to ``sub`` (``positive`` makes a positive-number argument type)."""
    cp = sub.add_parser(
        "check",
        help="Register your density kernel MODULE:FUNCTION and check it as ours are checked",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cp.add_argument("target", metavar="MODULE:FUNCTION", help="e.g. mykernels:splat or path/to/mykernels.py:splat")
    cp.add_argument(
        "models", nargs="*", metavar="MODEL", help="PDB/mmCIF files to check on (default: the bundled examples)"
    )
    cp.add_argument(
        "--op", default="density", choices=["density"], help="the op the function computes (default density)"
    )
    cp.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the kernel is checked: cpu, or cuda for the first visible NVIDIA GPU (default cpu)",
    )
    cp.add_argument("--name", help="backend name to register it under (default: the function's name)")
    cp.add_argument(
        "--spacing", type=positive("--spacing", "Å"), default=2 / 3, help="grid spacing in Å (default 0.667)"
    )
    cp.add_argument(
        "--no-gradients",
        action="store_true",
        help="the kernel is not differentiable: skip the gradient checks (default: check them)",
    )
    cp.add_argument(
        "--no-fresh-process",
        action="store_true",
        help="skip the first-call check in a new process (default: run it)",
    )
    cp.add_argument(
        "--html",
        type=Path,
        help="also write the report as a self-contained HTML page to this file; its folder must exist (default: none)",
    )
    cp.add_argument(
        "--timeout",
        type=positive("--timeout", "seconds"),
        default=600.0,
        help="seconds the whole check may take; a kernel still running then fails (default 600)",
    )
    cp.set_defaults(func=_run)
