"""The binned gather forward of the isotropic Triton splat (``KERNELS_TRITON_FORWARD=gather``).

Against the float64 reference and the scatter within docs/kernels.md's float32 contract on the four cell kinds,
atoms on and past the cell's faces, spheres wider than the cell, non-finite atoms, frames; bitwise over repeated
calls, and in deterministic mode under a permutation of the atoms; the overflow flag; the switch. In CI under
``TRITON_INTERPRET=1`` (set by the root conftest); the CUDA tests (no host sync, CUDA-graph replay, real
structures) run in the GPU tier.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridSpec
from kernels.density import triton as T
from kernels.density.reference import splat_reference
from tests.helpers import assert_kernel_close, deterministic, model, requires_cuda, run_compiled
from tests.kernels.test_density_triton import CELLS, MIXED, check_against_reference, synthetic

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gather():
    """Every isotropic Triton forward through the gather while the test runs."""
    previous = T._set_forward_method("gather")
    try:
        yield
    finally:
        T._set_forward_method(previous)


def _inputs(atoms, grid, radius=None):
    """(plan, kernel inputs) of ``atoms`` on DEVICE as float32, for the internal forwards."""
    atoms = atoms.to(DEVICE, torch.float32)
    plan = T._plan(grid, radius, kernels.DEFAULT_CUTOFF, DEVICE)
    return plan, T._kernel_inputs(atoms)


def _gather(atoms, grid, radius=None, n_frames=1, gplan=None):
    """(map, radii, state) of the gather forward alone."""
    plan, inputs = _inputs(atoms, grid, radius)
    shape = plan.shape if n_frames == 1 else (n_frames, *plan.shape)
    return T._forward_gather(plan, *inputs, n_frames, shape, gplan=gplan)


def _scatter(atoms, grid, radius=None, n_frames=1):
    """(map, radii) of the scatter forward alone, whatever the switch says."""
    plan, inputs = _inputs(atoms, grid, radius)
    shape = plan.shape if n_frames == 1 else (n_frames, *plan.shape)
    previous = T._set_forward_method("scatter")
    try:
        return T._forward(plan, *inputs, n_frames, shape)
    finally:
        T._set_forward_method(previous)


def _assert_agrees(atoms, grid, radius=None):
    """Gather against the float64 reference and the scatter; radii bitwise the scatter's; no overflow."""
    out, radii, state = _gather(atoms, grid, radius)
    assert out.shape == grid.shape and out.dtype == torch.float32
    assert int(state[1]) == 0, "pair buffer overflow"
    ref = splat_reference(atoms.to(DEVICE, torch.float64), grid, radius=radius)
    assert float(ref.abs().max()) > 0
    assert_kernel_close(out, ref)
    sc, sc_radii = _scatter(atoms, grid, radius)
    assert_kernel_close(out, sc)
    if radius is None:
        assert torch.equal(radii, sc_radii), "the gather's radii are not the scatter's"
    return out


# --------------------------------------------------------------------------- against the reference and the scatter


@pytest.mark.parametrize("kind", list(CELLS))
def test_gather_cells_match_reference_and_scatter(kind):
    # synthetic() puts some atoms up to 0.1 of an edge outside the cell: their boxes wrap over the faces.
    cell = Cell.from_parameters(*CELLS[kind])
    _assert_agrees(synthetic(cell, MIXED, seed=len(kind)), GridSpec.for_spacing(cell, 0.7))


@pytest.mark.parametrize("kind", ["orthogonal", "hexagonal", "triclinic"])
def test_gather_fixed_radius(kind):
    cell = Cell.from_parameters(*CELLS[kind])
    _assert_agrees(synthetic(cell, MIXED[:6], seed=7), GridSpec.for_spacing(cell, 0.8), radius=2.7)


