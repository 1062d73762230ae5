"""Bad input to the kernels: a clear error naming the value, or a defined result, never a crash,
a silent wrong map or a memory blow-up (issue 18, categories 1, 2, 5, 8 and the numeric arguments).

Every input is generated here. Crashes and memory peaks are measured in subprocesses, so a
segfault or a multi-GB allocation fails one test instead of the run.
"""

from __future__ import annotations

import gzip
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridSpec
from tests.helpers import assert_kernel_close, requires_cuda
from tests.signals import default_action

ROOT = Path(__file__).resolve().parents[2]
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _child_env() -> dict[str, str]:
    """This process's environment with this checkout first on the path (the rest kept: packages
    may be installed on PYTHONPATH), and Triton's interpreter where there is no GPU."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return env


def _run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (see :func:`_child_env`)."""
    env = _child_env()
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


def _cell() -> Cell:
    return Cell.from_parameters(20.0, 24.0, 28.0, 90.0, 100.0, 90.0)


def _atoms(dtype=torch.float64) -> AtomSet:
    xyz = torch.tensor([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0], [10.0, 3.0, 20.0]], dtype=dtype)
    return AtomSet.from_elements(
        ["C", "N", "O"], xyz, torch.tensor([20.0, 30.0, 15.0], dtype=dtype), torch.ones(3, dtype=dtype)
    )


def _with_xyz(atoms: AtomSet, xyz: torch.Tensor) -> AtomSet:
    """``atoms`` at other positions, unvalidated (how a bad value reaches a kernel after validation)."""
    return AtomSet(xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, _validate=False)


# --------------------------------------------------------------------------- numeric arguments


def _splat(**kw):
    grid = GridSpec(_cell(), (10, 12, 14))
    return kernels.splat_density(_atoms(), grid, backend="reference", **kw)


def _tricubic(**kw):
    grid = GridSpec(_cell(), (6, 6, 6))
    return kernels.tricubic_sample(torch.zeros(grid.shape), grid, torch.zeros(2, 3), backend="reference", **kw)


def _spacing(spacing):
    return GridSpec.for_spacing(_cell(), spacing)


def _sigma(sigma):
    return kernels.PlaneSet.from_lists([[0, 1, 2]], sigma, n_atoms=3)


BAD_NUMBERS = [
    True,
    False,
    1 + 2j,
    float("nan"),
    float("inf"),
    -float("inf"),
    0,
    -1.5,
    "2",
    None,
    [1.0],
    torch.tensor([1.0, 2.0]),
    torch.tensor(True),
    np.float64("nan"),
]
GOOD_NUMBERS = [
    2,
    2.5,
    np.float32(2.5),
    np.float64(2.5),
    np.int64(2),
    np.int32(3),
    torch.tensor(2.5),
    torch.tensor(2, dtype=torch.int64),
    np.array(2.5),
]
NUMERIC_ARGUMENTS = {
    "radius": lambda v: _splat(radius=v),
    "cutoff": lambda v: _splat(cutoff=v),
    "spacing": _spacing,
    "sigma": _sigma,
}


@pytest.mark.parametrize(
    "name, value",
    # radius=None is valid (each atom's radius from the cutoff); sigma may also be per-atom lists (checked elsewhere)
    [
        (n, v)
        for n in NUMERIC_ARGUMENTS
        for v in BAD_NUMBERS
        if not (n == "radius" and v is None) and not (n == "sigma" and np.ndim(v) > 0)
    ],
    ids=repr,
)
def test_bad_numeric_argument_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError) as info:
        NUMERIC_ARGUMENTS[name](value)
    msg = str(info.value)
    assert name in msg and "positive finite number" in msg, msg
    assert repr(value)[:20] in msg or str(value)[:20] in msg, msg


@pytest.mark.parametrize("name", list(NUMERIC_ARGUMENTS))
@pytest.mark.parametrize("value", GOOD_NUMBERS, ids=repr)
def test_numpy_and_torch_scalars_are_numbers(name, value):
    NUMERIC_ARGUMENTS[name](value)


@pytest.mark.parametrize("value", [np.float32(-1.5), torch.tensor(0.25), np.int16(4), float("nan")], ids=repr)
def test_fill_value_takes_any_real_scalar_and_nan(value):
    grid = GridSpec(_cell(), (6, 6, 6), origin=(1, 1, 1), sampling=(12, 12, 12))
    far = torch.tensor([[100.0, 100.0, 100.0]])
    with pytest.warns(kernels.tricubic.OutsideMapWarning):
        out = kernels.tricubic_sample(
            torch.zeros(grid.shape), grid, far, mode="bounded", fill_value=value, backend="reference"
        )
    expected = float(value)
    assert (np.isnan(expected) and torch.isnan(out).all()) or out.item() == expected


@pytest.mark.parametrize("value", [float("inf"), "0", True, 1j, None], ids=repr)
def test_bad_fill_value_is_a_value_error(value):
    with pytest.raises(ValueError, match="fill_value must be a finite number or nan"):
        _tricubic(fill_value=value)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_huge_radius_is_a_grid_error_saying_how_many_voxels(backend):
    atoms = _atoms().to(TRITON_DEVICE if backend == "triton" else "cpu")
    grid = GridSpec(_cell(), (10, 12, 14))
    with pytest.raises(kernels.GridError, match=r"radius=1e\+06 Å makes each atom cover .* voxels .* use radius ≤"):
        kernels.splat_density(atoms, grid, radius=1e6, backend=backend)
    # a sphere larger than the cell is still a valid radius
    kernels.splat_density(atoms, grid, radius=40.0, backend=backend)


