"""Bad model files: every one is a ModelError naming the file and what is wrong, or a warning.

Each case writes its file in the test (PDB or mmCIF text, gzip or not) and asserts the
exception type and that the message names the file, the line or row, the atom, the field
and the value. Then value equality of the cell, grid and atom objects.
"""

from __future__ import annotations

import gzip
import warnings

import numpy as np
import pytest
import torch

import kernels
from tests.helpers import STRUCTURES

CRYST1 = "CRYST1{a:>9s}{b:>9s}{c:>9s}{al:>7s}{be:>7s}{ga:>7s} {sg:<11s}   1\n"


def cryst1(a="30.000", b="40.000", c="50.000", al="90.00", be="90.00", ga="90.00", sg="P 1"):
    return CRYST1.format(a=a, b=b, c=c, al=al, be=be, ga=ga, sg=sg)


def atom(serial=1, name="N", x="1.000", y="2.000", z="3.000", occ="1.00", b="10.00", el="N"):
    """One ATOM record with its fields placed in their PDB columns (values right-aligned)."""
    line = f"ATOM  {serial:5d} {name:<4s} ALA A   1    {x:>8s}{y:>8s}{z:>8s}{occ:>6s}{b:>6s}          {el:>2s}"
    assert len(line) == 78
    return line + "\n"


def pdb(*atoms, cell=None):
    head = cryst1() if cell is None else cell
    body = "".join(atoms) if atoms else atom()
    return head + atom(1, "N") + body.replace("ATOM      1", "ATOM      2") + "END\n"


def second(cut=None, after="", **fields):
    """A PDB whose second atom (CA, line 3) has the given field text, its line cut to ``cut`` columns."""
    line = atom(2, "CA", el=fields.pop("el", "C"), **fields)
    line = line if cut is None else line[:cut] + "\n"
    return cryst1() + atom(1, "N") + line + after + "END\n"


ANISOU = "ANISOU    2  CA  ALA A   1     1000{u22:>7s}   3000      0      0      0       C\n"

CIF_COLUMNS = (
    "group_PDB id type_symbol label_atom_id label_alt_id label_comp_id label_asym_id label_seq_id "
    "Cartn_x Cartn_y Cartn_z occupancy B_iso_or_equiv auth_seq_id auth_asym_id pdbx_PDB_model_num"
).split()
CIF_ROWS = [
    dict(zip(CIF_COLUMNS, "ATOM 1 N N . ALA A 1 1.0 2.0 3.0 1.0 10.0 1 A 1".split())),
    dict(zip(CIF_COLUMNS, "ATOM 2 C CA . ALA A 1 2.4 2.1 3.2 1.0 12.0 1 A 1".split())),
]
CIF_CELL = {"length_a": "30", "length_b": "40", "length_c": "50", "angle_alpha": "90", "angle_beta": "90",
            "angle_gamma": "90"}  # fmt: skip


def cif(drop=(), row2=None, cell=None, spacegroup="P 1"):
    """mmCIF text: the two atoms above, without the ``drop`` columns, row 2 changed by ``row2``."""
    cols = [c for c in CIF_COLUMNS if c not in drop]
    rows = [dict(CIF_ROWS[0]), {**CIF_ROWS[1], **(row2 or {})}]
    cell = {**CIF_CELL, **(cell or {})}
    text = "data_test\n" + "".join(f"_cell.{k} {v}\n" for k, v in cell.items())
    text += f"_symmetry.space_group_name_H-M '{spacegroup}'\nloop_\n"
    text += "".join(f"_atom_site.{c}\n" for c in cols)
    text += "".join(" ".join(r[c] for c in cols) + "\n" for r in rows)
    return text


def gz(text: str | bytes) -> bytes:
    return gzip.compress(text.encode() if isinstance(text, str) else text)


RANDOM = np.random.default_rng(7).integers(0, 256, 400, dtype=np.uint8).tobytes()
GOOD_GZ = gz(pdb())

