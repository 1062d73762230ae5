"""Deterministic Triton density under ``torch.use_deterministic_algorithms(True)``.

With the switch on, the forward adds fixed-point int64 contributions with integer atomics
(docs/kernels.md, "Determinism"), so a map is the same bit for bit on every call and for any
order of the atoms; the backward kernels use no atomics, so the gradients follow. In the
interpreter float32 atomics add in program order, so permuting the atoms changes the default
map's last bits: the permutation checks below fail on a float accumulation, here as on a GPU.
The CUDA tests repeat each call 10 times on real structures.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridSpec
from kernels.density import triton as triton_splat
from kernels.density.reference import splat_reference
from tests.helpers import assert_kernel_close, deterministic, model, requires_cuda, run_compiled
from tests.kernels.test_density_aniso_triton import CELLS, ELEMENTS, _leaves, check_against_reference
from tests.kernels.test_density_aniso_triton import synthetic as aniso_synthetic
from tests.kernels.test_density_triton import MIXED
from tests.kernels.test_density_triton import synthetic as iso_synthetic

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[2]


def _run(atoms: AtomSet, grid: GridSpec, w: torch.Tensor, *, n_frames=None, radius=None):
    """Map and the gradients of Σ w·ρ (xyz, b_iso, occ[, u_aniso]) of one call, detached."""
    fast, leaves = _leaves(atoms, torch.float32)
    if n_frames is None:
        out = triton_splat.splat_triton(fast, grid, radius=radius)
    else:
        out = triton_splat.splat_frames_triton(fast, grid, n_frames=n_frames, radius=radius)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    return out.detach(), [g.detach() for g in grads]


def _permutation(n_atoms: int, n_frames: int, seed: int) -> list[int]:
    """One random order of each frame's atoms (the same in every frame; frames stay frame-major)."""
    per = torch.randperm(n_atoms // n_frames, generator=torch.Generator().manual_seed(seed))
    return [f * (n_atoms // n_frames) + int(i) for f in range(n_frames) for i in per]


def _dense(kind: str, scale: float = 0.6) -> Cell:
    """CELLS[kind] with its edges scaled: atoms overlap enough that the order of float additions shows."""
    p = CELLS[kind]
    return Cell.from_parameters(p[0] * scale, p[1] * scale, p[2] * scale, *p[3:])


def _assert_same_under_permutation(
    atoms: AtomSet, grid: GridSpec, *, n_frames=None, radius=None, seed=0, can_fail=True
) -> None:
    """Map and gradients bitwise equal on a second call and with the atoms permuted (gradients permuted back).

    ``can_fail``: in the interpreter the case first shows that it can fail: without the switch (float32
    atomics added in program order) the permuted atoms give another map.
    """
    atoms = atoms.to(DEVICE, torch.float32)
    shape = grid.shape if n_frames is None else (n_frames, *grid.shape)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    perm = _permutation(len(atoms), n_frames or 1, seed)
    if can_fail and DEVICE.type == "cpu":
        with deterministic(False):
            plain, plain_p = (
                _run(a, grid, w, n_frames=n_frames, radius=radius)[0] for a in (atoms, atoms.select(perm))
            )
        assert not torch.equal(plain, plain_p), "too sparse a case: float sums in either order agree"
    with deterministic():
        out, grads = _run(atoms, grid, w, n_frames=n_frames, radius=radius)
        again, grads_again = _run(atoms, grid, w, n_frames=n_frames, radius=radius)
        out_p, grads_p = _run(atoms.select(perm), grid, w, n_frames=n_frames, radius=radius)
    assert float(out.abs().max()) > 0
    assert torch.equal(out, again), "two calls differ"
    assert torch.equal(out, out_p), f"permuted atoms: max |diff| {float((out - out_p).abs().max()):.3e}"
    idx = torch.tensor(perm, device=out.device)
    for name, g, g2, gp in zip(("xyz", "b_iso", "occ", "u_aniso"), grads, grads_again, grads_p):
        assert torch.equal(g, g2), f"gradient of {name}: two calls differ"
        assert torch.equal(g[idx], gp), f"gradient of {name}, permuted atoms: {float((g[idx] - gp).abs().max()):.3e}"


# --------------------------------------------------------------------------- CI (interpreter or GPU)


@pytest.mark.parametrize("kind", ["orthogonal", "hexagonal", "triclinic"])
def test_isotropic_matches_reference_and_ignores_atom_order(kind):
    # orthogonal: the separable forward; hexagonal: the z-separable one; triclinic: the general exponent.
    cell = _dense(kind)
    grid = GridSpec(cell, (16, 16, 20))
    atoms = iso_synthetic(cell, MIXED * 3, seed=len(kind))
    with deterministic():
        check_against_reference(atoms, grid, seed=1)
    _assert_same_under_permutation(atoms, grid, seed=2)


@pytest.mark.parametrize("kind", ["monoclinic", "triclinic"])
def test_anisotropic_matches_reference_and_ignores_atom_order(kind):
    cell = _dense(kind)
    grid = GridSpec(cell, (16, 18, 20))
    atoms = aniso_synthetic(cell, ELEMENTS * 3, seed=3 + len(kind))
    with deterministic():
        check_against_reference(atoms, grid, seed=4)
    _assert_same_under_permutation(atoms, grid, seed=5)


def test_frames_match_reference_and_ignore_atom_order():
    cell = _dense("orthogonal", 0.5)
    grid = GridSpec(cell, (16, 18, 20))
    one = aniso_synthetic(cell, ELEMENTS, seed=7)
    gen = torch.Generator().manual_seed(8)
    frames = [one.replace(xyz=one.xyz + 0.5 * torch.randn(one.xyz.shape, generator=gen, dtype=one.xyz.dtype))
              for _ in range(3)]  # fmt: skip
    stack = AtomSet(
        torch.cat([f.xyz for f in frames]), one.b_iso.repeat(3), one.occ.repeat(3), one.a.repeat(3, 1),
        one.b.repeat(3, 1), list(one.elements) * 3, u_aniso=one.u_aniso.repeat(3, 1), aniso=one.aniso.repeat(3),
        _validate=False,
    )  # fmt: skip
    with deterministic():
        check_against_reference(stack, grid, n_frames=3, seed=9)
    _assert_same_under_permutation(stack, grid, n_frames=3, seed=10)


def test_sphere_larger_than_the_cell():
    # A 30 Å radius in a ~8 Å cell: each box wraps onto the same voxels several times, which the
    # fixed-point scale's bound counts (⌈box/cell⌉ per axis).
    cell = Cell.from_parameters(8.0, 9.0, 7.5, 90.0, 90.0, 90.0)
    grid = GridSpec(cell, (8, 9, 8))
    atoms = iso_synthetic(cell, ["C", "O", "Fe"], seed=11, b_range=(60.0, 90.0))
    with deterministic():
        check_against_reference(atoms, grid, radius=30.0, seed=12)
    # Few atoms: in the interpreter each voxel meets them in loop order, whatever their order, so the float
    # path passes this permutation too; the reference check above is what the bound is tested by.
    _assert_same_under_permutation(atoms, grid, radius=30.0, seed=13, can_fail=False)


@pytest.mark.parametrize("factor", [1e-30, 1e30])
def test_scale_follows_the_data(factor):
    # The fixed-point scale comes from the atoms' largest contribution on the device, so occupancies
    # of 1e-30 keep float32's relative accuracy and 1e30 does not overflow the int64 sums.
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    grid = GridSpec(cell, (20, 22, 24))
    atoms = iso_synthetic(cell, MIXED, seed=14)
    atoms = atoms.replace(occ=atoms.occ * factor, _validate=False)  # beyond [0, 1]: a weighted ensemble can be
    with deterministic():
        out = triton_splat.splat_triton(atoms.to(DEVICE, torch.float32), grid)
    ref = splat_reference(atoms.to(dtype=torch.float32).to(dtype=torch.float64), grid)
    assert float(ref.abs().max()) > 0
    assert_kernel_close(out, ref)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy says the bound overflowed
def test_contribution_beyond_float32_gives_a_nan_map():
    # An atom whose density overflows float32 (occupancy 1e37 times an amplitude > 34) has no fixed-point
    # scale: the map comes back NaN everywhere instead of wrapped integers.
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    grid = GridSpec(cell, (20, 22, 24))
    atoms = iso_synthetic(cell, MIXED, seed=15)
    occ = atoms.occ.clone()
    occ[4] = 1e37
    atoms = atoms.replace(occ=occ, _validate=False).to(DEVICE, torch.float32)
    with deterministic():
        out = triton_splat.splat_triton(atoms, grid)
    assert bool(torch.isnan(out).all())


def test_ensemble_matches_reference_and_ignores_atom_order():
    # splat_ensemble(reduce="sum") is one call of the single-model splat on the F·N atoms.
    cell = _dense("triclinic", 0.5)
    grid = GridSpec(cell, (16, 18, 18))
    base = iso_synthetic(cell, MIXED, seed=16).to(DEVICE, torch.float32)
    gen = torch.Generator().manual_seed(17)
    xyz = (base.xyz.cpu() + 0.6 * torch.randn((4, len(base), 3), generator=gen)).to(DEVICE)
    weights = (0.2 + torch.rand(4, generator=gen)).to(DEVICE)
    upstream = torch.randn(grid.shape, generator=gen).to(DEVICE)
    perm = _permutation(len(base), 1, 18)

    def run(atoms, x):
        leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
        out = kernels.splat_ensemble(atoms, leaves[0], grid, weights=leaves[1], backend="triton")
        return out.detach(), torch.autograd.grad((out * upstream).sum(), leaves)

    if DEVICE.type == "cpu":  # the case can fail: float32 sums in the two orders differ
        with deterministic(False):
            assert not torch.equal(run(base, xyz)[0], run(base.select(perm), xyz[:, perm])[0])
    with deterministic():
        out, (g_xyz, g_w) = run(base, xyz)
        again, (g_xyz2, g_w2) = run(base, xyz)
        out_p, (g_xyz_p, g_w_p) = run(base.select(perm), xyz[:, perm])
    ref = sum(w * splat_reference(base.replace(xyz=x).to(dtype=torch.float64), grid) for w, x in zip(weights, xyz))
    assert_kernel_close(out, ref)
    assert torch.equal(out, again) and torch.equal(g_xyz, g_xyz2) and torch.equal(g_w, g_w2)
    assert torch.equal(out, out_p), f"permuted atoms: max |diff| {float((out - out_p).abs().max()):.3e}"
    assert torch.equal(g_xyz[:, perm], g_xyz_p)
    # The weights' gradient is torch's sum over each frame's atoms (autograd of occ·w): the same on every
    # call, summed in the atoms' order, so a permutation may move its last bit.
    assert_kernel_close(g_w_p, g_w)


def test_switch_off_keeps_the_float_path():
    # Without the switch the map is the float32-atomic one; with it, the fixed-point one (a different
    # rounding, each within the float32 contract of the reference).
    cell = Cell.from_parameters(*CELLS["orthogonal"])
    grid = GridSpec(cell, (20, 22, 24))
    atoms = iso_synthetic(cell, MIXED, seed=19).to(DEVICE, torch.float32)
    with deterministic(False):
        plain = triton_splat.splat_triton(atoms, grid)
    with deterministic():
        fixed = triton_splat.splat_triton(atoms, grid)
    ref = splat_reference(atoms.to(dtype=torch.float64), grid)
    assert_kernel_close(plain, ref)
    assert_kernel_close(fixed, ref)
    assert not torch.equal(plain, fixed)


# --------------------------------------------------------------------------- GPU: 10 calls, real structures


def _gpu_case(name: str, aniso: bool):
    m = model(name)
    atoms = m.atoms if aniso else m.atoms.replace(u_aniso=None, aniso=None)
    return atoms.to("cuda", torch.float32), GridSpec.for_spacing(m.cell, 2.0 / 3.0, m.spacegroup)


def _ten_calls_then_permuted(atoms: AtomSet, grid: GridSpec, n_frames=None) -> None:
    shape = grid.shape if n_frames is None else (n_frames, *grid.shape)
    w = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    perm = _permutation(len(atoms), n_frames or 1, 1)
    with deterministic():
        first, grads = _run(atoms, grid, w, n_frames=n_frames)
        for call in range(9):
            out, gs = _run(atoms, grid, w, n_frames=n_frames)
            assert torch.equal(out, first), f"call {call + 2}: max |diff| {float((out - first).abs().max()):.3e}"
            for g0, g in zip(grads, gs):
                assert torch.equal(g0, g), f"call {call + 2}: a gradient differs"
        out, gs = _run(atoms.select(perm), grid, w, n_frames=n_frames)
    assert torch.equal(out, first), f"permuted: max |diff| {float((out - first).abs().max()):.3e}"
    idx = torch.tensor(perm, device="cuda")
    for g0, g in zip(grads, gs):
        assert torch.equal(g0[idx], g), "permuted: a gradient differs"


@requires_cuda
@pytest.mark.parametrize("name", ["1aki", "5h73", "3wip"])
def test_gpu_isotropic_ten_calls_bitwise(name):
    _ten_calls_then_permuted(*_gpu_case(name, aniso=False))


@requires_cuda
@pytest.mark.parametrize("name", ["1pfe", "3o5r"])
def test_gpu_anisotropic_ten_calls_bitwise(name):
    _ten_calls_then_permuted(*_gpu_case(name, aniso=True))


@requires_cuda
@pytest.mark.parametrize("aniso", [False, True], ids=["iso", "aniso"])
def test_gpu_frames_ten_calls_bitwise(aniso):
    atoms, grid = _gpu_case("3o5r", aniso)
    gen = torch.Generator("cuda").manual_seed(2)
    frames = [atoms.replace(xyz=atoms.xyz + 0.3 * torch.randn(atoms.xyz.shape, device="cuda", generator=gen))
              for _ in range(4)]  # fmt: skip
    stack = AtomSet(
        torch.cat([f.xyz for f in frames]), atoms.b_iso.repeat(4), atoms.occ.repeat(4), atoms.a.repeat(4, 1),
        atoms.b.repeat(4, 1), list(atoms.elements) * 4,
        u_aniso=None if atoms.u_aniso is None else atoms.u_aniso.repeat(4, 1),
        aniso=None if atoms.aniso is None else atoms.aniso.repeat(4), _validate=False,
    )  # fmt: skip
    _ten_calls_then_permuted(stack, grid, n_frames=4)


@requires_cuda
def test_gpu_ensemble_sum_ten_calls_bitwise():
    atoms, grid = _gpu_case("1aki", aniso=False)
    gen = torch.Generator("cuda").manual_seed(3)
    xyz = atoms.xyz + 0.3 * torch.randn((8, *atoms.xyz.shape), device="cuda", generator=gen)
    weights = torch.rand(8, device="cuda", generator=gen) + 0.1
    upstream = torch.randn(grid.shape, device="cuda", generator=gen)
    perm = _permutation(len(atoms), 1, 4)

    def run(at, x):
        leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
        out = kernels.splat_ensemble(at, leaves[0], grid, weights=leaves[1], backend="triton")
        return out.detach(), torch.autograd.grad((out * upstream).sum(), leaves)

    with deterministic():
        first, (g_xyz, g_w) = run(atoms, xyz)
        for _ in range(9):
            out, (gx, gw) = run(atoms, xyz)
            assert torch.equal(out, first) and torch.equal(gx, g_xyz) and torch.equal(gw, g_w)
        out, (gx, _gw) = run(atoms.select(perm), xyz[:, perm])
    assert torch.equal(out, first)
    assert torch.equal(gx, g_xyz[:, perm])


_SM90_SCRIPT = textwrap.dedent(
    """
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.density import triton as T

    types = {"xyz_ptr": "*fp32", "u_ptr": "*fp32", "flag_ptr": "*u8", "b_iso_ptr": "*fp32", "occ_ptr": "*fp32",
             "a_ptr": "*fp32", "b_ptr": "*fp32", "radius_ptr": "*fp32", "p_ptr": "*fp64", "n_atoms": "i32",
             "atoms_per_frame": "i32", "out_ptr": "*i64", "fix_ptr": "*i64", "fix_shift": "i32", "acc_ptr": "*i64",
             "n": "i32"}
    cases = [
        (T._splat_fwd_kernel, dict(ATOMS=1, BP=8, BQ=16, SEPARABLE=True, PER_ATOM_RADIUS=True, INDEX64=False,
                                   VEC=True, FRAMES=False, ZSEP=False, FIXED=True)),
        (T._splat_fwd_kernel, dict(ATOMS=1, BP=8, BQ=16, SEPARABLE=False, PER_ATOM_RADIUS=False, INDEX64=True,
                                   VEC=False, FRAMES=True, ZSEP=True, FIXED=True)),
        (T._aniso_fwd_kernel, dict(ATOMS=1, BP=8, BQ=8, RULE=1, NEUTRON=False, INDEX64=False, VEC=True,
                                   FRAMES=False, SEPARABLE=True, FIXED=True)),
        (T._fixed_scale_kernel, dict(BLOCK=128, PER_ATOM_RADIUS=True)),
        (T._aniso_fixed_scale_kernel, dict(BLOCK=128, RULE=2, NEUTRON=False)),
        (T._fixed_to_float_kernel, dict(BLOCK=1024)),
    ]
    done = {}
    for fn, const in cases:
        sig = {n: "constexpr" if n in const else types.get(n, "*fp32") for n in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        ptx = kernel.asm["ptx"]
        ops = (t for line in ptx.splitlines() for t in line.split() if t.startswith(("atom.", "red.")))
        adds = [t for t in ops if ".add" in t]
        done.setdefault(fn.__name__, []).append(sorted(set(adds)))
    print(json.dumps(done))
    """
)


def test_deterministic_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter does not lower to PTX: compile the deterministic kernels for sm_90 with Triton's own
    # ptxas (no GPU needed) and check that the forwards' only atomic adds are 64-bit integer ones.
    done = json.loads(run_compiled(_SM90_SCRIPT, ROOT).strip().splitlines()[-1])
    assert len(done) == 5, done
    for name in ("_splat_fwd_kernel", "_aniso_fwd_kernel"):
        for adds in done[name]:
            assert adds and all(a.endswith(".u64") or a.endswith(".s64") for a in adds), (name, adds)


@requires_cuda
def test_gpu_direct_launches_match_the_normal_launch_bitwise(monkeypatch):
    # Every launcher of the deterministic path (exponent, splat, conversion, backward) keeps its kernel on
    # the normal launch and launches it directly afterwards; in this mode the two must agree bit for bit.
    from tests.kernels.test_compile_and_graphs import _splat_case, check_direct_launches

    atoms, grid = _gpu_case("1aki", aniso=False)
    atoms = AtomSet(atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, _validate=False)
    aniso, agrid = _gpu_case("3o5r", aniso=True)
    w = torch.randn(grid.shape, device="cuda")
    wa = torch.randn(agrid.shape, device="cuda")
    pair = AtomSet(
        torch.cat([atoms.xyz, atoms.xyz + 0.4]), atoms.b_iso.repeat(2), atoms.occ.repeat(2), atoms.a.repeat(2, 1),
        atoms.b.repeat(2, 1), _validate=False,
    )  # fmt: skip
    cases = {
        "float32": _splat_case(atoms, grid, w),
        "float64 positions": _splat_case(atoms.to(dtype=torch.float64), grid, w),
        "frames": _splat_case(pair, grid, torch.randn((2, *grid.shape), device="cuda"), n_frames=2),
        "fixed radius": _splat_case(atoms, grid, w, radius=2.5),
        "anisotropic": _splat_case(aniso, agrid, wa),
    }
    launchers = (
        triton_splat._fwd_launch, triton_splat._bwd_launch, triton_splat._aniso_fwd_launch,
        triton_splat._aniso_bwd_launch, triton_splat._fixed_scale_launch, triton_splat._aniso_fixed_scale_launch,
        triton_splat._fixed_to_float_launch,
    )  # fmt: skip

    def compare(name, got, want):
        for g, ref in zip(got, want):
            assert torch.equal(g, ref), name

    with deterministic():
        check_direct_launches(monkeypatch, launchers, cases, compare)
