"""The pieces :func:`kernels.splat_ensemble` and the streamed ensembles (:mod:`kernels.density.stream`) share.

Rank agreement and shares under ``torch.distributed``, the host checks of frames' values, weights,
the flattening of frames into one atom set and the chunked sum (:func:`_sum_frames`) with its
memory estimates. Both :mod:`kernels.density.ensemble` and :mod:`kernels.density.stream` import
from here, never from each other.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kernels._util import end_with_launcher
from kernels.adp import first_bad_adp, with_blur
from kernels.crystal import AtomSet, GridError, GridSpec, _free_memory, _size, _Tiled


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

# How ranks that call alike find out that one of them left process_group out. Every call of
# splat_ensemble or splat_stream in a world of two or more ranks has a number on its rank (1, 2, …:
# ranks that run the same program number their calls alike). A call that runs the ranks' agreement
# (the first of each signature) writes "group" under its number in the default store of
# torch.distributed, and reads the other ranks' entries while it waits; a call without
# process_group writes "alone" and reads them once. Whichever finds the other kind at the same call
# raises at once, naming the ranks, instead of waiting out the group's timeout (30 minutes by
# default). A call whose agreement is already made writes nothing and checks nothing. Entries stay:
# a rank that runs ahead alone must still be found by a rank of the group that comes later (one
# short key per call without process_group, a use that is warned about).
_calls = 0
_STORE_PREFIX = "kernels/splat_ensemble"
_WAIT_NOTICE_S = 5.0  # a wait this long is stated once: which ranks have not come, and until when it lasts
_LOOK_S = 0.5  # a rank left waiting reads the others' entries this often (N - 1 reads of the store each time)


def _store():
    """The default store of torch.distributed, or None where this torch has none to offer."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _number_call() -> int:
    """The number of this call of splat_ensemble or splat_stream on this rank (see ``_calls``)."""
    global _calls
    _calls += 1
    return _calls


def _announce(call: int, kind: str):
    """Write ``kind`` ("group" or "alone") for this rank under call number ``call``; the store, or None."""
    import torch.distributed as dist

    store = _store()
    if store is not None:
        store.set(f"{_STORE_PREFIX}/{call}/{dist.get_rank()}", kind)
    return store


def _kinds(store, call: int, ranks) -> dict[int, str]:
    """What the global ``ranks`` wrote for call number ``call`` so far (a rank that has not come is left out)."""
    keys = {r: f"{_STORE_PREFIX}/{call}/{r}" for r in ranks}
    present = [r for r, key in keys.items() if store.check([key])]
    return {r: store.get(keys[r]).decode() for r in present}


def _mismatch(call: int, alone: list[int], group: list[int]) -> ValueError:
    return ValueError(
        f"splat_ensemble: at call {call} of this program, rank(s) {', '.join(map(str, group))} passed process_group= "
        f"and rank(s) {', '.join(map(str, alone))} did not (those splat every frame alone, and the others would "
        "wait for them until the group's timeout). Pass the same process_group= on every rank of the group, or "
        "leave it out on every rank"
    )


def _raise_if_alone(process_group, store, call: int) -> None:
    """ValueError naming the ranks of ``process_group`` that made call number ``call`` without it, if any did."""
    if store is None:
        return
    import torch.distributed as dist

    me = dist.get_rank()
    seen = _kinds(store, call, [r for r in dist.get_process_group_ranks(process_group) if r != me])
    alone = sorted(r for r, kind in seen.items() if kind == "alone")
    if alone:
        raise _mismatch(call, alone, sorted({me, *(r for r in seen if r not in alone)}))