# --------------------------------------------------------------------------- extreme coordinates

EXTREME_SCRIPT = """
import json, sys, warnings
import torch, kernels
from kernels.crystal import AtomSet, Cell, GridSpec
warnings.simplefilter("ignore")
# triton on the GPU where there is one, in its interpreter (CPU tensors) elsewhere
dev = {"reference": "cpu", "cpu": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
cell = Cell.from_parameters(23.0, 31.0, 37.0, 80.0, 95.0, 105.0)
result = {}
# tricubic: float32 map and points, so every backend sees the same values
grid = GridSpec(cell, (12, 15, 18))
rho = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0))
vals = [1e20, -1e20, 1e30, 3e38, -3e38, 1e6, 2.0 ** 45, 12.3]
pts = torch.tensor([[v, 0.5 * v, -0.25 * v] for v in vals] + [[v, 1.0, 2.0] for v in vals], dtype=torch.float32)
for mode in ("periodic", "bounded"):
    for be in ("reference", "cpu", "triton"):
        p = pts.clone().to(dev[be]).requires_grad_(True)
        out = kernels.tricubic_sample(rho.to(dev[be]), grid, p, mode=mode, backend=be)
        out.sum().backward()
        result[f"tricubic/{mode}/{be}"] = [out.double().cpu().tolist(), p.grad.double().cpu().tolist()]
# density: one atom of three moved far away
dgrid = GridSpec(cell, (12, 15, 18))
xyz = torch.tensor([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0], [10.0, 3.0, 20.0]])
for off in (1e20, 1e30, 3e38, -3e38):
    x = xyz.clone(); x[0] = torch.tensor([off, -0.5 * off, 0.25 * off])
    atoms = AtomSet.from_elements(["C", "N", "O"], x, torch.tensor([20.0, 30.0, 15.0]), torch.ones(3))
    for be in ("reference", "cpu", "triton"):
        rho_be = kernels.splat_density(atoms.to(dev[be]), dgrid, backend=be)
        result[f"density/{off}/{be}"] = rho_be.double().cpu().reshape(-1).tolist()
print(json.dumps(result))
"""


def test_extreme_finite_inputs_give_defined_values_identical_across_backends():
    proc = _run_python(EXTREME_SCRIPT, timeout=600)
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (a negative code is a signal: -11 a segfault)\n{proc.stderr[-3000:]}"
    )
    import json

    res = {k: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    for key in [k for k in res if k.endswith("/reference")]:
        stem = key[: -len("reference")]
        ref = res[key]
        if stem.startswith("tricubic"):
            ref_v, ref_g = (torch.tensor(x, dtype=torch.float64) for x in ref)
            assert torch.isfinite(ref_v).all() and torch.isfinite(ref_g).all(), key
            for be in ("cpu", "triton"):
                v, g = (torch.tensor(x, dtype=torch.float64) for x in res[stem + be])
                assert_kernel_close(v, ref_v)
                assert_kernel_close(g, ref_g)
        else:
            ref_map = torch.tensor(ref, dtype=torch.float64)
            assert torch.isfinite(ref_map).all() and ref_map.sum() > 0, key
            for be in ("cpu", "triton"):
                assert_kernel_close(torch.tensor(res[stem + be], dtype=torch.float64), ref_map)


def _map_and_grads(atoms: AtomSet, grid: GridSpec, backend: str, dev: str, w: torch.Tensor):
    """The map of ``atoms`` (moved to ``dev``) and the gradients of Σ w·ρ for xyz, b_iso, occ, as float64 on the CPU."""
    at = atoms.to(dev)
    leaves = [t.detach().clone().requires_grad_(True) for t in (at.xyz, at.b_iso, at.occ)]
    at = AtomSet(*leaves, at.a, at.b, at.elements, at.labels, _validate=False)
    rho = kernels.splat_density(at, grid, backend=backend)
    grads = torch.autograd.grad((rho * w.to(rho)).sum(), leaves)
    for leaf, g in zip(leaves, grads):
        assert g.dtype == leaf.dtype  # gradients come back in the inputs' dtype (float64 positions included)
    return rho.double().cpu(), [g.double().cpu() for g in grads]


# Every backend wraps positions into the cell in float64 when they are float64 (the triton kernels do it
# in the kernel, before rounding to float32); float32 positions are what they are.
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("reference", torch.float64),
        ("cpu", torch.float64),
        ("triton", torch.float64),
        ("reference", torch.float32),
        ("cpu", torch.float32),
        ("triton", torch.float32),
    ],
)
def test_lattice_translation_far_away_gives_the_same_map(backend, dtype):
    """Atoms moved by ~10^6 Å of whole lattice vectors: wrapped in float64 before any float32 cast; map and gradients."""
    cell = _cell()
    grid = GridSpec(cell, (20, 24, 28))
    atoms = _atoms(torch.float64)
    shift = torch.tensor(
        [[40000.0, -30000.0, 25000.0], [-50000.0, 0.0, 35714.0], [0.0, 41666.0, -1.0]], dtype=torch.float64
    )
    far = atoms.replace(xyz=atoms.xyz + shift @ cell.orth.T)
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype == torch.float32:  # float32 input: the float32 far positions are what they are; compare with them
            far32 = far.to(dtype=dtype)
            ref, ref_g = _map_and_grads(far32.to(dtype=torch.float64), grid, "reference", "cpu", w)
            got, got_g = _map_and_grads(far32, grid, backend, dev, w)
        else:
            ref, ref_g = _map_and_grads(atoms, grid, backend, dev, w)
            got, got_g = _map_and_grads(far, grid, backend, dev, w)
    assert_kernel_close(got, ref)
    for name, g, rg in zip(("xyz", "b_iso", "occ"), got_g, ref_g):
        try:
            assert_kernel_close(g, rg)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {name}: {exc}") from None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("field", ["xyz", "b_iso", "occ"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=repr)
