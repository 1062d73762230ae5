"""Anisotropic ADPs and radiation types: reading, the float64 reference against gemmi, radius rules, blur.

The fast backends are checked against the reference in their own files; here the reference itself
is held to gemmi's ``DensityCalculatorX/E/N`` keeping ANISOU, on real entries (1PFE hexagonal,
3O5R with its non-positive-definite atom), a large synthetic anisotropic 3WIP (monoclinic C 2) and
a small monoclinic model with hydrogens for the neutron maps.
"""

from __future__ import annotations

import math
import warnings

import gemmi
import numpy as np
import pytest
import torch

import kernels
from kernels.adp import U_TO_B, effective_u, u_matrix
from kernels.crystal import AtomSet, ModelError, form_factor_coefficients
from kernels.density.radius import atom_cutoff_radii, cutoff_radius
from kernels.testing import gemmi_density, synthetic_anisou
from tests.helpers import DATA

PFE = kernels.example_structure("1pfe")
O5R = DATA / "3o5r.cif.gz"
WIP = DATA / "3wip.cif.gz"
BAD_ATOM = ("A", 48, "CB", "A")  # 3O5R's atom whose ANISOU is not positive definite


def _agree_with_gemmi(ours: np.ndarray, theirs: np.ndarray) -> None:
    """The reference against gemmi: atol 1e-4 + rtol 1e-5 per voxel (gemmi's fast exp), ≤ 1e-5 relative L2."""
    diff = np.abs(ours - theirs)
    worst = diff - (1e-4 + 1e-5 * np.abs(theirs))
    assert worst.max() <= 0, f"{int((worst > 0).sum())} voxels off, worst {diff.max():.3g}"
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= 1e-5


def _zero_anisou(st: gemmi.Structure, chain: str, seq: int, name: str, altloc: str) -> None:
    for ch in st[0]:
        for res in ch:
            for atom in res:
                if (ch.name, res.seqid.num, atom.name, atom.altloc) == (chain, seq, name, altloc):
                    atom.aniso = gemmi.SMat33f(0, 0, 0, 0, 0, 0)


def _monoclinic_with_hydrogens(path) -> None:
    """A small P 1 21 1 model (β = 104°) with C, N, O, H, D atoms, some anisotropic and strongly tilted."""
    st = gemmi.Structure()
    st.cell = gemmi.UnitCell(14.0, 11.0, 12.5, 90, 104.0, 90)
    st.spacegroup_hm = "P 1 21 1"
    model = gemmi.Model("1")
    chain = gemmi.Chain("A")
    rng = np.random.default_rng(3)
    for i, el in enumerate(["C", "N", "O", "H", "D", "C", "H", "S"]):
        res = gemmi.Residue()
        res.name = "UNK"
        res.seqid = gemmi.SeqId(i + 1, " ")
        atom = gemmi.Atom()
        atom.name = f"{el}{i}"
        atom.element = gemmi.Element(el)
        atom.pos = gemmi.Position(*(rng.uniform(0.5, 10.0, 3)))
        atom.occ = 1.0 if i != 5 else 0.6
        atom.b_iso = float(rng.uniform(8, 30))
        if i % 2 == 0:  # every other atom anisotropic: eigenvalue ratio 12, tilted off the axes
            lam = np.array([1.0, 3.0, 12.0]) * 3 * atom.b_iso / U_TO_B / 16.0
            q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
            u = np.round(q @ np.diag(lam) @ q.T, 4)
            atom.aniso = gemmi.SMat33f(u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2])
        res.add_atom(atom)
        chain.add_residue(res)
    model.add_chain(chain)
    st.add_model(model)
    st.setup_entities()
    st.make_mmcif_document().write_file(str(path))


# --------------------------------------------------------------------------- reading


def test_read_model_keeps_anisou_and_iso_drops_it():
    model = kernels.read_model(PFE)
    atoms = model.atoms
    assert atoms.u_aniso.shape == (len(atoms), 6) and atoms.aniso.dtype == torch.bool and bool(atoms.aniso.all())
    st = gemmi.read_structure(str(PFE))
    first = st[0][0][0][0].aniso
    np.testing.assert_allclose(
        atoms.u_aniso[0].numpy(), [first.u11, first.u22, first.u33, first.u12, first.u13, first.u23], rtol=1e-6
    )
    iso = kernels.read_model(PFE, adp="iso").atoms
    assert iso.u_aniso is None and iso.aniso is None
    assert torch.equal(iso.b_iso, atoms.b_iso)
    assert kernels.read_model(DATA / "5h73.cif.gz").atoms.u_aniso is None  # no ANISOU: isotropic set


