"""Triton anisotropic density splat against the float64 reference: forward and every gradient.

Anisotropic sets (``u_aniso``) and neutron sets (isotropic or not) take the anisotropic kernels of
``kernels/density/triton.py``. Runs on CUDA tensors where a GPU is present, otherwise on CPU tensors
under ``TRITON_INTERPRET=1`` (set by the root conftest; small cases, the interpreter is slow).
Tolerance: docs/kernels.md's float32 contract through :func:`tests.helpers.assert_kernel_close`
(``|out − ref| ≤ 1e-5·max|ref| + 1e-5·|ref|``), maps and gradients alike, against
:func:`kernels.density.reference.splat_reference` on the same float32-rounded atoms.
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

import numpy as np
import pytest
import torch

import kernels
from kernels.adp import adp_eigenvalues
from kernels.crystal import AtomSet, Cell, GridSpec
from kernels.density import triton as triton_splat
from kernels.density.radius import atom_cutoff_radii
from kernels.density.reference import splat_frames_reference, splat_reference
from kernels.density.triton import splat_frames_triton, splat_triton
from tests.helpers import STRUCTURES, assert_close, assert_kernel_close, requires_cuda, run_compiled

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[2]
U_TO_B = 8 * np.pi**2

CELLS = {
    "orthogonal": (20.0, 22.0, 25.0, 90.0, 90.0, 90.0),
    "monoclinic": (21.0, 17.0, 24.0, 90.0, 104.5, 90.0),
    "hexagonal": (18.0, 18.0, 25.0, 90.0, 90.0, 120.0),
    "triclinic": (15.0, 17.0, 19.0, 79.0, 95.0, 106.0),
}
ELEMENTS = ("C", "N", "O", "S", "Fe", "C", "O", "N", "P", "C")


# --------------------------------------------------------------------------- synthetic atoms


def rotation(gen: np.random.Generator) -> np.ndarray:
    """A random proper rotation (3, 3): Q of a Gaussian matrix's QR, signs fixed, det +1."""
    q, r = np.linalg.qr(gen.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def tilted_u(gen: np.random.Generator, b_mean: float, ratio: float) -> np.ndarray:
    """U11, U22, U33, U12, U13, U23 of R·diag(λ)·Rᵀ: mean eigenvalue b_mean/8π², largest/smallest = ratio."""
    lam = np.array([1.0, np.sqrt(ratio), ratio])
    lam = lam * (3 * b_mean / U_TO_B) / lam.sum()
    rot = rotation(gen)
    u = rot @ np.diag(lam) @ rot.T
    return np.array([u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2]])


def synthetic(
    cell: Cell, elements, seed: int, *, ratio=(1.5, 12.0), iso_every: int = 3, radiation="xray", frac=None
) -> AtomSet:
    """Atoms at random fractional positions (some outside the cell), tilted anisotropic U with eigenvalue
    ratios drawn from ``ratio``; every ``iso_every``-th atom isotropic (0: none)."""
    gen = np.random.default_rng(seed)
    n = len(elements)
    if frac is None:
        frac = gen.random((n, 3)) * 1.2 - 0.1
    xyz = np.asarray(frac) @ cell.orth.numpy().T
    b = 5.0 + 40.0 * gen.random(n)
    occ = 0.3 + 0.7 * gen.random(n)
    u = np.stack([tilted_u(gen, b[i], gen.uniform(*ratio)) for i in range(n)])
    if iso_every:
        u[::iso_every] = np.nan
    return AtomSet.from_elements(list(elements), xyz, b, occ, u_aniso=u, radiation=radiation)


