"""Reflection files: MTZ and structure-factor mmCIF made here by gemmi, read back; bad files; the R-factor."""

from __future__ import annotations

import functools
import gzip
import math

import numpy as np
import pytest
import torch

import kernels
import kernels.testing
from kernels import ReflectionFileError, r_factor, read_structure_factors, write_structure_factors
from kernels.reciprocal.files import match_reflections
from tests.helpers import model


@functools.cache
def calculated(name: str = "1orc", d_min: float = 2.0) -> kernels.StructureFactors:
    """The symmetrised map's factors of a bundled model in its space group (sampling blur, divided out)."""
    m = model(name)
    grid = kernels.GridSpec.for_spacing(m.cell, 2 / 3, m.spacegroup)
    blur = kernels.sampling_blur(m.atoms, grid)
    rho = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, blur=blur, backend="cpu")
    rho = kernels.symmetrize(rho, grid, m.spacegroup)
    return kernels.structure_factors(rho, grid, d_min, spacegroup=m.spacegroup, blur=blur)


def gemmi_mtz(path, hkl, columns: dict, cell, spacegroup: str | None = "P 21 21 21"):
    """An MTZ written by gemmi: H K L and ``columns`` {label: (type, values)}."""
    import gemmi

    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(spacegroup or "P 1")  # gemmi writes no MTZ without one
    if cell is not None:
        mtz.set_cell_for_all(gemmi.UnitCell(*cell))
    mtz.add_dataset("test")
    data = [np.asarray(hkl, dtype=np.float32)]
    for label, (kind, values) in columns.items():
        mtz.add_column(label, kind)
        data.append(np.asarray(values, dtype=np.float32).reshape(-1, 1))
    mtz.set_data(np.hstack(data))
    mtz.write_to_file(str(path))
    if spacegroup is None:
        # blank the symmetry records (80-byte header lines) into TITLE lines: a file with no space group
        raw = bytearray(path.read_bytes())
        start = raw.find(b"VERS MTZ")
        for at in range(start, len(raw), 80):
            record = bytes(raw[at : at + 80])
            if record.startswith((b"SYMINF", b"SYMM ")):
                raw[at : at + 80] = b"TITLE".ljust(80)
            if record.startswith(b"END"):
                break
        path.write_bytes(bytes(raw))
    return path


def observed_columns(f: kernels.StructureFactors, seed: int = 0):
    """Amplitudes of ``f`` times 2.5·exp(−12 s²/4) with 1 % noise, sigmas, and FC/PHIC for good measure."""
    rng = np.random.default_rng(seed)
    amp = f.f.abs().double().numpy() * 2.5 * np.exp(-12.0 * f.inv_d2.numpy() / 4)
    amp = amp * (1 + 0.01 * rng.standard_normal(len(amp)))
    return {
        "FC": ("F", f.f.abs().numpy()),
        "PHIC": ("P", torch.rad2deg(torch.angle(f.f)).numpy()),
        "FP": ("F", amp),
        "SIGFP": ("Q", 0.01 * amp),
    }


def test_mtz_from_gemmi_reads_back_and_r_factor_fits_scale_and_b(tmp_path):
    f = calculated()
    m = model("1orc")
    path = gemmi_mtz(tmp_path / "data.mtz", f.hkl.numpy(), observed_columns(f), m.cell.parameters)
    data = read_structure_factors(path)
    assert data.columns == ("FP", "SIGFP")  # FP is the observed column, FC is not picked
    assert data.factors.spacegroup == "P 21 21 21" and data.factors.cell.parameters == pytest.approx(m.cell.parameters)
    assert torch.equal(data.factors.hkl, f.hkl) and not data.factors.f.is_complex()
    assert data.factors.d_min == pytest.approx(float(f.d.min()), rel=1e-9)
    assert torch.allclose(data.sigma, 0.01 * data.factors.f, rtol=1e-6)
    r = r_factor(data, f)
    # 1 % Gaussian noise on |F|: R ≈ 0.8·1 % (mean |noise|); scale and B found to well within the noise
    assert r.r == pytest.approx(0.008, abs=0.002)
    assert r.scale == pytest.approx(2.5, rel=5e-3) and r.b == pytest.approx(12.0, abs=0.2)
    assert r.n_used == len(f) == r.n_observed and not r.bulk_solvent
    assert "no bulk-solvent model" in str(r)
    assert len(r.table) == 10 and torch.all(r.table.r_factor < 0.02) and torch.all(r.table.correlation > 0.99)
    without_b = r_factor(data, f, fit_b=False)
    assert without_b.b == 0.0 and without_b.r > 5 * r.r
    # the phases as well: complex factors, equal to the written ones to float32
    both = read_structure_factors(path, amplitudes="FC", phases="PHIC")
    assert both.factors.f.is_complex() and both.columns == ("FC", "PHIC")
    table = kernels.shells(both.factors, f.replace(f=f.f.to(torch.complex128)), n_shells=5)
    assert torch.all(table.rel_error < 1e-6)


