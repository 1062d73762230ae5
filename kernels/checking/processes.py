"""The child processes of a check: finding a backend by name in a new process, and the first-call process.

A new Python process imports the backend by (module, attribute path) and registers it as the
caller did (:func:`_function_path`, :func:`_backend_spec`, :func:`_import_backend`). Every child
runs under a supervisor (:mod:`kernels._lifetime`) in a ``check-backend-*`` folder of its own
(:func:`_check_folder`): stopped with its whole process group on a timeout, a Ctrl-C or any
exception of the caller; ended, its folder removed, when the caller dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import torch

from kernels._lifetime import start_supervised, stop_supervised
from kernels.dispatch import _REGISTERED, BACKENDS
from kernels.dispatch import _load as _load_backend

_EXIT_IMPORT = 3  # the fresh process could not import the function

_EXIT_RAISED = 5  # the backend raised (SystemExit included) in the fresh process

_FRESH_SCRIPT = (
    textwrap.dedent(
        """
    import sys, warnings
    import torch
    from kernels.checking.processes import _import_backend
    args = torch.load(sys.argv[1], weights_only=False)
    try:
        fn = _import_backend(args)
    except Exception as exc:
        print(f"cannot import {args['module']}:{args['qualname']} in a new process: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        sys.exit(EXIT_IMPORT)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    atoms = args["atoms"].to(args["device"])
    outs = []
    try:
        for _ in range(3):
            out = fn(atoms, args["grid"], radius=args["radius"], cutoff=args["cutoff"])
            outs.append(out.detach().to("cpu"))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        from kernels.checking.processes import _raised
        print(f"call {len(outs) + 1}: {_raised(exc)}", file=sys.stderr)
        sys.exit(EXIT_RAISED)
    torch.save(outs, sys.argv[2])
    """
    )
    .replace("EXIT_IMPORT", str(_EXIT_IMPORT))
    .replace("EXIT_RAISED", str(_EXIT_RAISED))
)


def _raised(exc: BaseException) -> str:
    """What the backend raised, in words; SystemExit (``sys.exit``) is named as the attempt to end the process it is."""
    if isinstance(exc, SystemExit):
        return (
            f"the backend raised SystemExit({exc.code!r}) (sys.exit or exit): a backend returns its map, "
            "it does not end the process"
        )
    return f"{type(exc).__name__}: {exc}"


def _ended(returncode: int) -> str:
    """How a child process ended, in words: its exit status or the signal that killed it."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _attribute(module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _function_path(op: str, name: str) -> tuple[str, str] | str:
    """(module, attribute path) a new process imports the backend from, or why it cannot.

    The path is the function's qualified name where that leads back to the very function,
    else a module-level name bound to it (``splat = make_kernel()``); a function that neither
    finds (a notebook cell, ``__main__``, a closure, a decorator's wrapper kept under another
    name) cannot be imported by a new process.
    """
    if name in BACKENDS[op]:
        module, func = BACKENDS[op][name].split(":")
        return module, func
    fn = _REGISTERED[op][name].fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module:
        return f"{fn!r} has no module a new process could import it from"
    if module == "__main__":
        return (
            f"{module}.{qualname} is defined in a notebook cell or a script's __main__, which no new process can "
            "import; put it in a module to have it checked in a new process"
        )
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any error importing the user's module again is the reason
        return f"module {module} cannot be imported again ({type(exc).__name__}: {exc})"
    if getattr(mod, "__file__", None) is None:
        return f"module {module} has no file a new process could import"
    if qualname and "<" not in qualname:
        with contextlib.suppress(AttributeError):
            if _attribute(mod, qualname) is fn:
                return module, qualname
    for key, value in vars(mod).items():
        if value is fn:
            return module, key
    return (
        f"{module}.{qualname} is not reachable by a name in module {module} (defined in a function or replaced "
        "by a decorator), so no new process can import it; bind it to a module-level name to have it checked in "
        "a new process"
    )


def _backend_spec(op: str, name: str, where: tuple[str, str]) -> dict:
    """What a child process needs to call backend ``name`` as this process does (see :func:`_import_backend`)."""
    entry = _REGISTERED.get(op, {}).get(name)
    return {
        "op": op,
        "name": name,
        "module": where[0],
        "qualname": where[1],
        "devices": None if entry is None else entry.devices,
        "capabilities": None if entry is None else dataclasses.asdict(entry.capabilities),
    }


def _import_backend(spec: dict):
    """In a child process: import the backend :func:`_backend_spec` describes, registered as in the parent.

    Returns the function dispatch calls (a registered backend with its output checks).
    """
    fn = _attribute(importlib.import_module(spec["module"]), spec["qualname"])
    if spec["devices"] is None:
        return fn
    from kernels.dispatch import register_backend

    register_backend(spec["op"], spec["name"], fn, devices=spec["devices"], capabilities=spec["capabilities"])
    return _load_backend(spec["op"], spec["name"])


def _child_env() -> dict:
    env = dict(os.environ)
    # the parent's import path, its current folder ("" on sys.path) spelled out: a child's script runs elsewhere
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return env


@contextlib.contextmanager
def _check_folder() -> Iterator[Path]:
    """A new ``check-backend-*`` folder in the temporary directory, removed on every way out of the block.

    A process that dies without leaving the block (SIGKILL) cannot remove it: the supervisor of a
    command started in it (:func:`kernels._lifetime.start_supervised`) does.
    """
    path = Path(tempfile.mkdtemp(prefix="check-backend-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _fresh_process(op, name, case, atoms32, device, radius, cutoff, timeout) -> tuple[list[torch.Tensor] | None, str]:
    """The backend's first three calls in a new Python process (empty Triton cache); (outs, why not)."""
    where = _function_path(op, name)
    if isinstance(where, str):
        return None, where
    with _check_folder() as tmp:
        spec = _backend_spec(op, name, where)
        spec.update(atoms=atoms32.to("cpu"), grid=case.grid, device=str(device), radius=radius, cutoff=cutoff)
        torch.save(spec, tmp / "in.pt")
        env = _child_env()
        env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")  # empty: the first call compiles
        script = tmp / "fresh.py"
        script.write_text(_FRESH_SCRIPT)
        proc = start_supervised(
            [sys.executable, str(script), str(tmp / "in.pt"), str(tmp / "out.pt")],
            tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:  # Ctrl-C here or the timeout: the process goes, with any process it started
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"the new process was still running after {timeout:g} s: stopped (a backend that never returns, "
                "or raise timeout=)"
            ) from None
        finally:
            stop_supervised(proc)
            proc.stderr.close()
        if proc.returncode == -signal.SIGINT:
            raise KeyboardInterrupt("the first-call process was interrupted")
        lines = stderr.strip().splitlines()
        if proc.returncode == _EXIT_IMPORT:
            return None, lines[-1]
        if proc.returncode == _EXIT_RAISED:
            raise RuntimeError(f"in a new process, {lines[-1]}")
        if proc.returncode != 0 or not (tmp / "out.pt").is_file():
            tail = "\n".join(lines[-3:])
            raise RuntimeError(
                f"the new process ended ({_ended(proc.returncode)}) before the backend returned its three maps: "
                "the backend ended or killed its process" + (f"; its last words: {tail}" if tail else "")
            )
        return torch.load(tmp / "out.pt", weights_only=False), ""