@pytest.mark.parametrize("kind", ["orthogonal", "monoclinic", "hexagonal", "triclinic"])
def test_gather_sphere_wider_than_cell(kind):
    # 4–6 Å cells, radii up to ~7.5 Å: boxes wider than the cell in every axis, each atom adds several periodic
    # images of itself to one voxel; odd grid sizes leave a partial last brick on each axis.
    params = {
        "orthogonal": (4.0, 4.5, 5.0, 90, 90, 90),
        "monoclinic": (4.5, 5.0, 6.0, 90, 112, 90),
        "hexagonal": (4.6, 5.2, 6.0, 90, 90, 104),
    }
    cell = Cell.from_parameters(*params.get(kind, (5.0, 5.5, 6.0, 75, 100, 110)))
    atoms = synthetic(cell, ("C", "O", "Fe", "N"), seed=3, b_range=(20.0, 90.0))
    grid = GridSpec.for_spacing(cell, 0.5)
    _assert_agrees(atoms, grid)
    _assert_agrees(atoms, grid, radius=7.5)


def test_gather_atoms_on_faces_and_corners_partial_bricks():
    # Atoms exactly on the faces and corners, one lattice vector out, and just inside/outside a face; a prime grid
    # whose bricks are partial on every axis.
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    frac = torch.tensor(
        [
            [0.0, 0.0, 0.0],
            [1.0, 1.0, 1.0],
            [0.5, 0.0, 1.0],
            [-1.0, 2.0, 0.25],
            [0.999, 0.001, -0.002],
            [1.02, -0.03, 0.5],
        ],
        dtype=torch.float64,
    )
    atoms = synthetic(cell, ("C", "N", "O", "S", "Fe", "C"), seed=5, frac=frac)
    _assert_agrees(atoms, GridSpec(cell, (31, 23, 37)))


def test_gather_odd_grid_hexagonal():
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    _assert_agrees(synthetic(cell, MIXED, seed=8), GridSpec(cell, (23, 29, 31)))


def test_gather_nitrogen_and_chlorine_at_low_b():
    # A near-delta Gaussian cancelled by a large negative c, on a voxel: the sum's cancellation is where an
    # evaluation that differs from the scatter's would show.
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    frac = torch.tensor([[0.25, 0.25, 0.3], [0.5, 0.5, 0.5], [0.71, 0.13, 0.9]], dtype=torch.float64)
    atoms = synthetic(cell, ("N", "Cl", "N"), seed=6, b_range=(2.0, 2.0), frac=frac)
    out = _assert_agrees(atoms, GridSpec(cell, (40, 44, 50)))
    assert float(out.max()) > 10


def test_gather_nonfinite_atoms_add_nothing():
    # NaN and infinite positions, B and occupancies: such an atom has no pairs. The finite atoms keep their
    # ascending order, so the map is bit for bit the map of the finite atoms alone.
    cell = Cell.from_parameters(*CELLS["triclinic"])
    atoms = synthetic(cell, MIXED, seed=9).to(dtype=torch.float32)
    xyz, b_iso, occ = atoms.xyz.clone(), atoms.b_iso.clone(), atoms.occ.clone()
    xyz[1, 0] = float("nan")
    xyz[4, 2] = float("inf")
    b_iso[6] = float("nan")
    occ[8] = float("-inf")
    bad = atoms.replace(xyz=xyz, b_iso=b_iso, occ=occ)
    grid = GridSpec.for_spacing(cell, 0.8)
    out, radii, state = _gather(bad, grid)
    keep = [i for i in range(len(atoms)) if i not in (1, 4, 6, 8)]
    want = _gather(atoms.select(keep), grid)[0]
    assert torch.isfinite(out).all()
    assert torch.equal(out, want)


def test_gather_empty_cell_region_is_written_zero():
    # No memset: every voxel is written by its brick, those with no atom as exact zeros.
    cell = Cell.from_parameters(40.0, 40.0, 40.0, 90, 90, 90)
    frac = torch.tensor([[0.1, 0.1, 0.1], [0.15, 0.12, 0.1]], dtype=torch.float64)
    atoms = synthetic(cell, ("C", "O"), seed=1, frac=frac, b_range=(10.0, 10.0))
    out = _assert_agrees(atoms, GridSpec(cell, (40, 40, 40)))
    assert float(out[20:, 20:, 20:].abs().max()) == 0.0