# (id, file name, contents, strings the message must contain: file, where, field, value)
CASES = [
    # numbers gemmi would read leniently, in each numeric column of ATOM/HETATM
    ("x-letter-O", "m.pdb", second(x="1O.OOO"), ["line 3", "A/ALA 1/CA", "x coordinate", "31-38", "'1O.OOO'"]),
    ("y-two-points", "m.pdb", second(y="12.3.4"), ["line 3", "A/ALA 1/CA", "y coordinate", "39-46", "'12.3.4'"]),
    ("z-lone-minus", "m.pdb", second(z="-"), ["line 3", "A/ALA 1/CA", "z coordinate", "47-54", "'-'"]),
    ("x-blank", "m.pdb", second(x=""), ["line 3", "A/ALA 1/CA", "x coordinate", "blank"]),
    ("x-nan", "m.pdb", second(x="nan"), ["line 3", "A/ALA 1/CA", "x coordinate", "'nan'", "non-finite"]),
    ("x-inner-blank", "m.pdb", second(x="1 2.000"), ["line 3", "A/ALA 1/CA", "x coordinate", "'1 2.000'"]),
    ("x-sign-inside", "m.pdb", second(x="1-2.000"), ["line 3", "A/ALA 1/CA", "x coordinate", "'1-2.000'"]),
    ("b-letter-O", "m.pdb", second(b="2O.00"), ["line 3", "A/ALA 1/CA", "B-factor", "61-66", "'2O.00'"]),
    ("occ-trailing-x", "m.pdb", second(occ="0.5x"), ["line 3", "A/ALA 1/CA", "occupancy", "55-60", "'0.5x'"]),
    ("occ-blank", "m.pdb", second(occ=""), ["line 3", "A/ALA 1/CA", "occupancy", "blank"]),
    ("b-blank", "m.pdb", second(b=""), ["line 3", "A/ALA 1/CA", "B-factor", "blank", "no ANISOU"]),
    ("cut-before-b", "m.pdb", second(cut=60), ["line 3", "A/ALA 1/CA", "B-factor", "ends at column 60"]),
    ("cut-before-occ", "m.pdb", second(cut=54), ["line 3", "A/ALA 1/CA", "occupancy", "ends at column 54"]),
    ("cut-inside-x", "m.pdb", second(cut=35), ["line 3", "A/ALA 1/CA", "x coordinate", "cut short"]),
    ("cut-inside-b", "m.pdb", cryst1() + atom()[:63] + "\n", ["line 2", "A/ALA 1/N", "B-factor", "cut short"]),
    ("anisou-letter", "m.pdb", second(after=ANISOU.format(u22="2O00")), ["ANISOU", "A/ALA 1/CA", "U22", "'2O00'"]),
    ("anisou-cut", "m.pdb", second(after=ANISOU.format(u22="2000")[:40] + "\n"), ["ANISOU", "A/ALA 1/CA", "U22"]),
    ("element-unknown", "m.pdb", second(el="Xx"), ["line 3", "A/ALA 1/CA", "unknown element 'Xx'", "77-78"]),
    ("element-blank-name-unknown", "m.pdb", cryst1() + atom(name="QQ1", el=""), ["A/ALA 1/QQ1", "77-78", "'QQ1'"]),
    # impossible cells and space groups
    ("cryst1-letters", "m.pdb", pdb(cell=cryst1(a="3a.000")), ["line 1", "CRYST1 a", "7-15", "'3a.000'"]),
    ("cryst1-all-letters", "m.pdb", pdb(cell=cryst1(b="abc")), ["CRYST1 b", "16-24", "'abc'"]),
    ("cell-negative", "m.pdb", pdb(cell=cryst1(a="-30.000")), ["CRYST1", "a = -30 Å", "positive"]),
    ("cell-zero", "m.pdb", pdb(cell=cryst1(c="0.000")), ["CRYST1", "c = 0 Å", "positive"]),
    ("cell-nan", "m.pdb", pdb(cell=cryst1(b="nan")), ["CRYST1 b", "'nan'", "non-finite"]),
    ("angle-zero", "m.pdb", pdb(cell=cryst1(be="0.00")), ["CRYST1", "β = 0°"]),
    ("angle-180", "m.pdb", pdb(cell=cryst1(al="180.00")), ["CRYST1", "α = 180°"]),
    ("angles-sum", "m.pdb", pdb(cell=cryst1(al="100.00", be="100.00", ga="170.00")), ["sum to 370°", "γ=170"]),
    ("angle-too-wide", "m.pdb", pdb(cell=cryst1(al="30.00", be="30.00", ga="90.00")), ["γ = 90°", "(60°)"]),
    ("trigonal-on-orthogonal", "m.pdb", pdb(cell=cryst1(sg="P 31 2 1")), ["P 31 2 1", "trigonal", "a=30 b=40 c=50"]),
    ("cubic-on-orthogonal", "m.pdb", pdb(cell=cryst1(sg="P 2 3")), ["P 2 3", "cubic", "a = b = c"]),
    ("tetragonal-on-monoclinic", "m.pdb", pdb(cell=cryst1(b="30.000", be="100.00", sg="P 4")), ["P 4", "β=100"]),
    ("cif-hexagonal-on-orth", "m.cif", cif(spacegroup="P 63"), ["P 63", "hexagonal", "_cell"]),
    ("cif-cell-negative", "m.cif", cif(cell={"length_b": "-40"}), ["_cell", "b = -40 Å"]),
    ("cif-cell-letters", "m.cif", cif(cell={"length_a": "3a"}), ["_cell.length_a", "'3a'"]),
    ("cif-angles", "m.cif", cif(cell={"angle_alpha": "150", "angle_beta": "150"}), ["_cell", "sum to 390°"]),
    # mmCIF columns and values
    ("cif-no-y", "m.cif", cif(drop=["Cartn_y"]), ["_atom_site.Cartn_y", "coordinate"]),
    ("cif-no-b", "m.cif", cif(drop=["B_iso_or_equiv"]), ["_atom_site.B_iso_or_equiv"]),
    ("cif-no-element", "m.cif", cif(drop=["type_symbol"]), ["_atom_site.type_symbol"]),
    ("cif-no-altid", "m.cif", cif(drop=["label_alt_id"]), ["_atom_site.label_alt_id", "gemmi needs"]),
    ("cif-b-letter", "m.cif", cif(row2={"B_iso_or_equiv": "1O.0"}), ["row 2", "A/ALA 1/CA", "B_iso", "'1O.0'"]),
    ("cif-b-unknown", "m.cif", cif(row2={"B_iso_or_equiv": "?"}), ["row 2", "A/ALA 1/CA", "B_iso", "unknown"]),
    ("cif-x-unknown", "m.cif", cif(row2={"Cartn_x": "."}), ["row 2", "_atom_site.Cartn_x", "unknown"]),
    ("cif-z-two-points", "m.cif", cif(row2={"Cartn_z": "1.2.3"}), ["row 2", "_atom_site.Cartn_z", "'1.2.3'"]),
    ("cif-occ-letter", "m.cif", cif(row2={"occupancy": "O.5"}), ["row 2", "_atom_site.occupancy", "'O.5'"]),
    ("cif-element", "m.cif", cif(row2={"type_symbol": "Qq"}), ["row 2", "A/ALA 1/CA", "unknown element 'Qq'"]),
    ("cif-no-atom-site", "m.cif", "data_x\n_cell.length_a 30\n", ["no _atom_site table"]),
    # file-level problems
    ("empty", "m.pdb", b"", ["empty (0 bytes)"]),
    ("empty-gz", "m.cif.gz", b"", ["empty (0 bytes)"]),
    ("whitespace", "m.pdb", "\n  \n\t\n", ["only whitespace"]),
    ("random-bytes", "m.pdb", RANDOM, ["binary data", "offset"]),
    ("random-bytes-cif", "m.cif", RANDOM, ["binary data"]),
    ("not-gzip", "m.pdb.gz", pdb(), ["not a gzip file", "remove .gz"]),
    ("random-not-gzip", "m.cif.gz", RANDOM, ["not a gzip file"]),
    ("gzip-of-garbage", "m.pdb.gz", gz(RANDOM), ["binary data after decompressing"]),
    ("gzip-of-prose", "m.pdb.gz", gz("hello world\n" * 3), ["not a PDB file (after decompressing)"]),
    ("gzip-of-prose-cif", "m.cif.gz", gz("hello world\n" * 3), ["not an mmCIF file (after decompressing)"]),
    ("gzip-of-nothing", "m.pdb.gz", gz(b""), ["decompresses to nothing"]),
    ("gzip-truncated", "m.pdb.gz", GOOD_GZ[: len(GOOD_GZ) // 2], ["truncated gzip"]),
    ("gzip-corrupt", "m.pdb.gz", GOOD_GZ[:20] + bytes(b ^ 0x5A for b in GOOD_GZ[20:-8]) + GOOD_GZ[-8:], ["gzip"]),
    ("pdb-named-cif", "m.cif", pdb(), ["is PDB", "rename the file to .pdb"]),
    ("cif-named-pdb", "m.pdb", cif(), ["looks like mmCIF", "rename the file to .cif"]),
    ("no-atom-records", "m.pdb", cryst1() + "END\n", ["no ATOM or HETATM records"]),
    ("truncated-cif", "m.cif", cif()[:-25], ["cannot read the file"]),
]


@pytest.mark.parametrize("name, contents, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_model_is_a_model_error_naming_file_and_field(tmp_path, name, contents, expected):
    path = tmp_path / name
    path.write_bytes(contents.encode() if isinstance(contents, str) else contents)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error, not a warning followed by a map
        with pytest.raises(kernels.ModelError) as info:
            kernels.read_model(path)
    message = str(info.value)
    assert message.startswith(f"{path}:"), message
    for part in expected:
        assert part in message, f"{part!r} not in: {message}"
    assert "\n" not in message and "Traceback" not in message


def test_readable_oddities_are_not_errors(tmp_path):
    """Valid but unusual formatting reads as gemmi reads it: no false alarm."""
    text = (
        cryst1(a="300.000", b="300.000", c="300.000")
        + atom(1, "N", x="-100.000", y="1234.567", z="12", occ=".50", b="100.00")
        + atom(2, "CA", x="+2.5", el="C")
        + "END\n"
    )
    for name, data in (("odd.pdb", text), ("crlf.pdb", text.replace("\n", "\r\n")), ("odd.pdb.gz", gz(text))):
        path = tmp_path / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m = kernels.read_model(path)
        assert m.atoms.xyz[0].tolist() == [-100.0, 1234.567, 12.0] and m.atoms.xyz[1, 0] == 2.5
        assert m.atoms.occ.tolist() == [0.5, 1.0] and m.atoms.b_iso[0] == 100.0


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_every_bundled_structure_passes_the_checks_as_pdb_and_mmcif(tmp_path, name):
    import gemmi

    st = gemmi.read_structure(str(STRUCTURES[name]))
    (tmp_path / "x.pdb").write_text(st.make_pdb_string())
    st.make_mmcif_document().write_file(str(tmp_path / "x.cif"))
    first_u = None
    for path in (STRUCTURES[name], tmp_path / "x.pdb", tmp_path / "x.cif"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if name == "3o5r":  # one ANISOU that is not positive definite: refused by default, naming it
                with pytest.raises(kernels.ModelError, match=r"A/MET 48/CB altloc A \(eigenvalues -0\.017"):
                    kernels.read_model(path)
                m = kernels.read_model(path, adp="iso")
            else:
                m = kernels.read_model(path)
        assert len(m) == st[0].count_atom_sites()
        if m.atoms.u_aniso is not None:  # the same U from every format (PDB keeps 4 decimals)
            if first_u is None:
                first_u = m.atoms.u_aniso
            torch.testing.assert_close(m.atoms.u_aniso, first_u, rtol=0, atol=5.1e-5)


def test_blank_b_with_anisou_is_derived_from_u(tmp_path):
    path = tmp_path / "aniso.pdb"
    path.write_text(second(b="", after=ANISOU.format(u22="2000")))
    with pytest.warns(UserWarning, match="trace"):
        m = kernels.read_model(path)
    assert m.atoms.b_iso[1].item() == pytest.approx(8 * np.pi**2 * 0.6 / 3, rel=1e-6)
    cut = tmp_path / "aniso_cut.pdb"  # the same with the line ending before the B field
    cut.write_text(second(cut=60, after=ANISOU.format(u22="2000")))
    with pytest.warns(UserWarning, match="trace"):
        assert kernels.read_model(cut).atoms.b_iso[1].item() == pytest.approx(8 * np.pi**2 * 0.6 / 3, rel=1e-6)


@pytest.mark.parametrize(
    "name, text, warning, check",
    [
        ("no-occ.cif", cif(drop=["occupancy"]), "2 atom(s) have no occupancy (no _atom_site.occupancy column)",
         lambda m: m.atoms.occ.tolist() == [1.0, 1.0]),
        ("occ-unknown.cif", cif(row2={"occupancy": "?"}), "1 atom(s) have no occupancy (occupancy ? or ., first row 2",
         lambda m: m.atoms.occ.tolist() == [1.0, 1.0]),
        ("unknown-sg.pdb", pdb(cell=cryst1(sg="Q 9")), "space group 'Q 9' is not one gemmi knows; using P 1",
         lambda m: m.spacegroup == "P 1"),
        ("no-sg.pdb", pdb(cell=cryst1(sg="")), "gives no space group; using P 1", lambda m: m.spacegroup == "P 1"),
        ("nearly-tetragonal.pdb", pdb(cell=cryst1(a="30.000", b="30.010", sg="P 4")), "fits P 4 (tetragonal) only "
         "approximately", lambda m: m.spacegroup == "P 4"),
    ],
)  # fmt: skip
def test_readable_with_an_assumption_warns_and_notes_it(tmp_path, name, text, warning, check):
    path = tmp_path / name
    path.write_text(text)
    with pytest.warns(UserWarning) as record:
        m = kernels.read_model(path)
    messages = [str(w.message) for w in record]
    assert any(warning in msg and str(path) in msg for msg in messages), messages
    assert any(warning.split(" (")[0] in note for note in m.notes) and check(m)


def test_exact_cell_of_its_group_reads_silently(tmp_path):
    for group, cell in (("P 31 2 1", cryst1(b="30.000", ga="120.00", sg="P 31 2 1")), ("P 2 3", cryst1(b="30.000",
                        c="30.000", sg="P 2 3")), ("R 3", cryst1(b="30.000", c="30.000", al="80.00", be="80.00",
                        ga="80.00", sg="R 3"))):  # fmt: skip
        path = tmp_path / "sym.pdb"
        path.write_text(pdb(cell=cell))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels.read_model(path).spacegroup.startswith(group[0])


@pytest.mark.parametrize("value", [-1.0, 0, float("nan"), float("inf"), True, "5", np.bool_(True)])
def test_box_padding_must_be_a_positive_number(tmp_path, value):
    path = tmp_path / "nocell.pdb"
    path.write_text(atom() + "END\n")
    with pytest.raises(
        kernels.ModelError, match=r"nocell.pdb: box_padding must be a positive finite number of Å .*, got"
    ):
        kernels.read_model(path, box_padding=value)


@pytest.mark.parametrize("value", [5, 5.0, np.float32(5), np.int64(5), torch.tensor(5.0), torch.tensor(5)])
def test_box_padding_takes_any_real_scalar(tmp_path, value):
    path = tmp_path / "nocell.pdb"
    path.write_text(atom() + "END\n")
    m = kernels.read_model(path, box_padding=value)
    assert m.cell.parameters[:3] == pytest.approx((10.0, 10.0, 10.0))


def test_filters_that_leave_nothing_say_so(tmp_path):
    path = tmp_path / "water.pdb"
    path.write_text(cryst1() + atom().replace("ALA", "HOH").replace("  N  ", "  O  ")[:-3] + " O\n")
    with pytest.raises(
        kernels.ModelError, match=r"none of the 1 atoms of model 0 is left after the filters.*water=False"
    ):
        kernels.read_model(path, water=False)


@pytest.mark.parametrize(
    "params, expected",
    [
        ((-30, 40, 50), "a = -30 Å must be positive"),
        ((30, 0, 50), "b = 0 Å must be positive"),
        ((30, 40, float("nan")), "c = nan is not a finite number"),
        ((30, 40, 50, 90, 90, 0), "γ = 0°"),
        ((30, 40, 50, 120, 120, 130), "sum to 370°"),
        ((30, 40, 50, 20, 30, 90), "γ = 90° is not less than the sum of the other two (50°)"),
        ((30, 40, 50, 90, 180, 90), "β = 180°"),
    ],
)
def test_impossible_cell_parameters_say_which_and_why(params, expected):
    with pytest.raises(ValueError, match="impossible unit cell") as info:
        kernels.Cell.from_parameters(*params)
    assert expected in str(info.value)


def test_cell_takes_numpy_and_torch_scalars_but_not_bool():
    ref = kernels.Cell.from_parameters(30, 40, 50)
    assert kernels.Cell.from_parameters(np.float32(30), np.int64(40), torch.tensor(50.0)) == ref
    with pytest.raises(ValueError, match="cell a must be a real number, got True"):
        kernels.Cell.from_parameters(True, 40, 50)
    with pytest.raises(ValueError, match="cell b must be a real number, got '40'"):
        kernels.Cell.from_parameters(30, "40", 50)


def test_cells_and_grids_compare_and_hash_by_value():
    c1 = kernels.Cell.from_parameters(30, 40, 50, 90, 100, 90)
    c2 = kernels.Cell.from_parameters(30, 40, 50, 90, 100, 90)
    other = kernels.Cell.from_parameters(30, 40, 51, 90, 100, 90)
    assert c1 is not c2 and c1 == c2 and hash(c1) == hash(c2) and c1 != other
    g1, g2 = kernels.GridSpec.for_spacing(c1, 1.0), kernels.GridSpec.for_spacing(c2, 1.0)
    assert g1 == g2 and hash(g1) == hash(g2) and len({g1, g2}) == 1
    assert g1 != kernels.GridSpec.for_spacing(other, 1.0)
    assert g1 != kernels.GridSpec(c1, g1.shape, origin=(1, 0, 0), sampling=g1.sampling)
    assert {g1: "map"}[g2] == "map" and c1 != "a cell" and g1 != None  # noqa: E711


def test_atomsets_compare_by_value_and_are_unhashable():
    a1 = kernels.AtomSet.from_elements(["C", "O"], [[0, 0, 0], [1, 1, 1]], [10.0, 20.0])
    a2 = kernels.AtomSet.from_elements(["C", "O"], [[0, 0, 0], [1, 1, 1]], [10.0, 20.0])
    assert a1 == a2 and not (a1 != a2)
    assert a1 != a1.replace(b_iso=torch.tensor([10.0, 21.0], dtype=torch.float64))
    assert a1 != a1.to(dtype=torch.float32) and a1 != a1.select([0])
    with pytest.raises(TypeError, match="unhashable"):
        hash(a1)


def test_a_model_read_twice_gives_equal_cells_grids_and_atoms():
    m1, m2 = kernels.read_model(STRUCTURES["1orc"]), kernels.read_model(STRUCTURES["1orc"])
    assert m1.cell == m2.cell and m1.atoms == m2.atoms
    assert kernels.GridSpec.for_spacing(m1.cell, 1.0, m1.spacegroup) == kernels.GridSpec.for_spacing(
        m2.cell, 1.0, m2.spacegroup
    )