def _wait_agreed(work, process_group, store, call: int) -> None:
    """Wait for the ranks' agreement ``work``: raise when a rank of the group splats this call alone; say a long wait."""
    import time
    import warnings

    import torch.distributed as dist

    me = dist.get_rank()
    others = [r for r in dist.get_process_group_ranks(process_group) if r != me]
    start = time.monotonic()
    told, pause, looked = False, 0.001, start
    while not work.is_completed():
        waited = time.monotonic() - start
        if waited > _LOOK_S and time.monotonic() - looked > _LOOK_S:
            # a healthy group agrees in milliseconds: the store is read again only by ranks left waiting
            looked = time.monotonic()
            _raise_if_alone(process_group, store, call)
        if not told and waited > _WAIT_NOTICE_S:
            told = True
            missing = [r for r in others if r not in _kinds(store, call, others)] if store is not None else others
            warnings.warn(
                f"splat_ensemble(process_group=...): rank {me} has waited {_WAIT_NOTICE_S:g} s for rank(s) "
                f"{', '.join(map(str, missing))} to reach call {call} with process_group=; it waits until they do, "
                "or until the group's timeout (init_process_group(timeout=), 30 minutes by default). A rank that "
                "stopped, or that calls without process_group= at another point, is never coming",
                stacklevel=5,
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    work.wait()


def _check_ranks_agree(process_group, n_frames: int, n: int, grid: GridSpec, device: torch.device) -> None:
    """ValueError on every rank unless all ranks of ``process_group`` pass the same F, N and grid shape.

    One all_reduce (MAX) of five host integers and their negatives, once per (group, F, N, shape) on
    this rank: every rank passes the same full inputs, and a rank with other frames would give a map
    silently off. NCCL reduces device tensors: the result is read back once per signature. While it
    waits, a rank of the group that makes this call without ``process_group`` raises a ValueError
    at once (see ``_calls``); a wait of more than a few seconds is stated in a warning.
    """
    import torch.distributed as dist

    call = _number_call()
    mine = (n_frames, n, *grid.shape)
    key = (id(process_group), mine)
    if key in _agreed:
        return
    store = _announce(call, "group")
    on = device if dist.get_backend(process_group) == "nccl" else torch.device("cpu")
    values = torch.tensor([*mine, *(-v for v in mine)], dtype=torch.int64, device=on)
    _raise_if_alone(process_group, store, call)  # a rank that came first, alone, may have left already
    try:
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group, async_op=True)
        _wait_agreed(work, process_group, store, call)
    except ValueError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses; a timeout is the usual one here
        _raise_if_alone(process_group, store, call)
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