def test_gather_frames_match_scatter():
    # Three frames of the same atoms (frame-major), moved and with other B: each frame's map is that frame's own
    # gather bit for bit (its own bricks, the same atoms in the same order).
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    base = synthetic(cell, MIXED, seed=11)
    gen = torch.Generator().manual_seed(12)
    frames = [
        base.replace(xyz=base.xyz + 0.8 * f * torch.randn(base.xyz.shape, generator=gen, dtype=base.xyz.dtype),
                     b_iso=base.b_iso * (1.0 + 0.2 * f))
        for f in range(3)
    ]  # fmt: skip
    stacked = AtomSet(
        *(torch.cat([getattr(a, name) for a in frames]) for name in ("xyz", "b_iso", "occ", "a", "b")), _validate=False
    )
    grid = GridSpec.for_spacing(cell, 0.9)
    out, _radii, state = _gather(stacked, grid, n_frames=3)
    assert out.shape == (3, *grid.shape) and int(state[1]) == 0
    for f, atoms in enumerate(frames):
        assert torch.equal(out[f], _gather(atoms, grid)[0]), f"frame {f} differs from its own gather"
        assert_kernel_close(out[f], splat_reference(atoms.to(DEVICE, torch.float64), grid))
    assert_kernel_close(out, _scatter(stacked, grid, n_frames=3)[0])


# --------------------------------------------------------------------------- bits, order, overflow


def _dense_atoms():
    # A small cell crowded with atoms: float sums in another order differ in their last bits.
    cell = Cell.from_parameters(9.0, 10.0, 11.0, 90, 101, 90)
    return synthetic(cell, MIXED * 2, seed=21, b_range=(2.0, 30.0)), GridSpec.for_spacing(cell, 0.8)


def test_gather_bitwise_over_calls_and_order_is_atom_index():
    atoms, grid = _dense_atoms()
    first = _gather(atoms, grid)[0]
    for _ in range(2):
        assert torch.equal(_gather(atoms, grid)[0], first)
    # The sum order is ascending atom index: a permutation changes it, and so (in this crowded cell) the last bits.
    # That shows the bitwise checks below can fail on float sums.
    perm = torch.randperm(len(atoms), generator=torch.Generator().manual_seed(0)).tolist()
    permuted = _gather(atoms.select(perm), grid)[0]
    assert_kernel_close(permuted, first)
    assert not torch.equal(permuted, first), "too sparse a case: float sums in either order agree"


def test_gather_long_segments_take_the_chunked_selection():
    # A brick's list longer than SEG slots is walked by the chunked min-selection instead of the one held in
    # registers: the same atoms in the same order, so the same map bit for bit.
    atoms, grid = _dense_atoms()
    plan, _ = _inputs(atoms, grid)
    g = T._gather_plan(plan)
    short = dataclasses.replace(g, seg=2)
    bins = T._gather_bin(plan, g, *_inputs(atoms, grid)[1], 1)
    starts = bins[3]
    assert int(torch.diff(torch.cat([starts.new_zeros(1), starts[:-1]])).max()) > 2 * short.seg
    assert torch.equal(_gather(atoms, grid, gplan=short)[0], _gather(atoms, grid)[0])


def test_gather_deterministic_mode_bitwise_under_permutation():
    atoms, grid = _dense_atoms()
    perm = torch.randperm(len(atoms), generator=torch.Generator().manual_seed(1)).tolist()
    with deterministic():
        out, _radii, state = _gather(atoms, grid)
        again = _gather(atoms, grid)[0]
        permuted = _gather(atoms.select(perm), grid)[0]
        fixed_scatter = _scatter(atoms, grid)[0]
    assert int(state[0]) > 0, "no fixed-point exponent"
    assert torch.equal(out, again)
    assert torch.equal(out, permuted)
    assert_kernel_close(out, splat_reference(atoms.to(DEVICE, torch.float64), grid))
    if DEVICE.type == "cpu":
        # The interpreter evaluates both kernels' expressions as written (no FMA contraction): the same
        # fixed-point values, so the deterministic scatter's map bit for bit.
        assert torch.equal(out, fixed_scatter)
    else:
        assert_kernel_close(out, fixed_scatter)


