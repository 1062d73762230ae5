"""Small helpers shared by the backends and the public entry points (not public API)."""

from __future__ import annotations

import errno
import math
import os
import stat
import warnings
from pathlib import Path

import torch

_warned: set[tuple] = set()


def warn_once(key: tuple, message: str, category=UserWarning, stacklevel: int = 3) -> None:
    """Issue ``message`` the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)


def assume_constant_result(fn):
    """Mark ``fn`` as :func:`torch.compiler.assume_constant_result` does, without importing dynamo.

    torch's decorator imports ``torch._dynamo`` (and with it sympy and Triton, about a second)
    to set one attribute that only a ``torch.compile`` trace reads; the kernels use it on
    module-level helpers, so importing ``kernels`` would pay that second for every user. Once
    dynamo is loaded anyway, torch's own decorator is used. ``tests/kernels`` checks that both
    leave the same mark.
    """
    import sys

    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # what torch._dynamo.decorators.assume_constant_result sets
    return fn


class Handles:
    """Host objects (device tables, plans) that compiled graphs name by an int.

    A graph holds only plain values, so a custom op that needs host state takes its handle.
    The objects are made by :meth:`get` while dynamo traces a call (from an
    :func:`assume_constant_result` helper), before any compiled code runs, so nothing an op keeps
    is allocated inside a CUDA graph's private pool (``mode="reduce-overhead"``). They are kept
    for the process: a compiled graph may run again as long as it lives.
    """

    def __init__(self):
        self._objects: list = []
        self._keys: dict = {}

    def get(self, key, make) -> int:
        """The handle of the object for ``key`` (hashable), made by ``make()`` on the first call."""
        handle = self._keys.get(key)
        if handle is None:
            handle = self._keys[key] = len(self._objects)
            self._objects.append(make())
        return handle

    def __getitem__(self, handle: int):
        return self._objects[handle]


def to_float32(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """``tensor`` as float32 for a float32-only kernel; warns once per (op, input dtype)."""
    if tensor.dtype == torch.float32:
        return tensor
    warn_once(
        (op, tensor.dtype),
        f"{op}: the fast kernels compute in float32; casting {tensor.dtype} input "
        "(convert once with .to(dtype=torch.float32) to avoid the copy, or use backend='reference' for float64)",
    )
    return tensor.to(torch.float32)


def _real_scalar(value, name: str, unit: str, allowed: str) -> float:
    """``value`` as a Python float if it is one real number (Python, numpy or a 0-d/1-element torch tensor).

    bool is refused although Python counts it as an int: ``radius=True`` is a mistake, not 1 Å.
    """
    import numbers

    import numpy as np

    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise _number_error(value, name, unit, allowed)
        value = value.detach().reshape(()).cpu().item()  # a host value: the caller passed a tensor for a scalar
    elif isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise _number_error(value, name, unit, allowed)
    return float(value)


def _number_error(value, name: str, unit: str, allowed: str) -> ValueError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    of_unit = f" of {unit}" if unit else ""
    return ValueError(
        f"{name} must be {allowed.format(of_unit=of_unit, name=name)}, got {shown} ({type(value).__name__})"
    )


def real_number(value, name: str, unit: str = "") -> float:
    """One real scalar (as :func:`positive_number` accepts them) as a float; NaN and ±inf pass.

    For callers that judge the value themselves (cell parameters, whose message names the
    whole cell).
    """
    return _real_scalar(value, name, unit, "a real number{of_unit}")


def positive_number(value, name: str, unit: str = "") -> float:
    """Check one public numeric argument that must be a positive finite real number; return it as float.

    Accepts Python ``int``/``float``, numpy real scalars (``np.float32(2)``, ``np.int64(2)``) and
    one-element real torch tensors (``torch.tensor(2.0)``). Refuses bool, complex, strings,
    NaN, ±inf and values ≤ 0 with a ``ValueError`` naming the argument, the value and the range.

    Parameters
    ----------
    value : real scalar
    name : str
        The argument's name as the caller wrote it (``"radius"``).
    unit : str
        Its unit for the message (``"Å"``), or ``""``.

    Returns
    -------
    float
    """
    allowed = "a positive finite number{of_unit} (0 < {name} < inf)"
    x = _real_scalar(value, name, unit, allowed)
    if not (math.isfinite(x) and x > 0):
        raise _number_error(value, name, unit, allowed)
    return x


def finite_number(value, name: str, unit: str = "", *, allow_nan: bool = False) -> float:
    """Like :func:`positive_number` for an argument that may be any finite real number.

    ``allow_nan=True`` also lets NaN through (``fill_value=nan`` marks points outside a map).
    """
    allowed = "a finite number{of_unit}" + (" or nan" if allow_nan else "")
    x = _real_scalar(value, name, unit, allowed)
    if not (math.isfinite(x) or (allow_nan and math.isnan(x))):
        raise _number_error(value, name, unit, allowed)
    return x


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a regular file to read, as a phrase to put after ``"<path>: "``; None if it is.

    ``"no such file"``, ``"a folder, not a file"``, the kind of special file (``/dev/null``, a
    pipe, a device, a socket), or a link to a missing file. Whether a regular file can be read
    is left to opening it.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            return f"a link to {os.readlink(path)}, which does not exist"
        return "no such file"
    except NotADirectoryError:
        return "no such file (a part of its path is a file, not a folder)"
    except OSError as exc:
        return f"cannot be reached ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    if stat.S_ISCHR(mode) and os.path.realpath(path) == os.devnull:
        return "the null device (it reads as empty), not a file"
    kinds = {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO), not a regular file (save what it gives to a file first)"
    kind = next((name for test, name in kinds.items() if test(mode)), "a special file")
    return f"{kind}, not a regular file"


_SPECIAL_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))

#: The temporary file written beside an output keeps at most this many characters of its name.
TEMPORARY_NAME_KEEP = 64


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def output_problem(path: str | os.PathLike) -> str | None:
    """Why an output file may not be written (or replaced) at ``path``, as a phrase after ``"<path>: "``; None if it may.

    An output goes only to a regular file, which it replaces, or to a new path in an existing
    folder. Anything else is refused, since writing would replace it or never end: a folder,
    the null device or any other device node, a pipe (FIFO), a socket, and a link to any of
    these; a name longer than the file system takes, or a path that cannot be reached.
    The rule of every writer of the project (:func:`kernels.write_map`, the CLI's ``--out``
    and ``--html``, the workbench's exports), checked before any work.
    """
    path = Path(path)
    link = f"a link to {os.readlink(path)}, which is " if _is_link(path) else ""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        target = Path(os.path.realpath(path))
        folder = target.parent
        if not folder.is_dir():
            shown = folder if link else (path.parent if str(path.parent) else Path("."))
            what = "is not a folder" if folder.exists() else "does not exist"
            return f"the folder {shown} {what}: create it or write elsewhere"
        limit = _name_max(folder)
        if len(os.fsencode(target.name)) > limit:
            return (
                f"a name in the path is {len(os.fsencode(target.name))} bytes long, more than the {limit} this file "
                "system takes: give a shorter name"
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"the folder {folder} is not writable: write elsewhere"
        return None
    except NotADirectoryError:
        return f"the folder {path.parent} is not a folder (a part of its path is a file)"
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in path.parts)
            return (
                f"a name in the path is {longest} bytes long, more than the {_name_max(Path('/'))} this file system "
                "takes: give a shorter name"
            )
        return f"cannot be reached ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        folder = Path(os.path.realpath(path)).parent  # replacing a file takes its folder's permission
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"the folder {folder} is not writable: write elsewhere"
        return None
    if stat.S_ISDIR(mode):
        return f"{link}a folder, not a file: give a file name inside it"
    if stat.S_ISFIFO(mode):
        kind = "a pipe (FIFO)"
    elif stat.S_ISCHR(mode) and os.path.realpath(path) == os.devnull:
        kind = "the null device"
    else:
        kind = next((name for test, name in _SPECIAL_KINDS if test(mode)), "a special file")
    return (
        f"{link}{kind}, not a regular file: an output is written only to a regular file or a new path "
        "(writing would replace it); give a file name"
    )


def _is_link(path: Path) -> bool:
    try:
        return path.is_symlink()
    except OSError:
        return False


_launcher_watched = False


def end_with_launcher() -> None:
    """Make this process end (SIGTERM) when the process that started it dies; once per process.

    torchrun starts each rank in a session of its own, so a SIGKILL of torchrun reaches no rank,
    and the ranks would run on, waiting on each other's collectives until the group's timeout.
    Linux: ``prctl(PR_SET_PDEATHSIG)``; elsewhere a daemon thread that polls the parent's pid
    every second. A parent that died before this call is seen at once (the process was
    re-parented). Called by ``splat_ensemble(process_group=...)`` in a rank torchrun started and
    by ``workbench ensemble``.
    """
    global _launcher_watched
    if _launcher_watched:
        return
    _launcher_watched = True
    import signal
    import threading
    import time

    from kernels._lifetime import arm_parent_death

    parent = os.getppid()
    armed = arm_parent_death(signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="end-with-launcher", daemon=True).start()


def format_size(n_bytes: float) -> str:
    """A byte count for a message: GiB from 1 GiB, MiB below."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"
