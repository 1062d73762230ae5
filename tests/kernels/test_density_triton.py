"""Triton density splat against the float64 reference: forward and every gradient.

Runs on CUDA tensors where a GPU is present, otherwise on CPU tensors under
``TRITON_INTERPRET=1`` (set by the root conftest). Tolerance: docs/kernels.md's float32
contract through :func:`tests.helpers.assert_kernel_close`
(``|out − ref| ≤ 1e-5·max|ref| + 1e-5·|ref|``, ~20× what float32 atomics give on an H100).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridSpec
from kernels.density import triton as triton_splat
from kernels.density.reference import splat_reference
from kernels.density.triton import _kernel_inputs, _plan, _radii_alone, splat_triton
from tests.helpers import assert_close, assert_kernel_close, model, requires_cuda

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[2]


def _leaf(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.detach().to(device=DEVICE, dtype=dtype).clone().requires_grad_(True)


def _with_grads(atoms: AtomSet, dtype):
    """``atoms`` on DEVICE in ``dtype`` with fresh leaf xyz/b_iso/occ (returned too)."""
    xyz, b, o = _leaf(atoms.xyz, dtype), _leaf(atoms.b_iso, dtype), _leaf(atoms.occ, dtype)
    a, bb = atoms.a.to(DEVICE, dtype), atoms.b.to(DEVICE, dtype)
    return AtomSet(xyz, b, o, a, bb, atoms.elements, atoms.labels, _validate=False), (xyz, b, o)


def check_against_reference(atoms: AtomSet, grid: GridSpec, radius=None, seed=0, **plan_fields):
    """Forward and the gradients of Σ w·ρ (random w) for xyz, b_iso, occ vs the float64 reference.

    ``plan_fields`` (e.g. ``vec=False``, ``atoms_per_program=1``) replace fields of the production plan, to run
    another z layout or launch shape of the same kernels through ``kernels.density.triton._splat``.
    """
    atoms = atoms.to(dtype=torch.float32)  # both sides see the same float32 values
    fast_atoms, fast_leaves = _with_grads(atoms, torch.float32)
    ref_atoms, ref_leaves = _with_grads(atoms, torch.float64)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(grid.shape, generator=gen, dtype=torch.float64).to(DEVICE)

    if plan_fields:
        plan = triton_splat._plan(grid, radius, kernels.DEFAULT_CUTOFF, DEVICE)
        out = triton_splat._splat(fast_atoms, dataclasses.replace(plan, **plan_fields))
    else:
        out = splat_triton(fast_atoms, grid, radius=radius)
    assert out.dtype == torch.float32 and tuple(out.shape) == grid.shape and out.device.type == DEVICE.type
    ref = splat_reference(ref_atoms, grid, radius=radius)
    assert_kernel_close(out, ref)
    grads = torch.autograd.grad((out * w.float()).sum(), fast_leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for name, g, rg in zip(("xyz", "b_iso", "occ"), grads, ref_grads):
        assert g is not None, name
        try:
            assert_kernel_close(g, rg)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {name}: {exc}") from None
    return out, ref


def synthetic(cell: Cell, elements, seed: int, b_range=(2.0, 60.0), frac=None) -> AtomSet:
    gen = torch.Generator().manual_seed(seed)
    n = len(elements)
    if frac is None:
        frac = torch.rand(n, 3, generator=gen, dtype=torch.float64) * 1.2 - 0.1  # some outside the cell
    xyz = torch.as_tensor(frac, dtype=torch.float64) @ cell.orth.T
    b = b_range[0] + torch.rand(n, generator=gen, dtype=torch.float64) * (b_range[1] - b_range[0])
    occ = 0.2 + 0.8 * torch.rand(n, generator=gen, dtype=torch.float64)
    return AtomSet.from_elements(list(elements), xyz.numpy(), b.numpy(), occ.numpy())


MIXED = ("C", "N", "O", "S", "Cl", "Fe", "P", "C", "O", "N", "Zn", "C")

CELLS = {
    "orthogonal": (20.0, 22.0, 25.0, 90.0, 90.0, 90.0),
    "monoclinic": (21.0, 17.0, 24.0, 90.0, 104.5, 90.0),
    "hexagonal": (18.0, 18.0, 25.0, 90.0, 90.0, 120.0),
    "triclinic": (15.0, 17.0, 19.0, 79.0, 95.0, 106.0),
}


# --------------------------------------------------------------------------- real structures


def test_1orc_matches_reference():
    # The whole of 1ORC (559 atoms, B up to 100 Å²) on a 1 Å grid: 0.67 Å takes ~3× longer in the interpreter.
    m = model("1orc")
    check_against_reference(m.atoms, GridSpec.for_spacing(m.cell, 1.0))


@requires_cuda
@pytest.mark.parametrize("name", ["1aki", "5h73", "3wip"])
def test_real_structures_match_reference(name):
    m = model(name)
    check_against_reference(m.atoms, GridSpec.for_spacing(m.cell, 2.0 / 3.0))


@requires_cuda
def test_forward_register_cap_reaches_the_compile():
    # The production plan caps the one-warp forward's registers (maxnreg) so more programs fit an SM.
    # The cap must reach the compiler, and the capped kernel (a few registers spilled) must give the
    # uncapped kernel's map, up to the order of the atomics.
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    atoms = m.atoms.to(DEVICE, torch.float32)
    plan = triton_splat._plan(grid, None, kernels.DEFAULT_CUTOFF, DEVICE)
    assert plan.maxnreg == 80
    capped = triton_splat._splat(atoms, plan)
    free = triton_splat._splat(atoms, dataclasses.replace(plan, maxnreg=None))
    compiled = triton_splat._splat_fwd_kernel.device_caches[torch.cuda.current_device()][0].values()
    regs = sorted(k.n_regs for k in compiled)
    assert regs[0] <= plan.maxnreg < regs[-1], regs
    assert_close(capped, free, atol=1e-6, rtol=1e-5)


@requires_cuda
@pytest.mark.parametrize("name", ["1aki", "3wip"])
def test_matches_gemmi(name):
    from tests.helpers import gemmi_density

    m = model(name)
    out = kernels.splat_density(m.atoms.to("cuda", torch.float32), GridSpec.for_spacing(m.cell, 2.0 / 3.0))
    ref = torch.from_numpy(gemmi_density(name, 2.0 / 3.0, 1e-5))
    # Tolerance as in test_reference_density: gemmi's float sum uses a fast exp (rel. error ≤ 1e-5).
    assert_close(out, ref, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- synthetic cells


@pytest.mark.parametrize("kind", list(CELLS))
def test_cells_match_reference(kind):
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = synthetic(cell, MIXED, seed=len(kind))
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.7), seed=1)


@pytest.mark.parametrize("kind", ["orthogonal", "hexagonal", "triclinic"])
def test_global_radius_matches_reference(kind):
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = synthetic(cell, MIXED[:6], seed=7)
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.8), radius=2.7, seed=2)


@pytest.mark.parametrize("kind", ["orthogonal", "monoclinic", "hexagonal", "triclinic"])
def test_tiny_cell_sphere_larger_than_cell(kind):
    # 4–6 Å cells, radii up to ~6 Å: every atom adds several images of itself to one voxel. The
    # "hexagonal" one is of that kind with γ = 104° (only the a–b pair couples: the forward's E(x, y)·e(z)).
    params = {
        "orthogonal": (4.0, 4.5, 5.0, 90, 90, 90),
        "monoclinic": (4.5, 5.0, 6.0, 90, 112, 90),
        "hexagonal": (4.6, 5.2, 6.0, 90, 90, 104),
    }
    cell = Cell.from_parameters(*params.get(kind, (5.0, 5.5, 6.0, 75, 100, 110)))
    atoms = synthetic(cell, ("C", "O", "Fe", "N"), seed=3, b_range=(20.0, 90.0))
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.5), seed=3)
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.5), radius=7.5, seed=4)


def test_atom_on_corner_and_voxel():
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    frac = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.0, 1.0], [-1.0, 2.0, 0.25]], dtype=torch.float64)
    atoms = synthetic(cell, ("C", "N", "O", "S"), seed=5, frac=frac)
    check_against_reference(atoms, GridSpec(cell, (30, 24, 32)), seed=5)


def test_nitrogen_and_chlorine_at_low_b():
    # IT92 N and Cl: a near-delta Gaussian cancelled by a large negative c; B = 2 Å² on a voxel.
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    grid = GridSpec(cell, (40, 44, 50))
    frac = torch.tensor([[0.25, 0.25, 0.3], [0.5, 0.5, 0.5], [0.71, 0.13, 0.9]], dtype=torch.float64)
    atoms = synthetic(cell, ("N", "Cl", "N"), seed=6, b_range=(2.0, 2.0), frac=frac)
    out, ref = check_against_reference(atoms, grid, seed=6)
    assert float(ref.detach().max()) > 10  # the nuclei are sampled


def test_odd_and_prime_grid():
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    atoms = synthetic(cell, MIXED, seed=8)
    check_against_reference(atoms, GridSpec(cell, (23, 29, 31)), seed=8)


# --------------------------------------------------------------------------- API, radius, errors


def test_device_radius_rule_matches_cutoff_radius():
    # The in-kernel port of gemmi's estimate_radius, float32, against the float64 torch rule.
    m = model("1orc")
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    syn = synthetic(cell, MIXED * 4, seed=9, b_range=(0.5, 400.0))
    for atoms, atoms_cell in ((m.atoms, m.cell), (syn, cell)):
        grid = GridSpec(atoms_cell, (24, 24, 24))
        for cutoff in (1e-5, 1e-3, 1e-7):
            at = atoms.to(DEVICE, torch.float32)
            got = _radii_alone(_plan(grid, None, cutoff, torch.device(DEVICE)), *_kernel_inputs(at)).double()
            want = kernels.cutoff_radius(atoms.b_iso, atoms.a, atoms.b, cutoff).to(DEVICE)
            err = float((got - want).abs().max())
            assert err < 1e-4, f"cutoff {cutoff}: max |Δr| = {err} Å"


def test_dispatch_and_float64_warning(monkeypatch):
    # float64 input is cast with one warning per (op, dtype) per process; start from a process state in
    # which splat_triton has not warned yet, so the warning must be seen here, then not again.
    import kernels._util

    monkeypatch.setattr(kernels._util, "_warned", set())
    m = model("1orc")
    atoms = m.atoms.select(list(range(0, 559, 8))).to(DEVICE)  # float64
    grid = GridSpec.for_spacing(m.cell, 1.5)
    with pytest.warns(UserWarning, match=r"splat_triton: .*casting torch\.float64 input"):
        out = kernels.splat_density(atoms, grid, backend="triton")
    assert out.dtype == torch.float32
    ref = splat_reference(atoms.to(dtype=torch.float32), grid)
    assert_kernel_close(out, ref)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="splat_triton")
        again = kernels.splat_density(atoms, grid, backend="triton")
    # On a GPU the atomics' order changes from call to call: the contract, not bitwise equality.
    assert_kernel_close(again, ref)
    if DEVICE.type == "cuda":
        assert kernels.resolve_backend("density", DEVICE, "auto") == "triton"


def test_empty_and_bad_input():
    m = model("1orc")
    grid = GridSpec.for_spacing(m.cell, 1.5)
    empty = m.atoms.select([]).to(DEVICE, torch.float32)
    out = splat_triton(empty, grid)
    assert tuple(out.shape) == grid.shape and float(out.abs().max()) == 0.0
    atoms = m.atoms.select([0, 1]).to(DEVICE, torch.float32)
    with pytest.raises(ValueError, match="radius"):
        splat_triton(atoms, grid, radius=-1.0)
    with pytest.raises(ValueError, match="cutoff"):
        splat_triton(atoms, grid, cutoff=0.0)
    box = GridSpec(m.cell, (10, 10, 10), origin=(1, 2, 3), sampling=grid.shape)
    with pytest.raises(kernels.GridError, match="whole-cell"):
        splat_triton(atoms, box)


def test_no_grad_when_not_required():
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    atoms = synthetic(cell, MIXED[:4], seed=10).to(DEVICE, torch.float32)
    out = splat_triton(atoms, GridSpec.for_spacing(cell, 1.0))
    assert not out.requires_grad


# --------------------------------------------------------------------------- GPU only

_FIRST_CALL_SCRIPT = textwrap.dedent(
    """
    import json, torch, kernels
    from kernels.crystal import AtomSet, Cell, GridSpec
    from kernels.density.reference import splat_reference
    from tests.helpers import model

    def rel(u, v):
        return float((u.double() - v).norm() / v.norm())

    results = []
    tri = Cell.from_parameters(15.0, 17.0, 19.0, 79.0, 95.0, 106.0)
    gen = torch.Generator().manual_seed(0)
    xyz = (torch.rand(40, 3, generator=gen, dtype=torch.float64) @ tri.orth.T).numpy()
    syn = AtomSet.from_elements(["C", "N", "O", "S"] * 10, xyz, 15.0)
    configs = [
        ("1aki", model("1aki").atoms, GridSpec.for_spacing(model("1aki").cell, 2 / 3), None),
        ("5h73", model("5h73").atoms, GridSpec.for_spacing(model("5h73").cell, 0.6), None),
        ("triclinic", syn, GridSpec.for_spacing(tri, 0.5), 3.3),
    ]
    for name, atoms, grid, radius in configs:
        at = atoms.to("cuda", torch.float32)
        xyz = at.xyz.clone().requires_grad_()
        at = AtomSet(xyz, at.b_iso, at.occ, at.a, at.b, at.elements, at.labels, _validate=False)
        # Random upstream weights: the gradient of a plain sum nearly cancels over each sphere.
        w = torch.randn(grid.shape, generator=gen, dtype=torch.float64).cuda()
        call1 = kernels.splat_density(at, grid, radius=radius, backend="triton")
        g1 = torch.autograd.grad(call1, xyz, grad_outputs=w.float())[0]
        call2 = kernels.splat_density(at, grid, radius=radius, backend="triton")
        g2 = torch.autograd.grad(call2, xyz, grad_outputs=w.float())[0]
        ref_at = atoms.to("cuda", torch.float32).to(dtype=torch.float64)
        rxyz = ref_at.xyz.clone().requires_grad_()
        ref_at = AtomSet(rxyz, ref_at.b_iso, ref_at.occ, ref_at.a, ref_at.b, _validate=False)
        ref = splat_reference(ref_at, grid, radius=radius)
        rg = torch.autograd.grad(ref, rxyz, grad_outputs=w)[0]
        results.append(dict(name=name, call1=rel(call1, ref), call2=rel(call2, ref),
                            grad1=rel(g1, rg), grad2=rel(g2, rg)))
    print(json.dumps(results))
    """
)


@requires_cuda
def test_first_call_correct_with_empty_triton_cache(tmp_path):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 3
    for r in results:
        for key in ("call1", "call2", "grad1", "grad2"):
            # float32 level (1e-7–1e-6 measured on the H100); the public kernel's first calls were 0.065–1.3.
            assert r[key] < 1e-5, r
    assert any((tmp_path / "triton-cache").iterdir()), "the subprocess did not compile into the empty cache"


@requires_cuda
def test_cuda_graph_capture_forward_backward():
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    base = m.atoms.to("cuda", torch.float32)
    xyz = base.xyz.clone().requires_grad_()
    b_iso = base.b_iso.clone().requires_grad_()
    occ = base.occ.clone().requires_grad_()
    atoms = AtomSet(xyz, b_iso, occ, base.a, base.b, _validate=False)
    w = torch.randn(grid.shape, device="cuda")

    def step():
        out = splat_triton(atoms, grid)
        return (out,) + torch.autograd.grad((out * w).sum(), [xyz, b_iso, occ])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    # New positions and B between replays, as in refinement: the replay must follow them.
    with torch.no_grad():
        xyz.add_(0.05 * torch.randn_like(xyz))
        b_iso.mul_(1.1)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for got, want in zip(captured, eager):
        assert_kernel_close(got, want)


# --------------------------------------------------------------------------- z lanes in aligned groups of 4 (VEC)
# With nz % 4 == 0 the kernels walk z in groups of 4 lanes starting at multiples of 4 in absolute grid index
# (one vector atomic / 128-bit load per group on sm_90), with masks constant over each group; otherwise (or
# with a plan whose vec is False) lane by lane. Both paths against the float64 reference, atoms on the z
# faces so that groups wrap around the cell.

_Z_FACES = (0.0, 1.0, -0.004, 0.996, 0.0021, 1.003, 0.5, -0.02, 0.98, 0.25)


def _atoms_on_z_faces(cell: Cell, seed: int) -> AtomSet:
    gen = torch.Generator().manual_seed(seed)
    frac = torch.rand(len(_Z_FACES), 3, generator=gen, dtype=torch.float64)
    frac[:, 2] = torch.tensor(_Z_FACES, dtype=torch.float64)
    return synthetic(cell, MIXED[: len(_Z_FACES)], seed=seed, frac=frac)


def _check_path(atoms, grid, path: str, radius=None, seed=0, **plan_fields):
    """The production plan takes VEC exactly when nz % 4 == 0; "scalar" on such a grid forces lane by lane."""
    plan = triton_splat._plan(grid, radius, kernels.DEFAULT_CUTOFF, DEVICE)
    assert plan.vec == (grid.shape[2] % 4 == 0), grid.shape
    if path == "scalar" and plan.vec:
        plan_fields["vec"] = False
    else:
        assert plan.vec == (path == "vec"), (path, grid.shape)
    check_against_reference(atoms, grid, radius=radius, seed=seed, **plan_fields)


# (grid, path): nz % 4 == 0 takes the VEC path unless forced scalar; nz % 4 == 2 falls back to scalar.
_PATHS = [((24, 26, 32), "vec"), ((24, 26, 32), "scalar"), ((24, 26, 30), "scalar")]


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("shape,path", _PATHS, ids=["nz32-vec", "nz32-scalar", "nz30-scalar"])
def test_vec_and_scalar_paths_atoms_on_z_faces(kind, shape, path):
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = _atoms_on_z_faces(cell, seed=12 + len(kind))
    _check_path(atoms, GridSpec(cell, shape), path, seed=12)


@pytest.mark.parametrize("kind", ["orthogonal", "hexagonal"])
@pytest.mark.parametrize("shape,path", _PATHS, ids=["nz32-vec", "nz32-scalar", "nz30-scalar"])
def test_vec_and_scalar_paths_small_global_radius(kind, shape, path):
    # A 1.3 Å sphere cuts the density where it is large: a voxel added or dropped at the sphere's edge
    # (the group masks, the per-voxel select) is far above the tolerance here.
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = _atoms_on_z_faces(cell, seed=21)
    _check_path(atoms, GridSpec(cell, shape), path, radius=1.3, seed=21)


@pytest.mark.parametrize("kind", ["orthogonal", "monoclinic", "triclinic"])
@pytest.mark.parametrize(
    "nz,path", [(12, "vec"), (12, "scalar"), (14, "scalar")], ids=["nz12-vec", "nz12-scalar", "nz14-scalar"]
)
def test_vec_and_scalar_paths_sphere_larger_than_cell(kind, nz, path):
    # 4–6 Å cells, radii up to 7.5 Å: boxes span several cells in z, so groups wrap more than once.
    params = {"orthogonal": (4.0, 4.5, 5.0, 90, 90, 90), "monoclinic": (4.5, 5.0, 6.0, 90, 112, 90)}
    cell = Cell.from_parameters(*params.get(kind, (5.0, 5.5, 6.0, 75, 100, 110)))
    atoms = synthetic(cell, ("C", "O", "Fe", "N"), seed=3, b_range=(20.0, 90.0))
    grid = GridSpec(cell, (9, 10, nz))
    _check_path(atoms, grid, path, seed=3)
    _check_path(atoms, grid, path, radius=7.5, seed=4)


def test_vec_path_one_atom_per_program():
    # The GPU's launch shape (one atom per program) under the interpreter, monoclinic, atoms on the z faces.
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    _check_path(_atoms_on_z_faces(cell, seed=30), GridSpec(cell, (24, 20, 28)), "vec", seed=30, atoms_per_program=1)


@pytest.mark.parametrize("bp_bwd,bq_bwd", [(4, 8), (2, 32)])
def test_backward_with_its_own_tiles(bp_bwd, bq_bwd):
    # On the GPU the backward walks wider tiles than the forward (16x16 vs 8x16 at 0.67 Å); here both sizes
    # differ from the forward's and from each other, monoclinic, atoms on the z faces, nz % 4 == 0 (VEC).
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    grid = GridSpec(cell, (24, 20, 28))
    plan = triton_splat._plan(grid, None, kernels.DEFAULT_CUTOFF, DEVICE)
    assert (bp_bwd, bq_bwd) != (plan.bp, plan.bq) and plan.vec
    check_against_reference(_atoms_on_z_faces(cell, seed=60), grid, seed=60, bp_bwd=bp_bwd, bq_bwd=bq_bwd)


# --------------------------------------------------------------------------- per-tile row spans
# Each (x, z) tile walks only the rows where one of its voxels can lie inside the sphere (_tile_rows,
# _tile_rows_separable). A row left out that held a voxel inside loses that voxel's density: with a 1.3 Å
# sphere the density at the sphere's edge is far above the tolerance, so the reference comparison sees a
# single dropped voxel. Every cell kind (separable spans, the lanes' union otherwise), both launch shapes
# (one atom per program walks exactly its rows; packed programs mask each atom's own rows), both z layouts;
# on separable cells the backward walks rows in pairs, so odd and even row counts occur.


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("atoms_per_program", [None, 1], ids=["packed", "one-atom"])
@pytest.mark.parametrize("nz", [32, 30], ids=["nz32-vec", "nz30-scalar"])
def test_row_spans_keep_every_voxel_of_a_small_sphere(kind, atoms_per_program, nz):
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = _atoms_on_z_faces(cell, seed=70 + len(kind))
    fields = {} if atoms_per_program is None else {"atoms_per_program": atoms_per_program}
    check_against_reference(atoms, GridSpec(cell, (24, 26, nz)), radius=1.3, seed=70, **fields)


# --------------------------------------------------------------------------- frames (splat_frames_triton)
# F frames of the same atoms in one launch each way: the kernels add (atom // atoms_per_frame)·n_voxels to
# each atom's map offset. Under the interpreter many atoms share a program, so one program spans frames.


def _frame_stack(cell: Cell, n_atoms: int, n_frames: int, seed: int) -> AtomSet:
    """``n_frames`` frames of one synthetic model, frame-major: positions, B and occupancy differ per frame."""
    gen = torch.Generator().manual_seed(seed)
    base = synthetic(cell, MIXED[:n_atoms], seed=seed)
    xyz = torch.cat(
        [base.xyz + 0.6 * torch.randn(base.xyz.shape, generator=gen, dtype=torch.float64) for _ in range(n_frames)]
    )
    b_iso = torch.cat([base.b_iso * (1.0 + 0.3 * f) for f in range(n_frames)])
    occ = torch.cat([base.occ * (1.0 - 0.2 * f) for f in range(n_frames)])
    a, b = base.a.repeat(n_frames, 1), base.b.repeat(n_frames, 1)
    return AtomSet(xyz, b_iso, occ, a, b, list(base.elements) * n_frames, _validate=False).to(dtype=torch.float32)


@pytest.mark.parametrize(
    ("kind", "radius", "fields"),
    [("orthogonal", None, {}), ("triclinic", None, {"atoms_per_program": 1}), ("monoclinic", 2.5, {"vec": False})],
)
def test_frames_equal_single_splats_forward_and_gradients(kind, radius, fields):
    cell = Cell.from_parameters(*CELLS[kind])
    grid = GridSpec(cell, (16, 18, 20))
    n_frames, n_atoms = 3, 5
    stack = _frame_stack(cell, n_atoms, n_frames, seed=80 + len(kind))
    plan = dataclasses.replace(triton_splat._plan(grid, radius, kernels.DEFAULT_CUTOFF, DEVICE), **fields)
    atoms, leaves = _with_grads(stack, torch.float32)
    maps = triton_splat._splat(atoms, plan, n_frames=n_frames)
    assert tuple(maps.shape) == (n_frames, *grid.shape) and maps.dtype == torch.float32
    w = torch.randn(maps.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = torch.autograd.grad((maps * w).sum(), leaves)
    for f in range(n_frames):
        frame, frame_leaves = _with_grads(stack.select(list(range(f * n_atoms, (f + 1) * n_atoms))), torch.float32)
        single = triton_splat._splat(frame, plan)
        assert float(single.detach().abs().max()) > 0
        assert_kernel_close(maps[f], single)
        for name, g, sg in zip(
            ("xyz", "b_iso", "occ"), grads, torch.autograd.grad((single * w[f]).sum(), frame_leaves)
        ):
            try:
                assert_kernel_close(g[f * n_atoms : (f + 1) * n_atoms], sg)
            except AssertionError as exc:
                raise AssertionError(f"frame {f}, gradient of {name}: {exc}") from None


def test_splat_frames_triton_public_function():
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    grid = GridSpec(cell, (15, 15, 20))
    stack = _frame_stack(cell, 4, 2, seed=90).to(DEVICE)
    maps = triton_splat.splat_frames_triton(stack, grid, n_frames=2)
    for f in range(2):
        assert_kernel_close(maps[f], splat_triton(stack.select(list(range(4 * f, 4 * f + 4))), grid))
    one = triton_splat.splat_frames_triton(stack, grid, n_frames=1)
    assert tuple(one.shape) == (1, *grid.shape)
    assert_kernel_close(one[0], splat_triton(stack, grid))
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="n_frames must be a positive integer dividing the 8 atoms"):
            triton_splat.splat_frames_triton(stack, grid, n_frames=bad)