def _leaves(atoms: AtomSet, dtype):
    """``atoms`` on DEVICE in ``dtype`` with fresh leaf xyz, b_iso, occ and (if any) u_aniso."""

    def leaf(t):
        return t.detach().to(DEVICE, dtype).clone().requires_grad_(True)

    xyz, b, occ = leaf(atoms.xyz), leaf(atoms.b_iso), leaf(atoms.occ)
    u = None if atoms.u_aniso is None else leaf(atoms.u_aniso)
    flag = None if atoms.aniso is None else atoms.aniso.to(DEVICE)
    at = AtomSet(
        xyz, b, occ, atoms.a.to(DEVICE, dtype), atoms.b.to(DEVICE, dtype), atoms.elements, atoms.labels, u, flag,
        radiation=atoms.radiation, _validate=False,
    )  # fmt: skip
    return at, [t for t in (xyz, b, occ, u) if t is not None]


def check_against_reference(
    atoms: AtomSet, grid: GridSpec, *, radius=None, radius_rule="gemmi", n_frames=None, seed=0, **plan_fields
):
    """Map and the gradients of Σ w·ρ (random w) for xyz, b_iso, occ, u_aniso vs the float64 reference.

    ``plan_fields`` replace fields of the production plan (another z layout or launch shape of the same kernels).
    Returns the map and the reference.
    """
    atoms = atoms.to(dtype=torch.float32)  # both sides see the same float32 values
    fast, fast_leaves = _leaves(atoms, torch.float32)
    ref_atoms, ref_leaves = _leaves(atoms, torch.float64)
    shape = grid.shape if n_frames is None else (n_frames, *grid.shape)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)
    if plan_fields:
        plan = triton_splat._plan(grid, radius, kernels.DEFAULT_CUTOFF, DEVICE)
        out = triton_splat._splat(fast, dataclasses.replace(plan, **plan_fields), n_frames, radius_rule)
    elif n_frames is None:
        out = splat_triton(fast, grid, radius=radius, radius_rule=radius_rule)
    else:
        out = splat_frames_triton(fast, grid, n_frames=n_frames, radius=radius, radius_rule=radius_rule)
    assert out.dtype == torch.float32 and tuple(out.shape) == shape and out.device.type == DEVICE.type
    if n_frames is None:
        ref = splat_reference(ref_atoms, grid, radius=radius, radius_rule=radius_rule)
    else:
        ref = splat_frames_reference(ref_atoms, grid, n_frames=n_frames, radius=radius, radius_rule=radius_rule)
    assert_kernel_close(out, ref)
    grads = torch.autograd.grad((out * w.float()).sum(), fast_leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_leaves)
    iso = torch.ones(len(atoms), dtype=torch.bool) if atoms.aniso is None else ~atoms.aniso.cpu()
    for name, g, rg in zip(("xyz", "b_iso", "occ", "u_aniso"), grads, ref_grads):
        # b_iso carries the gradient of the isotropic atoms only (anisotropic atoms do not use it).
        if name != "b_iso" or bool(iso.any()):
            assert float(rg.abs().max()) > 0, f"the reference gradient of {name} is zero: the case tests nothing"
        if name == "b_iso":
            assert bool((g.detach().cpu()[~iso] == 0).all()), "b_iso gradient of anisotropic atoms"
        try:
            assert_kernel_close(g, rg)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {name}: {exc}") from None
    return out, ref


def _max_ratio(atoms: AtomSet) -> float:
    lam = adp_eigenvalues(atoms.u_aniso[atoms.aniso])
    return float((lam[:, 2] / lam[:, 0]).max())


# --------------------------------------------------------------------------- cells, rules, radiation


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("radius_rule", ["gemmi", "eigen"])
def test_mixed_iso_aniso_cells_match_reference(kind, radius_rule):
    # Hexagonal (G12) and monoclinic (G13) cells couple axes; every third atom isotropic.
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = synthetic(cell, ELEMENTS, seed=1)
    assert bool(atoms.aniso.any()) and not bool(atoms.aniso.all())
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.8), radius_rule=radius_rule)


@pytest.mark.parametrize("radius_rule", ["gemmi", "eigen"])
def test_strongly_anisotropic_tilted_atoms(radius_rule):
    # Eigenvalue ratios 10–25 on axes tilted by random rotations: the cross terms of the quadratic form
    # dominate, and the gemmi rule's sphere (B_max from the diagonal) differs from the exact one.
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    atoms = synthetic(cell, ELEMENTS[:6], seed=2, ratio=(10.0, 25.0), iso_every=0)
    assert _max_ratio(atoms) >= 10.0
    u = atoms.u_aniso
    assert float((u[:, 3:].abs().max(dim=1).values / u[:, :3].max(dim=1).values).min()) > 0.05, "not tilted"
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.7), radius_rule=radius_rule)


