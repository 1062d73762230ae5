"""Reading and writing CCP4/MRC maps through gemmi."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from kernels._util import TEMPORARY_NAME_KEEP, file_problem, format_size, output_problem
from kernels.crystal import Cell, GridError, GridSpec

__all__ = ["write_map", "read_map"]


def _umask() -> int:
    """The process's umask: from /proc (Linux) without touching it, else by setting it and setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def _temporary_beside(target: Path, mode: int):
    """A new file ``.<name>.*.tmp`` beside ``target`` with permissions ``mode``; yields its path.

    On exit the file is removed unless it was renamed away (the caller's ``os.replace``). It is removed as well
    when SIGTERM, SIGINT or SIGHUP ends the process while it exists:

    - a signal whose action is the default (the process ends without Python's clean-up) gets a handler that
      removes the file, then ends the process as the default action would;
    - SIGINT under Python's own handler gets one that removes the file, then raises ``KeyboardInterrupt``;
    - a handler of the caller's is kept (if it raises, the exit removes the file; if it returns, the write goes
      on), and a signal the process ignores (SIGHUP under ``nohup``) changes nothing.

    A signal that comes while the file is being made is handled once it exists and is known, so none finds it
    made but not yet named. Handlers are set in the main thread only (Python runs them there); the previous
    ones are restored on exit.
    """
    tmp = None
    making = True
    pending = []
    main = threading.current_thread() is threading.main_thread()
    previous = {}

    def handler(signum, frame):
        if making:  # the file may exist without its name known here yet: handle the signal when it is
            pending.append(signum)
            return
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if previous.get(signum) is signal.default_int_handler:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def made():
        nonlocal making
        making = False
        while pending:
            handler(pending.pop(0), None)

    try:
        for sig in _ENDING_SIGNALS if main else ():
            with contextlib.suppress(ValueError, OSError):  # not settable here
                if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                    previous[sig] = signal.signal(sig, handler)
        try:
            # a long name is cut short here: the temporary file's name must fit where the output's fits
            fd, tmp = tempfile.mkstemp(
                prefix=f".{target.name[:TEMPORARY_NAME_KEEP]}.", suffix=".tmp", dir=target.parent
            )
        except BaseException:
            made()  # no file: end or interrupt as the signals that came ask
            raise
        try:
            try:
                os.fchmod(fd, mode)  # mkstemp makes the file 0600
            finally:
                os.close(fd)
            made()
            yield tmp
        finally:
            with contextlib.suppress(FileNotFoundError):  # renamed into place, or removed by a handler
                os.unlink(tmp)
            made()  # signals deferred while the file was unnamed end or interrupt the process here, the file gone
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _check_output(path: Path) -> None:
    problem = output_problem(path)
    if problem is None:
        return
    if problem.startswith("the folder") and "does not exist" in problem:
        raise FileNotFoundError(f"{path}: {problem}")
    raise ValueError(f"{path}: {problem}")


def write_output(path: str | os.PathLike, write) -> Path:
    """Write an output file atomically: ``write(tmp)`` fills a temporary file, which then replaces ``path``.

    The rule of every file the project writes (:func:`write_map`, the check's report page, the
    workbench's exports): ``path`` must be a regular file or a new path in an existing folder
    (:func:`kernels._util.output_problem`; a device, pipe, socket or folder, or a link to one, is
    refused before anything is written). The temporary file lies beside the final one and is
    renamed onto it only when ``write`` returns, so an interrupted or failed write leaves the old
    file (or none) under the name, never a part; the signals that end the process remove it
    (see :func:`write_map`). A symbolic link is written through: the file it points to is replaced
    and the link stays. A new file gets 0666 less the umask; a replaced one keeps its permissions.

    Parameters
    ----------
    path : str or path-like
        The output file.
    write : callable
        ``write(tmp)`` writes the whole content to the path ``tmp`` (a str).

    Returns
    -------
    pathlib.Path
        ``path`` as given.

    Raises
    ------
    ValueError
        ``path`` is not a regular file or a new path (the message says what it is and why).
    FileNotFoundError
        The folder to write into does not exist.
    """
    path = Path(path)
    _check_output(path)
    # Write through a link to its target: replacing the link itself would leave the file it names stale.
    target = Path(os.path.realpath(path))
    # A new file: 0666 less the umask, as ``open`` gives; a replaced one keeps its permissions.
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
    with _temporary_beside(target, mode) as tmp:
        write(tmp)
        os.replace(tmp, target)
    return path