def test_select_to_replace_and_equality_carry_the_adps():
    atoms = kernels.read_model(PFE).atoms
    part = atoms.select([3, 1])
    assert torch.equal(part.u_aniso, atoms.u_aniso[[3, 1]]) and part.radiation == "xray"
    assert atoms.to(dtype=torch.float32).u_aniso.dtype == torch.float32
    assert atoms.replace(u_aniso=None, aniso=None) != atoms
    assert atoms.select(range(len(atoms))) == atoms


def test_a_non_positive_definite_anisou_is_refused_naming_the_atom_and_its_eigenvalues():
    with pytest.raises(ModelError, match=r"A/MET 48/CB altloc A \(eigenvalues -0\.01708, 0\.035, 0\.1161"):
        kernels.read_model(O5R)
    with pytest.warns(UserWarning, match="MET 48/CB.*splatted at their isotropic B"):
        model = kernels.read_model(O5R, on_bad_adp="iso")
    atoms = model.atoms
    bad = [i for i, lab in enumerate(atoms.labels) if (lab.chain, lab.seq_num, lab.atom_name, lab.altloc) == BAD_ATOM]
    assert len(bad) == 1 and not bool(atoms.aniso[bad[0]]) and int(atoms.aniso.sum()) == len(atoms) - 1
    assert any("not positive definite" in note for note in model.notes)
    # atoms built by hand are refused by check() and by the CPU kernels, naming the atom
    u = atoms.u_aniso.clone()
    u[bad[0]] = torch.tensor([0.05, 0.05, 0.05, 0.2, 0.0, 0.0], dtype=u.dtype)
    flags = atoms.aniso.clone()
    flags[bad[0]] = True
    by_hand = atoms.replace(u_aniso=u, aniso=flags)
    with pytest.raises(ValueError, match=r"MET 48/CB.*not positive definite \(eigenvalues -0\.15.*adp='iso'"):
        by_hand.check()
    grid = kernels.GridSpec.for_spacing(model.cell, 2.0)
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match=r"MET 48/CB.*not positive definite \(eigenvalues -0\.15"):
            kernels.splat_density(by_hand, grid, backend=backend)


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
def test_coefficients_come_from_gemmis_tables(radiation):
    a, b = form_factor_coefficients(["C", "H", "Fe"], radiation)
    for row, symbol in enumerate(["C", "H", "Fe"]):
        el = gemmi.Element(symbol)
        if radiation == "xray":
            want_a, want_b = [*el.it92.a, el.it92.c], [*el.it92.b, 0.0]
        elif radiation == "electron":
            want_a, want_b = list(el.c4322.a), list(el.c4322.b)
        else:
            want_a, want_b = [el.neutron92.get_coefs()[0], 0, 0, 0, 0], [0.0] * 5
        np.testing.assert_allclose(a[row].numpy(), want_a, rtol=1e-6)
        np.testing.assert_allclose(b[row].numpy(), want_b, rtol=1e-6)
    assert radiation != "neutron" or float(a[1, 0]) < 0  # hydrogen's neutron length is negative


@pytest.mark.parametrize(("radiation", "element"), [("electron", "Fm"), ("neutron", "Po")])
def test_an_element_the_table_lacks_is_an_error_naming_the_atom(radiation, element):
    with pytest.raises(ValueError, match=rf"atom .* has element '{element}'.*no .*{radiation}|{element}.*in gemmi"):
        AtomSet.from_elements(["C", element], [[0, 0, 0], [1, 1, 1]], 20.0, radiation=radiation)
    with pytest.raises(ValueError, match="radiation must be one of"):
        form_factor_coefficients(["C"], "proton")


def test_read_model_refuses_unknown_option_values():
    with pytest.raises(ModelError, match="adp must be one of"):
        kernels.read_model(PFE, adp="aniso")
    with pytest.raises(ModelError, match="radiation must be one of"):
        kernels.read_model(PFE, radiation="x-ray")


# --------------------------------------------------------------------------- reference vs gemmi


def test_reference_matches_gemmi_anisotropic_on_1pfe_hexagonal():
    model = kernels.read_model(PFE)
    grid = kernels.GridSpec.for_spacing(model.cell, 2 / 3, model.spacegroup)
    ours = kernels.splat_density(model.atoms, grid, backend="reference").numpy()
    _agree_with_gemmi(ours, gemmi_density(PFE, 2 / 3))
    iso = kernels.splat_density(model.atoms.replace(u_aniso=None, aniso=None), grid, backend="reference").numpy()
    assert np.linalg.norm(iso - ours) / np.linalg.norm(ours) > 0.1  # the ADPs matter: ~16 % on 1PFE