def test_radius_rules_give_different_spheres():
    # On strongly tilted atoms the exact sphere is larger than gemmi's (B_max from the diagonal), so the
    # two rules are different maps; each matches the reference under its own rule (tests above).
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    atoms = synthetic(cell, ELEMENTS[:4], seed=3, ratio=(15.0, 20.0), iso_every=0).to(DEVICE, torch.float32)
    grid = GridSpec.for_spacing(cell, 0.8)
    gemmi_rule = splat_triton(atoms, grid, radius_rule="gemmi")
    eigen_rule = splat_triton(atoms, grid, radius_rule="eigen")
    assert int(((eigen_rule != 0) & (gemmi_rule == 0)).sum()) > 0


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
def test_every_radiation_anisotropic(radiation):
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    elements = ("C", "H", "N", "O", "H", "S", "C", "H")
    atoms = synthetic(cell, elements, seed=4, radiation=radiation, iso_every=4)
    out, ref = check_against_reference(atoms, GridSpec.for_spacing(cell, 0.8))
    if radiation == "neutron":  # hydrogen's scattering length is negative
        assert float(ref.detach().min()) < 0 and float(out.detach().min()) < 0


@pytest.mark.parametrize("radius_rule", ["gemmi", "eigen"])
def test_neutron_isotropic_set(radius_rule):
    # An isotropic neutron set takes the anisotropic kernels for the closed-form radius (not the X-ray step
    # search); the rule does not apply to isotropic sets.
    cell = Cell.from_parameters(*CELLS["triclinic"])
    gen = np.random.default_rng(5)
    elements = ["C", "H", "O", "N", "H", "Fe", "S", "H"]
    xyz = gen.random((len(elements), 3)) @ cell.orth.numpy().T
    atoms = AtomSet.from_elements(elements, xyz, 5.0 + 30.0 * gen.random(len(elements)), radiation="neutron")
    out, ref = check_against_reference(atoms, GridSpec.for_spacing(cell, 0.7), radius_rule=radius_rule)
    assert float(ref.detach().min()) < 0 and float(out.detach().min()) < 0


@pytest.mark.parametrize("radiation", ["xray", "neutron"])
@pytest.mark.parametrize("radius_rule", ["gemmi", "eigen"])
def test_device_radii_match_atom_cutoff_radii(radiation, radius_rule):
    # The radii the forward computes (float32, on the device) against the float64 rule of the reference.
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    elements = ("C", "H", "O", "N", "S", "Fe", "Zn", "P", "C", "H", "O", "C")
    atoms = synthetic(cell, elements, seed=6, ratio=(1.0, 20.0), iso_every=0, radiation=radiation)
    atoms = atoms.to(DEVICE, torch.float32)
    # Near-isotropic and axially symmetric U (double eigenvalues) are the eigenvalue solver's hard cases.
    u = atoms.u_aniso.clone()
    u[1] = torch.tensor([0.2, 0.2, 0.2, 1e-5, 0.0, 0.0])
    u[2] = torch.tensor([0.3, 0.3, 0.1, 0.0, 0.0, 0.0])
    u[4] = torch.tensor([0.1, 0.1, 0.3, 0.0, 0.0, 0.0])
    atoms = atoms.replace(u_aniso=u)
    grid = GridSpec.for_spacing(cell, 1.0)
    plan = triton_splat._plan(grid, None, 1e-5, DEVICE)
    xyz, u32, aniso, b_iso, occ, a, b = triton_splat._kernel_inputs_aniso(atoms)
    rule = triton_splat._aniso_rule(plan, radius_rule)
    _, radii = triton_splat._forward_aniso(
        plan, xyz, u32, aniso, b_iso, occ, a, b, 1, rule, radiation == "neutron", plan.shape
    )
    want = atom_cutoff_radii(atoms.to(dtype=torch.float64), 1e-5, radius_rule)
    assert_close(radii, want, atol=2e-4, rtol=0.0)  # float32 search: the isotropic kernel's 1e-4 Å, doubled


