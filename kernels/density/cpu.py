"""CPU production splat: separable per-atom tables + C++ partitioned scatter-add, with gradients.

Anisotropic sets (``atoms.u_aniso`` not None) take the C++ anisotropic path for every atom: each
atom's effective U, Gaussians and cutoff radius are formed in C++, every voxel costs one exp per
Gaussian term, and the backward gathers per-term moments and carries them to xyz, occ, u_aniso
(anisotropic atoms) and b_iso (isotropic atoms) in C++, with no torch op around the kernel.

The work happens in the C++ extension ``kernels.density._scatter`` (built at install
time; the algorithm's files are listed in ``scatter.hpp``, its nanobind bindings are ``_scatter.cpp``). This
module checks the inputs, casts them to float32 (warning once per dtype), derives the
per-atom quantities the kernel needs, and defines each op once (:data:`CPU_OP`, :data:`CPU_ANISO_OP`):
the eager autograd Function and the ``torch.library`` op are both built from that definition.

The result is bitwise identical run to run and for any number of threads; the thread
count follows ``torch.get_num_threads()``. One call runs two parallel loops (the atoms'
preparation and the map's slabs; the backward likewise) and no multi-threaded torch op. The
loops run on torch's own OpenMP threads where the extension shares torch's OpenMP runtime
(checked at the first kernel call, see ``_openmp_is_torchs``), else on the extension's helper threads; a team
member kept off its core by another process sends the next calls to the helpers, whose loops
never wait for a thread to arrive (``TorchTeam`` and ``HelperPool`` in ``thread_pool.cpp``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re

import torch

from kernels._opdef import OpDef, eager_function, register
from kernels._util import positive_number, to_float32
from kernels.adp import first_bad_adp
from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density.positions import NEAR_CELL, positions_in_cell
from kernels.density.radius import DEFAULT_CUTOFF, RADIUS_RULES, _closed_form, _precalculate
from kernels.density.reference import atom_radii
from kernels.grid import grid_of

try:
    from kernels.density import _scatter
except ImportError as exc:  # the dispatcher turns this into a BackendError with the reason
    raise ImportError(
        "the C++ extension kernels.density._scatter is not built; build it with "
        "`pip install --no-build-isolation -e .` in the source tree (needs a C++17 compiler)"
    ) from exc

__all__ = ["splat_cpu", "splat_frames_cpu", "cutoff_radius_cpu"]

_OPENMP_RUNTIMES = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so[^/]*$")


def _openmp_is_torchs() -> bool:
    """Whether the extension's OpenMP runtime is the one torch's CPU ops run on.

    True where torch's parallel backend is OpenMP and the only OpenMP runtime mapped into this
    process (torch's, loaded by ``import torch``) is the file the extension calls. Then the
    kernel's parallel loops run on torch's intra-op threads, which are awake right after the
    caller's torch ops; otherwise (another runtime, a build without OpenMP, no ``/proc``) on the
    kernel's own threads. Either way the results are bitwise the same.
    """
    ours = _scatter.build_info()["openmp_library"]
    if not ours or "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as maps:
            mapped = {line.split(maxsplit=5)[5].strip() for line in maps if _OPENMP_RUNTIMES.search(line.strip())}
    except (OSError, IndexError):
        return False
    return {os.path.realpath(p) for p in mapped} == {os.path.realpath(ours)}


_openmp_checked = False


def _kernel():
    """The C++ extension, told at its first parallel call whether it shares torch's OpenMP runtime.

    Every call that runs the kernel's parallel loops goes through here, so importing this module runs
    nothing: the check (which reads ``/proc/self/maps``) runs once, at the first such call.
    """
    global _openmp_checked
    if not _openmp_checked:
        _scatter.set_shared_openmp(_openmp_is_torchs())
        _openmp_checked = True
    return _scatter


_OP = "splat_density"
# Cell kinds as the C++ kernel takes them: which axis stays separable.
_KIND = {"orthogonal": 0, "hexagonal": 0, "monoclinic": 1, "triclinic": 2}


# The C++ kernel's private plan, by call: keyword arguments of kernels.density._scatter's splat, gather
# and gather_aniso (their docstrings say what each does). keep_rows is this module's: whether a forward
# that will be differentiated keeps its row intervals for the backward.
_PLAN_FIELDS = {
    "splat": ("slabs_per_thread", "float_rows"),
    "gather": ("float_rows", "lanes"),
    "gather_aniso": (),
}
_PLAN_KEYS = frozenset(k for keys in _PLAN_FIELDS.values() for k in keys) | {"keep_rows"}


@dataclasses.dataclass
class _Plan:
    """A private plan (:func:`_plan_hook`) and what the calls under it did."""

    fields: dict
    forward: list = dataclasses.field(default_factory=list)  # the forward's timing dicts
    backward: list = dataclasses.field(default_factory=list)  # the backward's timing dicts

    def args(self, call: str) -> dict:
        return {k: v for k, v in self.fields.items() if k in _PLAN_FIELDS[call]}


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("kernels_density_cpu_plan", default=None)


@contextlib.contextmanager
def _plan_hook(**fields):
    """For tests and benchmarks only: run the CPU splats inside the block under a private plan.

    The one way to vary how the C++ kernel runs and to read what it did; users never need it, and
    every plan gives bitwise the same maps and gradients. Each splat started inside the block (and its
    backward, which keeps its forward's plan wherever it runs) passes ``fields`` to the kernel.

    Parameters
    ----------
    **fields
        Any of:

        - ``slabs_per_thread`` (int, forward): 0 (default): one slab at one thread; at T threads
          slabs of decreasing work (each 1/(2T) of what is left, down to 1/(16T), 1/(2T) for an
          anisotropic set), their count capped where the edges' cost would pass 6 % of the work, never
          fewer than T. k > 0: k slabs of equal work per thread (at one thread too: how benchmarks time
          the cost of an edge).
        - ``float_rows`` (bool): row intervals of the lane path from the float pass, every row it
          cannot trust settled in double (default True); False: from the double pass only.
        - ``lanes`` (int, isotropic backward): 0 (default) lets the kernel pick (16 on CPUs that run
          its AVX-512 clone, else 8); 8 forces 8-lane blocks.
        - ``keep_rows`` (bool): a forward that will be differentiated keeps its row intervals for
          the backward (default True, 4 bytes per row); False makes the backward solve for them.

    Yields
    ------
    _Plan
        ``.forward`` and ``.backward`` receive one timing dict per kernel call of the block: phase
        times in s (``"prepare"``, ``"partition"``, ``"compute"``), ``"tasks"``,
        ``"rows_reused"`` (backward: atoms whose rows came from the forward), ``"exp_visits"`` (anisotropic forward: (atom, slab) visits that took an exp per
        voxel instead of the factor tables).

    Raises
    ------
    TypeError
        A field that is not one of these.
    """
    unknown = set(fields) - _PLAN_KEYS
    if unknown:
        raise TypeError(f"unknown plan fields {sorted(unknown)}; the fields are {sorted(_PLAN_KEYS)}")
    plan = _Plan(dict(fields))
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def _plan_args(plan: _Plan | None, call: str) -> dict:
    return {} if plan is None else plan.args(call)


def _record(plan: _Plan | None, where: str, info) -> None:
    if plan is not None and info is not None:
        getattr(plan, where).append(info)


def cutoff_radius_cpu(b_iso: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cutoff: float = DEFAULT_CUTOFF):
    """Per-atom cutoff radius in Å with gemmi's rule, computed in C++ (CPU tensors).

    The same steps as :func:`kernels.density.radius.cutoff_radius` (which the reference
    uses), atom by atom in float64: the radii agree with it to rounding (~1e-15 Å). That
    vectorised torch version takes 0.3–5 s on 17k atoms because every atom runs the
    longest walk; this takes about a millisecond.

    Parameters
    ----------
    b_iso : torch.Tensor, shape (N,)
        Isotropic B in Å² (> 0), any floating dtype, CPU.
    a, b : torch.Tensor, shape (N, 5)
        IT92 coefficients, c as the fifth term with width 0.
    cutoff : float
        Density level in e/Å³ (> 0).

    Returns
    -------
    torch.Tensor, shape (N,), float64
        Not differentiable.
    """
    cutoff = _check_cutoff(cutoff)
    bb = b_iso.detach().to(torch.float64).contiguous()
    aa = a.detach().to(torch.float64).contiguous()
    wb = b.detach().to(torch.float64).contiguous()
    out = torch.empty(bb.shape[0], dtype=torch.float64)
    if bb.shape[0]:
        _kernel().cutoff_radii(out, bb, aa, wb, float(cutoff), n_threads=torch.get_num_threads())
    return out


def _check_cutoff(cutoff) -> float:
    return positive_number(cutoff, "cutoff", "the map's unit")


def _kernel_cell(grid: GridSpec):
    """The grid's cell as the kernel reads it (metric, orth, reciprocal lengths, kind)."""
    cell = grid.cell
    return _scatter.Cell(cell.metric.contiguous(), cell.orth.contiguous(), cell.reciprocal_lengths, _KIND[cell.kind])


def _f32(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor as the kernel reads it: detached, float32, C-contiguous (no copy when it already is)."""
    return tuple(t.detach().to(torch.float32).contiguous() for t in tensors)


@dataclasses.dataclass(eq=False)
class _CpuSplat:
    """The host state of one CPU splat: what the ops' ``forward`` and ``backward`` take besides tensors.

    Built by :func:`_prepare` (eager calls) or by the ops' ``call`` (compiled calls), from the atoms'
    checked and cast values.

    Attributes
    ----------
    grid : GridSpec
        Whole-cell grid.
    frac : torch.Tensor, shape (N, 3), float64
        Fractional positions of the atoms as the kernel reads them (near the cell).
    radii : torch.Tensor or None
        (N,) float64 cutoff radii in Å; None: each atom's radius from ``cutoff`` inside the kernel
        (isotropic X-ray and electron atoms, gemmi's rule).
    cutoff : float
        The cutoff the kernel reads (0 where ``radii`` are given).
    aniso_u8 : torch.Tensor or None
        (N,) uint8 flags of anisotropic atoms for the anisotropic kernel; None for the isotropic one.
    n_frames : int
        0: one map of ``grid.shape``; F ≥ 1: F maps (F, *grid.shape) of F equal frames (frame-major).
    plan : _Plan or None
        The private plan of an enclosing :func:`_plan_hook`; the backward runs under the forward's.
    keep_rows : bool
        The isotropic forward keeps its row intervals in ``rows`` for the backward (4 bytes a row).
    out : torch.Tensor or None
        The map to write into instead of a new one (``splat_cpu(out=)``).
    rows : object
        Set by the isotropic forward when ``keep_rows``: its row intervals (opaque, freed with the state);
        None makes the backward solve for them, bitwise the same.
    """

    grid: GridSpec
    frac: torch.Tensor
    radii: torch.Tensor | None
    cutoff: float
    aniso_u8: torch.Tensor | None = None
    n_frames: int = 0
    plan: _Plan | None = None
    keep_rows: bool = False
    out: torch.Tensor | None = None
    rows: object = None

    def shape(self) -> list[int]:
        return list(self.grid.shape) if self.n_frames == 0 else [self.n_frames, *self.grid.shape]

    def atoms(self, b_iso, occ, a, b, u_aniso=None):
        """The kernel's atom set (C++ ``Atoms``) of these per-atom values (float32, contiguous)."""
        if self.aniso_u8 is None:
            return _scatter.Atoms(self.frac, b_iso, occ, a, b, radii=self.radii, cutoff=self.cutoff)
        return _scatter.Atoms(
            self.frac, b_iso, occ, a, b, radii=self.radii, cutoff=0.0, u_aniso=u_aniso, aniso=self.aniso_u8
        )

    def new_map(self) -> torch.Tensor:
        # uninitialised (the kernel writes every voxel); storage of a freed map of this size when there
        # is one, already paged in
        return self.out if self.out is not None else _scatter.empty_maps(self.shape())


def _fractional(xyz: torch.Tensor, grid: GridSpec) -> torch.Tensor:
    """frac·xyz in float64, (N, 3): the same product (and rounding) as the reference's matmul."""
    return (xyz.detach().to(torch.float64) @ grid.cell.frac.T).contiguous()


def _splat(call: _CpuSplat, katoms) -> torch.Tensor:
    """The C++ forward (either kernel) of ``katoms`` into a new map (or ``call.out``); keeps the rows asked for."""
    out = call.new_map()
    keep = call.keep_rows and call.aniso_u8 is None
    info, rows = _kernel().splat(
        out, _kernel_cell(call.grid), katoms, n_threads=torch.get_num_threads(), keep_rows=keep,
        **_plan_args(call.plan, "splat"),
    )  # fmt: skip
    _record(call.plan, "forward", info)
    call.rows = rows
    return out


def _gradients(n: int, *widths: int) -> list[torch.Tensor]:
    """float32 gradient buffers, (n,) or (n, width) each: the kernels write every entry (float64 sums,
    rounded once)."""
    return [torch.empty((n, w) if w else n, dtype=torch.float32) for w in widths]


def _gather(grad_out, call: _CpuSplat, katoms):
    """The C++ isotropic backward: (gxyz, gb_iso, gocc), float32."""
    gxyz, gb, gocc = out = _gradients(len(katoms), 3, 0, 0)
    if len(katoms):
        g = grad_out.detach().to(torch.float32).contiguous()
        info = _kernel().gather(
            g, _kernel_cell(call.grid), katoms, gxyz, gb, gocc, rows=call.rows, n_threads=torch.get_num_threads(),
            **_plan_args(call.plan, "gather"),
        )  # fmt: skip
        _record(call.plan, "backward", info)
    return tuple(out)


def _gather_aniso(grad_out, call: _CpuSplat, katoms):
    """The C++ anisotropic backward: (gxyz, gu, gb_iso, gocc), float32."""
    gxyz, gu, gb, gocc = out = _gradients(len(katoms), 3, 6, 0, 0)
    if len(katoms):
        g = grad_out.detach().to(torch.float32).contiguous()
        info = _kernel().gather_aniso(
            g, _kernel_cell(call.grid), katoms, call.grid.cell.frac.contiguous(), gxyz, gocc, gu, gb,
            n_threads=torch.get_num_threads(), **_plan_args(call.plan, "gather_aniso"),
        )  # fmt: skip
        _record(call.plan, "backward", info)
    return tuple(out)


# --------------------------------------------------------------------------- the ops, defined once
#
# Each OpDef is the whole op: forward, backward and output shapes. Eager calls (_splat_cpu) apply the autograd
# Function built from it with the state _prepare gives; compiled calls run its torch.library op, whose call
# builds that state from the op's plain arguments. Only an eager forward keeps its row intervals (the state
# carries them to the backward); the op's backward, with a state of its own, solves for them again.


def _iso_forward(call: _CpuSplat, xyz, b_iso, occ, a, b):
    return (_splat(call, call.atoms(*_f32(b_iso, occ, a, b))),)


def _iso_backward(call: _CpuSplat, grad, xyz, b_iso, occ, a, b):
    g = _gather(grad, call, call.atoms(*_f32(b_iso, occ, a, b)))
    return tuple(t.to(v.dtype) for t, v in zip(g, (xyz, b_iso, occ)))


def _aniso_forward(call: _CpuSplat, xyz, u_aniso, aniso, b_iso, occ, a, b):
    return (_splat(call, call.atoms(*_f32(b_iso, occ, a, b, u_aniso))),)


def _aniso_backward(call: _CpuSplat, grad, xyz, u_aniso, aniso, b_iso, occ, a, b):
    g = _gather_aniso(grad, call, call.atoms(*_f32(b_iso, occ, a, b, u_aniso)))
    # The kernel writes zero B gradients where atoms use U (their b_iso is not read).
    return tuple(t.to(v.dtype) for t, v in zip(g, (xyz, u_aniso, b_iso, occ)))


def _op_call(inputs, params, u_aniso=None, aniso=None):
    """The state of a compiled call, from the op's inputs and plain arguments (it runs no grad)."""
    xyz, b_iso, occ, a, b = inputs
    cell, shape, radius, cutoff, radiation, radius_rule = params
    atoms = AtomSet(xyz, b_iso, occ, a, b, (), (), u_aniso, aniso, radiation=radiation, _validate=False)
    return _prepare(atoms, grid_of(cell, shape), radius, cutoff, radius_rule, 0, _PLAN.get(), grad=False)[0]


def _map_fake(xyz, shape):
    return (xyz.new_empty(tuple(shape), dtype=torch.float32),)


_ISO_INPUTS = ("Tensor xyz", "Tensor b_iso", "Tensor occ", "Tensor a", "Tensor b")
_PARAMS = ("float[] cell", "int[] shape", "float? radius", "float cutoff", "str radiation", "str radius_rule")

CPU_OP = OpDef(
    name="kernels::density_cpu",
    inputs=_ISO_INPUTS,
    params=_PARAMS,
    grads=(0, 1, 2),
    saved=0,
    call=_op_call,
    forward=_iso_forward,
    backward=_iso_backward,
    fake=lambda xyz, b_iso, occ, a, b, cell, shape, *_: _map_fake(xyz, shape),
)
CPU_ANISO_OP = OpDef(
    name="kernels::density_cpu_aniso",
    inputs=("Tensor xyz", "Tensor u_aniso", "Tensor aniso", *_ISO_INPUTS[1:]),
    params=_PARAMS,
    grads=(0, 1, 3, 4),
    saved=0,
    call=lambda inputs, params: _op_call((inputs[0], *inputs[3:]), params, inputs[1], inputs[2]),
    forward=_aniso_forward,
    backward=_aniso_backward,
    fake=lambda xyz, u, aniso, b_iso, occ, a, b, cell, shape, *_: _map_fake(xyz, shape),
)
_SplatCPU = eager_function(CPU_OP)
_AnisoSplatCPU = eager_function(CPU_ANISO_OP)
register(CPU_OP)
register(CPU_ANISO_OP)


def _neutron_radii(b_iso, a, b, cutoff: float) -> torch.Tensor:
    """Cutoff radii in Å, (N,) float64, of an isotropic neutron set: one Gaussian, in closed form
    (:func:`kernels.density.radius.atom_cutoff_radii`'s rule; hydrogen's negative length by |a|)."""
    f64 = torch.float64
    with torch.no_grad():
        amp, expo = _precalculate(b_iso.detach().to(f64), a.detach().to(f64), b.detach().to(f64))
        return _closed_form(amp.sum(-1), expo[:, 0], cutoff)


def _aniso_radii(u_aniso, aniso_u8, b_iso, a, b, radiation: str, cutoff: float, radius_rule: str) -> torch.Tensor:
    """Cutoff radii in Å, (N,) float64, of an anisotropic set, by
    :func:`kernels.density.radius.atom_cutoff_radii`'s rules, in C++ (float32 CPU inputs, uint8 flags).

    The vectorised torch search walks every atom the longest way (seconds on 17k atoms); this takes
    about a millisecond. The eigenvalues of the "eigen" rule come from the closed-form cubic, within
    ~1e-12 Å of the torch rule's radii.
    """
    out = torch.empty(len(b_iso), dtype=torch.float64)
    if len(out):
        _kernel().cutoff_radii_aniso(
            out,
            u_aniso,
            aniso_u8,
            b_iso,
            a,
            b,
            float(cutoff),
            radius_rule,
            neutron=radiation == "neutron",
            n_threads=torch.get_num_threads(),
        )
    return out


def _check_adp(u_aniso: torch.Tensor, aniso_u8: torch.Tensor, atoms: AtomSet) -> None:
    """``ValueError`` naming the first anisotropic atom whose U is not finite and positive definite.

    Sylvester's test on every row first, in C++ on the calling thread (a torch op over the (N, 6) U
    runs on torch's OpenMP workers, which then spin on the cores the kernel's threads need); only when
    it fails does :func:`first_bad_adp` find the atom and its eigenvalues, for the reference's message.
    ``u_aniso`` (N, 6) float32 and ``aniso_u8`` (N,) uint8, contiguous.
    """
    if _scatter.first_non_positive_definite(u_aniso.detach(), aniso_u8) < 0:
        return
    bad = first_bad_adp(u_aniso, atoms.aniso)
    if bad is not None:
        idx, _count, what = bad
        raise ValueError(f"atom {atoms.labels[idx]} (index {idx}) {what}")


def splat_cpu(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Electron density of ``atoms`` on a whole-cell ``grid``, float32, on the CPU.

    An isotropic set (``atoms.u_aniso`` None) takes the separable kernel. A set with ``u_aniso``
    takes the anisotropic kernel for every atom, each through its effective U (isotropic atoms of a
    mixed set as B/8π²·I, exactly their isotropic density): per voxel and Gaussian term two
    multiplies of per-atom factor tables in float64 (an atom whose factors could leave float64's
    range, a very narrow term in a wide box, takes one exp per voxel and term instead), over the
    same sphere of voxels and the same deterministic partitioned scatter.

    Parameters
    ----------
    atoms : AtomSet
        CPU tensors; float32 (float64 is cast, with one warning per dtype). Any radiation; neutron
        lengths may be negative (hydrogen), and so may the map.
    grid : GridSpec
        Whole-cell grid (periodic). Any cell: orthogonal, monoclinic, hexagonal, triclinic.
    radius : float, optional
        One cutoff radius in Å for every atom; default: per atom from ``cutoff``
        (:func:`kernels.density.radius.atom_cutoff_radii`: gemmi's rule, :func:`cutoff_radius_cpu`,
        for isotropic X-ray and electron atoms; the closed form for neutrons).
    cutoff : float
        Density level (e/Å³; fm/Å³ for neutrons) that sets each atom's radius when ``radius`` is None.
    radius_rule : {"gemmi", "eigen"}
        Cutoff radius of anisotropic atoms (:func:`kernels.density.radius.atom_cutoff_radii`).
    out : torch.Tensor, optional
        shape grid.shape, float32, CPU, C-contiguous: the map is written into it (every voxel
        overwritten) and it is returned. For loops that splat the same grid again and again: a
        fresh map costs a page fault per 4 KiB page on its first touch. Not differentiable: refused
        while gradients are recorded for ``atoms`` (see :func:`check_out`).

    Returns
    -------
    torch.Tensor, shape grid.shape, float32
        Density in e/Å³, differentiable with respect to ``atoms.xyz``, ``atoms.b_iso``
        and ``atoms.occ`` (backward is a C++ gather over the same voxels), and ``atoms.u_aniso``
        (anisotropic rows; ``b_iso`` then of the isotropic atoms only); ``out`` when given.
        Without ``out`` the map's storage is the kernel's: when a map is freed its memory is
        kept for the next map of that size (at most two blocks, 256 MiB in all), which skips the page faults of
        fresh memory; such a tensor cannot be resized in place (``resize_``).

    Raises
    ------
    kernels.GridError
        ``grid`` is a box, not the whole cell.
    ValueError
        Atoms not on the CPU, a radius or cutoff that is not a positive number, an unknown
        ``radius_rule``, an atom with a non-finite position or an anisotropic U that is not finite
        and positive definite (named, as the reference names it), or an ``out`` that does not fit
        (see :func:`check_out`).
    """
    return _splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule, out=out)


def splat_frames_cpu(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    n_frames: int,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
) -> torch.Tensor:
    """Density of each of ``n_frames`` frames of atoms, one map per frame, in one parallel loop.

    Parameters
    ----------
    atoms : AtomSet
        ``n_frames * N`` atoms, frame-major (atom i belongs to frame i // N), CPU tensors,
        float32 (float64 is cast, with one warning per dtype); with ``u_aniso``, one row per atom
        of every frame.
    grid : GridSpec
        Whole-cell grid, the same for every frame.
    n_frames : int
        F ≥ 1; ``len(atoms)`` must be a multiple of it.
    radius, cutoff, radius_rule
        As for :func:`splat_cpu`.

    Returns
    -------
    torch.Tensor, shape (n_frames, nx, ny, nz), float32
        Map f is bitwise :func:`splat_cpu` of frame f's atoms, for any thread count (every map's
        slabs are tasks of one parallel loop, each voxel summed in its frame's atom order).
        Differentiable with respect to ``atoms.xyz``, ``atoms.b_iso``, ``atoms.occ`` (and ``atoms.u_aniso``): the
        backward gives each frame's atoms the gradient of their own map's slice of the upstream
        (F, nx, ny, nz) gradient.

    Raises
    ------
    kernels.GridError
        ``grid`` is a box, not the whole cell.
    ValueError
        ``n_frames`` not a positive integer dividing ``len(atoms)``, or as for :func:`splat_cpu`.
    """
    if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 1:
        raise ValueError(f"n_frames must be a positive integer, got {n_frames!r}")
    if len(atoms) % n_frames:
        raise ValueError(
            f"{len(atoms)} atoms do not split into {n_frames} frames of equal size; "
            "pass the frames' atoms frame-major, N atoms per frame"
        )
    return _splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule, n_frames=n_frames)


def check_out(out, atoms: AtomSet, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ``out`` can receive the CPU backend's map of ``atoms``.

    ``out`` must be a float32 CPU tensor of ``shape``, C-contiguous, not requiring grad, and no
    gradient may be recorded for ``atoms`` (an in-place result has no backward here: call without
    ``out``, or under ``torch.no_grad()``, or with detached atoms).
    """
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    problems = []
    if out.device.type != "cpu":
        problems.append(f"it is on {out.device}, the map is made on the cpu")
    if out.dtype != torch.float32:
        problems.append(f"its dtype is {out.dtype}, the map is float32")
    if tuple(out.shape) != tuple(shape):
        problems.append(f"its shape is {tuple(out.shape)}, the grid's is {tuple(shape)}")
    elif not out.is_contiguous():
        problems.append("it is not contiguous (use out.contiguous() once and keep that tensor)")
    if problems:
        raise ValueError(
            "out cannot hold this map: "
            + "; ".join(problems)
            + f"; make it with torch.empty({tuple(shape)}, dtype=torch.float32)"
        )
    if out.requires_grad or (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (atoms.xyz, atoms.b_iso, atoms.occ, atoms.u_aniso))
    ):
        raise ValueError(
            "out= is not differentiable: the atoms (or out) require grad while gradients are recorded; "
            "call without out= to get a differentiable map, or splat under torch.no_grad()"
        )


def _prepare(atoms: AtomSet, grid: GridSpec, radius, cutoff, radius_rule: str, n_frames: int, plan, grad: bool):
    """The state and kernel inputs of a CPU splat of ``atoms``: checks, float32 casts, fractional positions
    near the cell, radii. ``grad``: the forward will be differentiated (it keeps its row intervals, unless the
    plan says not to).

    Returns
    -------
    (_CpuSplat, OpDef, tuple of torch.Tensor)
        The state, the op that runs it (:data:`CPU_OP` or :data:`CPU_ANISO_OP`) and that op's inputs.
    """
    frac = None
    if atoms.xyz.dtype == torch.float32:
        # frac·xyz on this thread (a parallel torch op would wake other threads for microseconds of
        # work); atoms far from the cell take positions_in_cell's float64 move below
        xyz = atoms.xyz
        frac = torch.empty((len(atoms), 3), dtype=torch.float64)
        near = _scatter.fractional(
            frac, xyz.detach().contiguous(), grid.cell.frac.contiguous(), NEAR_CELL[0], NEAR_CELL[1]
        )
        if not near:
            frac = None
    if frac is None:
        xyz = positions_in_cell(atoms, grid.cell)  # float64 wrap: the float32 cast then keeps offsets exact
        xyz = to_float32(xyz.to(atoms.xyz.dtype), _OP)
        frac = _fractional(xyz, grid)
    b_iso = to_float32(atoms.b_iso, _OP)
    occ = to_float32(atoms.occ, _OP)
    a = to_float32(atoms.a, _OP)
    b = to_float32(atoms.b, _OP)
    if atoms.u_aniso is not None:
        u_aniso = to_float32(atoms.u_aniso, _OP).contiguous()
        aniso_u8 = atoms.aniso.to(torch.uint8).contiguous()
        _check_adp(u_aniso, aniso_u8, atoms)
        if radius is not None:
            radii = atom_radii(atoms, radius, cutoff)
        else:
            u, bi, aa, bb = (t.detach().contiguous() for t in (u_aniso, b_iso, a, b))
            radii = _aniso_radii(u, aniso_u8, bi, aa, bb, atoms.radiation, _check_cutoff(cutoff), radius_rule)
        call = _CpuSplat(grid, frac, radii.contiguous(), 0.0, aniso_u8, n_frames, plan)
        return call, CPU_ANISO_OP, (xyz, u_aniso, atoms.aniso, b_iso, occ, a, b)
    if radius is not None:
        radii, cutoff = atom_radii(atoms, radius, cutoff), 0.0  # the kernel reads the radii, not the cutoff
    elif atoms.radiation == "neutron":
        # closed-form radii (one Gaussian), not the five-term step search the kernel runs
        radii, cutoff = _neutron_radii(b_iso, a, b, _check_cutoff(cutoff)), 0.0
    else:
        cutoff = _check_cutoff(cutoff)
        radii = None  # the kernel derives each atom's radius from the cutoff (one pass, no extra call)
    keep = grad and (plan is None or plan.fields.get("keep_rows", True))
    call = _CpuSplat(grid, frac, radii, float(cutoff), None, n_frames, plan, keep)
    return call, CPU_OP, (xyz, b_iso, occ, a, b)


def _splat_cpu(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
    n_frames: int = 0,
    out: torch.Tensor | None = None,
    grad_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`splat_cpu`, :func:`splat_frames_cpu` and :func:`map_vjp_cpu` in one.

    The kernel runs under the plan of an enclosing :func:`_plan_hook` (tests and benchmarks), if any.

    Parameters
    ----------
    atoms, grid, radius, cutoff, radius_rule, out
        As for :func:`splat_cpu`.
    n_frames : int
        0: one map of all atoms. F ≥ 1: F maps of F equal frames (:func:`splat_frames_cpu`).
    grad_of : torch.Tensor, optional
        A map gradient (``grid.shape``): return the backward's gradients of ``sum(grad_of · map)``
        instead of the map, without running the forward (the C++ backward solves for the row
        intervals itself): ``(g_xyz, g_b_iso, g_occ)``, and ``g_u_aniso`` after them for an
        anisotropic set; float32.

    Returns
    -------
    torch.Tensor, shape grid.shape (n_frames 0) or (n_frames, *grid.shape), float32
        As for :func:`splat_cpu` (a tuple of gradients with ``grad_of``).
    """
    if not grid.is_whole_cell:
        raise GridError("the cpu density backend splats whole-cell grids only; use backend='reference' for a box")
    if atoms.device.type != "cpu":
        raise ValueError(f"splat_cpu needs CPU tensors, got {atoms.device}; use atoms.to('cpu') or backend='auto'")
    if radius_rule not in RADIUS_RULES:
        raise ValueError(f"radius_rule must be one of {RADIUS_RULES}, got {radius_rule!r}")
    if out is not None:
        check_out(out, atoms, grid.shape if n_frames == 0 else (n_frames, *grid.shape))
    grad = grad_of is None and out is None and torch.is_grad_enabled()
    grad = grad and any(t is not None and t.requires_grad for t in (atoms.xyz, atoms.b_iso, atoms.occ))
    call, op, inputs = _prepare(atoms, grid, radius, cutoff, radius_rule, n_frames, _PLAN.get(), grad)
    if grad_of is not None:
        g = op.backward(call, grad_of, *inputs)
        return g if op is CPU_OP else (g[0], g[2], g[3], g[1])
    if out is not None:
        call.out = out
        return op.forward(call, *inputs)[0]
    return (_SplatCPU if op is CPU_OP else _AnisoSplatCPU).apply(call, *inputs)


def map_vjp_cpu(
    atoms: AtomSet,
    grid: GridSpec,
    grad: torch.Tensor,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
):
    """Gradients of ``(grad · splat_cpu(atoms, grid)).sum()`` without the forward splat.

    The C++ backward (the gather) reads only the kernel's atom set: it solves for the row intervals
    the forward would have kept (the plan's ``keep_rows``) on its own, with bitwise the same
    result. So this is bit for bit the gradients of a forward and its backward, for the cost of the
    backward alone.

    Parameters
    ----------
    atoms : AtomSet
        As for :func:`splat_cpu` (their ``requires_grad`` is not read).
    grid : GridSpec
        Whole-cell grid.
    grad : torch.Tensor, shape grid.shape
        ∂L/∂map (read as float32).
    radius, cutoff, radius_rule
        As for :func:`splat_cpu`.

    Returns
    -------
    tuple of torch.Tensor
        ``(g_xyz, g_b_iso, g_occ, g_u_aniso)``, float32: (N, 3), (N,), (N,), and (N, 6) for an
        anisotropic set (None for an isotropic one).

    Raises
    ------
    ValueError, kernels.GridError
        As :func:`splat_cpu` raises for its inputs.
    """
    grads = _splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule, grad_of=grad)
    return grads if len(grads) == 4 else (*grads, None)
