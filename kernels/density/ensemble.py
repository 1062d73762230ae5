"""Density of an ensemble: F frames of the same atoms, summed (weighted) or one map per frame.

``reduce="sum"`` flattens the frames into one atom set of F·N atoms (positions a view of ``xyz``,
each frame's B and occupancy, the coefficients repeated, occupancy times the frame's weight) and
calls the single-model density backend on it: ONE call on the GPU (one launch); on the CPU in
chunks of ``CHUNK_ATOM_FRAMES`` atom-frames whose maps are added (one chunk for a usual ensemble),
so the kernel's ~450 B of state per atom never exists for every atom-frame at once; never F maps
in memory. Because every atom's radius depends on its B and the
cutoff only (not its occupancy), the voxel set of each frame is the one its single splat uses,
and the weights' gradient is the occupancy gradient through the product.

``reduce="none"`` calls the backend's ``splat_frames_*`` function (op ``"density_frames"`` in
:mod:`kernels.dispatch`), which returns the F maps.

With ``process_group=`` every rank takes the same full inputs and splats a contiguous share of
the frames; ``reduce="sum"`` maps are then combined by one ``all_reduce`` whose backward passes
the map gradient through unchanged, so each rank's input gradients hold its own frames' rows
(zeros elsewhere) and their sum over ranks is the single-process gradient
(:func:`sum_gradients_over_ranks`).

Frames that are not one tensor (an iterable of chunks, a :class:`kernels.FrameSource`) go to
:mod:`kernels.density.stream`, which sums chunk by chunk with :func:`_sum_frames` as this module does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from kernels._util import end_with_launcher
from kernels.crystal import AtomSet, GridError, GridSpec, _free_memory, _size, _Tiled
from kernels.density.adp import first_bad_adp, with_blur
from kernels.density.radius import DEFAULT_CUTOFF
from kernels.dispatch import get_backend

__all__ = ["splat_ensemble", "sum_gradients_over_ranks", "frame_share"]


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


def _check_group(process_group) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("process_group= needs torch.distributed, which this build of torch does not have")
    if not dist.is_initialized():
        raise ValueError(
            "process_group= was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group (torchrun sets the environment for it) first"
        )
    if dist.get_rank(process_group) < 0:
        raise ValueError("this process is not a member of process_group; every rank of the group must call")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank torchrun started: end with it (a SIGKILL reaches no rank)
        end_with_launcher()


_agreed: set[tuple] = set()


def _check_ranks_agree(process_group, n_frames: int, n: int, grid: GridSpec, device: torch.device) -> None:
    """ValueError on every rank unless all ranks of ``process_group`` pass the same F, N and grid shape.

    One all_reduce (MAX) of five host integers and their negatives, once per (group, F, N, shape) on
    this rank: every rank passes the same full inputs, and a rank with other frames would give a map
    silently off. NCCL reduces device tensors: the result is read back once per signature.
    """
    import torch.distributed as dist

    mine = (n_frames, n, *grid.shape)
    key = (id(process_group), mine)
    if key in _agreed:
        return
    on = device if dist.get_backend(process_group) == "nccl" else torch.device("cpu")
    values = torch.tensor([*mine, *(-v for v in mine)], dtype=torch.int64, device=on)
    try:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group)
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses; a timeout is the usual one here
        raise RuntimeError(
            f"splat_ensemble(process_group=...): rank {dist.get_rank(process_group)} could not agree on the inputs "
            f"with the other ranks ({exc}). Every rank of the group must call splat_ensemble with process_group= "
            "at the same point; a rank that left process_group out, or stopped, makes the others wait until the "
            "group's timeout"
        ) from exc
    high = values[:5].tolist()
    low = [-v for v in values[5:].tolist()]
    if high != low:
        names = ("F (frames)", "N (atoms)", "grid nx", "grid ny", "grid nz")
        differ = "; ".join(f"{name} from {lo} to {hi}" for name, lo, hi in zip(names, low, high) if lo != hi)
        raise ValueError(
            f"splat_ensemble(process_group=...): the ranks pass different inputs ({differ}); this rank "
            f"{dist.get_rank(process_group)} has F={n_frames}, N={n}, grid {grid.shape}. Every rank must pass the "
            "same atoms, full frames and grid (F is the total number of frames; each rank splats its share)"
        )
    _agreed.add(key)


def _rank(process_group) -> int:
    """This process's rank in ``process_group`` (0 without one)."""
    if process_group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(process_group)