def test_fixed_radius():
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    check_against_reference(synthetic(cell, ELEMENTS[:6], seed=7), GridSpec.for_spacing(cell, 0.8), radius=2.7)


def test_sphere_larger_than_the_cell():
    # A 5 Å sphere in a 6–7 Å cell: one voxel receives several periodic images of one atom.
    cell = Cell.from_parameters(6.0, 6.5, 7.0, 90.0, 97.0, 90.0)
    atoms = synthetic(cell, ELEMENTS[:3], seed=8, iso_every=0)
    check_against_reference(atoms, GridSpec(cell, (10, 11, 12)), radius=5.0)


@pytest.mark.parametrize(
    ("shape", "fields"),
    [
        ((24, 26, 32), {}),  # nz % 4 == 0: aligned groups of 4 z lanes (VEC)
        ((24, 26, 32), {"vec": False}),  # the same grid lane by lane
        ((23, 26, 30), {}),  # nz % 4 != 0: lane by lane
        ((24, 26, 32), {"atoms_per_program": 1}),  # the GPU's launch shape: no per-atom row mask
        ((23, 26, 30), {"atoms_per_program": 1}),
        ((24, 26, 32), {"index64": True}),  # 64-bit voxel indices (grids of 2³¹ voxels and more)
    ],
)
def test_vec_scalar_and_one_atom_per_program(shape, fields):
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    frac = np.random.default_rng(9).random((6, 3))
    frac[:, 2] = [0.0, 0.996, -0.004, 1.003, 0.5, 0.25]  # on the z faces: groups wrap around the cell
    atoms = synthetic(cell, ELEMENTS[:6], seed=9, frac=frac)
    grid = GridSpec(cell, shape)
    assert triton_splat._plan(grid, None, kernels.DEFAULT_CUTOFF, DEVICE).vec == (shape[2] % 4 == 0)
    check_against_reference(atoms, grid, **fields)


@pytest.mark.parametrize("kind", ["hexagonal", "monoclinic"])  # general row spans; separable ones
@pytest.mark.parametrize(
    "tiles",
    [
        {"bp_aniso": 8, "bq_aniso": 8, "bp_aniso_bwd": 8, "bq_aniso_bwd": 8},  # the GPU's shapes
        {"bp_aniso": 1, "bq_aniso": 4, "bp_aniso_bwd": 8, "bq_aniso_bwd": 4},  # many chunks per box
    ],
)
def test_gpu_tiles_one_atom_per_program(tiles, kind):
    # Tiles smaller than the boxes (each box walked in several chunks), one atom per program, as on a GPU.
    cell = Cell.from_parameters(*CELLS[kind])
    atoms = synthetic(cell, ELEMENTS[:4], seed=15, ratio=(5.0, 15.0))
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.9), atoms_per_program=1, **tiles)


def test_frames_match_per_frame_reference():
    cell = Cell.from_parameters(*CELLS["hexagonal"])
    base = synthetic(cell, ELEMENTS[:5], seed=10)
    gen = np.random.default_rng(10)
    frames = [base.xyz.numpy() + gen.normal(scale=0.5, size=(5, 3)) for _ in range(3)]
    atoms = AtomSet(
        torch.as_tensor(np.concatenate(frames)),
        base.b_iso.repeat(3), base.occ.repeat(3), base.a.repeat(3, 1), base.b.repeat(3, 1),
        u_aniso=base.u_aniso.repeat(3, 1), aniso=base.aniso.repeat(3),
    )  # fmt: skip
    check_against_reference(atoms, GridSpec.for_spacing(cell, 0.9), n_frames=3)


