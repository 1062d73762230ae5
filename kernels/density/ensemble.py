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

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density._ensemble_parts import (
    _AllReduceSum,
    _as_weights,
    _check_group,
    _check_ranks_agree,
    _check_tensor,
    _check_values,
    _checked_frames,
    _no_frames,
    _Plan,
    _rank,
    _require_frames_memory,
    _sum_frames,
    _warn_if_distributed,
    _weighted,
)
from kernels.density.frames import frame_share, whole_chunk
from kernels.density.radius import DEFAULT_CUTOFF
from kernels.dispatch import get_backend

__all__ = ["splat_ensemble", "sum_gradients_over_ranks", "frame_share"]


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
        from kernels.density.frames import refuse_path

        refuse_path(xyz, "xyz")
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
        chunk = whole_chunk(chunk)
    if torch.compiler.is_compiling():
        return _compiled_sum(atoms, xyz, grid, weights, b_iso, occ, u_aniso, reduce, radius, cutoff, backend,
                             process_group, blur, radius_rule)  # fmt: skip
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


def _compiled_sum(
    atoms, xyz, grid, weights, b_iso, occ, u_aniso, reduce, radius, cutoff, backend, process_group, blur, radius_rule
) -> torch.Tensor:
    """:func:`splat_ensemble` while ``torch.compile`` traces it: the frames flattened, one :func:`splat_density` call.

    That call takes the density op (``kernels.density.ops``), so the sum compiles into the caller's graph and
    replays under ``mode="reduce-overhead"``. What needs the host — a process group's agreement, per-frame maps,
    the memory query, the CPU value checks — is refused or left out, as for a compiled ``splat_density``.
    """
    if reduce != "sum" or process_group is not None:
        raise ValueError(
            "under torch.compile splat_ensemble sums tensor frames on one device (reduce='sum', no process_group); "
            "call it eagerly for per-frame maps or several ranks"
        )
    if weights is not None and not isinstance(weights, torch.Tensor):
        raise TypeError("under torch.compile the weights must be a tensor of one weight per frame")
    from kernels.density import splat_density
    from kernels.density._ensemble_parts import _flatten, with_blur

    n_frames, n = xyz.shape[0], len(atoms)
    frames = _weighted(with_blur(_flatten(atoms, xyz, b_iso, occ, 0, n_frames, u_aniso), blur), weights, 0, n_frames, n)
    extra = {} if atoms.u_aniso is None else {"radius_rule": radius_rule}
    return splat_density(frames, grid, radius=radius, cutoff=cutoff, backend=backend, **extra)


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