def _distributed_world() -> bool:
    """Whether torch.distributed runs two or more ranks here."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 2


def _check_alone() -> None:
    """A call without ``process_group`` in a world of two or more ranks: ValueError if another rank passed one here.

    A rank that passes ``process_group`` at the same call finds this rank's entry itself, whichever
    comes first (see ``_calls``).
    """
    import torch.distributed as dist

    if not _distributed_world():
        return
    call = _number_call()
    store = _announce(call, "alone")
    if store is None:
        return
    me = dist.get_rank()
    seen = _kinds(store, call, [r for r in range(dist.get_world_size()) if r != me])
    group = sorted(r for r, kind in seen.items() if kind == "group")
    if group:
        raise _mismatch(call, [me], group)


def _warn_if_distributed(n_frames: int) -> None:
    """Warn once when torch.distributed runs several ranks but this call splats every frame alone.

    Raises ValueError when another rank passed ``process_group`` at this call (:func:`_check_alone`).
    """
    import torch.distributed as dist

    if not _distributed_world():
        return
    _check_alone()
    from kernels._util import warn_once

    warn_once(
        ("splat_ensemble", "no process_group"),
        f"splat_ensemble: torch.distributed runs {dist.get_world_size()} ranks but process_group= was not given, "
        f"so rank {dist.get_rank()} splats all {n_frames} frames alone; a rank that passes process_group= at this "
        "call raises a ValueError saying so. Pass the same process_group= on every rank to split the frames (or "
        "leave it out on every rank)",
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


def _check_values(
    atoms: AtomSet, xyz, b_iso, occ, n: int, u_aniso=None, per_chunk: int | None = None, offset: int = 0
) -> None:
    """Host checks of the frames' values (CPU tensors only: on a GPU they would stop the host).

    ``per_chunk`` frames at a time, so the masks never cover every atom-frame at once. ``offset``:
    the index of the tensors' first row among all the frames (a streamed chunk's), which messages name.
    """
    n_frames = xyz.shape[0]
    per_chunk = per_chunk or n_frames
    for lo in range(0, n_frames, per_chunk):
        rows = slice(lo, min(n_frames, lo + per_chunk))
        part = [None if t is None else t[rows] for t in (b_iso, occ, u_aniso)]
        _check_chunk(atoms, xyz[rows], part[0], part[1], n, part[2], offset + lo)


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


def _warn_tiny(atoms: AtomSet, b_iso, u_aniso, start: int, stop: int, offset: int) -> None:
    """The tiny-B/U rule of :meth:`AtomSet.check` on host frames ``start..stop``: one warning naming the first.

    Per-frame ``b_iso`` (F, N) and ``u_aniso`` (F, N, 6), or the atoms' own where None.
    """
    from kernels.atoms import MIN_PHYSICAL_B, thin_u

    n = len(atoms)
    b = (atoms.b_iso[None] if b_iso is None else b_iso[start:stop]).detach()
    tiny = b < MIN_PHYSICAL_B
    if atoms.aniso is not None:
        tiny &= ~atoms.aniso
    where = what = None
    if bool(tiny.any()):
        f, i, count = _first_bad(tiny, n)
        where, what = (f, i, count), f"B = {float(b[f, i]):.3g} Å²"
    elif atoms.u_aniso is not None:
        u = (atoms.u_aniso[None] if u_aniso is None else u_aniso[start:stop]).detach().reshape(-1, 6)
        found = thin_u(u, atoms.aniso.repeat(u.shape[0] // n))
        if found is not None:
            idx, count, lam = found
            where, what = (
                (*divmod(idx, n), count),
                f"U's narrowest axis, {lam:.3g} Å² (B = 8π²·λ = {lam * 8 * math.pi**2:.3g} Å²),",
            )
    if where is None:
        return
    f, i, count = where
    frame = "" if (b_iso is None and u_aniso is None) else f"frame {offset + start + f}: "
    more = f" and {count - 1} more atom-frames" if count > 1 else ""
    warnings.warn(
        f"{frame}atom {atoms.labels[i]} (index {i}){more}: {what} is below {MIN_PHYSICAL_B} Å², less than zero-point "
        "motion allows; its density is a spike narrower than any map voxel, so the map will not show it faithfully "
        "(check the B and U values)",
        UserWarning,
        stacklevel=4,
    )


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
    atoms, xyz, plan: _Plan, w, b_iso, occ, u_aniso, start: int, stop: int, chunk, warn_small=True, bar=None, offset=0
):
    """Σ over frames ``start..stop`` of ``w[f]``·map_f, one backend call per ``chunk`` frames; (map, small?).

    ``chunk`` None: the host takes ``CHUNK_ATOM_FRAMES`` atom-frames per call (the kernel's per-atom state,
    ~450 B, then never exists for all F·N at once), a GPU all frames in one call. The second value says
    whether atoms below the grid spacing were found (warned about when ``warn_small``). ``bar``: a
    :func:`kernels._progress.progress_bar` told of every call's frames. ``offset``: the index of
    ``xyz``'s first row among all the frames (a streamed chunk's), which messages and warnings name.
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
        _check_values(atoms, xyz, b_iso, occ, n, u_aniso, per_chunk, offset)
        if warn_small:
            _warn_tiny(atoms, b_iso, u_aniso, start, stop, offset)
    extra = {} if atoms.u_aniso is None else {"radius_rule": plan.radius_rule}
    out, bound = None, 0.0
    small = []  # what each chunk's check of atoms below the grid spacing found
    for lo in range(start, stop, per_chunk):
        hi = min(stop, lo + per_chunk)
        frames = _checked_frames(
            atoms,
            xyz,
            b_iso,
            occ,
            u_aniso,
            lo,
            hi,
            plan.blur,
            plan.radius,
            plan.cutoff,
            grid,
            plan.radius_rule,
            small,
            offset,
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
            offset + first_lo,
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


def _checked_frames(
    atoms, xyz, b_iso, occ, u_aniso, lo, hi, blur, radius, cutoff, grid, radius_rule, small=None, offset=0
):
    """Frames ``lo..hi`` flattened and blurred, with the host checks that need their values.

    Host atoms: a negative blur that leaves an atom without a Gaussian raises (naming the frame);
    atoms whose cutoff radius is below the grid spacing warn (or, with ``small`` given, are appended
    to it as ``(finding, lo)`` for one warning over every chunk). Messages name frame ``offset + lo``, ….
    """
    from kernels.density import _atoms_below_spacing, _check_blurred, _warn_small

    n = len(atoms)
    frames = with_blur(_flatten(atoms, xyz, b_iso, occ, lo, hi, u_aniso), blur)
    if atoms.device.type != "cpu":
        return frames
    _check_blurred(frames, blur, n, offset + lo)
    if radius is None:
        found = _atoms_below_spacing(frames, cutoff, grid, radius_rule)
        if found is not None:
            if small is None:
                _warn_small(frames, found, cutoff, grid, n, offset + lo)
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