def test_float64_positions_far_from_the_cell():
    # float64 atoms translated by 10⁶ Å of lattice vectors: the kernels wrap positions in float64 before
    # rounding, so the map is the near copy's (U, B, occupancy and coefficients are cast to float32).
    cell = Cell.from_parameters(*CELLS["monoclinic"])
    atoms = synthetic(cell, ELEMENTS[:4], seed=11).to(DEVICE)
    grid = GridSpec.for_spacing(cell, 0.9)
    shift = (torch.tensor([40000.0, -50000.0, 30000.0], dtype=torch.float64) @ cell.orth.T).to(DEVICE)
    far = AtomSet(
        atoms.xyz + shift, atoms.b_iso, atoms.occ, atoms.a, atoms.b, u_aniso=atoms.u_aniso, aniso=atoms.aniso,
        _validate=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float32 cast's warning
        out = splat_triton(far, grid)
    assert_kernel_close(out, splat_reference(atoms, grid))


# --------------------------------------------------------------------------- unvalidated input


def test_non_positive_definite_and_non_finite_u_add_nothing():
    # A user's own tensor can reach the kernel unvalidated; the kernel does not read it back to raise.
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    atoms = synthetic(cell, ELEMENTS[:6], seed=12, iso_every=0).to(dtype=torch.float32)
    u = atoms.u_aniso.clone()
    u[1] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.0, 0.0])  # eigenvalue < 0 (like 3o5r's MET 48 CB)
    u[3] = torch.tensor([float("nan"), 0.2, 0.3, 0.0, 0.0, 0.0])
    u[4] = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.0, float("inf")])
    bad = AtomSet(atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, u_aniso=u, aniso=atoms.aniso, _validate=False)
    fast, leaves = _leaves(bad, torch.float32)
    out = splat_triton(fast, GridSpec.for_spacing(cell, 0.8))
    assert bool(torch.isfinite(out).all())
    good = atoms.select([0, 2, 5]).to(DEVICE, torch.float64)
    assert_kernel_close(out, splat_reference(good, GridSpec.for_spacing(cell, 0.8)))
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), leaves)
    for name, g in zip(("xyz", "b_iso", "occ", "u_aniso"), grads):
        assert bool(torch.isfinite(g).all()), name
        assert float(g[[1, 3, 4]].abs().max()) == 0.0, name
        if name != "b_iso":  # anisotropic atoms do not use their B
            assert float(g[[0, 2, 5]].abs().max()) > 0, name


def test_empty_set_and_grad_of_u_alone():
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    grid = GridSpec.for_spacing(cell, 1.0)
    atoms = synthetic(cell, ELEMENTS[:3], seed=13).to(DEVICE, torch.float32)
    empty = atoms.select([])
    assert float(splat_triton(empty, grid).abs().max()) == 0.0
    u = atoms.u_aniso.clone().requires_grad_(True)
    out = splat_triton(atoms.replace(u_aniso=u), grid)
    (g,) = torch.autograd.grad(out.sum(), [u])
    assert g.shape == u.shape and float(g[atoms.aniso].abs().max()) > 0 and float(g[~atoms.aniso].abs().max()) == 0


def test_radius_rule_is_checked():
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    atoms = synthetic(cell, ELEMENTS[:2], seed=14).to(DEVICE, torch.float32)
    with pytest.raises(ValueError, match="radius_rule"):
        splat_triton(atoms, GridSpec.for_spacing(cell, 1.0), radius_rule="exact")


def test_first_call_equals_second_and_reference():
    # Several cells, grids and rules in a row: every first call for a new plan is right, not a warm-up.
    for i, (kind, spacing, rule) in enumerate(
        [("hexagonal", 0.9, "gemmi"), ("monoclinic", 0.75, "eigen"), ("triclinic", 1.0, "gemmi")]
    ):
        cell = Cell.from_parameters(*CELLS[kind])
        atoms = synthetic(cell, ELEMENTS[:4], seed=20 + i).to(DEVICE, torch.float32)
        grid = GridSpec.for_spacing(cell, spacing)
        call1 = splat_triton(atoms, grid, radius_rule=rule)
        call2 = splat_triton(atoms, grid, radius_rule=rule)
        ref = splat_reference(atoms.to(dtype=torch.float64), grid, radius_rule=rule)
        assert_kernel_close(call1, ref)
        assert_kernel_close(call2, ref)