_INT32 = (-(2**31), 2**31 - 1)


def map_header_problem(grid: GridSpec) -> str | None:
    """Why ``grid`` cannot be recorded in a CCP4/MRC header (its words are int32), or None.

    The origin (NXSTART…) and sampling (MX…) of a box grid, and the shape, must each fit in int32;
    callers check it before the work that makes the map.
    """
    for what, values in (("shape", grid.shape), ("origin", grid.origin), ("sampling", grid.sampling)):
        if any(not _INT32[0] <= v <= _INT32[1] for v in values):
            return (
                f"the map's {what} {tuple(values)} (voxels) does not fit the CCP4 header's 32-bit words "
                f"({_INT32[0]} to {_INT32[1]}): place the box nearer the cell's origin (shift the atoms by "
                "whole cells) or use a coarser grid"
            )
    return None


def _check_header(grid: GridSpec) -> None:
    problem = map_header_problem(grid)
    if problem:
        raise GridError(problem)


def write_map(
    path: str | os.PathLike, rho: torch.Tensor, grid: GridSpec, spacegroup: str = "P 1", radiation: str | None = None
) -> Path:
    """Write ``rho`` as a CCP4/MRC map (mode 2, float32), atomically.

    The map goes to a temporary file in the same folder as the final file and is renamed
    onto it only once complete, so an interrupted write never leaves a half map under
    the final name; SIGTERM, SIGINT and SIGHUP during the write remove the temporary file when
    they end the process (a signal the process ignores, as SIGHUP under ``nohup``, changes nothing
    and the map is written; SIGKILL cannot be caught and may leave a ``.<name>.*.tmp`` file,
    never a half map).
    A new file gets the usual permissions (0666 less the umask, as ``open`` would give); a
    replaced file keeps its permissions.
    When ``path`` is a symbolic link the map is written to the file it points to (the
    link stays a link). Box grids keep their origin (header words NXSTART…) and cell sampling.

    Parameters
    ----------
    path : str or path-like
        Usually ``.ccp4``, ``.map`` or ``.mrc``.
    rho : torch.Tensor, shape grid.shape
        Any floating dtype or device (written as float32).
    grid : GridSpec
    spacegroup : str
        Hermann–Mauguin name recorded in the header (P 1 for a map of the atoms in the file).
    radiation : {"xray", "electron", "neutron"}, optional
        The radiation whose coefficients made ``rho``: the map's first label (header word LABEL)
        then says so and names its unit (:func:`kernels.density_unit`), e.g. "density-workbench
        electron map, unit A^-2". Default: gemmi's label, no unit.

    Returns
    -------
    pathlib.Path
        ``path`` as given.

    Raises
    ------
    ValueError
        ``path`` is not a regular file or a new path: a folder, a device node (``/dev/null``), a
        pipe (FIFO), a socket, a link to one of these (writing would replace it), or a name longer
        than the file system takes; an unknown space group (named), or an unknown ``radiation``.
    kernels.GridError
        ``rho`` does not have the grid's shape, or the grid's shape, origin or sampling does not fit
        the header's 32-bit words (:func:`map_header_problem`; check it before making the map).
    FileNotFoundError
        The folder to write into does not exist.
    """
    import gemmi

    path = Path(path)
    _check_output(path)
    if tuple(rho.shape) != grid.shape:
        raise GridError(f"map shape {tuple(rho.shape)} does not match the grid {grid.shape}")
    sg = gemmi.find_spacegroup_by_name(spacegroup) if isinstance(spacegroup, str) else None
    if sg is None:
        raise ValueError(
            f"unknown space group {spacegroup!r} for the map header; give a Hermann–Mauguin name such as "
            "'P 1' or 'P 21 21 21' (e.g. model.spacegroup)"
        )
    if radiation is not None:
        from kernels.density import density_unit

        label = f"density-workbench {radiation} map, unit {density_unit(radiation, ascii=True)}"
    _check_header(grid)
    data = np.ascontiguousarray(rho.detach().to("cpu", torch.float32).numpy())
    ccp4 = gemmi.Ccp4Map()
    ccp4.grid = gemmi.FloatGrid(data, grid.cell.to_gemmi(), sg)
    ccp4.update_ccp4_header(2, True)
    if radiation is not None:
        ccp4.set_header_i32(56, 1)  # NLABL: one label, in words 57-76
        ccp4.set_header_str(57, label.ljust(80))
    if not grid.is_whole_cell:
        for word, value in zip((5, 6, 7), grid.origin):
            ccp4.set_header_i32(word, value)
        for word, value in zip((8, 9, 10), grid.sampling):
            ccp4.set_header_i32(word, value)
    write_output(path, ccp4.write_ccp4_map)
    return path


