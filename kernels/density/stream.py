"""Ensembles of any length: frames streamed chunk by chunk into one summed map, and its per-frame gradients.

:func:`kernels.splat_ensemble` hands frames that are not one tensor (an iterable of chunks, or a
:class:`kernels.FrameSource`) to :func:`splat_stream`, which splats each chunk as the tensor path
splats its chunks (:func:`kernels.density.ensemble._sum_frames`) and adds the maps: at most the
chunk being splatted, the one prefetched and the one being read exist at once, plus the map.

:func:`ensemble_gradients` is the backward of such a sum: given dL/dρ, a second pass over the
frames runs the backend's backward alone on each chunk (its map vector-Jacobian product, no forward
splat; the reference and registered backends recompute the chunk's splat with autograd) and hands
its per-frame gradients to a callback or writes them into memory-mapped ``.npy`` files.

Under a process group a :class:`~kernels.FrameSource` is split with :meth:`~kernels.FrameSource.share`
(each rank reads only its share); an iterable is taken as this rank's own share.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import torch

from kernels._util import TEMPORARY_NAME_KEEP, output_problem
from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density._ensemble_parts import (
    CHUNK_ATOM_FRAMES,
    _check_alone,
    _check_group,
    _check_ranks_agree,
    _check_values,
    _checked_frames,
    _Plan,
    _rank,
    _real_weight,
    _sum_frames,
    _weighted,
)
from kernels.density.frames import DEFAULT_CHUNK_BYTES, FrameSource, frame_share, refuse_path, whole_chunk
from kernels.density.radius import DEFAULT_CUTOFF
from kernels.dispatch import get_backend

__all__ = ["ensemble_gradients", "splat_stream"]

_END = object()


class _Prefetch:
    """Iterate ``source`` on a thread, one item ahead: the next chunk is read while this one is splatted.

    At most one finished item waits in the queue; an exception of the source is raised where the
    item would have come. :meth:`close` stops the thread at its next item; at interpreter exit every
    prefetch still open (a stream's generator abandoned half-way) is closed, because a daemon thread
    left inside a torch call while the interpreter finalises aborts the process.
    """

    _open: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, source: Iterator):
        self._source, self._queue, self._stop = source, queue.Queue(maxsize=1), threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernels-prefetch", daemon=True)
        self._thread.start()
        _Prefetch._open.add(self)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put((item, None)):
                    return
            self._put((_END, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put((None, exc))

    def __iter__(self):
        while True:
            item, exc = self._queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
        _Prefetch._open.discard(self)

    @staticmethod
    def _close_at_exit() -> None:
        for prefetch in list(_Prefetch._open):
            prefetch.close()


atexit.register(_Prefetch._close_at_exit)


class _Stream:
    """This rank's frames as a sequence of (first, chunk) with ``first`` the chunk's index in the whole source.

    ``total`` is the number of frames of the whole source when known up front (a tensor or a
    FrameSource), else None; ``mine`` this rank's count when known.
    """

    def __init__(self, frames, n: int, chunk, process_group, device: torch.device):
        self.n, self.split, self.from_tensor = n, chunk, isinstance(frames, torch.Tensor)
        refuse_path(frames, "frames")
        if isinstance(frames, FrameSource):
            if frames.n_atoms != n:
                raise ValueError(
                    f"the frames have {frames.n_atoms} atoms ({frames.path}) but the atoms have {n}: open the "
                    "trajectory with the topology the atoms were made from"
                )
            view = frames.share(process_group)
            if chunk is not None:
                view.chunk = chunk
            self.total, self.mine, self.offset = frames.n_frames, view.n_frames, view.start - frames.start
            self._items = view.chunks()
        elif isinstance(frames, torch.Tensor):
            lo, hi = frame_share(frames.shape[0], process_group)
            self.total, self.mine, self.offset = frames.shape[0], hi - lo, lo
            self._items = iter(frames[lo:hi].detach().split(chunk or _default_chunk(n, device)))
        elif isinstance(frames, np.ndarray) or not isinstance(frames, Iterable):
            raise TypeError(
                f"frames must be a torch.Tensor (F, {n}, 3), an iterable of (F_chunk, {n}, 3) tensors or a "
                f"kernels.FrameSource, got {type(frames).__name__}"
                + ("; convert an array with torch.from_numpy" if isinstance(frames, np.ndarray) else "")
            )
        else:
            self.total = self.mine = None
            self.offset = 0
            self._items = iter(frames)

    def __iter__(self):
        first = self.offset
        for index, c in enumerate(self._items):
            c = _checked_chunk(c, index, self.n)
            for part in c.split(self.split) if self.split else (c,):
                if part.shape[0]:
                    yield first, part
                    first += part.shape[0]


def _checked_chunk(c, index: int, n: int) -> torch.Tensor:
    what = f"frames: chunk {index}"
    if not isinstance(c, torch.Tensor):
        raise TypeError(f"{what} is a {type(c).__name__}, not a torch.Tensor of shape (F_chunk, {n}, 3) (Å)")
    if c.ndim != 3 or tuple(c.shape[1:]) != (n, 3):
        raise ValueError(f"{what} has shape {tuple(c.shape)}; every chunk must be (F_chunk, {n}, 3): frames, atoms, Å")
    if not c.is_floating_point():
        raise TypeError(f"{what} is {c.dtype}; positions must be floating point (Å)")
    if c.requires_grad:
        raise ValueError(
            f"{what} requires grad, but streamed frames carry no autograd graph across chunks: pass one tensor "
            "(F, N, 3) for autograd, or take the per-frame gradients with kernels.ensemble_gradients"
        )
    return c


def _streaming_only(b_iso, occ, u_aniso, reduce: str) -> None:
    if reduce != "sum":
        raise ValueError(
            f"reduce={reduce!r} needs every frame's map at once, which streamed frames (an iterable or a "
            "FrameSource) never hold: use reduce='sum', or pass the frames as one tensor"
        )
    for name, value in (("b_iso", b_iso), ("occ", occ), ("u_aniso", u_aniso)):
        if value is not None:
            raise ValueError(
                f"{name}= (one value per atom per frame) is not taken with streamed frames: every frame uses the "
                f"atoms' own {name} (set it on the AtomSet), or pass the frames as one tensor with {name}="
            )


def _plan(atoms: AtomSet, grid: GridSpec, backend, radius, cutoff, blur, radius_rule) -> _Plan:
    from kernels.density import _splat_arguments

    radius, cutoff, blur = _splat_arguments(radius, cutoff, blur, radius_rule, grid)
    name, single = get_backend("density", atoms.device, backend)
    if name != "reference" and not grid.is_whole_cell:
        raise GridError(f"the {name} density backend splats whole-cell grids only; use backend='reference' for a box")
    dtype = torch.float64 if name == "reference" else torch.float32
    return _Plan(grid, name, single, dtype, radius, cutoff, blur, radius_rule)


def _default_chunk(n: int, device: torch.device) -> int:
    """Frames per chunk of a tensor split here: the host backend's call size, or the position byte cap."""
    if device.type == "cpu":
        return max(1, CHUNK_ATOM_FRAMES // max(n, 1))
    return max(1, DEFAULT_CHUNK_BYTES // (12 * max(n, 1)))


def _bar(progress, total, desc: str, process_group):
    from kernels._progress import progress_bar

    shown = progress if callable(progress) else bool(progress) and _rank(process_group) == 0
    return progress_bar(total, desc=desc, unit="frames", enabled=shown)


def _chunks(stream: _Stream, prefetch, bar, device: torch.device, dtype: torch.dtype):
    """``(first, chunk)`` of ``stream`` on ``device`` in ``dtype``, counted on ``bar``; read one ahead when ``prefetch``.

    ``prefetch`` None: on unless the frames are one tensor (whose slices cost nothing to make). For a
    GPU the reading side also pins each chunk, and the copy runs on a stream of its own, so it
    overlaps the previous chunk's kernels. Close it (``contextlib.closing``) so that the reading
    thread ends even while an exception's traceback still holds the consumer's frame.
    """
    if prefetch is None:
        prefetch = not stream.from_tensor
    items = _pinned(iter(stream), device)
    feed = _Prefetch(items) if prefetch else None
    copy = torch.cuda.Stream(device) if device.type == "cuda" else None
    try:
        for first, c in feed if feed is not None else items:
            yield first, _moved(c, device, dtype, copy)
            bar.update(c.shape[0])
    finally:
        if feed is not None:
            feed.close()


def _pinned(items, device: torch.device):
    for first, c in items:
        if device.type == "cuda" and c.device.type == "cpu":
            c = c.pin_memory()  # page-locked, so that the copy to the GPU is asynchronous
        yield first, c


def _moved(c: torch.Tensor, device: torch.device, dtype: torch.dtype, copy) -> torch.Tensor:
    """``c`` on ``device`` in ``dtype``; a pinned host chunk is copied on the stream ``copy``, which the current one waits for."""
    if copy is None or c.device.type != "cpu":
        return c.to(device=device, dtype=dtype)
    with torch.cuda.stream(copy):
        out = c.to(device=device, dtype=dtype, non_blocking=True)
    current = torch.cuda.current_stream(device)
    current.wait_stream(copy)
    out.record_stream(current)  # allocated on ``copy``, used on ``current``: not reused before that is done
    return out


def _open(frames, n: int, chunk, process_group, grid: GridSpec, device: torch.device) -> _Stream:
    """This rank's :class:`_Stream` of ``frames``, after the ranks' check of N, the grid and F.

    An iterable's F is not known up front: it is checked as -1 (a FrameSource on one rank and an
    iterable on another disagree).
    """
    chunk = None if chunk is None else whole_chunk(chunk)
    if process_group is None:
        _check_alone()  # a rank that passes process_group= at this call would wait for this one
        return _Stream(frames, n, chunk, None, device)
    _check_group(process_group)
    stream = _Stream(frames, n, chunk, process_group, device)
    _check_ranks_agree(process_group, -1 if stream.total is None else stream.total, n, grid, device)
    return stream


def _all_frames(process_group, count: int, device: torch.device) -> int:
    """The sum of ``count`` over the ranks (one all_reduce); ``count`` without a group."""
    if process_group is None:
        return count
    import torch.distributed as dist

    on = device if dist.get_backend(process_group) == "nccl" else torch.device("cpu")
    total = torch.tensor([count], dtype=torch.int64, device=on)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
    return int(total.item())


def splat_stream(
    atoms: AtomSet,
    frames,
    grid: GridSpec,
    *,
    weights=None,
    b_iso=None,
    occ=None,
    u_aniso=None,
    reduce: str = "sum",
    radius=None,
    cutoff: float = DEFAULT_CUTOFF,
    backend: str = "auto",
    process_group=None,
    blur: float = 0.0,
    radius_rule: str = "gemmi",
    chunk: int | None = None,
    progress=None,
    prefetch: bool | None = None,
) -> torch.Tensor:
    """:func:`kernels.splat_ensemble` of frames that come as chunks (an iterable or a FrameSource).

    The arguments are :func:`kernels.splat_ensemble`'s; see there for what streamed frames allow.
    """
    n = len(atoms)
    _streaming_only(b_iso, occ, u_aniso, reduce)
    weight = None if weights is None else _real_weight(weights)
    plan = _plan(atoms, grid, backend, radius, cutoff, blur, radius_rule)
    stream = _open(frames, n, chunk, process_group, grid, atoms.device)
    out, done, warned = None, 0, False
    with (
        _bar(progress, stream.mine, "splat_ensemble", process_group) as bar,
        torch.no_grad(),
        closing(_chunks(stream, prefetch, bar, atoms.device, atoms.dtype)) as chunks,
    ):
        for first, c in chunks:
            f = c.shape[0]
            w = None if weight is None else torch.full((f,), weight, dtype=atoms.dtype, device=atoms.device)
            part, small = _sum_frames(
                atoms, c, plan, w, None, None, None, 0, f, None, warn_small=not warned, offset=first
            )
            warned |= small
            del c
            if out is None:
                out = part
            else:
                out.add_(part)
            del part
            done += f
    total = _all_frames(process_group, done, atoms.device)
    if total == 0:
        raise ValueError("the frames held no frames (an empty iterable or source): give at least one")
    if out is None:  # a rank without frames adds zeros
        grid.require_memory(plan.dtype, atoms.device, copies=2)
        out = torch.zeros(tuple(grid.shape), dtype=plan.dtype, device=atoms.device)
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=process_group)
    return out


_WRT = ("xyz", "b_iso", "occ")


def ensemble_gradients(
    atoms: AtomSet,
    frames,
    grid: GridSpec,
    map_grad: torch.Tensor,
    *,
    out,
    chunk: int | None = None,
    wrt=("xyz",),
    progress=None,
    process_group=None,
    weights=None,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    backend: str = "auto",
    blur: float = 0.0,
    radius_rule: str = "gemmi",
    prefetch: bool | None = None,
):
    """Per-frame gradients of a loss on the summed map of an ensemble, streamed chunk by chunk.

    For ρ = Σ_f w·map_f (what :func:`kernels.splat_ensemble` gives with ``reduce="sum"``) and a
    loss L(ρ) whose gradient ``map_grad`` = ∂L/∂ρ you have (e.g. ``torch.autograd.grad(loss, rho)``
    on the map alone), the gradient of L with respect to frame f's positions is
    ∂L/∂xyz[f] = w·(∂map_f/∂xyz[f])ᵀ ``map_grad``: it needs only frame f and ``map_grad``, not
    the forward's map. So a second pass over the frames runs the backend's backward alone on each
    chunk (``map_vjp_cpu``, ``map_vjp_triton``: the backward kernel, with each atom's cutoff radius
    computed as the forward computes it) and hands the chunk's gradients on; no more than a few
    chunks of frames and gradients exist at once. They equal the autograd gradients of the tensor
    path (``xyz.grad`` after ``(rho * map_grad).sum().backward()``) bit for bit on the cpu and triton
    backends (each atom's gradient is its own sum over its voxels, whichever frames share a call),
    within summation order on the others. The reference backend and registered backends have no
    backward of their own:
    for them each chunk's splat is recomputed with autograd (a forward and a backward per chunk).

    Cost: every frame is read (or generated) a second time, and each chunk costs one backward of
    the backend (plus, for per-atom radii on Triton, one small per-atom launch), so a streamed
    forward and its second pass cost about what the tensor path's forward+backward costs, plus the
    second read of the frames.

    Parameters
    ----------
    atoms : AtomSet
        The N atoms of every frame (their coefficients, B and occupancy), as for
        :func:`kernels.splat_ensemble`.
    frames : torch.Tensor (F, N, 3), iterable of (F_chunk, N, 3) tensors, or kernels.FrameSource
        The frames of the forward pass, in the same order (an iterable must yield them again:
        pass a new generator).
    grid : GridSpec
        The grid of the map.
    map_grad : torch.Tensor, shape ``grid.shape``
        ∂L/∂ρ of the summed map; every rank of a process group passes the same one.
    out : callable or str or os.PathLike
        Callable: called as ``out(start, stop, grads)`` for every chunk, frames ``[start, stop)``
        of the whole source (of this rank's own stream for an iterable under a process group), with
        ``grads`` a dict of tensors on the atoms' device: ``"xyz"`` (F_chunk, N, 3) in
        (map unit)·Å⁻¹, ``"b_iso"`` (F_chunk, N) per Å², ``"occ"`` (F_chunk, N), as asked by
        ``wrt``. A path ``name.npy``: the gradients are written into memory-mapped ``.npy`` files,
        ``name.npy`` (F, N, 3) for ``"xyz"``, ``name_b_iso.npy`` and ``name_occ.npy`` (F, N) for the
        others, in the map's dtype (float32; float64 from ``reference``); F must be known up front
        (a tensor or a FrameSource). The files are written as temporaries beside these names and
        renamed onto them once every row is written, so a pass that fails part way leaves no
        partial ``.npy`` (a name that is not a regular file or a new path is refused first, as by
        :func:`kernels.write_map`). Under a process group every rank writes its own rows of the
        same files (rank 0 creates them), so the path must be on a file system all ranks share.
    chunk : int, optional
        Frames per backward call (default: the source's chunk; for a tensor, the CPU backend's
        call size or ``DEFAULT_CHUNK_BYTES`` of positions on a GPU).
    wrt : sequence of {"xyz", "b_iso", "occ"}
        The gradients to compute: positions, and the per-frame B and occupancy of every atom
        (evaluated at the atoms' own B and occupancy).
    progress : bool or callable, optional
        As for :func:`kernels.splat_ensemble`.
    process_group : torch.distributed.ProcessGroup, optional
        Each rank computes the gradients of its share of the frames (a FrameSource's
        :meth:`~kernels.FrameSource.share`, a tensor's :func:`kernels.frame_share`, an iterable as
        given); no communication but the check that the ranks agree on N, the grid and F.
    weights : float, optional
        The one weight of every frame used in the forward (default 1).
    radius, cutoff, backend, blur, radius_rule, prefetch
        As for :func:`kernels.splat_ensemble`; must be those of the forward.

    Returns
    -------
    pathlib.Path or None
        The ``.npy`` path given as ``out`` (None for a callable).

    Raises
    ------
    ValueError
        ``map_grad`` not of ``grid.shape``; ``wrt`` empty or with unknown names; a path ``out`` that
        does not end in ``.npy``, whose F is not known up front, or that names a device, pipe, socket
        or folder; frames that hold no frame (an empty list, a generator the forward used up); bad
        frames as :func:`kernels.splat_ensemble` raises for them.
    TypeError
        ``out`` neither callable nor a path; frames of another kind.
    """
    n = len(atoms)
    wrt = tuple(wrt) if not isinstance(wrt, str) else (wrt,)
    if not wrt or any(name not in _WRT for name in wrt) or len(set(wrt)) != len(wrt):
        raise ValueError(f"wrt must name some of {_WRT} (each once), got {wrt!r}")
    weight = 1.0 if weights is None else _real_weight(weights)
    plan = _plan(atoms, grid, backend, radius, cutoff, blur, radius_rule)
    if not isinstance(map_grad, torch.Tensor) or tuple(map_grad.shape) != tuple(grid.shape):
        shape = tuple(map_grad.shape) if isinstance(map_grad, torch.Tensor) else type(map_grad).__name__
        raise ValueError(f"map_grad must be a tensor of the grid's shape {tuple(grid.shape)} (∂L/∂ρ), got {shape}")
    map_grad = map_grad.detach().to(device=atoms.device, dtype=plan.dtype)
    stream = _open(frames, n, chunk, process_group, grid, atoms.device)
    write, path = _writer(out, stream, n, wrt, plan.dtype, process_group, atoms.device)
    const = atoms.replace(
        b_iso=atoms.b_iso.detach(), occ=atoms.occ.detach(),
        u_aniso=None if atoms.u_aniso is None else atoms.u_aniso.detach(), _validate=False,
    )  # fmt: skip
    vjp = _map_vjp(plan.name)
    warned, done = False, 0
    try:
        with (
            _bar(progress, stream.mine, "ensemble_gradients", process_group) as bar,
            closing(_chunks(stream, prefetch, bar, atoms.device, atoms.dtype)) as chunks,
        ):
            for first, c in chunks:
                f = c.shape[0]
                w = None if weight == 1.0 else torch.full((f,), weight, dtype=atoms.dtype, device=atoms.device)
                if vjp is not None:
                    grads, small = _backward_only(vjp, const, c, plan, w, wrt, map_grad, first, warn_small=not warned)
                else:
                    grads, small = _recomputed(const, c, plan, w, wrt, map_grad, warn_small=not warned, first=first)
                warned |= small
                del c
                write(first, first + f, grads)
                del grads
                done += f
        if _all_frames(process_group, done, atoms.device) == 0:
            raise ValueError(
                "the frames held no frames (an empty iterable or source, or a generator the forward pass used "
                "up): give at least one; pass a new generator of the same frames for the second pass"
            )
        if path is not None:
            write.finish()
    except BaseException:
        if path is not None:
            write.abort()
        raise
    return path


#: Backends with a map vector-Jacobian product (the backward alone: ``fn(atoms, grid, grad, *, radius, cutoff,
#: radius_rule) -> (g_xyz, g_b_iso, g_occ, g_u_aniso)``), as "module:function". The others (the reference, a
#: registered backend) recompute each chunk's splat with autograd in the second pass.
_MAP_VJP = {
    "cpu": "kernels.density.cpu:map_vjp_cpu",
    "triton": "kernels.density.triton:map_vjp_triton",
}


def _map_vjp(name: str):
    """Backend ``name``'s map vector-Jacobian product, or None where the second pass recomputes the forward."""
    path = _MAP_VJP.get(name)
    if path is None:
        return None
    import importlib

    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


def _backward_only(vjp, atoms: AtomSet, c, plan: _Plan, w, wrt, map_grad, first: int, warn_small: bool):
    """(grads of chunk ``c`` by name, small?) from ``vjp`` on the chunk's flattened, weighted atoms: no forward.

    The chain rule autograd applies to the tensor path's flattening is applied here: the weight to the
    occupancy's gradient, and each gradient cast to the atoms' dtype; the chunk's host checks and its
    warning of atoms below the grid spacing are those of the forward (:func:`_sum_frames`).
    """
    f, n = c.shape[0], len(atoms)
    if atoms.device.type == "cpu":
        _check_values(atoms, c, None, None, n, None, f, first)
    found = []
    frames = _checked_frames(
        atoms,
        c,
        None,
        None,
        None,
        0,
        f,
        plan.blur,
        plan.radius,
        plan.cutoff,
        plan.grid,
        plan.radius_rule,
        found,
        first,
    )
    if found and warn_small:
        from kernels.density import _warn_small

        _warn_small(frames, found[0][0], plan.cutoff, plan.grid, n, first)
    frames = _weighted(frames, w, 0, f, n)
    g_xyz, g_b, g_occ, _ = vjp(
        frames, plan.grid, map_grad, radius=plan.radius, cutoff=plan.cutoff, radius_rule=plan.radius_rule
    )
    del frames
    dtype = atoms.dtype
    grads = {"xyz": g_xyz.to(c.dtype).reshape(f, n, 3), "b_iso": g_b.to(dtype).reshape(f, n)}
    if "occ" in wrt:
        g_occ = g_occ.to(dtype).reshape(f, n)
        grads["occ"] = g_occ if w is None else g_occ * w[:, None]
    return {name: grads[name] for name in wrt}, bool(found)


def _recomputed(atoms: AtomSet, c, plan: _Plan, w, wrt, map_grad, warn_small: bool, first: int = 0):
    """(grads of chunk ``c`` by name, small?) by autograd of the chunk's splat, recomputed (any backend)."""
    f, n = c.shape[0], len(atoms)
    x = c.detach().requires_grad_("xyz" in wrt)  # a tensor of its own: the caller's chunk stays as it is
    b = atoms.b_iso.expand(f, n).clone().requires_grad_() if "b_iso" in wrt else None
    o = atoms.occ.expand(f, n).clone().requires_grad_() if "occ" in wrt else None
    with torch.enable_grad():
        rho, small = _sum_frames(atoms, x, plan, w, b, o, None, 0, f, None, warn_small=warn_small, offset=first)
        asked = {"xyz": x, "b_iso": b, "occ": o}
        grads = torch.autograd.grad(rho, [asked[name] for name in wrt], grad_outputs=map_grad)
    return dict(zip(wrt, grads)), small


class _NpyWriter:
    """Rows of memory-mapped ``.npy`` files, one per gradient, written as temporaries and renamed at the end.

    Rank 0 creates every file as ``.<name>.<token>.tmp`` beside its final name (the token random, agreed
    by the ranks in one all_reduce) at full size; each rank opens them by that name and writes its
    rows; :meth:`finish` renames them onto their final names once every rank has written. So a
    stream that fails part way (a damaged frame, Ctrl-C, a rank that stops) leaves no ``.npy`` whose
    unwritten rows read as zeros: :meth:`abort` removes the temporaries, and only a killed process
    may leave a ``.tmp`` file, never a partial file under the final name.
    """

    def __init__(self, paths: dict, n_frames: int, n: int, dtype: torch.dtype, process_group, device: torch.device):
        self.process_group, self.paths, self.maps = process_group, paths, {}
        np_dtype = np.float32 if dtype == torch.float32 else np.float64
        shapes = {name: (n_frames, n, 3) if name == "xyz" else (n_frames, n) for name in paths}
        rank0 = _rank(process_group) == 0
        token = _agreed_token(process_group, device, int.from_bytes(os.urandom(7), "little") if rank0 else 0)
        self.temporaries = {
            name: p.with_name(f".{p.name[:TEMPORARY_NAME_KEEP]}.{token:014x}.tmp") for name, p in paths.items()
        }
        self.made = []
        try:
            if rank0:
                for name, tmp in self.temporaries.items():
                    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # 0666 less the umask
                    self.made.append(tmp)
                    np.lib.format.open_memmap(tmp, mode="w+", dtype=np_dtype, shape=shapes[name]).flush()
            self._barrier()
            self.maps = {name: np.load(tmp, mmap_mode="r+") for name, tmp in self.temporaries.items()}
        except BaseException:
            self.abort()
            raise

    def _barrier(self) -> None:
        if self.process_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.process_group)

    def __call__(self, start: int, stop: int, grads: dict) -> None:
        for name, g in grads.items():
            self.maps[name][start:stop] = g.detach().cpu().numpy()

    def finish(self) -> None:
        """Every rank's rows are written: rank 0 renames the files onto their final names."""
        for m in self.maps.values():
            m.flush()
        self.maps = {}
        self._barrier()
        if self.made:
            for name, tmp in self.temporaries.items():
                os.replace(tmp, self.paths[name])
            self.made = []
        self._barrier()

    def abort(self) -> None:
        """Drop the files: the gradients are not all written (the final names are left as they were)."""
        self.maps = {}
        for tmp in self.made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self.made = []


def _agreed_token(process_group, device: torch.device, mine: int) -> int:
    """Rank 0's ``mine`` on every rank (an all_reduce MAX, the others passing 0); ``mine`` without a group."""
    if process_group is None:
        return mine
    import torch.distributed as dist

    on = device if dist.get_backend(process_group) == "nccl" else torch.device("cpu")
    value = torch.tensor([mine], dtype=torch.int64, device=on)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=process_group)
    return int(value.item())