# --------------------------------------------------------------------------- torch.compile


def _compile_atoms(device) -> AtomSet:
    cell = Cell.from_parameters(20.0, 24.0, 28.0, 90.0, 100.0, 90.0)
    return synthetic(cell, ("C", "N", "O", "S"), seed=30, iso_every=2).to(device, torch.float32)


def test_compiled_loop_of_aniso_splats_matches_eager():
    from torch._dynamo.backends.registry import lookup_backend

    base = _compile_atoms(DEVICE)
    grid = GridSpec(Cell.from_parameters(20.0, 24.0, 28.0, 90.0, 100.0, 90.0), (20, 24, 28))
    w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def run(xyz, b_iso, occ, u):
        total = xyz.new_zeros(())
        for i in range(3):
            at = AtomSet(
                xyz + 0.1 * i, b_iso, occ, base.a, base.b, u_aniso=u * (1.0 + 0.05 * i), aniso=base.aniso,
                _validate=False,
            )  # fmt: skip
            total = total + (kernels.splat_density(at, grid, backend="triton") * w).sum()
        return total

    def value_and_grads(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ, base.u_aniso)]
        value = fn(*leaves)
        return value, torch.autograd.grad(value, leaves)

    compiler = "inductor" if DEVICE.type == "cuda" else "aot_eager"
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        return lookup_backend(compiler)(gm, example_inputs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, eager_g = value_and_grads(run)
        torch._dynamo.reset()
        compiled, compiled_g = value_and_grads(torch.compile(run, fullgraph=True, backend=recording))
    assert len(graphs) == 1 and graphs[0].count("kernels.density_triton_aniso") == 3, graphs
    assert abs(float(compiled.detach()) - float(eager.detach())) <= 1e-5 * abs(float(eager.detach())) + 1e-6
    for name, g, ge in zip(("xyz", "b_iso", "occ", "u_aniso"), compiled_g, eager_g):
        assert float(ge.abs().max()) > 0, name
        try:
            assert_kernel_close(g, ge)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {name}: {exc}") from None


@pytest.mark.parametrize("iso_neutron", [False, True])
def test_aniso_custom_ops_pass_opcheck(iso_neutron):
    from kernels.density import ops  # noqa: F401  (registers the ops)

    base = _compile_atoms(DEVICE)
    grid = GridSpec(Cell.from_parameters(20.0, 24.0, 28.0, 90.0, 100.0, 90.0), (20, 24, 28))
    cell, shape = list(grid.cell.parameters), list(grid.shape)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    xyz, b, occ = (t.detach().clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ))
    # An isotropic neutron set reaches the op with a zero U and no atom flagged (triton._kernel_inputs_aniso).
    u = torch.zeros_like(base.u_aniso) if iso_neutron else base.u_aniso.detach().clone().requires_grad_(True)
    flag = torch.zeros_like(base.aniso) if iso_neutron else base.aniso
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for radius in (None, 2.5):
            torch.library.opcheck(
                torch.ops.kernels.density_triton_aniso.default,
                (xyz, u, flag, b, occ, base.a, base.b, cell, shape, radius, 1e-5, 1, "eigen", iso_neutron),
                test_utils=tests,
            )


# --------------------------------------------------------------------------- real structures