def test_gather_overflow_sets_flag_and_map_is_nan():
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    atoms = synthetic(cell, MIXED, seed=2)
    grid = GridSpec.for_spacing(cell, 0.7)
    plan, _ = _inputs(atoms, grid)
    small = dataclasses.replace(T._gather_plan(plan), pairs_per_atom=1)
    out, _radii, state = _gather(atoms, grid, gplan=small)
    assert int(state[1]) == 1
    assert torch.isnan(out).all()
    out, _radii, state = _gather(atoms, grid)
    assert int(state[1]) == 0 and torch.isfinite(out).all()


def test_gather_binning_lists_only_bricks_the_sphere_can_reach():
    # Bricks of a box that its sphere cannot reach are not listed (the maps above show none that it reaches is
    # lost); each listed brick is counted exactly once, and the segments tile the listed pairs.
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    atoms = synthetic(cell, MIXED, seed=16)
    grid = GridSpec.for_spacing(cell, 0.6)
    plan, inputs = _inputs(atoms, grid)
    g = T._gather_plan(plan)
    _radii, _fprep, iprep, starts, pairs, _cap, _fixed, state = T._gather_bin(plan, g, *inputs, 1)
    listed, enumerated = int(starts[-1]), int(iprep[:, 9].sum())
    assert int(state[1]) == 0
    assert 0 < listed < enumerated, (listed, enumerated)
    lengths = torch.diff(torch.cat([starts.new_zeros(1), starts[:-1]]))
    assert int(lengths.sum()) == listed and int(lengths.min()) >= 0
    got = pairs[:listed].long()
    assert int(got.min()) >= 0 and int(got.max()) < len(atoms)
    for k in range(0, g.n_bricks, 7):  # each atom at most once a brick
        seg = pairs[int(starts[k - 1]) if k else 0 : int(starts[k])]
        assert len(set(seg.tolist())) == len(seg), k


def test_gather_pair_bound_covers_the_bound_atom():
    # The per-atom buffer bound holds the widest atom it is sized for (U at B = 250 Å²), wherever it sits.
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    gen = torch.Generator().manual_seed(4)
    frac = torch.rand(12, 3, generator=gen, dtype=torch.float64)
    atoms = synthetic(cell, ("U",) * 12, seed=4, frac=frac, b_range=(T._GATHER_BOUND_B, T._GATHER_BOUND_B))
    grid = GridSpec.for_spacing(cell, 0.7)
    out, _radii, state = _gather(atoms, grid)
    assert int(state[1]) == 0
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- the switch


def test_switch_routes_splat_and_gradients(gather):
    # With the switch the public call's map is the gather's bit for bit; gradients (the backward reads the
    # gather's radii) match the float64 reference.
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    atoms = synthetic(cell, MIXED, seed=14)
    grid = GridSpec.for_spacing(cell, 0.75)
    out, _ref = check_against_reference(atoms, grid, seed=3)
    assert torch.equal(out.detach(), _gather(atoms, grid)[0])


def test_switch_gather_deterministic_only_routes_deterministic_calls():
    atoms, grid = _dense_atoms()
    at = atoms.to(DEVICE, torch.float32)
    previous = T._set_forward_method("gather-deterministic")
    try:
        plain = T.splat_triton(at, grid)
        with deterministic():
            det = T.splat_triton(at, grid)
            det_gather = _gather(atoms, grid)[0]
    finally:
        T._set_forward_method(previous)
    assert torch.equal(det, det_gather)
    if DEVICE.type == "cpu":  # the interpreter's scatter adds in program order: its map is reproducible there
        assert torch.equal(plain, _scatter(atoms, grid)[0])


def test_switch_rejects_unknown_method(monkeypatch):
    with pytest.raises(ValueError, match="gather"):
        T._set_forward_method("gatherr")
    monkeypatch.setenv("KERNELS_TRITON_FORWARD", "bricks")
    with pytest.raises(ValueError, match="KERNELS_TRITON_FORWARD"):
        T._forward_method_from_env()
    monkeypatch.setenv("KERNELS_TRITON_FORWARD", "gather")
    assert T._forward_method_from_env() == "gather"


# --------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("name", ["1aki", "5h73", "3wip"])
def test_cuda_gather_real_structures_match_scatter_and_reference(name):
    m = model(name)
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    out = _assert_agrees(m.atoms, grid)
    with deterministic():
        det = _gather(m.atoms, grid)[0]
        assert torch.equal(det, _gather(m.atoms.select(list(range(len(m.atoms)))[::-1]), grid)[0])
    assert_kernel_close(det, out)