def _writer(out, stream: _Stream, n: int, wrt, dtype: torch.dtype, process_group, device: torch.device):
    """(callable taking (start, stop, grads), the path or None) for ``out``."""
    if callable(out):
        return out, None
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(
            f"out must be a callable out(start, stop, grads) or a path to a .npy file, got {type(out).__name__}"
        )
    path = Path(out)
    if path.suffix != ".npy":
        raise ValueError(f"out={str(path)!r} must end in .npy (the gradients are written as memory-mapped .npy files)")
    if stream.total is None:
        raise ValueError(
            "out= a .npy path needs the number of frames up front, which an iterable does not give: pass a "
            "FrameSource or a tensor, or a callable out(start, stop, grads) that stores the chunks"
        )
    if not path.parent.is_dir():
        raise FileNotFoundError(f"the folder of out={str(path)!r} does not exist")
    paths = {name: path if name == "xyz" else path.with_name(f"{path.stem}_{name}.npy") for name in wrt}
    for p in paths.values():
        problem = output_problem(p)
        if problem:
            raise ValueError(f"out={str(path)!r}: {p}: {problem}")
    # a link is written through: the file it names is replaced, the link stays
    paths = {name: Path(os.path.realpath(p)) for name, p in paths.items()}
    return _NpyWriter(paths, stream.total, n, dtype, process_group, device), path