def test_written_mtz_round_trips_through_gemmi(tmp_path):
    import gemmi

    f = calculated()
    out = write_structure_factors(tmp_path / "f.mtz", f)
    mtz = gemmi.read_mtz_file(str(out))
    assert mtz.spacegroup.hm == "P 21 21 21" and mtz.column_labels() == ["H", "K", "L", "FC", "PHIC"]
    back = read_structure_factors(out, phases="PHIC")
    assert torch.equal(back.factors.hkl, f.hkl)
    got, want = back.factors.f, f.f.to(torch.complex128)
    assert float(((got - want).abs() / want.abs().clamp_min(1.0)).max()) < 1e-5
    assert list((tmp_path).iterdir()) == [out]  # no temporary file left


def test_missing_values_and_f000_are_left_out_and_said(tmp_path):
    f = calculated()
    cols = observed_columns(f)
    amp = cols["FP"][1].copy()
    amp[[3, 10, 11]] = np.nan
    cols["FP"] = ("F", amp)
    hkl = np.vstack([f.hkl.numpy(), [[0, 0, 0]]])
    cols = {k: (t, np.append(v, 1000.0)) for k, (t, v) in cols.items()}
    path = gemmi_mtz(tmp_path / "gaps.mtz", hkl, cols, model("1orc").cell.parameters)
    data = read_structure_factors(path)
    assert len(data.factors) == len(f) - 3
    assert data.notes == ("3 reflections without a value in FP left out", "F(000) left out")
    assert r_factor(data, f).n_used == len(f) - 3


def sf_cif_text(
    f: kernels.StructureFactors, cell, spacegroup="P 21 21 21", tags=("F_meas_au", "F_meas_sigma_au")
) -> str:
    lines = ["data_r1orcsf", f"_cell.length_a {cell[0]}", f"_cell.length_b {cell[1]}", f"_cell.length_c {cell[2]}"]
    lines += [f"_cell.angle_alpha {cell[3]}", f"_cell.angle_beta {cell[4]}", f"_cell.angle_gamma {cell[5]}"]
    if spacegroup:
        lines.append(f"_symmetry.space_group_name_H-M '{spacegroup}'")
    lines += ["loop_", "_refln.index_h", "_refln.index_k", "_refln.index_l"] + [f"_refln.{t}" for t in tags]
    amp = f.f.abs().double().numpy()
    for (h, k, l), a in zip(f.hkl.tolist(), amp):  # noqa: E741
        extra = " ".join(f"{a:.3f}" if "sigma" not in t else f"{0.02 * a:.3f}" for t in tags)
        lines.append(f"{h} {k} {l} {extra}")
    return "\n".join(lines) + "\n"


