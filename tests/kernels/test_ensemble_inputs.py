"""Bad input to the splat entry points: the same argument checks everywhere, and what the map keeps.

``splat_ensemble`` makes every check ``splat_density`` makes (one validator: radius, cutoff, blur,
radius_rule), raises on weights that overflow its map, accepts every floating dtype as
``splat_density`` does, refuses a sum whose predicted host memory does not fit, and (host atoms)
warns for atoms whose cutoff radius is below the grid spacing with the number of grid points that
keep them — which is what the map holds. Memory peaks are measured in subprocesses (ru_maxrss).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridError, GridSpec

ROOT = Path(__file__).resolve().parents[2]


def _system(dtype=torch.float32, frames: int = 3):
    cell = Cell.from_parameters(11.0, 12.0, 10.0, 90.0, 90.0, 90.0)
    grid = GridSpec.for_spacing(cell, 1.0)
    gen = torch.Generator().manual_seed(3)
    xyz0 = torch.rand((4, 3), generator=gen, dtype=torch.float64) * 9
    atoms = AtomSet.from_elements(["C", "N", "O", "S"], xyz0, torch.tensor([20.0, 22.0, 25.0, 30.0]), dtype=dtype)
    xyz = (xyz0 + 0.3 * torch.randn((frames, 4, 3), generator=gen, dtype=torch.float64)).to(dtype)
    return atoms, grid, xyz


def _error(call) -> tuple[type, str]:
    with pytest.raises((ValueError, TypeError, GridError)) as info:
        call()
    return info.type, str(info.value)


# --------------------------------------------------------------------------- one validator for every entry point

BAD_ARGUMENTS = [
    ("blur", -100.0, "leaves"),  # B = 20..30: every atom loses its Gaussian
    ("blur", float("nan"), "blur must be a finite number"),
    ("blur", float("inf"), "blur must be a finite number"),
    ("blur", "5", "blur must be a finite number"),
    ("blur", True, "blur must be a finite number"),
    ("blur", torch.tensor([1.0, 2.0]), "blur must be a finite number"),
    ("blur", 1 + 2j, "blur must be a finite number"),
    ("radius", "2", "radius must be a positive finite number"),
    ("radius", True, "radius must be a positive finite number"),
    ("radius", -1.0, "radius must be a positive finite number"),
    ("radius", float("nan"), "radius must be a positive finite number"),
    ("radius", torch.tensor([2.0, 3.0]), "radius must be a positive finite number"),
    ("radius", 1e4, "makes each atom cover"),
    ("cutoff", "1e-5", "cutoff must be a positive finite number"),
    ("cutoff", True, "cutoff must be a positive finite number"),
    ("cutoff", 0.0, "cutoff must be a positive finite number"),
    ("cutoff", torch.tensor([1e-5, 1e-4]), "cutoff must be a positive finite number"),
    ("radius_rule", "GEMMI", "radius_rule must be one of"),
]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(("name", "value", "message"), BAD_ARGUMENTS, ids=lambda v: repr(v)[:20])
def test_splat_ensemble_refuses_what_splat_density_refuses(backend, name, value, message):
    atoms, grid, xyz = _system(torch.float64 if backend == "reference" else torch.float32)
    one = atoms.replace(xyz=xyz[0], _validate=False)
    kind, text = _error(lambda: kernels.splat_density(one, grid, backend=backend, **{name: value}))
    assert message in text, text
    ens_kind, ens_text = _error(
        lambda: kernels.splat_ensemble(atoms, xyz, grid, backend=backend, reduce="sum", **{name: value})
    )
    assert ens_kind is kind and message in ens_text, ens_text
    _error(lambda: kernels.splat_ensemble(atoms, xyz, grid, backend=backend, reduce="none", **{name: value}))


def test_a_negative_blur_names_the_frame_and_atom_it_leaves_without_a_gaussian():
    atoms, grid, xyz = _system(frames=3)
    b_iso = atoms.b_iso.expand(3, 4).clone()
    b_iso[2, 1] = 5.0  # only frame 2's N goes below zero at blur -10
    with pytest.raises(ValueError, match=r"blur=-10 Å² leaves frame 2: atom .*N2 \(index 1\) with B = -5 Å²"):
        kernels.splat_ensemble(atoms, xyz, grid, b_iso=b_iso, blur=-10.0)
    rho = kernels.splat_ensemble(atoms, xyz, grid, b_iso=b_iso, blur=-4.0)  # every B stays > 0
    assert bool(torch.isfinite(rho).all()) and float(rho.max()) > 0


def test_a_negative_blur_that_leaves_a_u_not_positive_definite_is_refused_in_an_ensemble():
    atoms, grid, xyz = _system()
    u = torch.zeros((4, 6), dtype=atoms.dtype)
    u[:, :3] = torch.tensor([0.3, 0.2, 0.05], dtype=atoms.dtype)
    aniso = atoms.replace(u_aniso=u, aniso=torch.tensor([True, False, False, False]))
    one = aniso.replace(xyz=xyz[0], _validate=False)
    blur = -0.06 * 8 * np.pi**2  # U33 0.05 Å² - 0.06 Å² < 0
    with pytest.raises(ValueError, match="leaves atom .*not positive definite"):
        kernels.splat_density(one, grid, blur=blur)
    with pytest.raises(ValueError, match="leaves frame 0: atom .*not positive definite"):
        kernels.splat_ensemble(aniso, xyz, grid, blur=blur)


@pytest.mark.parametrize(
    "value", [5, np.float32(5.0), np.float64(5.0), torch.tensor(5.0), torch.tensor([5.0])], ids=repr
)
def test_every_real_scalar_form_of_blur_gives_the_float_map(value):
    atoms, grid, xyz = _system()
    want = kernels.splat_ensemble(atoms, xyz, grid, blur=5.0)
    assert torch.equal(kernels.splat_ensemble(atoms, xyz, grid, blur=value), want)
    one = atoms.replace(xyz=xyz[0], _validate=False)
    assert torch.equal(kernels.splat_density(one, grid, blur=value), kernels.splat_density(one, grid, blur=5.0))


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_weights_that_overflow_the_map_raise(backend):
    dtype = torch.float64 if backend == "reference" else torch.float32
    atoms, grid, xyz = _system(dtype)
    big = float(torch.finfo(dtype).max) / 4  # finite in the dtype; times a peak of several e/Å³ it is not
    with pytest.raises(ValueError, match="make the .* map overflow"):
        kernels.splat_ensemble(atoms, xyz, grid, weights=[big, big, big], backend=backend)


def test_large_weights_whose_map_stays_finite_pass():
    atoms, grid, xyz = _system()
    w = [1e36, 1e36, -1e36]  # the bound passes float32's range, the map does not
    rho = kernels.splat_ensemble(atoms, xyz, grid, weights=w)
    assert bool(torch.isfinite(rho).all())
    want = sum(wi * kernels.splat_ensemble(atoms, xyz[i : i + 1], grid).double() for i, wi in enumerate(w))
    assert torch.allclose(rho.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_floating_dtype_splats_as_its_float64_values(backend, dtype):
    atoms, grid, xyz = _system(torch.float64)
    low = atoms.to(dtype=dtype)
    exact = low.to(dtype=torch.float64)  # the same values, rounded to dtype
    want = kernels.splat_density(exact, grid, backend="reference")
    got = kernels.splat_density(low, grid, cutoff=1e-5, backend=backend)
    tol = 1e-5 * float(want.abs().max())
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=tol)
    frames = xyz.to(dtype)
    got = kernels.splat_ensemble(low, frames, grid, backend=backend)
    want = kernels.splat_ensemble(exact, frames.double(), grid, backend="reference")
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# --------------------------------------------------------------------------- atoms narrower than a voxel


def _one_atom(pos, b=20.0, occ=1.0):
    cell = Cell.from_parameters(10.0, 10.0, 10.0, 90.0, 90.0, 90.0)
    atoms = AtomSet.from_elements(["C"], torch.tensor([pos], dtype=torch.float64), b, occ)
    return atoms, GridSpec.for_spacing(cell, 0.5)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(
    ("pos", "kept"), [([0.0, 0.0, 0.0], 1), ([0.01, 0.0, 0.0], 1), ([0.25, 0.25, 0.25], 0)], ids=str
)
def test_the_warning_says_how_many_grid_points_keep_an_atom_below_the_cutoff(backend, pos, kept):
    atoms, grid = _one_atom(pos)
    atoms = atoms.to(dtype=torch.float32 if backend == "cpu" else torch.float64)
    with pytest.warns(UserWarning, match="below the grid spacing") as record:
        rho = kernels.splat_density(atoms, grid, cutoff=2.0, backend=backend)  # the carbon's peak is 1.6
    text = str(record[0].message)
    assert int((rho != 0).sum()) == kept  # the warning and the map agree
    if kept:
        assert f"only the {kept} grid point that close" in text, text
    else:
        assert "no grid point lies that close, so the map leaves it out" in text, text


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_an_atom_above_the_cutoff_but_narrower_than_a_voxel_warns(backend):
    atoms, grid = _one_atom([0.0, 0.0, 0.0])
    atoms = atoms.to(dtype=torch.float32 if backend == "cpu" else torch.float64)
    with pytest.warns(UserWarning, match=r"cutoff radius 0.1\d* Å is below the grid spacing 0.5 Å") as record:
        rho = kernels.splat_density(atoms, grid, cutoff=1.5, backend=backend)  # peak 1.6: radius ~0.11 Å
    assert "only the 1 grid point" in str(record[0].message) and int((rho != 0).sum()) == 1


def test_a_faint_atom_of_low_occupancy_is_splatted_whole_and_does_not_warn():
    # the radius comes from B and the cutoff, not the occupancy: the atom keeps its whole sphere
    atoms, grid = _one_atom([0.0, 0.0, 0.0], occ=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rho = kernels.splat_density(atoms, grid, cutoff=1e-3, backend="cpu")
    assert int((rho != 0).sum()) > 100


def test_the_ensemble_warning_names_the_frame():
    atoms, grid = _one_atom([0.0, 0.0, 0.0])
    xyz = torch.tensor([[[1.0, 1.0, 1.0]], [[2.0, 2.0, 2.0]]], dtype=torch.float64)
    b_iso = torch.tensor([[20.0], [200.0]], dtype=torch.float64)  # frame 1's atom is wide and faint
    with pytest.warns(UserWarning, match=r"frame 1: atom .*C1 \(index 0\).*only the 1 grid point"):
        kernels.splat_ensemble(atoms, xyz, grid, b_iso=b_iso, cutoff=0.1, backend="reference")


# --------------------------------------------------------------------------- memory of a sum

MEMORY_SCRIPT = """
import resource, sys, torch, kernels
F, N = int(sys.argv[1]), 1000
cell = kernels.Cell.from_parameters(60.0, 60.0, 60.0, 90.0, 90.0, 90.0)
xyz0 = torch.rand((N, 3), generator=torch.Generator().manual_seed(0)) * 60
atoms = kernels.AtomSet.from_elements(["C"] * N, xyz0, 20.0, 1.0, dtype=torch.float32)
grid = kernels.GridSpec.for_spacing(cell, 1.0)
xyz = xyz0.expand(F, N, 3).contiguous()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rho = kernels.splat_ensemble(atoms, xyz, grid)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) / 1024, float(rho.sum()))
"""


def _child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_a_sum_over_a_million_atom_frames_stays_within_its_chunk(tmp_path):
    # before chunking every atom-frame held ~500 B at once: 480 MB here
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, "1000"], env=_child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown_mb, total = map(float, proc.stdout.split())
    assert grown_mb < 250, f"splat_ensemble of 10^6 atom-frames grew the peak RSS by {grown_mb:.0f} MB"
    assert total > 0


REFUSAL_SCRIPT = """
import resource, torch, kernels
from kernels.crystal import GridError
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a call that allocates F·N fails here, not the machine
cell = kernels.Cell.from_parameters(11.0, 12.0, 10.0, 90.0, 90.0, 90.0)
atoms = kernels.AtomSet.from_elements(["C", "N", "O", "S"], torch.rand((4, 3)) * 9, 20.0, dtype=torch.float32)
grid = kernels.GridSpec.for_spacing(cell, 1.0)
xyz = atoms.xyz.detach().expand(50_000_000, 4, 3).requires_grad_()  # a view: nothing of F·N is allocated
try:
    kernels.splat_ensemble(atoms, xyz, grid)