def _warn_if_distributed(n_frames: int) -> None:
    """Warn once when torch.distributed runs several ranks but this call splats every frame alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    from kernels._util import warn_once

    warn_once(
        ("splat_ensemble", "no process_group"),
        f"splat_ensemble: torch.distributed runs {dist.get_world_size()} ranks but process_group= was not given, "
        f"so rank {dist.get_rank()} splats all {n_frames} frames alone; if the other ranks pass process_group=, "
        "they wait for this one until the group's timeout. Pass the same process_group= on every rank to split "
        "the frames (or leave it out on every rank)",
        stacklevel=4,
    )


def _check_tensor(t, name: str, shape: tuple[int, ...], atoms: AtomSet, meaning: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape} ({meaning}), got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({meaning}), got {tuple(t.shape)}")
    if t.dtype != atoms.dtype or t.device != atoms.device:
        raise ValueError(
            f"{name} is {t.dtype} on {t.device} but the atoms are {atoms.dtype} on {atoms.device}; "
            f"convert it with {name}.to(device=atoms.device, dtype=atoms.dtype)"
        )
    return t


def _first_bad(bad: torch.Tensor, n: int) -> tuple[int, int, int]:
    """(frame, atom index, how many) of the True entries of an (F, N) mask."""
    flat = bad.reshape(-1)
    f, i = divmod(int(flat.nonzero()[0, 0]), n)
    return f, i, int(flat.sum())


def _check_values(atoms: AtomSet, xyz, b_iso, occ, n: int, u_aniso=None, per_chunk: int | None = None) -> None:
    """Host checks of the frames' values (CPU tensors only: on a GPU they would stop the host).

    ``per_chunk`` frames at a time, so the masks never cover every atom-frame at once.
    """
    n_frames = xyz.shape[0]
    per_chunk = per_chunk or n_frames
    for lo in range(0, n_frames, per_chunk):
        rows = slice(lo, min(n_frames, lo + per_chunk))
        part = [None if t is None else t[rows] for t in (b_iso, occ, u_aniso)]
        _check_chunk(atoms, xyz[rows], part[0], part[1], n, part[2], lo)


def _check_chunk(atoms: AtomSet, xyz, b_iso, occ, n: int, u_aniso, first: int) -> None:
    """:func:`_check_values` of frames ``first``, ``first + 1``, … (the tensors' first rows)."""
    if u_aniso is not None:
        flags = atoms.aniso.repeat(u_aniso.shape[0])
        bad = first_bad_adp(u_aniso.detach().reshape(-1, 6), flags)
        if bad is not None:
            idx, count, what = bad
            f, i = divmod(idx, n)
            more = f" ({count - 1} more atom-frames too)" if count > 1 else ""
            raise ValueError(f"frame {first + f}: atom {atoms.labels[i]} (index {i}) {what}{more}")
    checks = [(xyz, ~torch.isfinite(xyz.detach()).all(dim=2), "has a non-finite position", "Å")]
    if b_iso is not None:
        b = b_iso.detach()
        checks.append((b_iso, ~(torch.isfinite(b) & (b > 0)), "has B ≤ 0 or non-finite B", "Å²"))
    if occ is not None:
        o = occ.detach()
        checks.append((occ, ~(torch.isfinite(o) & (o >= 0) & (o <= 1)), "has an occupancy outside [0, 1]", ""))
    for values, bad, what, unit in checks:
        if bool(bad.any()):
            f, i, count = _first_bad(bad, n)
            value = f"{values[f, i].detach().tolist()}{' ' + unit if unit else ''}"
            more = f" ({count - 1} more atom-frames too)" if count > 1 else ""
            raise ValueError(f"frame {first + f}: atom {atoms.labels[i]} (index {i}) {what}: {value}{more}")


def _as_weights(weights, n_frames: int, atoms: AtomSet) -> torch.Tensor:
    if isinstance(weights, torch.Tensor):
        w = _check_tensor(weights, "weights", (n_frames,), atoms, "one weight per frame")
    else:
        try:
            arr = np.asarray(weights, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(
                f"weights must be a tensor or a sequence of {n_frames} real numbers (one per frame), "
                f"got {type(weights).__name__}"
            ) from None
        if arr.shape != (n_frames,):
            raise ValueError(f"weights must have shape ({n_frames},) (one weight per frame), got {arr.shape}")
        w = torch.as_tensor(arr).to(device=atoms.device, dtype=atoms.dtype)
    if w.device.type == "cpu":
        bad = ~torch.isfinite(w.detach())
        if bool(bad.any()):
            f = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"weights must be finite: frame {f} has weight {float(w[f])} ({int(bad.sum())} non-finite in all)"
            )
    return w


def _real_weight(weights) -> float:
    """The one weight of every streamed frame: a finite real number (per-frame weights need the F up front)."""
    from kernels._util import _real_scalar

    try:
        w = _real_scalar(weights, "weights", "", "one number for every frame")
    except ValueError:
        raise ValueError(
            f"weights with streamed frames (an iterable or a FrameSource) must be one number for every frame "
            f"(e.g. 1/F for the mean), got {type(weights).__name__}; per-frame weights need the frames as one tensor"
        ) from None
    if not math.isfinite(w):
        raise ValueError(f"weights must be finite, got {w}")
    return w


class _AllReduceSum(torch.autograd.Function):
    """Sum of each rank's map over ``group``; the backward passes the map gradient through unchanged.

    Every rank computes the same loss on the same reduced map, so the incoming gradient is the same
    on every rank, and each rank's frames receive exactly their single-process gradient.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        out = local.clone()  # the backend's map may be a view autograd still tracks: reduce a copy
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _NoFrames(torch.autograd.Function):
    """Zeros of ``shape`` for a rank without frames, joined to the inputs that want a gradient.

    The rank still runs the caller's loss and backward like the others; its inputs then get zero
    gradients instead of ``None`` (and ``backward`` does not fail on a map that needs no grad).
    """

    @staticmethod
    def forward(ctx, shape, dtype, device, *inputs):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.inputs))


def splat_ensemble(
    atoms: AtomSet,
    xyz: torch.Tensor,
    grid: GridSpec,
    *,
    weights=None,
    b_iso: torch.Tensor | None = None,
    occ: torch.Tensor | None = None,
    u_aniso: torch.Tensor | None = None,
    reduce: str = "sum",
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    backend: str = "auto",
    process_group=None,
    blur: float = 0.0,
    radius_rule: str = "gemmi",
    chunk: int | None = None,
    progress=None,
    prefetch: bool | None = None,
) -> torch.Tensor:
    """Electron density of F frames of the same atoms: their weighted sum, or one map per frame.

    Frame f is ``atoms`` with positions ``xyz[f]`` (and B ``b_iso[f]``, occupancy ``occ[f]``
    when given); its map is what :func:`kernels.splat_density` gives for those atoms.

    Parameters
    ----------
    atoms : AtomSet
        The N atoms every frame shares: their IT92 coefficients, and their B and occupancy where
        ``b_iso``/``occ`` are not given. ``atoms.xyz`` is not used. Its device and dtype pick the
        backend as for :func:`kernels.splat_density`.
    xyz : torch.Tensor (F, N, 3), iterable of (F_chunk, N, 3) tensors, or kernels.FrameSource
        The frames. A tensor: positions in Å of every frame, F ≥ 1, the atoms' dtype and device;
        may require grad. Streamed frames (a generator or any iterable of chunks, uneven sizes
        allowed, or a :class:`kernels.FrameSource` from :func:`kernels.frames_from`): each chunk is
        moved to the atoms' device and dtype, splatted and dropped, so at most three chunks (the
        one splatted, the one prefetched, the one being read) and the map exist at once. They take
        ``reduce="sum"`` only, no per-frame ``b_iso``/``occ``/``u_aniso`` (every frame uses the
        atoms' own), ``weights`` as one number for every frame (e.g. 1/F), and the map carries no
        autograd graph: the per-frame gradients come from :func:`kernels.ensemble_gradients`.
    grid : GridSpec
        Whole-cell grid (every backend) or box grid (``reference`` only).
    weights : torch.Tensor or sequence of float, shape (F,), optional
        Weight of each frame's map in the sum (default 1 each); finite, any sign. A tensor must
        have the atoms' dtype and device and may require grad; a sequence is converted.
    b_iso : torch.Tensor, shape (F, N), optional
        B in Å² of every atom in every frame (default: ``atoms.b_iso`` in every frame).
    occ : torch.Tensor, shape (F, N), optional
        Occupancy of every atom in every frame (default: ``atoms.occ`` in every frame).
    u_aniso : torch.Tensor, shape (F, N, 6), optional
        U in Å² of every atom in every frame, for the atoms ``atoms.aniso`` marks (default:
        ``atoms.u_aniso`` in every frame). Needs an anisotropic ``atoms``.
    reduce : {"sum", "none"}
        ``"sum"``: Σ_f weights[f]·map_f, one map, from one backend call on all F·N atoms (no F
        maps are ever held). ``"none"``: the F maps, each times its weight, after a check that
        they fit in memory.
    radius : float, optional
        One cutoff radius in Å for every atom; default: each atom's radius from its B and
        ``cutoff`` (gemmi's rule), as in :func:`kernels.splat_density`.
    cutoff : float
        Density level in e/Å³ for the per-atom radius (default 1e-5).
    backend : {"auto", "reference", "cpu", "triton"}
        As for :func:`kernels.splat_density`.
    blur, radius_rule
        As for :func:`kernels.splat_density`: an extra B on every atom of every frame, and the
        radius rule of anisotropic atoms.
    process_group : torch.distributed.ProcessGroup, optional
        Split the frames over the ranks of this group (only when given: an initialised
        ``torch.distributed`` alone changes nothing). Every rank passes the same full inputs and
        splats its contiguous share :func:`frame_share` (counts may be uneven; a rank may have
        none). ``reduce="sum"``: the ranks' maps are summed by one ``all_reduce`` and every rank
        returns the full map; its backward passes the map gradient through unchanged, so each
        rank's gradient of ``xyz``, ``b_iso``, ``occ`` and ``weights`` holds its own frames'
        rows and zeros elsewhere (and of ``atoms.b_iso``/``atoms.occ``, its frames' part): the
        sum over ranks (:func:`sum_gradients_over_ranks`) is the single-process gradient.
        ``reduce="none"``: each rank returns only its own frames' maps (no communication).
        In a rank torchrun started, the first such call makes the process end with torchrun
        (:func:`kernels._util.end_with_launcher`), which a SIGKILL of torchrun would not reach.
        Streamed frames (streaming mode): each rank reads only its own share, a FrameSource's
        :meth:`~kernels.FrameSource.share` or, for an iterable, whatever this rank's iterable
        yields (uneven counts allowed, a rank may have none). The ranks check that they agree on
        N, the grid shape and a FrameSource's F before reading, sum their frame counts (F ≥ 1 in
        all) and their maps with one ``all_reduce`` each; every rank returns the full map.
    chunk : int, optional
        Frames per backend call (≥ 1). Default: for a host tensor ``CHUNK_ATOM_FRAMES`` atom-frames,
        for a GPU tensor all frames in one call; streamed chunks are split into pieces of at most
        ``chunk`` frames (a FrameSource reads ``chunk`` frames at a time).
    progress : bool or callable, optional
        None/False: nothing shown. True: a bar with frames/s and an ETA (``tqdm.auto`` when tqdm is
        importable, an ipywidgets bar in a notebook; else one stderr line), on rank 0 only under a
        process group. A callable: ``progress(done, total)`` after every backend call, on every
        rank, counting this rank's frames (``total`` None for an iterable).
    prefetch : bool, optional
        Read the next chunk of streamed frames on a thread while this one is splatted (default:
        on for streamed frames; tensors are not prefetched).

    Returns
    -------
    torch.Tensor
        ``reduce="sum"``: shape ``grid.shape``; ``reduce="none"``: shape (F, *grid.shape), or
        (stop − start, *grid.shape) with a process group. float64 from ``reference``, float32
        from ``cpu`` and ``triton``; on the atoms' device. Differentiable with respect to
        ``xyz``, ``b_iso``, ``occ``, ``u_aniso``, ``weights`` and (where used)
        ``atoms.b_iso``/``atoms.occ``/``atoms.u_aniso``.

    Raises
    ------
    TypeError
        ``atoms`` is not an AtomSet, ``xyz`` neither a tensor, an iterable nor a FrameSource (or a
        chunk of it not a tensor), or ``b_iso``/``occ`` not tensors; ``chunk`` not an int.
    ValueError
        Streamed frames with ``reduce="none"``, per-frame ``b_iso``/``occ``/``u_aniso`` or per-frame
        weights, a chunk of another shape or one that requires grad (naming the chunk), no frames
        at all; a shape other than (F, N, 3), (F, N) or (F,); F = 0; N not ``len(atoms)``; a dtype or
        device other than the atoms'; an unknown ``reduce``; non-finite weights, or (CPU tensors)
        a non-finite position, B ≤ 0 or occupancy outside [0, 1] — naming the frame and atom;
        ``radius``/``cutoff``/``blur``/``radius_rule`` refused as :func:`kernels.splat_density`
        refuses them (one validator), a negative ``blur`` leaving an atom without a Gaussian (CPU,
        naming frame and atom); weights whose map overflows its dtype (CPU); ``process_group``
        given without an initialised ``torch.distributed``, or ranks passing different F, N or grid
        shapes (raised on every rank, naming the values). CUDA tensors' values are not read back
        (no host synchronisation), as for the ``triton`` backend of :func:`kernels.splat_density`.
    RuntimeError
        With ``process_group``: the ranks' check of their inputs failed or timed out (a rank that
        left ``process_group`` out, or stopped).
    kernels.GridError
        The map (``"sum"``) or the F maps (``"none"``) would not fit in memory; on the CPU the
        sum's predicted host peak (maps, one chunk's per-atom state and, with a gradient, what the
        backward keeps) would not fit, the figure stated; a fast backend got a box grid, or
        ``radius`` is far too large.
    kernels.BackendError
        The backend asked for cannot run here.
    """
    if not isinstance(atoms, AtomSet):
        raise TypeError(f"atoms must be a kernels.AtomSet, got {type(atoms).__name__}")
    n = len(atoms)
    if not isinstance(xyz, torch.Tensor):
        if isinstance(xyz, np.ndarray) or not isinstance(xyz, Iterable):
            raise TypeError(
                f"xyz must be a torch.Tensor of shape (F, {n}, 3) (frames, atoms, Å), an iterable of such tensors "
                f"(chunks of frames) or a kernels.FrameSource, got {type(xyz).__name__}"
                + ("; convert an array with torch.from_numpy" if isinstance(xyz, np.ndarray) else "")
            )
        from kernels.density.stream import splat_stream

        return splat_stream(
            atoms, xyz, grid, weights=weights, b_iso=b_iso, occ=occ, u_aniso=u_aniso, reduce=reduce, radius=radius,
            cutoff=cutoff, backend=backend, process_group=process_group, blur=blur, radius_rule=radius_rule,
            chunk=chunk, progress=progress, prefetch=prefetch,
        )  # fmt: skip
    if xyz.ndim != 3 or xyz.shape[1:] != (n, 3):
        hint = (
            f"; the atoms have {n}, so the frames must too"
            if xyz.ndim == 3 and xyz.shape[2] == 3
            else ("; one frame is xyz[None]" if xyz.ndim == 2 else "")
        )
        raise ValueError(f"xyz must have shape (F, {n}, 3) (frames, atoms, Å), got {tuple(xyz.shape)}{hint}")
    n_frames = xyz.shape[0]
    if n_frames < 1:
        raise ValueError(f"xyz holds no frames (shape {tuple(xyz.shape)}); give at least one")
    _check_tensor(xyz, "xyz", (n_frames, n, 3), atoms, "frames, atoms, Å")
    if b_iso is not None:
        _check_tensor(b_iso, "b_iso", (n_frames, n), atoms, "B of every atom in every frame, Å²")
    if occ is not None:
        _check_tensor(occ, "occ", (n_frames, n), atoms, "occupancy of every atom in every frame")
    if u_aniso is not None:
        if atoms.u_aniso is None:
            raise ValueError(
                "u_aniso was given but the atoms are isotropic: build them with U (read_model(adp='auto') of a "
                "file with ANISOU, or AtomSet(..., u_aniso=, aniso=)) so that atoms.aniso says which atoms use it"
            )
        _check_tensor(u_aniso, "u_aniso", (n_frames, n, 6), atoms, "U of every atom in every frame, Å²")
    from kernels.density import _splat_arguments

    radius, cutoff, blur = _splat_arguments(radius, cutoff, blur, radius_rule, grid)
    if chunk is not None:
        from kernels.density.frames import whole_chunk

        chunk = whole_chunk(chunk)
    w = None if weights is None else _as_weights(weights, n_frames, atoms)
    if reduce not in ("sum", "none"):
        raise ValueError(f"reduce must be 'sum' (one weighted map) or 'none' (one map per frame), got {reduce!r}")
    if process_group is not None:
        _check_group(process_group)
        _check_ranks_agree(process_group, n_frames, n, grid, atoms.device)
    else:
        _warn_if_distributed(n_frames)
    name, single = get_backend("density", atoms.device, backend)
    if name != "reference" and not grid.is_whole_cell:
        raise GridError(f"the {name} density backend splats whole-cell grids only; use backend='reference' for a box")
    dtype = torch.float64 if name == "reference" else torch.float32

    start, stop = frame_share(n_frames, process_group)
    count = stop - start
    if count == 0:
        return _no_frames(atoms, xyz, b_iso, occ, w, grid, dtype, reduce, process_group, u_aniso)
    host = atoms.device.type == "cpu"
    if reduce == "none":  # checked while no F·N-atom tensor exists yet, so a refusal allocates nothing
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (xyz, b_iso, occ, w, u_aniso, atoms.b_iso, atoms.occ, atoms.u_aniso)
        )
        _require_frames_memory(grid, count, dtype, atoms.device, grad)
        if host:
            _check_values(atoms, xyz, b_iso, occ, n, u_aniso, count)
        extra = {} if atoms.u_aniso is None else {"radius_rule": radius_rule}
        frames = _checked_frames(atoms, xyz, b_iso, occ, u_aniso, start, stop, blur, radius, cutoff, grid, radius_rule)
        frames = _weighted(frames, w, start, stop, n)
        _, per_frame = get_backend("density_frames", atoms.device, name)
        return per_frame(frames, grid, n_frames=count, radius=radius, cutoff=cutoff, **extra)
    plan = _Plan(grid, name, single, dtype, radius, cutoff, blur, radius_rule)
    from kernels._progress import progress_bar

    shown = progress if callable(progress) else bool(progress) and _rank(process_group) == 0
    with progress_bar(count, desc="splat_ensemble", enabled=shown) as bar:
        out, _ = _sum_frames(atoms, xyz, plan, w, b_iso, occ, u_aniso, start, stop, chunk, bar=bar)
    if process_group is not None:
        out = _AllReduceSum.apply(out, process_group)
    return out


class _Plan(NamedTuple):
    """What every backend call of one ensemble shares: the grid, the backend and the validated splat arguments."""

    grid: GridSpec
    name: str
    single: Callable
    dtype: torch.dtype
    radius: float | None
    cutoff: float
    blur: float
    radius_rule: str


def _sum_frames(
    atoms, xyz, plan: _Plan, w, b_iso, occ, u_aniso, start: int, stop: int, chunk, warn_small=True, bar=None
):
    """Σ over frames ``start..stop`` of ``w[f]``·map_f, one backend call per ``chunk`` frames; (map, small?).

    ``chunk`` None: the host takes ``CHUNK_ATOM_FRAMES`` atom-frames per call (the kernel's per-atom state,
    ~450 B, then never exists for all F·N at once), a GPU all frames in one call. The second value says
    whether atoms below the grid spacing were found (warned about when ``warn_small``). ``bar``: a
    :func:`kernels._progress.progress_bar` told of every call's frames.
    """
    n, count, grid, dtype = len(atoms), stop - start, plan.grid, plan.dtype
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (xyz, b_iso, occ, w, u_aniso, atoms.b_iso, atoms.occ, atoms.u_aniso)
    )
    host = atoms.device.type == "cpu"
    per_chunk = chunk or (max(1, CHUNK_ATOM_FRAMES // max(n, 1)) if host else count)
    grad_bytes = _grad_bytes_per_atom(atoms, b_iso, plan.radius, plan.cutoff, grid) if grad and host else 0
    _require_sum_memory(grid, count, n, min(per_chunk, count), dtype, atoms.device, grad_bytes, plan.name)
    if host:
        _check_values(atoms, xyz, b_iso, occ, n, u_aniso, per_chunk)
    extra = {} if atoms.u_aniso is None else {"radius_rule": plan.radius_rule}
    out, bound = None, 0.0
    small = []  # what each chunk's check of atoms below the grid spacing found
    for lo in range(start, stop, per_chunk):
        hi = min(stop, lo + per_chunk)
        frames = _checked_frames(
            atoms, xyz, b_iso, occ, u_aniso, lo, hi, plan.blur, plan.radius, plan.cutoff, grid, plan.radius_rule, small
        )
        if host and w is not None:  # the largest value the weighted map could reach: every atom on one voxel
            from kernels.density import _peak_density_host

            peaks = np.abs(_peak_density_host(frames)).reshape(hi - lo, n).sum(axis=1)
            with np.errstate(over="ignore"):  # beyond float64 is beyond any map's range: inf says so
                bound += float(peaks @ np.abs(w[lo:hi].detach().to(torch.float64).numpy()))
        part = plan.single(_weighted(frames, w, lo, hi, n), grid, radius=plan.radius, cutoff=plan.cutoff, **extra)
        del frames
        if out is None:
            out = part
        elif out.requires_grad or part.requires_grad:
            out = out + part
        else:
            out.add_(part)
        del part
        if bar is not None:
            bar.update(hi - lo)
    if small and warn_small:
        from kernels.density import _warn_small

        first, first_lo = small[0]
        idx, _, r, peak = first
        _warn_small(
            _flatten(atoms, xyz, b_iso, occ, first_lo, first_lo + 1 + idx // n, u_aniso),
            (idx, sum(f[1] for f, _ in small), r, peak),
            plan.cutoff,
            grid,
            n,
            first_lo,
        )
    if bound > torch.finfo(out.dtype).max and not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"the weights (largest |weight| {float(w.detach().abs().max()):.3g}) make the {out.dtype} map overflow: "
            f"its values could reach {bound:.3g}, beyond {torch.finfo(out.dtype).max:.3g}; scale the weights down "
            "(a weighted mean has weights summing to 1)"
        )
    return out, bool(small)


#: Atom-frames per call of the CPU backend in a sum: bounds the kernel's per-atom state to ~120 MB.
CHUNK_ATOM_FRAMES = 1 << 18

# Host bytes per atom-frame, measured with ru_maxrss on 10^6 atom-frames of carbon (isotropic, float32, B 20 Å²):
# in one chunk, the flattened frames (B, occupancy, coefficients: ~50 B) and the CPU kernel's per-atom
# state (its prepared atom, 368 B, and its x-segments, ~40 B): 520 B. With a gradient, for every
# atom-frame until the backward: the inputs the kernel read and the fractional positions (~160 B), and
# the row intervals of the atom's box (4 B per (x, y) row). Measured at 1.0, 0.5 and 0.33 Å: 480, 1520 and
# 3340 B per atom-frame; this estimate gives 740, 1760 and 3300.
_CHUNK_BYTES_PER_ATOM = 520
_GRAD_BYTES_PER_ATOM = 160


def _grad_bytes_per_atom(atoms: AtomSet, b_iso, radius, cutoff: float, grid: GridSpec) -> int:
    """Host bytes the CPU backward keeps per atom-frame: fixed part plus the atom's row intervals.

    The box of the widest of up to 64 atoms of the first frame (its radius from the cutoff, or ``radius``).
    """
    if radius is None:
        from kernels.density.cpu import cutoff_radius_cpu

        pick = torch.linspace(0, len(atoms) - 1, min(64, len(atoms))).round().long()
        b = (atoms.b_iso if b_iso is None else b_iso[0]).detach()[pick]
        radius = float(cutoff_radius_cpu(b.clamp_min(1e-3), atoms.a[pick], atoms.b[pick], cutoff).max())
    kx, ky = (r * m for r, m in zip(grid.cell.reciprocal_lengths[:2], grid.sampling[:2]))  # voxels per Å
    return _GRAD_BYTES_PER_ATOM + 4 * (2 * math.ceil(radius * kx) + 2) * (2 * math.ceil(radius * ky) + 2)


def _require_sum_memory(grid, count, n, chunk, dtype, device, grad_per_atom: int, backend: str) -> None:
    """GridError when reduce="sum" of ``count`` frames of ``n`` atoms would not fit, with the figure.

    Predicted host peak: two maps (the sum and one chunk's map; three with a gradient) plus one chunk's
    per-atom state, plus ``grad_per_atom`` bytes the backward keeps for every atom-frame (0 without a
    gradient). The reference backend checks its own temporaries per call; GPUs check the maps once per grid.
    """
    if device.type != "cpu" or backend == "reference":
        key = (grid.cell.parameters, grid.shape, dtype, str(device))
        from kernels.density import _memory_checked

        if key not in _memory_checked:  # as splat_density: once per grid
            grid.require_memory(dtype, device, copies=2)
            _memory_checked.add(key)
        return
    extra = chunk * n * _CHUNK_BYTES_PER_ATOM + count * n * grad_per_atom
    copies = 3 if grad_per_atom else 2
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = grid.n_voxels * itemsize * copies + extra
    if need < _SMALL_SUM:  # a usual ensemble: no query of the free memory per call
        return
    free = _free_memory(torch.device(device))
    if need > 0.8 * free:
        nx, ny, nz = grid.shape
        kept = (
            f", and ~{grad_per_atom} B per atom-frame kept for the backward ({_size(count * n * grad_per_atom)})"
            if grad_per_atom
            else ""
        )
        raise GridError(
            f"reduce='sum' of {count} frames × {n} atoms on a {nx}×{ny}×{nz} grid needs about {_size(need)} of "
            f"host memory ({copies} maps, ~{_CHUNK_BYTES_PER_ATOM} B per atom-frame for a chunk of {chunk} frames"
            f"{kept}), but only {_size(free)} is free; split the frames over several calls and add the maps"
            + (" (calling backward on each part)" if grad_per_atom else "")
            + ", or use a coarser grid spacing"
        )


_SMALL_SUM = 256 << 20


def _checked_frames(atoms, xyz, b_iso, occ, u_aniso, lo, hi, blur, radius, cutoff, grid, radius_rule, small=None):
    """Frames ``lo..hi`` flattened and blurred, with the host checks that need their values.

    Host atoms: a negative blur that leaves an atom without a Gaussian raises (naming the frame);
    atoms whose cutoff radius is below the grid spacing warn (or, with ``small`` given, are appended
    to it as ``(finding, lo)`` for one warning over every chunk).
    """
    from kernels.density import _atoms_below_spacing, _check_blurred, _warn_small

    n = len(atoms)
    frames = with_blur(_flatten(atoms, xyz, b_iso, occ, lo, hi, u_aniso), blur)
    if atoms.device.type != "cpu":
        return frames
    _check_blurred(frames, blur, n, lo)
    if radius is None:
        found = _atoms_below_spacing(frames, cutoff, grid, radius_rule)
        if found is not None:
            if small is None:
                _warn_small(frames, found, cutoff, grid, n, lo)
            else:
                small.append((found, lo))
    return frames


def _weighted(frames: AtomSet, w, lo: int, hi: int, n: int) -> AtomSet:
    """``frames`` (frames ``lo..hi`` of ``n`` atoms, flattened) with each frame's occupancy times its weight."""
    if w is None:
        return frames
    occ = (frames.occ.reshape(hi - lo, n) * w[lo:hi, None]).reshape(-1)
    return frames.replace(occ=occ, _validate=False)


def _flatten(atoms: AtomSet, xyz, b_iso, occ, start: int, stop: int, u_aniso=None) -> AtomSet:
    """Frames ``start..stop`` as one frame-major AtomSet of (stop − start)·N atoms (not validated again)."""
    count, n = stop - start, len(atoms)
    u = flags = None
    if atoms.u_aniso is not None:
        u = (atoms.u_aniso.expand(count, n, 6) if u_aniso is None else u_aniso[start:stop]).reshape(count * n, 6)
        flags = atoms.aniso.repeat(count)
    pos = xyz[start:stop].reshape(count * n, 3)  # a view when xyz is contiguous
    b = (atoms.b_iso.expand(count, n) if b_iso is None else b_iso[start:stop]).reshape(-1)
    o = atoms.occ.expand(count, n) if occ is None else occ[start:stop]
    a = atoms.a.detach().repeat(count, 1)
    bb = atoms.b.detach().repeat(count, 1)
    return AtomSet(
        pos,
        b,
        o.reshape(-1),
        a,
        bb,
        _Tiled(atoms.elements, count),
        _Tiled(atoms.labels, count),
        u,
        flags,
        radiation=atoms.radiation,
        _validate=False,
    )


def _no_frames(atoms, xyz, b_iso, occ, w, grid, dtype, reduce, process_group, u_aniso=None):
    """What a rank without frames returns: zeros joined to the graph (and reduced, for ``"sum"``)."""
    tensors = (xyz, b_iso, occ, w, atoms.b_iso, atoms.occ, u_aniso, atoms.u_aniso)
    inputs = [t for t in tensors if t is not None and t.requires_grad]
    shape = tuple(grid.shape) if reduce == "sum" else (0, *grid.shape)
    if torch.is_grad_enabled() and inputs:
        out = _NoFrames.apply(shape, dtype, atoms.device, *inputs)
    else:
        out = torch.zeros(shape, dtype=dtype, device=atoms.device)
    if reduce == "sum":
        grid.require_memory(dtype, atoms.device, copies=2)
        out = _AllReduceSum.apply(out, process_group)
    return out


def _require_frames_memory(grid: GridSpec, count: int, dtype: torch.dtype, device: torch.device, grad: bool) -> None:
    """GridError when ``count`` maps (and, for a gradient, their gradient) would not fit in 80 % of free memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    maps = count * grid.n_voxels * itemsize
    need = maps * (2 if grad else 1)
    free = _free_memory(torch.device(device))
    if need > 0.8 * free:
        nx, ny, nz = grid.shape
        also = f" and as much again for their gradient ({_size(need)} in all)" if grad else ""
        per_call = max(0, int(0.8 * free // (grid.n_voxels * itemsize * (2 if grad else 1))))
        raise GridError(
            f"reduce='none' returns {count} maps of {nx}×{ny}×{nz} {dtype}: {_size(maps)}{also}, but only "
            f"{_size(free)} is free on {device}; use reduce='sum' (one map for all frames), splat at most "
            f"{per_call} frames per call, or a coarser grid spacing"
        )


def sum_gradients_over_ranks(tensors: Sequence[torch.Tensor], process_group) -> list[torch.Tensor]:
    """Sum the ``.grad`` of each tensor over the ranks of ``process_group``, in place.

    After a backward through :func:`splat_ensemble` with ``process_group=``, each rank's gradients
    hold its own frames' contributions only; the sum over ranks is the single-process gradient.
    One ``all_reduce`` per dtype (the gradients are packed into one buffer). Every rank of the group
    must call it with the same tensors in the same order; a tensor whose ``.grad`` is None on this
    rank takes part as zeros (and gets the summed gradient).

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        Leaf tensors that took part in the backward (e.g. ``xyz``, ``weights``), any shapes; each
        must require grad.
    process_group : torch.distributed.ProcessGroup
        The group passed to :func:`splat_ensemble`.

    Returns
    -------
    list of torch.Tensor
        The summed gradients (each tensor's ``.grad``), in the order given.

    Raises
    ------
    ValueError
        A tensor does not require grad, or ``torch.distributed`` is not initialised.
    """
    import torch.distributed as dist

    _check_group(process_group)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            raise ValueError(f"tensors[{i}] does not require grad, so it has no gradient to sum")
        if t.grad is None:
            t.grad = torch.zeros_like(t)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.grad.dtype, t.grad.device), []).append(t.grad)
    for grads in by_dtype.values():
        packed = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
        offset = 0
        for g in grads:
            g.copy_(packed[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return [t.grad for t in tensors]