def test_triton_nonfinite_atom_adds_nothing_and_gets_zero_gradients(field, bad, dtype):
    """No host check on the GPU path: the kernels drop an atom whose position, B or occupancy is not finite.

    The map and the other atoms' gradients are those of the atoms without it; its own gradients are 0.
    """
    grid = GridSpec(_cell(), (20, 24, 28))
    atoms = _atoms(dtype)
    values = {"xyz": atoms.xyz.clone(), "b_iso": atoms.b_iso.clone(), "occ": atoms.occ.clone()}
    if field == "xyz":
        values["xyz"][1, 2] = bad
    else:
        values[field][1] = bad
    broken = AtomSet(values["xyz"], values["b_iso"], values["occ"], atoms.a, atoms.b, _validate=False)
    w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, got_g = _map_and_grads(broken, grid, "triton", TRITON_DEVICE, w)
        want, want_g = _map_and_grads(atoms.select([0, 2]), grid, "triton", TRITON_DEVICE, w)
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in got_g)
    assert_kernel_close(got, want)
    for g, wg in zip(got_g, want_g):
        assert float(g[1].abs().max()) == 0.0
        assert_kernel_close(g[[0, 2]], wg)


def test_triton_far_float64_positions_match_the_reference():
    """float64 positions 10^20–3·10^38 Å from the origin: the kernel's float64 wrap lands where the reference's does."""
    grid = GridSpec(_cell(), (12, 15, 18))
    atoms = _atoms(torch.float64)
    for off in (1e20, 1e30, 3e38, -3e38):
        xyz = atoms.xyz.clone()
        xyz[0] = torch.tensor([off, -0.5 * off, 0.25 * off], dtype=torch.float64)
        far = _with_xyz(atoms, xyz)
        ref = kernels.splat_density(far, grid, backend="reference")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = kernels.splat_density(far.to(TRITON_DEVICE), grid, backend="triton")
        assert ref.sum() > 0
        assert_kernel_close(got.double().cpu(), ref)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=repr)
def test_nonfinite_position_is_a_value_error_naming_the_atom(backend, bad):
    atoms = _atoms()
    xyz = atoms.xyz.clone()
    xyz[1, 2] = bad
    xyz[2, 0] = bad
    with pytest.raises(ValueError, match=r"atom .* \(index 1\) has a non-finite position .* \(1 more atoms too\)"):
        kernels.splat_density(_with_xyz(atoms, xyz), GridSpec(_cell(), (10, 12, 14)), backend=backend)


def test_position_overflowing_the_fractional_coordinate_is_named():
    atoms = _atoms()
    xyz = atoms.xyz.clone()
    xyz[0] = torch.tensor([1.7e308, 1.7e308, 1.7e308], dtype=torch.float64)
    tiny = Cell.from_parameters(0.5, 0.5, 0.5, 90.0, 90.0, 90.0)
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError, match=r"\(index 0\) has a non-finite position .*overflows float64"):
            kernels.splat_density(_with_xyz(atoms, xyz), GridSpec(tiny, (4, 4, 4)), backend=backend)


def test_check_finite_names_a_nonfinite_atom_on_any_device():
    """The triton backend does not read positions back; check_finite gives its callers the cpu error."""
    atoms = _atoms(torch.float32).to(TRITON_DEVICE)
    xyz = atoms.xyz.clone()
    xyz[1, 0] = float("nan")
    bad = AtomSet(xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, _validate=False)
    with pytest.raises(ValueError, match=r"\(index 1\) has a non-finite position"):
        kernels.check_finite(bad)
    kernels.check_finite(atoms)


@requires_cuda
def test_triton_density_forward_and_backward_make_no_host_sync():
    """Argument checks and the launches read nothing back: no .item() or .cpu() per call."""
    atoms = _atoms(torch.float32).to("cuda")
    grid = GridSpec(_cell(), (20, 24, 28))
    bad = atoms.replace(xyz=atoms.xyz.clone().requires_grad_(True))
    kernels.splat_density(bad, grid, backend="triton")  # first call: compile, memory query
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = kernels.splat_density(bad, grid, backend="triton")
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(bad.xyz.grad).all()


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_tricubic_nonfinite_and_far_bounded_points_agree(backend):
    grid = GridSpec(_cell(), (8, 8, 8), origin=(2, 2, 2), sampling=(16, 16, 16))
    rho = torch.randn(grid.shape, generator=torch.Generator().manual_seed(1))
    pts = torch.tensor(
        [[float("nan"), 1.0, 1.0], [float("inf"), 0.0, 0.0], [1e30, 1.0, 1.0], [-3e38, 0.0, 0.0], [5.0, 5.0, 6.0]]
    )
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    with pytest.warns(kernels.tricubic.OutsideMapWarning, match="2 of 5 points"):
        out = kernels.tricubic_sample(
            rho.to(dev), grid, pts.to(dev), mode="bounded", fill_value=-7.0, backend=backend
        ).cpu()
    assert torch.isnan(out[:2]).all() and (out[2:4] == -7.0).all() and torch.isfinite(out[4])


# --------------------------------------------------------------------------- map files