def _read(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3o5r's non-positive-definite atom falls back to B_iso, with a warning
        if name == "3o5r":
            return kernels.read_model(STRUCTURES[name], on_bad_adp="iso")
        return kernels.read_model(STRUCTURES[name])


@pytest.mark.parametrize(
    ("name", "radius_rule"),
    [
        ("1pfe", "gemmi"),  # ~9 s in the interpreter
        pytest.param("1pfe", "eigen", marks=requires_cuda),
        pytest.param("3o5r", "gemmi", marks=requires_cuda),  # ~20 s each in the interpreter: GPU only
        pytest.param("3o5r", "eigen", marks=requires_cuda),
    ],
)
def test_real_structures_match_reference(name, radius_rule):
    # 1PFE: hexagonal, ANISOU on every atom; 3O5R: orthogonal, one atom back to B_iso (on_bad_adp="iso").
    m = _read(name)
    assert m.atoms.u_aniso is not None and bool(m.atoms.aniso.any())
    check_against_reference(m.atoms, GridSpec.for_spacing(m.cell, 2.0 / 3.0), radius_rule=radius_rule)


def _gemmi_structure_without_bad_anisou(path):
    """gemmi's structure with the ANISOU of every atom whose U is not positive definite zeroed (B_iso used)."""
    import gemmi

    st = gemmi.read_structure(os.fspath(path))
    zero = gemmi.SMat33f(0, 0, 0, 0, 0, 0)
    for chain in st[0]:
        for residue in chain:
            for atom in residue:
                if atom.aniso.nonzero() and min(atom.aniso.calculate_eigenvalues()) <= 0:
                    atom.aniso = zero
    return st


@pytest.mark.parametrize("name", ["1pfe", "3o5r"])
def test_matches_gemmi_anisotropic(name):
    # gemmi's DensityCalculatorX with ANISOU, 3o5r's non-positive-definite one zeroed on both sides.
    from kernels.testing import gemmi_density

    m = _read(name)
    spacing = 2.0 / 3.0
    st = _gemmi_structure_without_bad_anisou(STRUCTURES[name])
    want = torch.from_numpy(gemmi_density(st, spacing, 1e-5, adp="auto")).double()
    grid = GridSpec.for_spacing(m.cell, spacing, m.spacegroup)
    assert grid.shape == tuple(want.shape), (grid.shape, tuple(want.shape))
    out = kernels.splat_density(m.atoms.to(DEVICE, torch.float32), grid, backend="triton").double().cpu()
    rel = float((out - want).norm() / want.norm())
    assert rel <= 1e-5, f"{name}: relative L2 distance from gemmi {rel:.3e}"  # 2.9e-6 and 3.5e-6 measured


_SM90_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.density import triton as T

    pointers = {"xyz_ptr": "*fp32", "u_ptr": "*fp32", "flag_ptr": "*u8", "b_iso_ptr": "*fp32", "occ_ptr": "*fp32",
                "a_ptr": "*fp32", "b_ptr": "*fp32", "radius_ptr": "*fp32", "p_ptr": "*fp64", "n_atoms": "i32",
                "atoms_per_frame": "i32", "out_ptr": "*fp32", "grad_ptr": "*fp32", "gxyz_ptr": "*fp32",
                "gu_ptr": "*fp32", "gb_ptr": "*fp32", "gocc_ptr": "*fp32", "fix_ptr": "*i64", "fix_shift": "i32"}
    done = []
    for fn in (T._aniso_fwd_kernel, T._aniso_bwd_kernel):
        for rule, neutron, vec, separable in ((1, False, True, True), (2, False, False, False), (1, True, True, False)):
            const = dict(ATOMS=1, BP=8, BQ=8, RULE=rule, NEUTRON=neutron, INDEX64=rule == 2,
                         VEC=vec, FRAMES=not vec, SEPARABLE=separable)
            if "FIXED" in fn.arg_names:  # the forward's deterministic mode: tests/kernels/test_density_deterministic.py
                const["FIXED"] = False
            sig = {n: "constexpr" if n in const else pointers[n] for n in fn.arg_names}
            src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
            assert kernel.asm["cubin"], fn.__name__
            done.append(fn.__name__)
    print(json.dumps(done))
    """
)


def test_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter does not lower to PTX: compile the anisotropic kernels for an H100 (sm_90) with
    # Triton's own ptxas, in a process without TRITON_INTERPRET, so a construct only the GPU compiler
    # rejects fails here too.
    assert len(json.loads(run_compiled(_SM90_SCRIPT, ROOT).strip().splitlines()[-1])) == 6


_FIRST_CALL_SCRIPT = textwrap.dedent(
    """
    import json, warnings, torch, kernels
    from kernels.crystal import AtomSet, Cell, GridSpec
    from kernels.density.reference import splat_reference
    from kernels.density.triton import splat_triton
    from tests.helpers import STRUCTURES
    from tests.kernels.test_density_aniso_triton import synthetic

    def rel(u, v):
        return float((u.double() - v).norm() / v.norm())

    warnings.simplefilter("ignore")
    gen = torch.Generator().manual_seed(0)
    tri = Cell.from_parameters(15.0, 17.0, 19.0, 79.0, 95.0, 106.0)
    pfe = kernels.read_model(STRUCTURES["1pfe"])
    o5r = kernels.read_model(STRUCTURES["3o5r"], on_bad_adp="iso")
    configs = [
        ("1pfe", pfe.atoms, GridSpec.for_spacing(pfe.cell, 2 / 3), None, "gemmi"),
        ("3o5r", o5r.atoms, GridSpec.for_spacing(o5r.cell, 0.6), None, "eigen"),
        ("triclinic", synthetic(tri, ["C", "N", "O", "S"] * 10, seed=0), GridSpec.for_spacing(tri, 0.5), 3.3, "gemmi"),
    ]
    results = []
    for name, atoms, grid, radius, rule in configs:
        at = atoms.to("cuda", torch.float32)
        xyz = at.xyz.clone().requires_grad_()
        u = at.u_aniso.clone().requires_grad_()
        at = AtomSet(xyz, at.b_iso, at.occ, at.a, at.b, u_aniso=u, aniso=at.aniso, _validate=False)
        w = torch.randn(grid.shape, generator=gen, dtype=torch.float64).cuda()
        call1 = splat_triton(at, grid, radius=radius, radius_rule=rule)
        g1 = torch.autograd.grad(call1, [xyz, u], grad_outputs=w.float())
        call2 = splat_triton(at, grid, radius=radius, radius_rule=rule)
        g2 = torch.autograd.grad(call2, [xyz, u], grad_outputs=w.float())
        ref_at = atoms.to("cuda", torch.float32).to(dtype=torch.float64)
        rxyz = ref_at.xyz.clone().requires_grad_()
        ru = ref_at.u_aniso.clone().requires_grad_()
        ref_at = AtomSet(rxyz, ref_at.b_iso, ref_at.occ, ref_at.a, ref_at.b, u_aniso=ru, aniso=ref_at.aniso,
                         _validate=False)
        ref = splat_reference(ref_at, grid, radius=radius, radius_rule=rule)
        rg = torch.autograd.grad(ref, [rxyz, ru], grad_outputs=w)
        results.append(dict(name=name, call1=rel(call1, ref), call2=rel(call2, ref),
                            xyz1=rel(g1[0], rg[0]), xyz2=rel(g2[0], rg[0]), u1=rel(g1[1], rg[1]), u2=rel(g2[1], rg[1])))
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
        for key in ("call1", "call2", "xyz1", "xyz2", "u1", "u2"):
            assert r[key] < 1e-5, r  # float32 level, as the isotropic first-call test
    assert any((tmp_path / "triton-cache").iterdir()), "the subprocess did not compile into the empty cache"


@requires_cuda
def test_no_host_sync_and_cuda_graph_capture():
    m = kernels.read_model(STRUCTURES["1pfe"])
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    base = m.atoms.to("cuda", torch.float32)
    xyz = base.xyz.clone().requires_grad_()
    u = base.u_aniso.clone().requires_grad_()
    atoms = AtomSet(xyz, base.b_iso, base.occ, base.a, base.b, u_aniso=u, aniso=base.aniso, _validate=False)
    w = torch.randn(grid.shape, device="cuda")

    def step():
        out = splat_triton(atoms, grid, radius_rule="eigen")
        return (out,) + torch.autograd.grad((out * w).sum(), [xyz, u])

    step()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
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
        u.mul_(1.1)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert_kernel_close(got, want)