def test_reference_matches_gemmi_on_3o5r_with_the_bad_atom_isotropic_on_both_sides():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = kernels.read_model(O5R, on_bad_adp="iso")
    grid = kernels.GridSpec.for_spacing(model.cell, 2 / 3, model.spacegroup)
    ours = kernels.splat_density(model.atoms, grid, backend="reference").numpy()
    st = gemmi.read_structure(str(O5R))
    _zero_anisou(st, *BAD_ATOM)
    _agree_with_gemmi(ours, gemmi_density(st, 2 / 3))
    assert np.isfinite(ours).all()
    raw = gemmi_density(O5R, 2 / 3)  # gemmi keeping the bad U: NaN around that atom, never in ours
    assert not np.isfinite(raw).all()


def test_reference_matches_gemmi_on_a_large_synthetic_anisotropic_3wip(tmp_path):
    path = tmp_path / "3wip_aniso.cif"
    synthetic_anisou(WIP, max_ratio=10, seed=0).make_mmcif_document().write_file(str(path))
    model = kernels.read_model(path)
    assert bool(model.atoms.aniso.all()) and len(model.atoms) > 17000
    lam = torch.linalg.eigvalsh(u_matrix(model.atoms.u_aniso))
    assert float((lam[:, 2] / lam[:, 0]).max()) > 8
    grid = kernels.GridSpec.for_spacing(model.cell, 1.0, model.spacegroup)
    ours = kernels.splat_density(model.atoms, grid, backend="reference").numpy()
    _agree_with_gemmi(ours, gemmi_density(path, 1.0))


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
@pytest.mark.parametrize("blur", [0.0, 12.0])
def test_reference_matches_gemmi_for_every_radiation_and_blur_on_a_monoclinic_cell(tmp_path, radiation, blur):
    path = tmp_path / "mono.cif"
    _monoclinic_with_hydrogens(path)
    model = kernels.read_model(path, radiation=radiation)
    assert model.atoms.radiation == radiation and 0 < int(model.atoms.aniso.sum()) < len(model.atoms)
    grid = kernels.GridSpec.for_spacing(model.cell, 0.5, model.spacegroup)
    ours = kernels.splat_density(model.atoms, grid, backend="reference", blur=blur).numpy()
    theirs = gemmi_density(path, 0.5, radiation=radiation, blur=blur)
    _agree_with_gemmi(ours, theirs)
    if radiation == "neutron":
        assert ours.min() < -1e-3  # hydrogen's negative length makes negative scattering-length density


def test_symmetrize_of_an_anisotropic_map_matches_gemmis_symmetry_expanded_map():
    model = kernels.read_model(PFE)
    grid = kernels.GridSpec.for_spacing(model.cell, 1.0, model.spacegroup)
    rho = kernels.splat_density(model.atoms, grid, backend="reference")
    ours = kernels.symmetrize(rho, grid, model.spacegroup).numpy()
    _agree_with_gemmi(ours, gemmi_density(PFE, 1.0, symmetry=True))


# --------------------------------------------------------------------------- radius rules


def _tilted_atoms(ratio: float = 10.0) -> AtomSet:
    """Three carbons: isotropic, anisotropic along an axis, and anisotropic tilted 45° (ratio ``ratio``)."""
    lam = np.array([1.0, 1.0, ratio]) * 0.3 / ratio
    rot = np.array([[1, 0, 0], [0, 1, -1], [0, 1, 1]]) / np.array([1, math.sqrt(2), math.sqrt(2)])[:, None]
    tilted = rot @ np.diag(lam) @ rot.T
    u = [
        [math.nan] * 6,
        [lam[0], lam[1], lam[2], 0, 0, 0],
        [tilted[0, 0], tilted[1, 1], tilted[2, 2], tilted[0, 1], tilted[0, 2], tilted[1, 2]],
    ]
    return AtomSet.from_elements(["C"] * 3, [[5, 5, 5], [15, 5, 5], [5, 15, 15]], 20.0, u_aniso=u)


def _density_along_major_axis(atoms: AtomSet, i: int, r: float) -> float:
    one = atoms.select([i])
    u = effective_u(one.u_aniso, one.aniso, one.b_iso)[0]
    m = u_matrix(u)[None] + (one.b[0] / U_TO_B)[:, None, None] * torch.eye(3, dtype=u.dtype)
    lam, vec = torch.linalg.eigh(u_matrix(u))
    x = r * vec[:, 2]
    q = torch.einsum("i,kij,j->k", x, torch.linalg.inv(m), x)
    return float((one.a[0] * (2 * math.pi) ** -1.5 / torch.linalg.det(m).sqrt() * torch.exp(-0.5 * q)).sum())