def test_structure_factor_mmcif_plain_and_gzipped(tmp_path):
    f = calculated()
    text = sf_cif_text(f, model("1orc").cell.parameters)
    plain = tmp_path / "r1orcsf.cif"
    plain.write_text(text)
    packed = tmp_path / "r1orcsf.cif.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        data = read_structure_factors(path)
        assert data.columns == ("F_meas_au", "F_meas_sigma_au")
        assert torch.equal(data.factors.hkl, f.hkl) and data.factors.spacegroup == "P 21 21 21"
        assert r_factor(data, f).r < 1e-4  # 3 decimals of amplitudes in the hundreds


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing", "does not exist|no such file|not found"),
        ("empty", "empty"),
        ("folder", "folder|directory"),
        ("text", "neither an MTZ file"),
        ("truncated", "not a readable MTZ file"),
        ("no_cell", "has no unit cell"),
        ("bad_cell", "its cell is not usable"),
        ("no_spacegroup", "has no space group"),
        ("no_amplitude", r"has no amplitude column \(type F\); its columns: PHIC \(P\)"),
        ("two_amplitudes", r"several amplitude columns \(FA, FB\): name one with amplitudes="),
        ("wrong_type", "column PHIC is of MTZ type P, not F"),
        ("unknown_column", "has no column 'FOO'; its columns: H, K, L, FP, SIGFP"),
        ("negative", r"FP is negative at hkl"),
        ("infinite", "holds infinite amplitudes"),
        ("all_missing", "no reflection has a value in FP"),
        ("cif_no_refln", "has no _refln category"),
        ("cif_intensities", "intensities only"),
        ("cif_no_cell", r"has no unit cell \(_cell.length_a missing\)"),
        ("cif_no_spacegroup", "has no space group"),
        ("cif_bad_index", "_refln.index_h holds a value that is not an integer"),
        ("cif_bad_number", r"_refln.F_meas_au row 2 is not a number \('abc'\)"),
    ],
)
def test_bad_files_are_refused_with_the_reason(tmp_path, case, message):
    f = calculated()
    cell = model("1orc").cell.parameters
    hkl = f.hkl.numpy()[:50]
    amp = f.f.abs().numpy()[:50]
    path = tmp_path / "bad.mtz"
    kwargs = {}
    if case == "missing":
        path = tmp_path / "nothing.mtz"
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "folder":
        path = tmp_path
    elif case == "text":
        path.write_text("not reflections\n")
    elif case == "truncated":
        gemmi_mtz(path, hkl, {"FP": ("F", amp)}, cell)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif case == "no_cell":
        gemmi_mtz(path, hkl, {"FP": ("F", amp)}, None)
    elif case == "bad_cell":
        gemmi_mtz(path, hkl, {"FP": ("F", amp)}, (10, 10, 10, 90, 90, 200))
    elif case == "no_spacegroup":
        gemmi_mtz(path, hkl, {"FP": ("F", amp)}, cell, spacegroup=None)
    elif case == "no_amplitude":
        gemmi_mtz(path, hkl, {"PHIC": ("P", amp)}, cell)
    elif case == "two_amplitudes":
        gemmi_mtz(path, hkl, {"FA": ("F", amp), "FB": ("F", amp)}, cell)
    elif case == "wrong_type":
        gemmi_mtz(path, hkl, {"FP": ("F", amp), "PHIC": ("P", amp)}, cell)
        kwargs = {"amplitudes": "PHIC"}
    elif case == "unknown_column":
        gemmi_mtz(path, hkl, {"FP": ("F", amp), "SIGFP": ("Q", amp)}, cell)
        kwargs = {"amplitudes": "FOO"}
    elif case in ("negative", "infinite", "all_missing"):
        bad = amp.copy()
        bad[7] = {"negative": -1.0, "infinite": math.inf, "all_missing": math.nan}[case]
        if case == "all_missing":
            bad[:] = math.nan
        gemmi_mtz(path, hkl, {"FP": ("F", bad)}, cell)
    else:
        path = tmp_path / "bad.cif"
        sub = f.replace(hkl=f.hkl[:50], f=f.f[:50], _inv_d2=None)
        text = sf_cif_text(sub, cell)
        if case == "cif_no_refln":
            text = "data_x\n_cell.length_a 10\n_entry.id x\n"
        elif case == "cif_intensities":
            text = sf_cif_text(sub, cell, tags=("intensity_meas", "intensity_sigma"))
        elif case == "cif_no_cell":
            text = "\n".join(line for line in text.splitlines() if not line.startswith("_cell.length_a")) + "\n"
        elif case == "cif_no_spacegroup":
            text = sf_cif_text(sub, cell, spacegroup=None)
        elif case == "cif_bad_index":
            text = text.replace(
                f"\n{hkl[0][0]} {hkl[0][1]} {hkl[0][2]} ", f"\n{hkl[0][0]}.5 {hkl[0][1]} {hkl[0][2]} ", 1
            )
        elif case == "cif_bad_number":
            rows = text.splitlines()
            first = next(i for i, r in enumerate(rows) if r and r[0].isdigit() or r.startswith("-"))
            parts = rows[first + 1].split()
            parts[3] = "abc"
            rows[first + 1] = " ".join(parts)
            text = "\n".join(rows) + "\n"
        path.write_text(text)
    with pytest.raises(ReflectionFileError, match=message) as err:
        read_structure_factors(path, **kwargs)
    assert str(path) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_r_factor_refuses_sets_that_share_nothing():
    f = calculated()
    other = f.replace(hkl=f.hkl + 1000, _inv_d2=None)
    with pytest.raises(ValueError, match="share no reflection"):
        r_factor(other, f)


def test_match_reflections_finds_shared_rows_in_any_order():
    a = torch.tensor([[1, 2, 3], [-1, 0, 2], [5, 5, 5], [0, 0, 1]])
    b = torch.tensor([[0, 0, 1], [9, 9, 9], [1, 2, 3], [-1, 0, 2]])
    ia, ib = match_reflections(a, b)
    assert ia.tolist() == [0, 1, 3] and ib.tolist() == [2, 3, 0]
    assert torch.equal(a[ia], b[ib])
    ia, ib = match_reflections(a, b[:0])
    assert len(ia) == len(ib) == 0