def _write_ccp4(path: Path, shape=(10, 12, 14), mode=2, values=None) -> torch.Tensor:
    grid = GridSpec(_cell(), shape)
    rho = torch.randn(shape, generator=torch.Generator().manual_seed(2)) if values is None else values
    kernels.write_map(path, rho, grid)
    return rho


def _patch_header(src: Path, dst: Path, word: int, value: int) -> Path:
    data = bytearray(src.read_bytes())
    data[4 * word : 4 * word + 4] = np.array([value], "<i4").tobytes()
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(
    "word, value, match",
    [
        (0, 100000, r"header describes 100000×12×14 values of mode 2 .* but the file holds \d+ bytes"),
        (1, 13, r"header describes 10×13×14 values .* disagree with the data"),
        (3, 0, r"values of mode 0 \(1 byte each\).* the file holds"),  # MODE re-typed
        (3, 1, r"values of mode 1 \(2 bytes each\)"),
        (3, 4, r"data mode 4 \(header word MODE\) is not a real-valued map"),
        (3, 99, r"data mode 99"),
        (0, -5, r"claims -5×12×14 values .* each must be at least 1"),
        (2, 0, r"claims 10×12×0 values"),
        (23, -4, r"negative extended-header length -4 \(header word NSYMBT\)"),
        (23, 10**6, r"after 1001024 header bytes"),
        (16, 7, r"bad axis order words MAPC/MAPR/MAPS \[7, 2, 3\]"),
    ],
)
def test_read_map_checks_the_header_against_the_file(tmp_path, word, value, match):
    good = tmp_path / "good.ccp4"
    _write_ccp4(good)
    bad = _patch_header(good, tmp_path / "bad.ccp4", word, value)
    with pytest.raises(ValueError, match=match) as info:
        kernels.read_map(bad)
    assert str(bad) in str(info.value)
    gz = tmp_path / "bad.ccp4.gz"
    gz.write_bytes(gzip.compress(bad.read_bytes()))
    with pytest.raises(ValueError, match=match):
        kernels.read_map(gz)


@pytest.mark.parametrize("cut", [0, 100, 1023, 1024 + 80, 1024 + 80 + 4 * 10 * 12 * 14 - 1])
def test_read_map_truncated_file(tmp_path, cut):
    good = tmp_path / "good.ccp4"
    _write_ccp4(good)
    bad = tmp_path / "cut.ccp4"
    bad.write_bytes(good.read_bytes()[:cut])
    with pytest.raises(ValueError, match=rf"{bad}: .*(too short|the file holds {cut} bytes)"):
        kernels.read_map(bad)


def test_read_map_not_a_map_and_bad_cell(tmp_path):
    junk = tmp_path / "junk.map"
    junk.write_bytes(b"hello" * 400)
    with pytest.raises(ValueError, match=r"junk.map: not a CCP4/MRC map"):
        kernels.read_map(junk)
    good = tmp_path / "good.ccp4"
    _write_ccp4(good)
    data = bytearray(good.read_bytes())
    data[40:44] = np.array([0.0], "<f4").tobytes()  # cell length a = 0
    (tmp_path / "cell.ccp4").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"cell.ccp4: unusable unit cell"):
        kernels.read_map(tmp_path / "cell.ccp4")


@pytest.mark.parametrize("mode, dtype", [(0, "i1"), (1, "i2"), (6, "u2"), (12, "f2")])
def test_read_map_other_modes_are_read_as_float32(tmp_path, mode, dtype):
    """A consistent header of another mode is read (values converted), as gemmi reads it."""
    import gemmi

    shape = (5, 6, 7)
    values = np.arange(np.prod(shape)).reshape(shape) % 100
    good = tmp_path / "good.ccp4"
    _write_ccp4(good, shape)
    head = bytearray(good.read_bytes()[: 1024 + 80])
    head[12:16] = np.array([mode], "<i4").tobytes()
    path = tmp_path / f"mode{mode}.ccp4"
    path.write_bytes(bytes(head) + np.asfortranarray(values.astype(dtype)).tobytes(order="F"))
    rho, _ = kernels.read_map(path)
    assert rho.dtype == torch.float32 and torch.equal(rho, torch.from_numpy(values.astype(np.float32)))
    if mode != 12:
        assert np.array_equal(np.array(gemmi.read_ccp4_map(str(path)).grid), values)


def test_read_map_round_trip_plain_and_gz(tmp_path):
    path = tmp_path / "m.ccp4"
    rho = _write_ccp4(path)
    gz = tmp_path / "m.ccp4.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    for p in (path, gz):
        back, grid = kernels.read_map(p)
        assert torch.equal(back, rho) and grid.shape == rho.shape


PEAK_SCRIPT = """
import resource, sys, torch, kernels
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
path = sys.argv[1]
base = rss()
try:
    kernels.read_map(path)
    print("read", rss() - base)
except ValueError as exc:
    print("error", rss() - base, str(exc).replace(chr(10), " "))
"""