def test_radius_rules_gemmi_follows_the_largest_diagonal_and_eigen_is_exact():
    atoms = _tilted_atoms(10.0)
    cutoff = 1e-5
    gemmi_rule = atom_cutoff_radii(atoms, cutoff, "gemmi")
    eigen = atom_cutoff_radii(atoms, cutoff, "eigen")
    u = effective_u(atoms.u_aniso, atoms.aniso, atoms.b_iso)
    b_max = U_TO_B * u[:, :3].max(dim=1).values
    np.testing.assert_allclose(gemmi_rule, cutoff_radius(b_max, atoms.a, atoms.b, cutoff))
    assert float(eigen[0]) == float(gemmi_rule[0])  # isotropic atoms: one rule
    assert float(eigen[2]) > float(gemmi_rule[2]) + 0.3  # the tilted atom: the diagonal underestimates
    for i in range(3):
        assert _density_along_major_axis(atoms, i, float(eigen[i])) <= cutoff * 1.0001
        assert _density_along_major_axis(atoms, i, float(eigen[i]) - 0.2) > cutoff
    # gemmi's rule cuts the tilted atom where its density along the major axis is still well above the cutoff
    assert _density_along_major_axis(atoms, 2, float(gemmi_rule[2])) > 2 * cutoff


def test_eigen_rule_keeps_every_voxel_above_the_cutoff():
    atoms = _tilted_atoms(10.0)
    cell = kernels.Cell.from_parameters(20.0, 20.0, 20.0)
    grid = kernels.GridSpec.for_spacing(cell, 0.4)
    wide = kernels.splat_density(atoms, grid, backend="reference", radius=12.0)
    for rule in ("gemmi", "eigen"):
        cut = kernels.splat_density(atoms, grid, backend="reference", radius_rule=rule)
        lost = float((wide - cut).max())
        if rule == "eigen":
            assert lost <= 1e-5 * 1.0001
        else:
            assert lost > 2e-5  # the documented loss of gemmi's rule on a tilted atom


def test_neutron_radius_is_gemmis_closed_form_with_the_absolute_length():
    atoms = AtomSet.from_elements(["H", "C"], [[0, 0, 0], [3, 3, 3]], [15.0, 25.0], radiation="neutron")
    r = atom_cutoff_radii(atoms, 1e-5)
    for i in range(2):
        b = float(atoms.b_iso[i])
        amp = abs(float(atoms.a[i, 0])) * (4 * math.pi / b) ** 1.5
        assert float(r[i]) == pytest.approx(math.sqrt(math.log(1e-5 / amp) / (-4 * math.pi**2 / b)), rel=1e-12)


# --------------------------------------------------------------------------- gradients, blur, errors


def test_reference_gradients_of_anisotropic_atoms_pass_gradcheck():
    atoms = _tilted_atoms(10.0)
    cell = kernels.Cell.from_parameters(20.0, 21.0, 19.0, 90, 100, 90)
    grid = kernels.GridSpec.for_spacing(cell, 1.2)
    upstream = torch.rand(grid.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss(xyz, u, b, occ):
        moved = AtomSet(xyz, b, occ, atoms.a, atoms.b, atoms.elements, atoms.labels, u, atoms.aniso, _validate=False)
        return (kernels.splat_density(moved, grid, backend="reference", radius=3.0) * upstream).sum()

    inputs = [t.clone().requires_grad_() for t in (atoms.xyz, atoms.u_aniso, atoms.b_iso, atoms.occ)]
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)
    loss(*inputs).backward()
    assert float(inputs[1].grad[0].abs().sum()) == 0.0  # the isotropic atom's U row is unused
    assert float(inputs[2].grad[1:].abs().sum()) == 0.0  # anisotropic atoms' B is informational