@requires_cuda
def test_cuda_gather_no_host_sync_and_graph_replay(gather):
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    base = m.atoms.to("cuda", torch.float32)
    xyz = base.xyz.clone().requires_grad_()
    b_iso = base.b_iso.clone().requires_grad_()
    atoms = base.replace(xyz=xyz, b_iso=b_iso)
    w = torch.randn(grid.shape, device="cuda")

    def step():
        out = T.splat_triton(atoms, grid)
        return (out,) + torch.autograd.grad((out * w).sum(), [xyz, b_iso])

    step()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        with deterministic():
            T.splat_triton(atoms, grid)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        xyz.add_(0.05 * torch.randn_like(xyz))
        b_iso.mul_(1.1)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(captured[0], eager[0]), "the replayed gather differs from an eager call"
    for got, want in zip(captured[1:], eager[1:]):
        assert_kernel_close(got, want)


# --------------------------------------------------------------------------- compiled for sm_90 (no GPU needed)

_SM90_SCRIPT = textwrap.dedent(
    """
    import json, os, re, subprocess, tempfile, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.density import _triton_gather as G
    from kernels.density import triton as T

    types = {"xyz_ptr": "*fp32", "b_iso_ptr": "*fp32", "occ_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32",
             "radius_ptr": "*fp32", "p_ptr": "*fp64", "fprep_ptr": "*fp32", "iprep_ptr": "*i32", "count_ptr": "*i32",
             "start_ptr": "*i32", "pair_ptr": "*i32", "fix_ptr": "*i64", "out_ptr": "*fp32", "n_atoms": "i32",
             "atoms_per_frame": "i32", "capacity": "i32", "fix_shift": "i32", "lam": "fp32"}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    bx, by, bz, warps = 8, 4, 16, 1  # the production GPU plan's (T._gather_plan)
    cases = []
    for sep in (True, False):
        for fixed in (False, True):
            cases.append((G._gather_brick_kernel, dict(BX=bx, BY=by, BZ=bz, SEG=128, SEPARABLE=sep, FIXED=fixed), warps))
    for per_atom in (True, False):
        cases.append((G._gather_bin_kernel, dict(BLOCK=128, TCH=16, BX=bx, BY=by, BZ=bz, PER_ATOM_RADIUS=per_atom,
                                                 FRAMES=not per_atom, FIXED=per_atom), 4))
    cases.append((G._gather_fill_kernel, dict(BLOCK=128, TCH=16, BX=bx, BY=by, BZ=bz, FRAMES=True), 4))
    done = []
    for fn, const, w in cases:
        sig = {n: "constexpr" if n in const else types[n] for n in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w})
        ptx = kernel.asm["ptx"]
        atomics = sorted({t for line in ptx.splitlines() for t in line.split() if t.startswith(("atom.", "red."))})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        os.unlink(f.name)
        regs = int(re.search(r"REG:(\\d+)", usage).group(1))
        local = int(re.search(r"LOCAL:(\\d+)", usage).group(1))
        done.append({"kernel": fn.__name__, "const": const, "atomics": atomics, "regs": regs, "local": local})
    print(json.dumps(done))
    """
)


def test_gather_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter neither lowers to PTX nor checks what only the compiler checks (globals a kernel may read,
    # say): compile every gather kernel for sm_90 with Triton's own ptxas. The brick programs issue no atomics at
    # all and spill nothing; the per-atom launches issue only 32-bit integer adds (and the exponent's max).
    done = json.loads(run_compiled(_SM90_SCRIPT, ROOT).strip().splitlines()[-1])
    assert len(done) == 7, done
    for row in done:
        assert row["local"] == 0, row  # no spills to local memory
        if row["kernel"] == "_gather_brick_kernel":
            assert row["atomics"] == [], row
        else:
            assert row["atomics"], row
            assert all(a.endswith((".s32", ".u32")) or ".max" in a for a in row["atomics"]), row
            assert not any(".f32" in a for a in row["atomics"]), row
