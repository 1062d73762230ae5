"""Frames read from a file chunk by chunk: :func:`frames_from` opens it, :class:`FrameSource` reads it.

An MD trajectory (DCD, XTC, TRR, NetCDF, … with its topology) is read through MDAnalysis, the
optional ``[md]`` extra, whose slicing reads only the frames asked for (a DCD's frames, whose
records have a fixed size, are copied out of a memory map of the file after MDAnalysis has read
its header); a multi-model PDB/mmCIF
(every model a frame) is read through gemmi, whole, at open. :func:`kernels.splat_ensemble` and
:func:`kernels.ensemble_gradients` take a :class:`FrameSource` as their frames and hold only a
few chunks of it at a time.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "FrameSource", "frame_share", "frames_from"]

#: Default cap on one chunk's positions, in bytes (the chunk is the most frames under it, at least one).
#: On a GPU a chunk in flight costs about five times its positions (its flattened atoms, the
#: prefetched chunk, the gradients of the second pass): 128 MiB keeps that near 1 GiB.
DEFAULT_CHUNK_BYTES = 128 << 20

_MODEL_SUFFIXES = (".pdb", ".ent", ".cif", ".mmcif", ".pdb.gz", ".ent.gz", ".cif.gz", ".mmcif.gz")


#: Bytes of a DCD frame's unit-cell record between its two byte counts: six float64.
_CELL_BYTES = 48


class _DcdLayout(NamedTuple):
    """What MDAnalysis's DCD reader found in the header: byte sizes of the header, the first frame and
    every later frame; whether each frame holds a unit cell; the dimensions (3, or 4 for CHARMM's 4D)."""

    header: int
    first: int
    frame: int
    cell: bool
    ndims: int


def _dcd_layout(reader, path: Path) -> _DcdLayout | None:
    """The layout of the DCD ``path`` that ``reader`` (an MDAnalysis DCDReader) opened; None for another format."""
    f = getattr(reader, "_file", None)
    sizes = [getattr(f, name, None) for name in ("_header_size", "_firstframesize", "_framesize", "ndims")]
    if path.suffix.lower() != ".dcd" or None in sizes:
        return None
    return _DcdLayout(*sizes[:3], bool(getattr(f, "is_periodic", False)), sizes[3])


def _check_dcd_length(layout: _DcdLayout, path: Path, n_frames: int) -> None:
    """ValueError when a DCD's size is not its header plus whole frames (MDAnalysis drops a cut-off frame silently)."""
    header, first, frame = layout.header, layout.first, layout.frame
    rest = os.path.getsize(path) - header - first - (n_frames - 1) * frame
    if rest != 0:
        raise ValueError(
            f"{path}: the DCD file holds {n_frames} whole frames and {rest} more bytes of a frame cut off "
            f"({frame} bytes each); it is truncated (a run that stopped while writing?): rewrite it, or copy the "
            f"first {n_frames} frames out with MDAnalysis"
        )


def _dcd_header_problem(path: Path) -> str | None:
    """What is wrong with a DCD's header or its first frame, read here before MDAnalysis reads it; or None.

    The CHARMM/NAMD layout: a record of 84 bytes (``CORD`` and 20 int32 control words), a title
    record, a record holding NATOM, then the frames. MDAnalysis answers a header it cannot use with
    errors that name neither the field nor the file ("Python int too large to convert to C long",
    "opened empty file"), so the atom count and the first frame's length are checked here first.
    A file that does not start as a DCD is left to MDAnalysis (another format under the name).
    """
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(4 + 84 + 4 + 4)
        order = next((o for o in "<>" if len(head) >= 8 and struct.unpack(o + "i", head[:4])[0] == 84), None)
        if order is None or head[4:8] != b"CORD":
            return None
        if len(head) < 4 + 84 + 4 + 4:
            return f"the DCD header is cut short: the file holds {size} bytes"
        control = struct.unpack(order + "20i", head[8:88])
        title = struct.unpack(order + "i", head[92:96])[0]
        if not 0 <= title <= size:
            return (
                f"the DCD header is cut short or damaged: its title record claims {title} bytes, but the file holds "
                f"{size}"
            )
        fh.seek(4 + 84 + 4 + 4 + title + 4)
        natom_record = fh.read(12)
    if len(natom_record) < 12:
        return f"the DCD header is cut short before its atom count (NATOM): the file holds {size} bytes"
    marker, natom, _ = struct.unpack(order + "3i", natom_record)
    header = 4 + 84 + 4 + 4 + title + 4 + 12
    if marker != 4 or not 1 <= natom <= (2**31 - 9) // 4:
        return (
            f"the DCD header gives {natom} atoms (NATOM, bytes {header - 8}–{header - 5}), which no DCD holds: the "
            "header is damaged or the file is not a DCD; write it again"
        )
    fixed, four_d = control[8], control[11]
    if fixed != 0 or four_d != 0:
        return None  # frames of another layout: MDAnalysis checks those
    cell = 56 if control[10] and control[19] else 0
    frame = cell + 3 * (8 + 4 * natom)
    if control[0] != 0 and size < header + frame:
        got = max(size - header, 0)
        return (
            f"the DCD is cut inside frame 1: it holds {got} of that frame's {frame} bytes ({natom} atoms) after its "
            f"{header}-byte header, so no whole frame (a run that stopped while writing its first frame?)"
        )
    return None


@contextlib.contextmanager
def _quiet_reader_cleanup():
    """MDAnalysis readers that failed while opening raise again from ``__del__`` ("Exception ignored in …");
    those reports are dropped while this is open. Free the failed reader inside it."""
    previous = sys.unraisablehook

    def hook(unraisable):
        module = getattr(type(unraisable.object), "__module__", "") or getattr(unraisable.object, "__module__", "")
        if not str(module).startswith("MDAnalysis"):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
        gc.collect()
    finally:
        sys.unraisablehook = previous


def open_universe(path: Path, topology: Path):
    """An MDAnalysis Universe of ``topology`` and the trajectory ``path``; ValueError naming the file and problem.

    A DCD's header and first frame are checked first (:func:`_dcd_header_problem`); whatever
    else MDAnalysis cannot read is reported with its message, once, without the noise of its
    failed reader's clean-up.
    """
    try:
        import MDAnalysis
    except ImportError:
        raise ImportError(
            "reading an MD trajectory needs MDAnalysis: pip install 'density-workbench[md]' (or MDAnalysis)"
        ) from None
    import warnings

    if path.suffix.lower() == ".dcd":
        problem = _dcd_header_problem(path)
        if problem:
            raise ValueError(f"{path}: {problem}")
    problem = None
    with _quiet_reader_cleanup():
        with warnings.catch_warnings():  # MDAnalysis warns about every guessed attribute of a PDB topology
            warnings.simplefilter("ignore")
            try:
                return MDAnalysis.Universe(str(topology), str(path))
            except Exception as exc:  # MDAnalysis raises many types for unreadable input
                problem = (
                    f"MDAnalysis cannot read the trajectory {path} with the topology {topology}: {exc}. "
                    "The topology must describe the trajectory's atoms (same number, same order)"
                )
        # the failed reader is freed here (the exception is gone), its clean-up quiet
    raise ValueError(problem)


class _Trajectory:
    """An MDAnalysis Universe of ``topology`` and ``path``: frames are read on demand."""

    def __init__(self, path: Path, topology: Path):
        self.universe = open_universe(path, topology)
        self.closed = False
        self.n_frames = len(self.universe.trajectory)
        self.n_atoms = len(self.universe.atoms)
        layout = _dcd_layout(self.universe.trajectory, path)
        self._records = None
        if layout is not None and self.n_frames >= 1:
            _check_dcd_length(layout, path, self.n_frames)
            self._records = _DcdRecords.open(layout, path, self.n_frames, self.n_atoms)

    def read(self, lo: int, hi: int, out: np.ndarray, path: Path) -> None:
        if self.closed:
            raise _closed(path)
        if self._records is not None:
            self._records.read(lo, hi, out, path)
            return
        k = -1
        try:
            for k, ts in enumerate(self.universe.trajectory[lo:hi]):
                out[k] = ts.positions
        except Exception as exc:
            raise ValueError(
                f"{path}: frame {lo + k + 1} of {self.n_frames} cannot be read ({type(exc).__name__}: {exc}); "
                "the trajectory may be truncated or damaged: read fewer frames (stop=) or rewrite it"
            ) from exc
        if k + 1 != hi - lo:
            raise ValueError(
                f"{path}: the trajectory ended after frame {lo + k + 1} although its header counts {self.n_frames}; "
                "it is truncated: read fewer frames (stop=) or rewrite it"
            )

    def close(self) -> None:
        self.closed = True
        if self._records is not None:
            self._records.close()
            self._records = None
        self.universe.trajectory.close()


class _DcdRecords:
    """A DCD's frames read as fixed-size records of the open file, checked against MDAnalysis's header.

    The layout of a DCD of three dimensions without fixed atoms: per frame an optional unit-cell
    record (six float64), then one Fortran record each of the X, Y and Z float32 coordinates, every
    record framed by its byte count. A chunk is one positioned read of its records and three strided
    copies, several times faster than a Timestep per frame; the markers of every frame read are
    checked, so damage still says where.

    The records are read with ``pread`` from a descriptor held open, never through a memory map: a
    file cut shorter while it is read (a run that rewrites it, a copy over it) gives a short read,
    which raises naming the file and the frame, where a map's missing pages would end the process
    with SIGBUS. A file replaced under its name (renamed over) is read on from the one opened.
    """

    def __init__(self, path: Path, header: int, n_frames: int, n_atoms: int, cell: bool, order: str):
        fields = [("cell0", order + "i4"), ("cell", f"V{_CELL_BYTES}"), ("cell1", order + "i4")] if cell else []
        for axis in "xyz":
            fields += [(axis + "0", order + "i4"), (axis, order + "f4", (n_atoms,)), (axis + "1", order + "i4")]
        self._cell, self._marker = cell, 4 * n_atoms
        self._dtype = np.dtype(fields)
        self._header, self._n_frames = header, n_frames
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    @classmethod
    def open(cls, layout: _DcdLayout, path: Path, n_frames: int, n_atoms: int) -> _DcdRecords | None:
        """The records of the DCD ``path`` of ``layout``, or None where its frames are laid out otherwise
        (fixed atoms, four dimensions: MDAnalysis reads those)."""
        cell_record = 8 + _CELL_BYTES if layout.cell else 0
        if n_atoms < 1 or layout.ndims != 3 or layout.first != layout.frame:
            return None
        if layout.frame != cell_record + 3 * (8 + 4 * n_atoms):
            return None
        with open(path, "rb") as fh:
            fh.seek(layout.header + cell_record)
            marker = fh.read(4)
        for order in "<>":
            if len(marker) == 4 and int(np.frombuffer(marker, dtype=order + "i4")[0]) == 4 * n_atoms:
                return cls(path, layout.header, n_frames, n_atoms, layout.cell, order)
        return None

    def _records(self, lo: int, hi: int, path: Path) -> np.ndarray:
        """Records ``lo..hi`` read whole; ValueError naming the first frame the file no longer holds."""
        records = np.empty(hi - lo, dtype=self._dtype)
        buf = memoryview(records).cast("B")
        at, offset = 0, self._header + lo * self._dtype.itemsize
        while at < len(buf):
            try:
                got = _pread_into(self._fd, buf[at:], offset + at)
            except OSError as exc:
                raise ValueError(
                    f"{path}: frame {lo + at // self._dtype.itemsize + 1} of {self._n_frames} cannot be read "
                    f"({exc.strerror or exc}): is the file still there and readable?"
                ) from exc
            if got == 0:
                size = os.fstat(self._fd).st_size
                raise ValueError(
                    f"{path}: frame {lo + at // self._dtype.itemsize + 1} of {self._n_frames} is no longer in the file: "
                    f"it is now {size} bytes, shorter than when it was opened (it changed while it was read: a run "
                    "still writing or rewriting it?); read it once it is complete, or copy it first"
                )
            at += got
        return records

    def read(self, lo: int, hi: int, out: np.ndarray, path: Path) -> None:
        """Frames ``lo..hi`` (0-based, ``hi`` excluded) into ``out`` of shape (hi − lo, N, 3)."""
        records = self._records(lo, hi, path)
        markers = [("cell0", _CELL_BYTES), ("cell1", _CELL_BYTES)] if self._cell else []
        markers += [(axis + end, self._marker) for axis in "xyz" for end in "01"]
        for name, size in markers:
            bad = np.flatnonzero(records[name] != size)
            if bad.size:
                raise ValueError(
                    f"{path}: frame {lo + int(bad[0]) + 1} is damaged (a record's byte count is "
                    f"{int(records[name][bad[0]])}, not {size}): read fewer frames (stop=) or rewrite it"
                )
        for k, axis in enumerate("xyz"):
            out[:, :, k] = records[axis]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Bytes read into ``buf`` from ``offset`` of ``fd`` (0 at the end of the file); the file position is untouched."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], offset)
    data = os.pread(fd, len(buf), offset)
    buf[: len(data)] = data
    return len(data)


def _closed(path: Path) -> ValueError:
    return ValueError(
        f"{path}: this FrameSource is closed (close() was called, or the with block that opened it ended): "
        "open the file again with kernels.frames_from"
    )


def model_rows(model) -> list:
    """(chain name, residue, atom) of every atom of a gemmi model, in :func:`kernels.read_model`'s order."""
    return [(chain.name, res, atom) for chain in model for res in chain for atom in res]


def atom_identity(chain: str, res, atom) -> tuple:
    """What makes an atom the same atom in another frame: its :class:`kernels.AtomLabel` and element."""
    from kernels.atoms import AtomLabel

    altloc = atom.altloc if atom.altloc != "\0" else ""
    return AtomLabel(chain, res.name, res.seqid.num, res.seqid.icode, atom.name, altloc), atom.element.name


def different_atoms(where: str, rows: list, first: list) -> str | None:
    """Why a model's atoms ``rows`` (:func:`model_rows`) are not model 1's, whose identities are ``first``; or None.

    The frames of an ensemble are the same atoms in the same order: every atom must match model 1's
    atom for atom (name, residue, chain, insertion code, altloc, element). ``where`` names the model.
    Both :func:`frames_from` and ``workbench ensemble`` refuse a multi-model file with this check.
    """
    if len(rows) != len(first):
        return (
            f"{where} has {len(rows)} atoms but model 1 has {len(first)}: the frames of an ensemble must be the "
            "same atoms in the same order"
        )
    for i, row in enumerate(rows):
        mine = atom_identity(*row)
        if mine != first[i]:
            return (
                f"{where}: atom {i + 1} is {mine[0]} ({mine[1]}) where model 1 has {first[i][0]} ({first[i][1]}): the "
                "frames of an ensemble must be the same atoms in the same order"
            )
    return None


class _Models:
    """Every model of a PDB/mmCIF file (gemmi), atoms in ``kernels.read_model``'s order; read whole at open.

    Every model must be model 1's atoms in the same order (:func:`different_atoms`).
    """

    def __init__(self, path: Path):
        import gemmi

        try:
            st = gemmi.read_structure(str(path))
        except Exception as exc:  # gemmi raises RuntimeError/ValueError for unreadable files
            raise ValueError(f"gemmi cannot read {path} as a model file: {exc}") from exc
        st.merge_chain_parts()
        self.positions = []
        first = None
        for index, model in enumerate(st):
            rows = model_rows(model)
            if first is None:
                first = [atom_identity(*row) for row in rows]
            else:
                problem = different_atoms(f"{path}: model {index + 1} of {len(st)} (MODEL {model.num})", rows, first)
                if problem:
                    raise ValueError(problem)
            pos = np.array([atom.pos.tolist() for _, _, atom in rows], dtype=np.float64).reshape(-1, 3)
            self.positions.append(pos)
        if not self.positions or len(self.positions[0]) == 0:
            raise ValueError(f"{path} holds no atoms")
        self.closed = False
        self.n_frames = len(self.positions)
        self.n_atoms = len(self.positions[0])

    def read(self, lo: int, hi: int, out: np.ndarray, path: Path) -> None:
        if self.closed:
            raise _closed(path)
        for k in range(lo, hi):
            out[k - lo] = self.positions[k]

    def close(self) -> None:
        self.closed = True
        self.positions = []


class FrameSource:
    """Frames ``[start, stop)`` of a trajectory or multi-model file, read chunk by chunk on demand.

    Made by :func:`frames_from`; pass it as the frames of :func:`kernels.splat_ensemble` or
    :func:`kernels.ensemble_gradients`. It holds no positions itself (a multi-model file's models
    excepted: gemmi reads those whole); every :meth:`chunks` call reads the frames again.

    Attributes
    ----------
    path : pathlib.Path
        The trajectory (or model file).
    topology : pathlib.Path or None
        Its topology (None for a model file).
    n_frames : int
        F, the frames of this source (``stop - start``).
    n_atoms : int
        N, the atoms of every frame.
    chunk : int
        Frames per chunk (≥ 1); settable. Default: the most frames whose positions fit in
        :data:`DEFAULT_CHUNK_BYTES` (128 MiB), at least one.
    start, stop : int
        The frames of the file this source covers (0-based, ``stop`` excluded).
    dtype : torch.dtype
        dtype of the chunks (float32 or float64).
    """

    def __init__(self, reader, path: Path, topology: Path | None, start: int, stop: int, chunk, dtype):
        self._reader, self.path, self.topology, self.dtype = reader, path, topology, dtype
        self.start, self.stop = start, stop
        self.chunk = _chunk_size(chunk, reader.n_atoms, dtype)

    @property
    def n_frames(self) -> int:
        """F, the frames of this source (``stop - start``)."""
        return self.stop - self.start

    @property
    def n_atoms(self) -> int:
        """N, the atoms of every frame."""
        return self._reader.n_atoms

    def __len__(self) -> int:
        return self.n_frames

    def __iter__(self):
        """Every chunk, as :meth:`chunks` gives them."""
        return self.chunks()

    @property
    def chunk(self) -> int:
        """Frames per chunk of :meth:`chunks` (≥ 1; setting it checks the value)."""
        return self._chunk

    @chunk.setter
    def chunk(self, value) -> None:
        self._chunk = _chunk_size(value, self._reader.n_atoms, self.dtype)

    def __repr__(self) -> str:
        top = f", topology={str(self.topology)!r}" if self.topology else ""
        return (
            f"FrameSource({str(self.path)!r}{top}, frames {self.start}..{self.stop} ({self.n_frames}), "
            f"{self.n_atoms} atoms, chunk={self.chunk})"
        )

    def chunks(self, start: int = 0, stop: int | None = None):
        """Yield the frames ``[start, stop)`` of this source as CPU tensors, :attr:`chunk` frames at a time.

        Parameters
        ----------
        start, stop : int
            Frames of this source (0-based, relative to :attr:`start`); default all.

        Yields
        ------
        torch.Tensor, shape (F_chunk, N, 3)
            Positions in Å, dtype :attr:`dtype`, each chunk a fresh tensor (the last may be shorter).

        Raises
        ------
        ValueError
            ``start``/``stop`` outside ``0 ≤ start ≤ stop ≤ n_frames``; a frame that cannot be read
            (a truncated or damaged trajectory), naming it.
        """
        stop = self.n_frames if stop is None else stop
        _check_range(start, stop, self.n_frames, f"{self.path} (frames {self.start}..{self.stop})", empty=True)
        np_dtype = np.float32 if self.dtype == torch.float32 else np.float64
        for lo in range(start, stop, self.chunk):
            hi = min(stop, lo + self.chunk)
            out = np.empty((hi - lo, self.n_atoms, 3), dtype=np_dtype)
            self._reader.read(self.start + lo, self.start + hi, out, self.path)
            yield torch.from_numpy(out)

    def share(self, process_group=None) -> FrameSource:
        """This rank's contiguous share of the frames (:func:`kernels.frame_share`), as a FrameSource.

        It reads the same file through the same reader; None gives a view of every frame.
        """
        lo, hi = frame_share(self.n_frames, process_group)
        return FrameSource(
            self._reader, self.path, self.topology, self.start + lo, self.start + hi, self.chunk, self.dtype
        )

    def close(self) -> None:
        """Close the file (a share closes the file of the source it came from too)."""
        self._reader.close()

    def __enter__(self) -> FrameSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chunk_size(chunk, n_atoms: int, dtype: torch.dtype) -> int:
    if chunk is None:
        itemsize = 4 if dtype == torch.float32 else 8
        return max(1, DEFAULT_CHUNK_BYTES // (3 * itemsize * max(n_atoms, 1)))
    return whole_chunk(chunk)


def frame_share(n_frames: int, process_group=None) -> tuple[int, int]:
    """The frames ``[start, stop)`` this rank splats when ``n_frames`` are split over ``process_group``.

    Contiguous shares in rank order; the first ``n_frames % world_size`` ranks take one frame more,
    so the counts differ by at most one and a rank may have none (``start == stop``).

    Parameters
    ----------
    n_frames : int
        F, the number of frames every rank passes.
    process_group : torch.distributed.ProcessGroup, optional
        None: this process splats every frame, ``(0, n_frames)``.

    Returns
    -------
    tuple of int
        ``(start, stop)``.
    """
    if process_group is None:
        return 0, n_frames
    import torch.distributed as dist

    return _share(n_frames, dist.get_rank(process_group), dist.get_world_size(process_group))


def _share(n_frames: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(n_frames, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def refuse_path(frames, name: str) -> None:
    """TypeError pointing to :func:`frames_from` when ``frames`` is a file's path, not frames.

    A str is iterable: its characters would otherwise be taken for chunks of frames.
    """
    if isinstance(frames, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{name} is a path ({os.fsdecode(frames)!r}), not frames: open the file with kernels.frames_from(path) "
            "(a multi-model PDB/mmCIF) or kernels.frames_from(path, topology) (an MD trajectory) and pass the "
            "FrameSource it gives"
        )


def whole_chunk(chunk) -> int:
    """``chunk`` as an int ≥ 1 (TypeError/ValueError otherwise)."""
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
        raise TypeError(f"chunk must be a whole number of frames (≥ 1) or None, got {chunk!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 frame, got {chunk}")
    return int(chunk)


def _check_range(start, stop, n_frames: int, what: str, empty: bool) -> None:
    """TypeError/ValueError unless ``0 ≤ start < stop ≤ n_frames`` (``start == stop`` too when ``empty``)."""
    for name, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be a frame index (int), got {value!r}")
    if not (0 <= start <= stop <= n_frames and (empty or start < stop)):
        raise ValueError(
            f"frames start={start}, stop={stop} are outside {what}, which has {n_frames} frames: "
            f"give 0 ≤ start {'≤' if empty else '<'} stop ≤ {n_frames}"
        )


def frames_from(
    path,
    topology=None,
    *,
    chunk: int | None = None,
    dtype: torch.dtype = torch.float32,
    start: int = 0,
    stop: int | None = None,
) -> FrameSource:
    """Open a trajectory (with its topology) or a multi-model PDB/mmCIF as a :class:`FrameSource`.

    An MD trajectory is opened through MDAnalysis, which reads only its header here (frame and
    atom counts); the frames are read chunk by chunk when the source is iterated. A model file
    (every MODEL a frame, atoms in :func:`kernels.read_model`'s order) is read whole by gemmi.

    Parameters
    ----------
    path : str or os.PathLike
        The trajectory (DCD, XTC, TRR, NetCDF, … anything MDAnalysis reads with a topology), or,
        without ``topology``, a multi-model ``.pdb``/``.cif`` (optionally ``.gz``).
    topology : str or os.PathLike, optional
        The trajectory's topology (PDB, PSF, GRO, PRMTOP, …); its atoms are the frames' atoms.
    chunk : int, optional
        Frames per chunk (≥ 1); default the most frames whose positions fit in
        :data:`DEFAULT_CHUNK_BYTES` (128 MiB).
    dtype : torch.dtype
        float32 (default; what trajectories store) or float64.
    start, stop : int
        Use only frames ``[start, stop)`` of the file (0-based; default every frame).

    Returns
    -------
    FrameSource

    Raises
    ------
    FileNotFoundError
        ``path`` or ``topology`` does not exist.
    ImportError
        A trajectory needs MDAnalysis (``pip install 'density-workbench[md]'``).
    ValueError
        The files cannot be read together (the topology's atom count differs from the
        trajectory's, a truncated DCD), a model file's models have different atom counts,
        ``chunk`` < 1, or ``start``/``stop`` outside the file's frames; each naming the numbers.
    TypeError
        ``chunk``/``start``/``stop`` not whole numbers, or a dtype other than float32/float64.

    Examples
    --------
    >>> src = frames_from("run.dcd", "system.psf", chunk=1000)  # doctest: +SKIP
    >>> rho = kernels.splat_ensemble(atoms, src, grid, progress=True)  # doctest: +SKIP
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    path = _existing(path, "trajectory" if topology is not None else "model file")
    if topology is not None:
        reader = _Trajectory(path, _existing(topology, "topology"))
    elif path.name.lower().endswith(_MODEL_SUFFIXES):
        reader = _Models(path)
    else:
        raise ValueError(
            f"{path} is not a PDB/mmCIF model file, so it needs its topology: frames_from({str(path)!r}, "
            "topology='system.psf' (or .pdb, .gro, .prmtop, …))"
        )
    n = reader.n_frames
    stop = n if stop is None else stop
    if n == 0:
        raise ValueError(f"{path} holds no frames")
    _check_range(start, stop, n, str(path), empty=False)
    return FrameSource(reader, path, None if topology is None else Path(topology), start, stop, chunk, dtype)


def _existing(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the {what} must be a path (str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"the {what} {p} does not exist (or is not a file)")
    return p