@pytest.mark.parametrize("suffix", [".ccp4", ".ccp4.gz"])
def test_read_map_lying_header_allocates_nothing(tmp_path, suffix):
    """A 46 KB file whose header claims 1000×1000×1700 float32 values (6.8 GB): refused before allocating."""
    good = tmp_path / "good.ccp4"
    _write_ccp4(good, (20, 24, 24))
    data = bytearray(good.read_bytes())
    data[0:12] = np.array([1000, 1000, 1700], "<i4").tobytes()
    bad = tmp_path / f"lie{suffix}"
    bad.write_bytes(gzip.compress(bytes(data)) if suffix.endswith(".gz") else bytes(data))
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    env = _child_env()
    proc = subprocess.run([sys.executable, str(script), str(bad)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kind, peak, *msg = proc.stdout.split(maxsplit=2)
    assert kind == "error" and "1000×1000×1700" in msg[0], proc.stdout
    assert int(peak) < 8 * 2**20 + 4 * len(data), (
        f"read_map of a {len(data)}-byte file raised its peak by {int(peak)} bytes"
    )


SYM_PEAK_SCRIPT = """
import resource, torch, kernels
from kernels.crystal import Cell, GridSpec
from kernels.symmetry import symmetrize_peak_bytes
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cell = Cell.from_parameters(60.0, 60.0, 60.0, 90.0, 90.0, 90.0)
grid = GridSpec.for_spacing(cell, 0.33, "P 21 21 21")
rho = torch.rand(grid.shape)
small = GridSpec(cell, (4, 4, 4))
kernels.symmetrize(torch.rand(small.shape), small, "P 21 21 21")
base = rss()
out = kernels.symmetrize(rho, grid, "P 21 21 21")
print(rss() - base, symmetrize_peak_bytes(grid, rho.dtype), rho.numel() * rho.element_size())
"""


def test_symmetrize_peak_within_its_stated_bound():
    proc = _run_python(SYM_PEAK_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak, stated, map_bytes = (int(v) for v in proc.stdout.split())
    # the stated peak: the output map + < 17 MB of chunk temporaries; 8 MB of slack for the allocator
    assert stated < map_bytes + 17 * 2**20
    assert peak <= stated + 8 * 2**20, (
        f"symmetrize raised the peak by {peak / map_bytes:.1f}x the map (stated {stated / map_bytes:.1f}x)"
    )


def test_symmetrize_refuses_what_does_not_fit(monkeypatch):
    import kernels.grid
    from kernels.symmetry import symmetrize_peak_bytes

    cell = Cell.from_parameters(30.0, 30.0, 30.0, 90.0, 90.0, 90.0)
    grid = GridSpec.for_spacing(cell, 1.0, "P 21 21 21")
    need = symmetrize_peak_bytes(grid, torch.float32)
    monkeypatch.setattr(kernels.grid, "_free_memory", lambda device: int(need / 0.8) - 1)
    with pytest.raises(kernels.GridError, match=r"needs .* MiB \(output and temporaries\)"):
        kernels.symmetrize(torch.zeros(grid.shape), grid, "P 21 21 21")
    monkeypatch.setattr(kernels.grid, "_free_memory", lambda device: int(need / 0.8) + 64)
    kernels.symmetrize(torch.zeros(grid.shape), grid, "P 21 21 21")


def test_reference_splat_checks_its_real_peak(monkeypatch):
    """The reference's temporaries (one chunk, and what autograd keeps) count, not only two maps."""
    import kernels.grid
    from kernels.density.reference import reference_peak_bytes

    grid = GridSpec(_cell(), (40, 48, 56))
    atoms = _atoms()
    two_maps = 2 * grid.n_voxels * 8
    # room for two maps and a little more: enough without a gradient, not with one at radius 8 Å
    monkeypatch.setattr(kernels.grid, "_free_memory", lambda device: int(2 * two_maps / 0.8))
    kernels.splat_density(atoms, grid, radius=3.0, backend="reference")
    with pytest.raises(kernels.GridError, match=r"iB of temporaries\) but only"):
        kernels.splat_density(atoms, grid, radius=8.0, backend="reference")
    # free memory between the need without a gradient and with one (what autograd keeps of every entry)
    m = torch.tensor(grid.sampling, dtype=torch.float64)
    centre = (atoms.xyz @ grid.cell.frac.T) * m
    reach = 3.0 * torch.linalg.norm(grid.cell.frac, dim=1) * m
    boxes = (torch.ceil(centre + reach) - torch.floor(centre - reach) + 1).prod(dim=1)
    entries, largest = int(boxes.sum()), int(boxes.max())
    without = reference_peak_bytes(grid.n_voxels, entries, largest, grad=False)
    with_grad = reference_peak_bytes(grid.n_voxels, entries, largest, grad=True)
    assert with_grad > without
    free = (without + with_grad) / 2 / 0.8
    monkeypatch.setattr(kernels.grid, "_free_memory", lambda device: int(free))
    kernels.splat_density(atoms, grid, radius=3.0, backend="reference")
    grad_atoms = atoms.replace(xyz=atoms.xyz.clone().requires_grad_(True))
    with pytest.raises(kernels.GridError, match="temporaries"):
        kernels.splat_density(grad_atoms, grid, radius=3.0, backend="reference")


REF_PEAK_SCRIPT = """
import resource, sys, warnings, torch, kernels
from kernels.crystal import GridSpec
from kernels.density.reference import reference_peak_bytes
warnings.simplefilter("ignore")
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
m = kernels.read_model(kernels.example_structure("1orc"))
grid = GridSpec.for_spacing(m.cell, float(sys.argv[1]))
grad = sys.argv[2] == "grad"
atoms = m.atoms.replace(xyz=m.atoms.xyz.clone().requires_grad_(True)) if grad else m.atoms
stated = []
real = kernels.crystal.GridSpec.require_memory
def spy(self, dtype, device, copies=1, extra_bytes=0):
    stated.append(self.n_voxels * 8 * copies + extra_bytes)
    return real(self, dtype, device, copies, extra_bytes)
kernels.crystal.GridSpec.require_memory = spy
small = GridSpec.for_spacing(m.cell, 3.0)
kernels.splat_density(m.atoms.select([0, 1]), small, backend="reference")
base = rss()
out = kernels.splat_density(atoms, grid, backend="reference")
if grad:
    out.sum().backward()
print(rss() - base, stated[-1])
"""


@pytest.mark.parametrize("spacing, grad", [(1.0, False), (0.4, False), (0.7, True)])
def test_reference_splat_peak_within_its_check(spacing, grad):
    """ru_maxrss of a real splat (1ORC) stays within what the reference's memory check asked for."""
    proc = _run_python(
        REF_PEAK_SCRIPT.replace("sys.argv[1]", repr(str(spacing))).replace("sys.argv[2]", repr("grad" if grad else ""))
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak, stated = (int(v) for v in proc.stdout.split())
    assert peak <= stated, (
        f"the reference splat peaked at {peak / 2**20:.0f} MiB but its check asked for {stated / 2**20:.0f} MiB"
    )


# --------------------------------------------------------------------------- writing maps


def test_write_map_unknown_spacegroup_is_named(tmp_path):
    grid = GridSpec(_cell(), (4, 4, 4))
    for sg in ("P 99", "not a group", ""):
        with pytest.raises(ValueError, match=f"unknown space group {sg!r}"):
            kernels.write_map(tmp_path / "m.ccp4", torch.zeros(grid.shape), grid, spacegroup=sg)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_write_map_respects_the_umask(tmp_path, umask):
    grid = GridSpec(_cell(), (4, 4, 4))
    old = os.umask(umask)
    try:
        path = kernels.write_map(tmp_path / "m.ccp4", torch.zeros(grid.shape), grid)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_write_map_keeps_the_mode_of_a_file_it_replaces(tmp_path):
    grid = GridSpec(_cell(), (4, 4, 4))
    path = tmp_path / "m.ccp4"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    kernels.write_map(path, torch.zeros(grid.shape), grid)
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_write_map_writes_through_a_symlink(tmp_path):
    grid = GridSpec(_cell(), (4, 5, 6))
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "map.ccp4"
    target.write_bytes(b"old")
    link = tmp_path / "link.ccp4"
    link.symlink_to(target)
    rho = torch.randn(grid.shape)
    kernels.write_map(link, rho, grid)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert torch.equal(kernels.read_map(target)[0], rho)
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["map.ccp4"]


def _special_outputs(folder: Path) -> dict[str, tuple[Path, str]]:
    """Paths an output must never replace, and what the refusal calls each."""
    os.mkfifo(folder / "fifo")
    (folder / "null-link").symlink_to(os.devnull)
    (folder / "fifo-link").symlink_to(folder / "fifo")
    (folder / "link-link").symlink_to(folder / "null-link")
    (folder / "dir").mkdir()
    (folder / "dir-link").symlink_to(folder / "dir")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock"))
    sock.close()  # the socket's file stays
    return {
        "fifo": (folder / "fifo", "a pipe (FIFO), not a regular file"),
        "null": (Path(os.devnull), "the null device, not a regular file"),
        "zero": (Path("/dev/zero"), "a character device, not a regular file"),
        "null-link": (folder / "null-link", f"a link to {os.devnull}, which is the null device"),
        "fifo-link": (folder / "fifo-link", "which is a pipe (FIFO), not a regular file"),
        "link-link": (folder / "link-link", "which is the null device"),  # a link to a link to /dev/null
        "sock": (folder / "sock", "a socket, not a regular file"),
        "dir": (folder / "dir", "a folder, not a file"),
        "dir-link": (folder / "dir-link", "which is a folder, not a file"),
        "long": (folder / ("m" * 256 + ".ccp4"), "bytes long, more than the 255 this file system takes"),
        "long-folder": (folder / ("d" * 300) / "m.ccp4", "a name in the path is 300 bytes long"),
    }


def _kinds(folder: Path) -> dict[str, int]:
    return {p.name: os.lstat(p).st_mode for p in folder.iterdir()}


def test_every_writer_refuses_what_is_not_a_regular_file_or_a_new_path(tmp_path):
    """write_map, the check's report page and the workbench's text exports share one rule: no device, pipe,
    socket, folder or link to one is replaced, and an over-long name is one line, before anything is written."""
    from kernels.checking import CheckReport
    from workbench.app import _write_text

    grid = GridSpec(_cell(), (4, 4, 4))
    cases = _special_outputs(tmp_path)
    before = _kinds(tmp_path)
    report = CheckReport("density", "mine", "cpu", [], [])
    writers = {
        "write_map": lambda p: kernels.write_map(p, torch.zeros(grid.shape), grid),
        "report page": report.save,
        "text export": lambda p: _write_text(p, "ATOM\n"),
    }
    for name, (path, why) in cases.items():
        for writer, write in writers.items():
            with pytest.raises(ValueError, match=re.escape(why)) as caught:
                write(path)
            assert str(path) in str(caught.value) and "\n" not in str(caught.value), (name, writer)
    assert _kinds(tmp_path) == before  # nothing replaced, no temporary file left
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    # a regular file (through a link too) and a new path are written; a dangling link makes its target
    (tmp_path / "old.ccp4").write_bytes(b"old")
    (tmp_path / "to-old").symlink_to(tmp_path / "old.ccp4")
    (tmp_path / "dangling").symlink_to(tmp_path / "made.ccp4")
    for path in ("old.ccp4", "to-old", "new.ccp4", "dangling", "n" * 200 + ".ccp4"):
        kernels.write_map(tmp_path / path, torch.ones(grid.shape), grid)
        assert torch.equal(kernels.read_map(tmp_path / path)[0], torch.ones(grid.shape)), path
    assert (tmp_path / "to-old").is_symlink() and (tmp_path / "made.ccp4").is_file()
    assert not list(tmp_path.glob(".*.tmp"))


def test_write_map_checks_the_header_words_before_writing(tmp_path):
    cell = _cell()
    for grid, what in [
        (GridSpec(cell, (4, 4, 4), origin=(2**31, 0, 0), sampling=(8, 8, 8)), "origin"),
        (GridSpec(cell, (4, 4, 4), origin=(0, -(2**31) - 5, 0), sampling=(8, 8, 8)), "origin"),
        (GridSpec(cell, (4, 4, 4), origin=(0, 0, 0), sampling=(8, 8, 2**32)), "sampling"),
    ]:
        assert what in kernels.mapio.map_header_problem(grid)
        with pytest.raises(kernels.GridError, match=f"map's {what} .* does not fit the CCP4 header's 32-bit words"):
            kernels.write_map(tmp_path / "m.ccp4", torch.zeros(grid.shape), grid)
    edge = GridSpec(cell, (4, 4, 4), origin=(2**31 - 1, -(2**31), 0), sampling=(8, 8, 8))
    assert kernels.mapio.map_header_problem(edge) is None
    assert not list(tmp_path.iterdir())


WRITER_SCRIPT = """
import sys, torch, kernels
from kernels.crystal import Cell, GridSpec
grid = GridSpec(Cell.from_parameters(100.0, 100.0, 100.0, 90.0, 90.0, 90.0), (400, 400, 400))
rho = torch.ones(grid.shape)
print("ready", flush=True)
for _ in range(1000):
    kernels.write_map(sys.argv[1], rho, grid)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_write_map_interrupted_leaves_no_temporary_file(tmp_path, sig):
    out = tmp_path / "big.ccp4"
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    env = _child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=default_action(sig),  # a background job's SIGINT is ignored
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):  # wait until a write is under way
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.01)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0  # it was interrupted, not finished
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in left if n.endswith(".tmp")], left
    if out.exists():  # a complete earlier write, never a half one
        back, grid = kernels.read_map(out)
        assert grid.shape == (400, 400, 400) and bool((back == 1).all())


# --------------------------------------------------------------------------- values that make no physical sense


@pytest.mark.parametrize("b", [1e-6, 0.1, 0.49])
def test_a_b_below_zero_point_motion_warns_naming_the_atom(b):
    xyz = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    with pytest.warns(UserWarning, match=rf"index 1\): B = {b:.3g} Å² is below 0.5 Å²"):
        AtomSet.from_elements(["C", "N"], xyz, torch.tensor([20.0, b]))


def test_physical_b_values_do_not_warn():
    xyz = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AtomSet.from_elements(["C", "N"], xyz, torch.tensor([0.5, 150.0]))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_cutoff_above_an_atoms_peak_density_warns(backend):
    cell = Cell.from_parameters(12.0, 13.0, 14.0, 90.0, 90.0, 90.0)
    grid = GridSpec.for_spacing(cell, 0.25)  # finer than the narrow atom's radius (0.68 Å) at this cutoff
    xyz = torch.tensor([[1.0, 2.0, 3.0], [6.0, 6.0, 6.0]])
    atoms = AtomSet.from_elements(["C", "O"], xyz, torch.tensor([20.0, 80.0]))
    peaks = kernels.density.peak_density(atoms)
    cutoff = float(peaks[1]) * 2  # above the wide atom's peak, below the other's
    pattern = r"atom .*O2 \(index 1\): peak density .* its cutoff radius .* is below the grid spacing"
    with pytest.warns(UserWarning, match=pattern):
        kernels.splat_density(atoms.to(dtype=torch.float32), grid, cutoff=cutoff, backend=backend)
    with warnings.catch_warnings():  # a fixed radius reads no cutoff; occupancy 0 is meant to add nothing
        warnings.simplefilter("error")
        kernels.splat_density(atoms.to(dtype=torch.float32), grid, radius=2.0, backend=backend)
        empty = atoms.replace(occ=torch.tensor([1.0, 0.0], dtype=atoms.occ.dtype))
        kernels.splat_density(empty.to(dtype=torch.float32), grid, cutoff=cutoff, backend=backend)


def test_peak_density_is_the_formula_at_the_centre():
    cell = Cell.from_parameters(20.0, 20.0, 20.0, 90.0, 90.0, 90.0)
    atoms = AtomSet.from_elements(["S"], torch.tensor([[10.0, 10.0, 10.0]]), torch.tensor([25.0]))
    grid = GridSpec(cell, (40, 40, 40))  # voxel (20, 20, 20) sits on the atom
    rho = kernels.splat_density(atoms, grid, backend="reference")
    assert float(kernels.density.peak_density(atoms)[0]) == pytest.approx(float(rho[20, 20, 20]), rel=1e-12)


# --------------------------------------------------------------------------- cells and atoms narrower than an atom


@pytest.mark.parametrize(
    "params, faces, width",
    [
        ((0.0002, 100.0, 100.0, 90, 90, 90), "b–c", "0.0002"),  # a 0.0002 Å box: ~10⁴ images on every voxel
        ((30.0, 0.3, 30.0, 90, 90, 90), "a–c", "0.3"),
        ((20.0, 20.0, 0.49, 90, 90, 90), "a–b", "0.49"),
        ((10.0, 10.0, 10.0, 179.0, 90, 90), "a–c", "0.175"),  # long edges, but the faces all but touch
        ((5.0, 5.0, 5.0, 60.0, 60.0, 119.9), "a–b", "0.275"),  # nearly flat: 5 Å edges, faces 0.27 Å apart
    ],
)
def test_a_cell_narrower_than_an_atom_is_refused_naming_its_faces(params, faces, width):
    with pytest.raises(ValueError, match=f"unit cell too narrow for an atom .*its {faces} faces are {width}"):
        Cell.from_parameters(*params)
    import gemmi

    with pytest.raises(ValueError, match="too narrow|flat|degenerate|impossible"):
        Cell.from_gemmi(gemmi.UnitCell(*params))
    assert Cell.from_parameters(0.5, 0.5, 0.5).parameters[0] == 0.5  # the floor itself is a cell


def test_a_box_padding_that_makes_a_box_narrower_than_an_atom_names_the_padding(tmp_path):
    one = tmp_path / "one.pdb"
    one.write_text("ATOM      1  C   ALA A   1       1.000   2.000   3.000  1.00 20.00           C\nEND\n")
    flat = tmp_path / "flat.pdb"  # two atoms in the plane z = 3: the box is thin along z only
    flat.write_text(
        "ATOM      1  C   ALA A   1       1.000   2.000   3.000  1.00 20.00           C\n"
        "ATOM      2  O   ALA A   1       4.000   6.000   3.000  1.00 20.00           O\nEND\n"
    )
    for path, padding, axis in ((one, 1e-3, "x"), (one, 0.2, "x"), (flat, 1e-4, "z"), (flat, 0.24, "z")):
        with pytest.raises(kernels.ModelError, match=rf"box_padding={padding:g} Å builds a box .* wide along {axis}"):
            kernels.read_model(path, box_padding=padding)
    assert kernels.read_model(flat, box_padding=0.25).cell.parameters[2] == pytest.approx(0.5)


def _tiny(u_or_b: str) -> AtomSet:
    """Two carbons on a 0.5 Å grid's cell; the second with B or U of 1e-8 Å², built from tensors (no read_model)."""
    atoms = AtomSet.from_elements(["C", "C"], [[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]], [20.0, 20.0], 1.0)
    if u_or_b == "b":
        return atoms.replace(b_iso=torch.tensor([20.0, 8 * math.pi**2 * 1e-8], dtype=atoms.dtype), _validate=False)
    u = torch.tensor([[0.25, 0.25, 0.25, 0, 0, 0], [1e-8, 1e-8, 1e-8, 0, 0, 0]], dtype=atoms.dtype)
    if u_or_b == "flat-u":  # positive definite, normal diagonal, but one axis of 1e-8 Å²: (1 1 0)/√2
        u[1] = torch.tensor([0.1 + 1e-8, 0.1 + 1e-8, 0.2, 0.1, 0.0, 0.0])
    return atoms.replace(u_aniso=u, aniso=torch.tensor([False, True]), _validate=False)


@pytest.mark.parametrize("kind", ["b", "u", "flat-u"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_atoms_with_a_tiny_b_or_u_built_from_tensors_warn_on_the_cpu(kind, backend):
    """read_model and AtomSet.check warn of B or U below zero-point motion; a host splat does too."""
    atoms = _tiny(kind)
    grid = GridSpec.for_spacing(Cell.from_parameters(10.0, 10.0, 10.0), 0.5)
    what = r"B = 7.9e-07 Å²" if kind == "b" else r"B along its U's narrowest axis, 8π² × [0-9.e-]+ Å² = [0-9.e-]+ Å²"
    dtype = torch.float64 if backend == "reference" else torch.float32
    with pytest.warns(
        UserWarning, match=rf"atom .* \(index 1\): {what}, is below 0.5 Å²|atom .* \(index 1\): {what} is below 0.5 Å²"
    ) as caught:
        kernels.splat_density(atoms.to("cpu", dtype), grid, backend=backend)
    assert any(w.filename == __file__ for w in caught)  # said at the caller's line
    with pytest.warns(UserWarning, match="is below 0.5 Å²"):
        atoms.check()
    # an ensemble's own per-frame B and U are read on the host too, and the message names the frame
    xyz = atoms.xyz.expand(3, 2, 3).clone()
    if kind == "b":
        b = atoms.b_iso.expand(3, 2).clone()
        b[1, 1], b[0, 1], b[2, 1] = 1e-6, 20.0, 20.0
        with pytest.warns(UserWarning, match=r"frame 1: atom .* \(index 1\): B = 1e-06 Å² is below 0.5 Å²"):
            kernels.splat_ensemble(
                atoms.replace(b_iso=b[0], _validate=False).to("cpu", dtype),
                xyz.to(dtype),
                grid,
                b_iso=b.to(dtype),
                backend=backend,
            )
    else:
        with pytest.warns(
            UserWarning,
            match=r"atom .* \(index 1\): U's narrowest axis, [0-9.e-]+ Å² \(B = 8π²·λ = [0-9.e-]+ Å²\), is below 0.5 Å²",
        ):
            kernels.splat_ensemble(atoms.to("cpu", dtype), xyz.to(dtype), grid, backend=backend)


def test_atoms_of_ordinary_b_and_u_give_no_warning():
    atoms = _tiny("u").replace(
        u_aniso=torch.tensor([[0.25, 0.25, 0.25, 0, 0, 0], [0.2, 0.3, 0.25, 0.05, -0.02, 0.01]], dtype=torch.float64)
    )
    grid = GridSpec.for_spacing(Cell.from_parameters(10.0, 10.0, 10.0), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.splat_density(atoms.to("cpu", torch.float32), grid, backend="cpu")
        kernels.splat_density(atoms, grid, backend="reference")