# CCP4/MRC data modes this reader takes, and the numpy type of one value. Complex modes (3, 4) hold
# structure factors, not a density, and are refused.
_MODES = {0: "i1", 1: "i2", 2: "f4", 6: "u2", 12: "f2"}
_HEADER_BYTES = 1024
_STREAM_CHUNK = 1 << 20


def _open_raw(path: Path):
    import gzip

    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_header(path: Path, head: bytes) -> dict:
    """The words of a CCP4/MRC header that say how much data follows; ValueError naming the file otherwise."""
    if not head:
        raise ValueError(
            f"{path}: the file is empty (0 bytes), too short for a CCP4/MRC map (the header alone is "
            f"{_HEADER_BYTES} bytes)"
        )
    if len(head) < _HEADER_BYTES:
        raise ValueError(
            f"{path}: {len(head)} bytes is too short for a CCP4/MRC map (the header alone is {_HEADER_BYTES} bytes); "
            "is the file complete?"
        )
    if head[208:212] != b"MAP ":
        raise ValueError(f"{path}: not a CCP4/MRC map (no 'MAP ' tag at byte 208 of the header)")
    # MACHST (bytes 212-213): 0x44 0x41 little endian, 0x11 0x11 big endian; files without it are little endian.
    order = ">" if head[212] == 0x11 else "<"
    words = np.frombuffer(head[:_HEADER_BYTES], dtype=order + "i4")
    floats = np.frombuffer(head[:_HEADER_BYTES], dtype=order + "f4")
    shape = tuple(int(v) for v in words[0:3])
    mode, nsymbt = int(words[3]), int(words[23])
    if min(shape) < 1:
        raise ValueError(
            f"{path}: the header claims {shape[0]}×{shape[1]}×{shape[2]} values (words NC, NR, NS); "
            "each must be at least 1: the file is damaged or not a map"
        )
    if mode not in _MODES:
        raise ValueError(
            f"{path}: data mode {mode} (header word MODE) is not a real-valued map; "
            f"this reader takes modes {sorted(_MODES)} (2 = float32)"
        )
    if nsymbt < 0:
        raise ValueError(f"{path}: negative extended-header length {nsymbt} (header word NSYMBT): the file is damaged")
    axes = [int(v) - 1 for v in words[16:19]]  # file column/row/section -> cell axis
    if sorted(axes) != [0, 1, 2]:
        raise ValueError(
            f"{path}: bad axis order words MAPC/MAPR/MAPS {[a + 1 for a in axes]} (need 1, 2, 3 in some order)"
        )
    itemsize = np.dtype(_MODES[mode]).itemsize
    return dict(
        order=order,
        shape=shape,
        mode=mode,
        itemsize=itemsize,
        data_offset=_HEADER_BYTES + nsymbt,
        expected=_HEADER_BYTES + nsymbt + math.prod(shape) * itemsize,
        start=[int(v) for v in words[4:7]],
        sampling=tuple(int(v) for v in words[7:10]),
        cell=[float(v) for v in floats[10:16]],
        axes=axes,
    )


def _stream_size(path: Path, stop_after: int) -> int:
    """Bytes in the (decompressed) file, counted in chunks; stops once past ``stop_after``."""
    total = 0
    with _open_raw(path) as f:
        while total <= stop_after:
            chunk = f.read(_STREAM_CHUNK)
            if not chunk:
                break
            total += len(chunk)
    return total


#: The most map data (bytes, as the file stores it) :func:`read_map` reads unless ``max_bytes`` says more:
#: a 1024³ float32 map.
MAX_MAP_BYTES = 4 * 2**30