def test_blur_adds_b_to_isotropic_atoms_and_b_over_8pi2_to_anisotropic_u():
    atoms = _tilted_atoms(5.0)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(20.0, 20.0, 20.0), 0.8)
    blurred = kernels.splat_density(atoms, grid, backend="reference", blur=7.5)
    diag = torch.tensor([1.0, 1, 1, 0, 0, 0], dtype=torch.float64)
    by_hand = atoms.replace(b_iso=atoms.b_iso + 7.5, u_aniso=atoms.u_aniso + 7.5 / U_TO_B * diag)
    torch.testing.assert_close(blurred, kernels.splat_density(by_hand, grid, backend="reference"), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"blur=-30 Å² leaves atom .* B = -10"):
        kernels.splat_density(atoms, grid, backend="reference", blur=-30.0)
    with pytest.raises(ValueError, match="blur must be a finite"):
        kernels.splat_density(atoms, grid, backend="reference", blur=math.nan)
    with pytest.raises(ValueError, match="radius_rule must be one of"):
        kernels.splat_density(atoms, grid, backend="reference", radius_rule="largest")


def test_a_non_positive_definite_u_reaching_the_reference_is_an_error_not_nan():
    atoms = _tilted_atoms(5.0)
    u = atoms.u_aniso.clone()
    u[2] = torch.tensor([0.05, 0.05, 0.05, 0.2, 0.0, 0.0], dtype=u.dtype)
    bad = atoms.replace(u_aniso=u, _validate=False)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(20.0, 20.0, 20.0), 1.0)
    with pytest.raises(ValueError, match=r"C3 \(index 2\) has an anisotropic U that is not positive definite"):
        kernels.splat_density(bad, grid, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(
    "row", [[0.05, 0.05, 0.0, 0.0, 0.0, 0.0], [0.05, 0.05, 0.05, 0.2, 0.0, 0.0]], ids=["singular", "indefinite"]
)
def test_a_u_without_a_peak_is_one_clear_error_and_no_numpy_warning(backend, dtype, row):
    """The peak-density estimate behind the cutoff warning meets the bad U first: it stays quiet."""
    atoms = _tilted_atoms(5.0)
    u = atoms.u_aniso.clone()
    u[2] = torch.tensor(row, dtype=u.dtype)
    bad = atoms.replace(u_aniso=u, _validate=False).to("cpu", dtype)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(20.0, 20.0, 20.0), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(ValueError, match=r"C3 \(index 2\) has an anisotropic U that is not positive definite"):
            kernels.splat_density(bad, grid, backend=backend)


def test_a_registered_backend_without_anisotropic_capability_is_not_handed_anisotropic_atoms():
    def isotropic_only(atoms, grid, *, radius=None, cutoff=1e-5):
        return kernels.splat_density(atoms, grid, backend="reference", radius=radius, cutoff=cutoff)

    kernels.register_backend("density", "iso_only_test", isotropic_only, devices=("cpu",))
    try:
        atoms = _tilted_atoms()
        grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(20.0, 20.0, 20.0), 1.0)
        with pytest.raises(kernels.BackendError, match="declares no anisotropic atoms"):
            kernels.splat_density(atoms, grid, backend="iso_only_test")
        iso = atoms.replace(u_aniso=None, aniso=None)
        assert kernels.splat_density(iso, grid, backend="iso_only_test").shape == grid.shape
    finally:
        kernels.unregister_backend("density", "iso_only_test")


def test_ensemble_takes_per_frame_u():
    atoms = _tilted_atoms(6.0)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(20.0, 20.0, 20.0), 1.0)
    gen = torch.Generator().manual_seed(0)
    xyz = atoms.xyz[None] + 0.2 * torch.randn((3, len(atoms), 3), generator=gen, dtype=torch.float64)
    scale = torch.tensor([0.8, 1.0, 1.3], dtype=torch.float64)[:, None, None]
    u = (atoms.u_aniso[None] * scale).requires_grad_()
    total = kernels.splat_ensemble(atoms, xyz, grid, u_aniso=u, backend="reference", blur=2.0)
    by_frame = sum(
        kernels.splat_density(atoms.replace(xyz=xyz[f], u_aniso=u[f].detach()), grid, backend="reference", blur=2.0)
        for f in range(3)
    )
    torch.testing.assert_close(total, by_frame)
    total.sum().backward()
    assert u.grad.shape == (3, 3, 6) and float(u.grad[:, 1:].abs().min()) > 0
    with pytest.raises(ValueError, match="u_aniso was given but the atoms are isotropic"):
        iso = atoms.replace(u_aniso=None, aniso=None)
        kernels.splat_ensemble(iso, xyz, grid, u_aniso=u.detach(), backend="reference")


def test_peak_density_of_anisotropic_atoms_is_the_density_at_the_centre():
    atoms = _tilted_atoms(10.0)
    peaks = kernels.peak_density(atoms)
    for i in range(len(atoms)):
        assert float(peaks[i]) == pytest.approx(_density_along_major_axis(atoms, i, 0.0), rel=1e-10)
