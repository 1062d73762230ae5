"""Anisotropic ADPs and radiation types in the workbench: the controls, the B-offset and blur
rule on anisotropic atoms, the radiation switch and its units, and the model export.

The anisotropic maps here run the float64 reference backend on 1PFE (342 atoms, all with
ANISOU, hexagonal cell) at 1.5 Å, well under a second a map; the cases named ``auto`` run
the app's default backend and hold it to the float32 contract against the reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernels
import kernels.testing
from kernels.adp import U_TO_B, adp_eigenvalues, with_blur
from kernels.crystal import RADIATIONS, form_factor_coefficients
from tests.helpers import STRUCTURES, assert_close, model
from workbench import compute
from workbench.compute import WorkbenchError
from workbench.state import ADP_MODES, RANGES, WorkbenchState, density_units
from workbench.state import RADIATIONS as STATE_RADIATIONS

DIAG = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)


def _reference(atoms, grid, blur=0.0):
    return kernels.splat_density(with_blur(atoms, blur), grid, backend="reference")


def _rel_l2(out, ref) -> float:
    out, ref = torch.as_tensor(out).double(), torch.as_tensor(ref).double()
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))


def test_state_offers_the_kernels_radiations_and_both_adp_modes():
    assert STATE_RADIATIONS == RADIATIONS
    assert ADP_MODES == ("anisotropic", "isotropic")
    state = WorkbenchState()
    assert (state.adp, state.radiation, state.blur, state.ellipsoids) == ("anisotropic", "xray", 0.0, False)
    with pytest.raises(Exception, match="radiation"):
        state.radiation = "proton"
    lo, hi, _ = RANGES["blur"]
    with pytest.raises(Exception, match=rf"blur must lie in \[{lo:g}, {hi:g}\]"):
        state.blur = -1.0
    assert (density_units("xray"), density_units("electron"), density_units("neutron")) == ("e/Å³", "Å⁻²", "fm/Å³")


def test_adp_control_is_shown_only_for_a_model_with_anisou(make_wb):
    wb = make_wb("1orc")  # no ANISOU records
    assert not wb.state.has_anisou
    assert wb.controls.adp.disabled and wb.controls.adp.layout.display == "none"
    assert wb.result.atoms.u_aniso is None
    wb.set(structure="1pfe", backend="reference")
    assert wb.state.has_anisou and wb.status.level != "error", wb.status.message
    assert not wb.controls.adp.disabled and wb.controls.adp.layout.display != "none"
    assert "wb-adp" in wb.controls.adp._dom_classes and "wb-radiation" in wb.controls.radiation._dom_classes
    wb.set(structure="1orc")
    assert wb.controls.adp.disabled and wb.controls.adp.layout.display == "none"


def test_adp_control_switches_between_the_anisotropic_and_the_isotropic_map(make_wb):
    m = model("1pfe")
    wb = make_wb("1pfe", backend="reference")
    r = wb.result
    assert r.atoms.u_aniso is not None and bool(r.atoms.aniso.all())
    torch.testing.assert_close(r.rho, _reference(m.atoms, r.grid), rtol=0, atol=0)
    aniso = r.rho
    runs = wb.scheduler.n_runs
    wb.controls.adp.set_state({"index": ADP_MODES.index("isotropic")})  # the browser's path (a selection's index)
    assert wb.scheduler.n_runs == runs + 1 and wb.state.adp == "isotropic"
    r = wb.result
    assert r.atoms.u_aniso is None and r.atoms.aniso is None
    iso_atoms = m.atoms.replace(u_aniso=None, aniso=None)
    torch.testing.assert_close(r.rho, _reference(iso_atoms, r.grid), rtol=0, atol=0)
    # the two maps differ where the atoms are anisotropic: by far more than any tolerance
    assert float((aniso - r.rho).abs().max()) > 0.05 * float(aniso.max())
    wb.controls.adp.value = "anisotropic"
    torch.testing.assert_close(wb.result.rho, aniso, rtol=0, atol=0)


def test_anisotropic_map_matches_gemmi(make_wb):
    wb = make_wb("1pfe", backend="reference")
    ref = kernels.testing.gemmi_density(STRUCTURES["1pfe"], 1.5)
    assert wb.result.rho.shape == ref.shape
    assert _rel_l2(wb.result.rho, ref) < 1e-5
    wb.controls.adp.value = "isotropic"
    assert _rel_l2(wb.result.rho, kernels.testing.gemmi_density(STRUCTURES["1pfe"], 1.5, adp="iso")) < 1e-5


def test_auto_backend_shows_the_anisotropic_map(make_wb):
    # The app's default backend (cpu here, triton on a GPU) against the float64 reference,
    # under the float32 contract: the map a person sees is the anisotropic one.
    wb = make_wb("1pfe")
    r = wb.result
    ref = _reference(r.atoms, r.grid)
    assert_close(r.rho, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)


def _tilted_u(eigenvalues) -> list[float]:
    """Six U components with the given eigenvalues (Å²), principal axes tilted off x, y, z."""
    c, s = math.cos(0.6), math.sin(0.6)
    rz = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])
    c, s = math.cos(0.9), math.sin(0.9)
    rx = np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    r = rz @ rx
    u = r @ np.diag(eigenvalues) @ r.T
    return [u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2]]


@pytest.mark.parametrize("delta", [-1.5, 12.0])
def test_b_offset_adds_delta_b_over_8pi2_to_the_diagonal_of_anisotropic_u(delta):
    # a mixed model: atoms 0 and 2 isotropic, 1 and 3 anisotropic (3 strongly: eigenvalue ratio 13, tilted)
    u = [[np.nan] * 6, _tilted_u([0.12, 0.2, 0.3]), [np.nan] * 6, _tilted_u([0.03, 0.1, 0.4])]
    atoms = kernels.AtomSet.from_elements(
        ["C", "N", "O", "S"], [[1, 2, 3], [4, 5, 6], [7, 8, 9], [2, 9, 4]], [15.0, 20.0, 25.0, 30.0], u_aniso=u
    )
    m = kernels.Model(atoms, kernels.Cell.from_parameters(20, 20, 20), "P 1", None, None, ())
    state = WorkbenchState(b_mode="offset", b_offset=delta)
    out = compute.prepare_atoms(m, state.snapshot())
    torch.testing.assert_close(out.b_iso, atoms.b_iso + delta)
    torch.testing.assert_close(out.u_aniso, atoms.u_aniso + delta / U_TO_B * DIAG)
    assert torch.equal(out.u_aniso[:, 3:], atoms.u_aniso[:, 3:])  # off-diagonal terms unchanged
    assert torch.equal(out.aniso, atoms.aniso)
    # every atom's U as splatted is its U + ΔB/8π²·I: the isotropic ones through b_iso
    from kernels.adp import effective_u

    before = effective_u(atoms.u_aniso, atoms.aniso, atoms.b_iso)
    after = effective_u(out.u_aniso, out.aniso, out.b_iso)
    torch.testing.assert_close(after, before + delta / U_TO_B * DIAG)
    # global B: one isotropic B for every atom, anisotropic tensors dropped
    glob = compute.prepare_atoms(m, WorkbenchState(b_mode="global", b_global=40.0).snapshot())
    assert glob.u_aniso is None and bool((glob.b_iso == 40.0).all())


def test_b_offset_and_blur_widen_anisotropic_atoms_as_gemmi_blur_does(make_wb):
    wb = make_wb("1pfe", backend="reference", b_mode="offset", b_offset=10.0)
    ref = kernels.testing.gemmi_density(STRUCTURES["1pfe"], 1.5, blur=10.0)
    assert _rel_l2(wb.result.rho, ref) < 1e-5
    offset_map = wb.result.rho
    # the blur control is the same rule inside the splat: offset 0 + blur 10 is the same map
    wb.set(b_mode="model", blur=10.0)
    assert wb.controls.blur.value == 10.0 and wb.result.settings.blur == 10.0
    assert wb.result.atoms.u_aniso is not None
    torch.testing.assert_close(wb.result.atoms.u_aniso, model("1pfe").atoms.u_aniso)  # blur is the splat's
    assert_close(wb.result.rho, offset_map, atol=1e-12 * float(offset_map.max()), rtol=1e-12)
    assert "blur 10 Å²" in compute.inputs_label(wb.result.settings)


def test_a_negative_offset_that_breaks_a_u_is_refused_with_the_limit(make_wb):
    m = model("1pfe")
    lam = adp_eigenvalues(m.atoms.u_aniso)[:, 0]
    limit = -float(lam.min()) * U_TO_B  # below this offset the narrowest atom's U has λ ≤ 0
    wb = make_wb("1pfe", backend="reference")
    i = int(torch.argmin(lam))
    with pytest.raises(WorkbenchError, match=rf"{limit:.2f} Å²") as err:
        compute.prepare_atoms(m, WorkbenchState(b_mode="offset", b_offset=math.floor(limit) - 1.0).snapshot())
    assert str(m.atoms.labels[i]) in str(err.value) and "not positive definite" in str(err.value)
    wb.controls.b_offset.value = math.floor(limit) - 1.0
    assert wb.status.level == "error" and f"{limit:.2f} Å²" in wb.status.message, wb.status.message
    wb.controls.b_offset.value = math.ceil(limit) + 1.0
    assert wb.status.level != "error", wb.status.message
    assert float(adp_eigenvalues(wb.result.atoms.u_aniso)[:, 0].min()) > 0


def test_global_b_makes_every_atom_isotropic_at_that_b(make_wb):
    # global mode carried over from a model without ANISOU, at a B below what shifting 1PFE's U
    # would allow (40.7 Å²): a map, not an error
    wb = make_wb("1orc", backend="reference")
    wb.controls.b_global.value = 25.0  # moving the slider selects global mode
    wb.set(structure="1pfe")
    assert wb.state.b_mode == "global" and wb.status.level != "error", wb.status.message
    r = wb.result
    assert r.atoms.u_aniso is None and bool((r.atoms.b_iso == 25.0).all())
    iso25 = model("1pfe").atoms.replace(
        u_aniso=None, aniso=None, b_iso=torch.full((len(r.atoms),), 25.0, dtype=torch.float64)
    )
    torch.testing.assert_close(r.rho, _reference(iso25, r.grid), rtol=0, atol=0)


@pytest.mark.parametrize("radiation", ["electron", "neutron"])
def test_radiation_switch_rereads_the_coefficients_and_the_units(make_wb, radiation):
    wb = make_wb("1orc")
    xray = wb.result.rho
    wb.controls.radiation.set_state({"index": RADIATIONS.index(radiation)})  # the browser's path
    r = wb.result
    assert wb.status.level != "error", wb.status.message
    assert r.atoms.radiation == radiation and r.settings.radiation == radiation
    m = model("1orc")
    a, b = form_factor_coefficients(m.atoms.elements, radiation, m.atoms.labels)
    torch.testing.assert_close(r.atoms.a, a)
    torch.testing.assert_close(r.atoms.b, b)
    # the same map as a model read for that radiation, splatted the same way
    read = kernels.read_model(STRUCTURES["1orc"], radiation=radiation)
    assert read.atoms.radiation == radiation
    expected = kernels.splat_density(read.atoms.to(dtype=torch.float32), r.grid)
    torch.testing.assert_close(r.rho, expected, rtol=0, atol=0)
    assert not torch.equal(r.rho, xray)
    units = {"electron": "Å⁻²", "neutron": "fm/Å³"}[radiation]  # electron form factors are lengths: Å/Å³
    assert r.settings.units == units
    assert f"({units})" in wb.controls.density_cutoff.description
    assert f"{units}, map" in wb.slice.caption.value and wb.slice.cbar.ax.get_ylabel() == f"ρ ({units})"
    assert wb.profile.ax.get_ylabel() == units
    assert f"ρ model ({units})" in wb.table.html.value
    assert f"{units}; click an atom" in wb.scene.caption.value
    assert torch.isfinite(r.rho).all()
    wb.compare("cpu:cpu", "cpu:reference")  # the difference tab labels its maps in the same unit
    assert wb.difference_result.units == units and f"map ρ ({units})" in wb.difference.stats.value
    assert f"({units})" in wb.difference.slice.cbar.ax.get_ylabel() and units in wb.difference.slice.caption.value
    assert radiation in wb.difference_result.label
    wb.controls.radiation.value = "xray"
    torch.testing.assert_close(wb.result.rho, xray, rtol=0, atol=0)
    assert "(e/Å³)" in wb.controls.density_cutoff.description and "fm/Å³" not in wb.slice.caption.value


@pytest.mark.parametrize("radiation", ["xray", "electron", "neutron"])
def test_every_radiation_of_an_anisotropic_model_matches_gemmi(make_wb, radiation):
    wb = make_wb("1pfe", backend="reference", radiation=radiation)
    assert wb.result.atoms.u_aniso is not None and wb.result.atoms.radiation == radiation
    ref = kernels.testing.gemmi_density(STRUCTURES["1pfe"], 1.5, radiation=radiation)
    assert _rel_l2(wb.result.rho, ref) < 1e-5


def test_neutron_hydrogen_density_is_negative_and_finite():
    # hydrogen's neutron length is negative: a negative well, never a NaN
    atoms = kernels.AtomSet.from_elements(
        ["H", "C"], [[5, 5, 5], [6.1, 5, 5]], 12.0, radiation="neutron",
        u_aniso=[[0.2, 0.02, 0.05, 0.04, 0.03, -0.01], [np.nan] * 6],
    )  # fmt: skip
    m = kernels.Model(atoms, kernels.Cell.from_parameters(10, 10, 10), "P 1", None, None, ())
    settings = WorkbenchState(radiation="neutron", backend="reference", spacing=0.5).snapshot()
    base = compute.model_atoms(m, settings.adp, settings.radiation)
    grid = kernels.GridSpec.for_spacing(m.cell, 0.5)
    rho, name, _ = compute.density_map(compute.prepare_atoms(m, settings, base=base), grid, settings)
    assert name == "reference" and torch.isfinite(rho).all()
    assert float(rho.min()) < 0 < float(rho.max())


def test_a_radiation_table_without_the_element_is_a_clear_error():
    # gemmi's neutron table has no length for some elements that have IT92 X-ray factors (Po, At, …)
    import gemmi

    missing = next(
        gemmi.Element(z).name
        for z in range(1, 119)
        if gemmi.Element(z).it92 is not None and any(gemmi.Element(z).it92.a)
        and (gemmi.Element(z).neutron92 is None or gemmi.Element(z).neutron92.get_coefs()[0] == 0)
    )  # fmt: skip
    atoms = kernels.AtomSet.from_elements(["C", missing], [[1, 1, 1], [3, 3, 3]], 20.0)
    m = kernels.Model(atoms, kernels.Cell.from_parameters(10, 10, 10), "P 1", None, None, ())
    with pytest.raises(WorkbenchError, match=rf"radiation neutron: .*{missing}2.*Choose another radiation"):
        compute.model_atoms(m, "anisotropic", "neutron")
    assert compute.model_atoms(m, "anisotropic", "xray").radiation == "xray"


def test_exported_model_keeps_its_anisou_records(tmp_path):
    m = model("1pfe")
    text = compute.model_pdb(m, m.atoms.xyz)
    n_anisou = sum(line.startswith("ANISOU") for line in text.splitlines())
    assert n_anisou == int(m.atoms.aniso.sum()) == len(m)
    path = tmp_path / "exported.pdb"
    path.write_text(text)
    back = kernels.read_model(path)
    assert back.atoms.u_aniso is not None and torch.equal(back.atoms.aniso, m.atoms.aniso)
    # ANISOU holds U in units of 1e-4 Å², rounded: half a unit is the file's precision
    torch.testing.assert_close(back.atoms.u_aniso, m.atoms.u_aniso, rtol=0, atol=0.5e-4 + 1e-9)
    torch.testing.assert_close(back.atoms.xyz, m.atoms.xyz, rtol=0, atol=0.5e-3 + 1e-9)


def test_app_exports_the_shown_model_with_its_anisou(make_wb, tmp_path):
    wb = make_wb("1pfe", backend="reference", distort_amplitude=0.2)
    path = wb.export_model(tmp_path / "model.pdb")
    back = kernels.read_model(path)
    torch.testing.assert_close(back.atoms.xyz, wb.result.atoms.xyz, rtol=0, atol=0.5e-3 + 1e-9)  # distorted
    torch.testing.assert_close(back.atoms.u_aniso, model("1pfe").atoms.u_aniso, rtol=0, atol=0.5e-4 + 1e-9)
    # the export button downloads the same text to the browser (the comm message is captured)
    sent = []
    wb.download.send = lambda content, buffers=None: sent.append((content, buffers))
    wb.controls.export_path.value = "mine.ccp4"
    wb.controls.export_model.click()
    ((content, buffers),) = sent
    assert content == {"type": "download", "filename": "mine_model.pdb", "mime": "chemical/x-pdb"}
    assert bytes(buffers[0]).decode() == path.read_text()
    assert wb.status.level == "idle" and "downloading mine_model.pdb" in wb.status.message, wb.status.message


def test_a_file_with_a_non_positive_definite_anisou_opens_with_a_note(make_wb):
    # 3O5R's A/MET 48/CB altloc A has a U that is not positive definite: the workbench reads
    # it at its isotropic B and says so, instead of refusing the file.
    m = compute.load_model(STRUCTURES["3o5r"])
    assert m.atoms.u_aniso is not None
    i = next(k for k, lab in enumerate(m.atoms.labels) if (lab.seq_num, lab.atom_name, lab.altloc) == (48, "CB", "A"))
    assert not bool(m.atoms.aniso[i])
    assert any("MET 48/CB" in note and "isotropic B" in note for note in m.notes), m.notes


def test_splat_command_takes_adp_radiation_and_blur(tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "map.ccp4"
    common = [str(STRUCTURES["1pfe"]), "--backend", "reference", "--spacing", "1.5", "--out", str(out)]
    assert main(["splat", *common, "--radiation", "neutron", "--blur", "10"]) == 0
    text = capsys.readouterr().out
    assert "neutron form factors, 342 atoms with anisotropic U, blur 10 Å²" in text and "fm/Å³" in text, text
    rho, _ = kernels.read_map(out)
    ref = kernels.testing.gemmi_density(STRUCTURES["1pfe"], 1.5, radiation="neutron", blur=10.0)
    assert _rel_l2(rho, ref) < 1e-5
    assert main(["splat", *common, "--adp", "iso"]) == 0
    assert "0 atoms with anisotropic U" in capsys.readouterr().out
    rho, _ = kernels.read_map(out)
    assert _rel_l2(rho, kernels.testing.gemmi_density(STRUCTURES["1pfe"], 1.5, adp="iso")) < 1e-5
    # 3O5R's non-positive-definite ANISOU: refused with the command-line fix, or read at B_iso
    bad = [str(STRUCTURES["3o5r"]), "--backend", "reference", "--spacing", "3.0", "--out", str(out)]
    assert main(["splat", *bad]) == 1
    assert "MET 48/CB" in (err := capsys.readouterr().err) and "--on-bad-adp iso" in err, err
    assert main(["splat", *bad, "--on-bad-adp", "iso"]) == 0
    said = capsys.readouterr()  # the warning, once, on stderr; not again as a note
    assert "splatted at their isotropic B" in said.err and "splatted at their isotropic B" not in said.out
    with pytest.raises(SystemExit) as exit_:
        main(["splat", "--blur", "-1"])
    assert exit_.value.code == 2 and "--blur: must be a finite number ≥ 0 of Å²" in capsys.readouterr().err