def read_map(path: str | os.PathLike, *, max_bytes: int = MAX_MAP_BYTES) -> tuple[torch.Tensor, GridSpec]:
    """Read a CCP4/MRC map (optionally gzipped).

    The header is checked against the file before anything is allocated: the data it
    describes (NC·NR·NS values of MODE's size after the 1024-byte header and NSYMBT
    bytes of extended header) must be at most ``max_bytes`` and exactly what the file holds
    (for ``.gz``, counted by streaming the decompressed bytes, never held at once). Only then
    are the values read, into one array of the validated size.

    Parameters
    ----------
    path : str or path-like
        ``.ccp4``, ``.map``, ``.mrc``, optionally ``.gz``.
    max_bytes : int
        The most data the header may describe, 4 GiB by default (a 1024³ float32 map); the
        float32 copy of it is held too. Raise it for a larger map.

    Returns
    -------
    rho : torch.Tensor, shape (nx, ny, nz), float32
        Values with axes in a, b, c order whatever the file's axis order (modes 0, 1, 6
        and 12 are converted to float32).
    grid : GridSpec
        The cell, the map's shape, its origin and the cell sampling from the header.

    Raises
    ------
    ValueError
        The file is missing, not a regular file (a folder, ``/dev/null``, a pipe), unreadable,
        not a CCP4/MRC map, describes more than ``max_bytes`` of data, or its header disagrees with
        its size (a truncated file, or a header claiming more or fewer values or another
        MODE); the message names the file and the header word.
    """
    import gemmi

    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise ValueError(f"{path}: {'no such map file' if problem == 'no such file' else problem}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
        raise ValueError(f"{path}: max_bytes must be a positive integer (bytes of map data), got {max_bytes!r}")
    try:
        with _open_raw(path) as f:
            head = f.read(_HEADER_BYTES)
        hdr = _read_header(path, head)
        data_bytes = hdr["expected"] - hdr["data_offset"]
        if data_bytes > max_bytes:
            nc, nr, ns = hdr["shape"]
            raise ValueError(
                f"{path}: the header describes {nc}×{nr}×{ns} values of mode {hdr['mode']}, {format_size(data_bytes)} of "
                f"data, more than the limit of {format_size(max_bytes)} (max_bytes={max_bytes}): is the header right? To "
                "read it anyway pass a larger max_bytes"
            )
        size = _stream_size(path, hdr["expected"]) if path.suffix == ".gz" else path.stat().st_size
    except (OSError, EOFError) as exc:  # unreadable, or a damaged gzip stream
        raise ValueError(f"{path}: cannot read it as a CCP4/MRC map ({exc})") from exc
    if size != hdr["expected"]:
        nc, nr, ns = hdr["shape"]
        more = "at least " if path.suffix == ".gz" and size > hdr["expected"] else ""
        raise ValueError(
            f"{path}: the header describes {nc}×{nr}×{ns} values of mode {hdr['mode']} ({hdr['itemsize']} byte{'s' if hdr['itemsize'] > 1 else ''} each) "
            f"after {hdr['data_offset']} header bytes, {hdr['expected']} bytes in all, but the file holds {more}{size} "
            "bytes (header words NC, NR, NS, MODE, NSYMBT disagree with the data): the file is truncated or its "
            "header is wrong"
        )
    a, b, c, alpha, beta, gamma = hdr["cell"]
    try:
        cell = Cell.from_gemmi(gemmi.UnitCell(a, b, c, alpha, beta, gamma))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"{path}: unusable unit cell in the header (words 11-16): {exc}") from exc
    dtype = np.dtype(hdr["order"] + _MODES[hdr["mode"]])
    count = math.prod(hdr["shape"])
    try:
        with _open_raw(path) as f:
            f.seek(hdr["data_offset"])
            buf = bytearray(count * dtype.itemsize)  # the validated size
            if f.readinto(buf) != len(buf):
                raise EOFError("the file changed while it was read")
    except (OSError, EOFError) as exc:
        raise ValueError(f"{path}: cannot read it as a CCP4/MRC map ({exc})") from exc
    nc, nr, ns = hdr["shape"]
    raw = np.frombuffer(buf, dtype=dtype).reshape(ns, nr, nc).transpose(2, 1, 0)  # [column, row, section]
    axes = hdr["axes"]
    perm = [axes.index(k) for k in range(3)]  # for cell axis k, which file axis holds it
    data = np.ascontiguousarray(np.transpose(raw, perm), dtype=np.float32)
    origin = tuple(hdr["start"][p] for p in perm)
    sampling = hdr["sampling"]
    if min(sampling) <= 0:
        sampling = data.shape
    grid = GridSpec(cell, data.shape, origin=origin, sampling=sampling)
    return torch.from_numpy(data), grid
