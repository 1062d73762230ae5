"""Density of an ensemble: F frames of the same atoms, summed (weighted) or one map per frame.

``reduce="sum"`` flattens the frames into one atom set of F·N atoms (positions a view of ``xyz``,
each frame's B and occupancy, the coefficients repeated, occupancy times the frame's weight) and
makes ONE call of the single-model density backend: one launch on the GPU, one parallel region
on the CPU, and never F maps in memory. Because every atom's radius depends on its B and the
cutoff only (not its occupancy), the voxel set of each frame is the one its single splat uses,
and the weights' gradient is the occupancy gradient through the product.

``reduce="none"`` calls the backend's ``splat_frames_*`` function (op ``"density_frames"`` in
:mod:`kernels.dispatch`), which returns the F maps.

With ``process_group=`` every rank takes the same full inputs and splats a contiguous share of
the frames; ``reduce="sum"`` maps are then combined by one ``all_reduce`` whose backward passes
the map gradient through unchanged, so each rank's input gradients hold its own frames' rows
(zeros elsewhere) and their sum over ranks is the single-process gradient
(:func:`sum_gradients_over_ranks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kernels._util import positive_number
from kernels.crystal import AtomSet, GridError, GridSpec, _free_memory, _size, _Tiled
from kernels.density.adp import first_bad_adp, with_blur
from kernels.density.radius import DEFAULT_CUTOFF, RADIUS_RULES
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


def _check_values(atoms: AtomSet, xyz, b_iso, occ, n: int, u_aniso=None) -> None:
    """Host checks of the frames' values (CPU tensors only: on a GPU they would stop the host)."""
    if u_aniso is not None:
        flags = atoms.aniso.repeat(u_aniso.shape[0])
        bad = first_bad_adp(u_aniso.detach().reshape(-1, 6), flags)
        if bad is not None:
            idx, count, what = bad
            f, i = divmod(idx, n)
            more = f" ({count - 1} more atom-frames too)" if count > 1 else ""
            raise ValueError(f"frame {f}: atom {atoms.labels[i]} (index {i}) {what}{more}")
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
            raise ValueError(f"frame {f}: atom {atoms.labels[i]} (index {i}) {what}: {value}{more}")


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


def _check_radius_cutoff(radius, cutoff, grid: GridSpec):
    from kernels.density import _check_radius_extent

    if radius is not None:
        radius = positive_number(radius, "radius", "Å")
        _check_radius_extent(radius, grid)
    return radius, positive_number(cutoff, "cutoff", "the map's unit")


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
    xyz : torch.Tensor, shape (F, N, 3)
        Positions in Å of every frame, F ≥ 1; the atoms' dtype and device. May require grad.
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
        ``atoms`` is not an AtomSet, or ``xyz``/``b_iso``/``occ`` not tensors.
    ValueError
        A shape other than (F, N, 3), (F, N) or (F,); F = 0; N not ``len(atoms)``; a dtype or
        device other than the atoms'; an unknown ``reduce``; non-finite weights, or (CPU tensors)
        a non-finite position, B ≤ 0 or occupancy outside [0, 1] — naming the frame and atom;
        ``radius``/``cutoff`` not positive finite numbers; ``process_group`` given without an
        initialised ``torch.distributed``. CUDA tensors' values are not read back (no host
        synchronisation), as for the ``triton`` backend of :func:`kernels.splat_density`.
    kernels.GridError
        The map (``"sum"``) or the F maps (``"none"``) would not fit in memory, a fast backend got
        a box grid, or ``radius`` is far too large.
    kernels.BackendError
        The backend asked for cannot run here.
    """
    if not isinstance(atoms, AtomSet):
        raise TypeError(f"atoms must be a kernels.AtomSet, got {type(atoms).__name__}")
    n = len(atoms)
    if not isinstance(xyz, torch.Tensor):
        raise TypeError(f"xyz must be a torch.Tensor of shape (F, {n}, 3) (frames, atoms, Å), got {type(xyz).__name__}")
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
    if radius_rule not in RADIUS_RULES:
        raise ValueError(f"radius_rule must be one of {RADIUS_RULES}, got {radius_rule!r}")
    blur = float(blur)
    if not math.isfinite(blur):
        raise ValueError(f"blur must be a finite number of Å², got {blur!r}")
    w = None if weights is None else _as_weights(weights, n_frames, atoms)
    if reduce not in ("sum", "none"):
        raise ValueError(f"reduce must be 'sum' (one weighted map) or 'none' (one map per frame), got {reduce!r}")
    if process_group is not None:
        _check_group(process_group)
    radius, cutoff = _check_radius_cutoff(radius, cutoff, grid)
    name, single = get_backend("density", atoms.device, backend)
    if name != "reference" and not grid.is_whole_cell:
        raise GridError(f"the {name} density backend splats whole-cell grids only; use backend='reference' for a box")
    dtype = torch.float64 if name == "reference" else torch.float32

    start, stop = frame_share(n_frames, process_group)
    count = stop - start
    if count == 0:
        return _no_frames(atoms, xyz, b_iso, occ, w, grid, dtype, reduce, process_group, u_aniso)
    if reduce == "none":  # checked while no F·N-atom tensor exists yet, so a refusal allocates nothing
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (xyz, b_iso, occ, w, u_aniso))
        _require_frames_memory(grid, count, dtype, atoms.device, grad)
    if atoms.device.type == "cpu":
        _check_values(atoms, xyz, b_iso, occ, n, u_aniso)
    frames = with_blur(_flatten(atoms, xyz, b_iso, occ, w, start, stop, u_aniso), blur)
    if radius is None and atoms.device.type == "cpu":
        from kernels.density import _warn_atoms_below_cutoff

        _warn_atoms_below_cutoff(with_blur(_flatten(atoms, xyz, b_iso, occ, None, start, stop, u_aniso), blur), cutoff)
    extra = {} if atoms.u_aniso is None else {"radius_rule": radius_rule}
    if reduce == "sum":
        from kernels.density import _memory_checked

        key = (grid.cell.parameters, grid.shape, dtype, str(atoms.device))
        if key not in _memory_checked:  # as splat_density: once per grid
            grid.require_memory(dtype, atoms.device, copies=2)
            _memory_checked.add(key)
        out = single(frames, grid, radius=radius, cutoff=cutoff, **extra)
        if process_group is not None:
            out = _AllReduceSum.apply(out, process_group)
        return out
    _, per_frame = get_backend("density_frames", atoms.device, name)
    return per_frame(frames, grid, n_frames=count, radius=radius, cutoff=cutoff, **extra)


def _flatten(atoms: AtomSet, xyz, b_iso, occ, w, start: int, stop: int, u_aniso=None) -> AtomSet:
    """Frames ``start..stop`` as one frame-major AtomSet of (stop − start)·N atoms (not validated again)."""
    count, n = stop - start, len(atoms)
    u = flags = None
    if atoms.u_aniso is not None:
        u = (atoms.u_aniso.expand(count, n, 6) if u_aniso is None else u_aniso[start:stop]).reshape(count * n, 6)
        flags = atoms.aniso.repeat(count)
    pos = xyz[start:stop].reshape(count * n, 3)  # a view when xyz is contiguous
    b = (atoms.b_iso.expand(count, n) if b_iso is None else b_iso[start:stop]).reshape(-1)
    o = atoms.occ.expand(count, n) if occ is None else occ[start:stop]
    if w is not None:
        o = o * w[start:stop, None]
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