except GridError as exc:
    print(exc)
"""


def test_a_sum_whose_gradient_state_cannot_fit_is_refused_before_allocation():
    proc = subprocess.run(
        [sys.executable, "-c", REFUSAL_SCRIPT], env=_child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reduce='sum' of 50000000 frames × 4 atoms" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "GiB" in proc.stdout and "per atom-frame kept for the backward" in proc.stdout, proc.stdout


def _mixed_atoms(radiation: str, anisotropic: bool):
    gen = torch.Generator().manual_seed(7)
    n = 60
    elements = (["C", "N", "O", "S", "H"] * 12)[:n]
    xyz = torch.rand((n, 3), generator=gen, dtype=torch.float64) * 10
    b = 2.0 * torch.exp(torch.rand(n, generator=gen, dtype=torch.float64) * 5.5)  # 2 to 490 Å²
    atoms = AtomSet.from_elements(elements, xyz, b, radiation=radiation)
    if anisotropic:
        axes = torch.linalg.qr(torch.randn((n, 3, 3), generator=gen, dtype=torch.float64))[0]
        lam = b[:, None] / (8 * np.pi**2) * (0.3 + 1.4 * torch.rand((n, 3), generator=gen, dtype=torch.float64))
        full = axes @ torch.diag_embed(lam) @ axes.transpose(1, 2)
        u = torch.stack([full[:, 0, 0], full[:, 1, 1], full[:, 2, 2], full[:, 0, 1], full[:, 0, 2], full[:, 1, 2]], 1)
        atoms = atoms.replace(u_aniso=u, aniso=torch.arange(n) % 3 != 0)  # every third atom isotropic
    return atoms


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
@pytest.mark.parametrize(("anisotropic", "rule"), [(False, "gemmi"), (True, "gemmi"), (True, "eigen")])
def test_the_warning_counts_exactly_the_atoms_whose_radius_is_below_the_spacing(radiation, anisotropic, rule):
    atoms = _mixed_atoms(radiation, anisotropic)
    grid = GridSpec.for_spacing(Cell.from_parameters(10.0, 10.0, 10.0, 90.0, 90.0, 90.0), 0.4)
    radii = kernels.density.atom_cutoff_radii(atoms, 0.02, rule)
    small = torch.nonzero(radii < max(grid.spacing)).flatten().tolist()
    assert 0 < len(small) < len(atoms)  # the case is one that tells
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        kernels.splat_density(atoms, grid, cutoff=0.02, radius_rule=rule, backend="reference")
    texts = [str(w.message) for w in record if "below the grid spacing" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in record]
    more = f" and {len(small) - 1} more atoms" if len(small) > 1 else ""
    assert f"(index {small[0]}){more}:" in texts[0], texts[0]


def test_a_sum_in_chunks_is_the_sum_in_one_call_with_its_gradients(monkeypatch):
    from kernels.density import _ensemble_parts

    atoms, grid, xyz = _system(frames=7)
    weights = torch.linspace(0.5, 1.5, 7)

    def run():
        x = xyz.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        rho = kernels.splat_ensemble(atoms, x, grid, weights=w)
        (rho * torch.linspace(-1, 1, rho.numel()).reshape(rho.shape)).sum().backward()
        return rho.detach(), x.grad, w.grad

    whole = run()
    monkeypatch.setattr(_ensemble_parts, "CHUNK_ATOM_FRAMES", 8)  # 2 frames of 4 atoms per backend call: 4 calls
    chunked = run()
    for got, want in zip(chunked, whole):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    b_iso = atoms.b_iso.expand(7, 4).clone()
    b_iso[5, 2] = 400.0  # frame 5 (the third chunk) holds the one wide, faint atom
    with pytest.warns(UserWarning, match=r"frame 5: atom .*O3 \(index 2\): .*below the grid spacing"):
        kernels.splat_ensemble(atoms, xyz, grid, b_iso=b_iso, cutoff=0.05)
