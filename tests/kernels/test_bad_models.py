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


# --------------------------------------------------------------------------- ANISOU and its atom

# Two atoms of one residue; each ANISOU repeats columns 7-27 of the atom record it follows.
ATOM_1 = "ATOM      1  CA  ALA A   1       1.000   2.000   3.000  1.00 10.00           C\n"
ATOM_2 = "ATOM      2  CB  ALA A   1       2.500   2.000   3.000  1.00 10.00           C\n"
U_COLUMNS = "   2000   2000   2000      0      0      0       C\n"  # U = 0.2 Å² (B 15.8 Å²)


def anisou_of(atom_line: str, **columns: str) -> str:
    """The ANISOU record of ``atom_line``, with the given 1-based column ranges ("7-11") replaced."""
    line = "ANISOU" + atom_line[6:27] + " " + U_COLUMNS
    for span, value in columns.items():
        first, last = (int(c) for c in span[1:].split("_"))
        assert len(value) == last - first + 1
        line = line[: first - 1] + value + line[last:]
    return line


STRAY = [
    # (id, records after CRYST1, what the message must name besides the ANISOU and its line)
    ("serial-of-another-atom", ATOM_1 + anisou_of(ATOM_2) + ATOM_2, ["line 3", "serial '2' vs '1'", "'ATOM      1"]),
    ("name-of-another-atom", ATOM_1 + anisou_of(ATOM_1, c13_16=" CB ") + ATOM_2, ["atom name 'CB' vs 'CA'"]),
    ("atom-not-in-file", ATOM_1 + anisou_of(ATOM_1, c7_11="   99", c13_16=" OG ") + ATOM_2,
     ["serial '99' vs '1'", "atom name 'OG' vs 'CA'"]),
    ("other-residue-number", ATOM_1 + anisou_of(ATOM_1, c23_26="   2") + ATOM_2, ["residue number '2' vs '1'"]),
    ("other-residue-name", ATOM_1 + anisou_of(ATOM_1, c18_20="GLY") + ATOM_2, ["residue name 'GLY' vs 'ALA'"]),
    ("other-chain", ATOM_1 + anisou_of(ATOM_1, c22_22="B") + ATOM_2, ["chain 'B' vs 'A'"]),
    ("other-altloc", ATOM_1 + anisou_of(ATOM_1, c17_17="B") + ATOM_2, ["altloc 'B' vs 'blank'"]),
    ("other-icode", ATOM_1 + anisou_of(ATOM_1, c27_27="A") + ATOM_2, ["insertion code 'A' vs 'blank'"]),
    ("hybrid36-serial", ATOM_1.replace("    1", "A0000", 1) + anisou_of(ATOM_1, c7_11="A0001") + ATOM_2,
     ["serial 'A0001' vs 'A0000'"]),
    ("after-ter", ATOM_1 + "TER       2      ALA A   1\n" + anisou_of(ATOM_1) + ATOM_2, ["line 4", "follows line 3 (TER)"]),
    ("before-any-atom", anisou_of(ATOM_1) + ATOM_1 + ATOM_2, ["line 2", "follows line 1 (CRYST1)"]),
    ("twice", ATOM_1 + anisou_of(ATOM_1) + anisou_of(ATOM_1) + ATOM_2, ["line 4", "follows line 3 (ANISOU)"]),
    ("after-a-remark", ATOM_1 + "REMARK   1 x\n" + anisou_of(ATOM_1) + ATOM_2, ["line 4", "follows line 3 (REMARK)"]),
    ("hetatm-of-another-atom", ATOM_1 + ATOM_2.replace("ATOM  ", "HETATM") + anisou_of(ATOM_1) + "END\n",
     ["line 4", "HETATM record", "serial '1' vs '2'"]),
]  # fmt: skip


@pytest.mark.parametrize("records, expected", [c[1:] for c in STRAY], ids=[c[0] for c in STRAY])
def test_anisou_that_is_not_its_atoms_is_refused_naming_both_records(tmp_path, records, expected):
    path = tmp_path / "m.pdb"
    path.write_text(cryst1() + records + "END\n")
    with pytest.raises(kernels.ModelError) as info:
        kernels.read_model(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line ") and "the ANISOU record 'ANISOU" in message, message
    for part in [*expected, "on_bad_adp='iso'"]:
        assert part in message, f"{part!r} not in: {message}"


@pytest.mark.parametrize("records", [c[1] for c in STRAY], ids=[c[0] for c in STRAY])
def test_on_bad_adp_iso_leaves_a_stray_anisou_out_with_a_warning(tmp_path, records):
    """The atom the U would have landed on keeps its isotropic B: the same atoms as without the record."""
    path, plain = tmp_path / "m.pdb", tmp_path / "plain.pdb"
    path.write_text(cryst1() + records + "END\n")
    kept = [line for line in records.splitlines(keepends=True) if not line.startswith("ANISOU")]
    # The ANISOU records that do belong to their atom stay in the reference file too.
    lines = records.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("ANISOU") and i and lines[i - 1][6:27] == line[6:27] and lines[i - 1][:6] != "ANISOU":
            kept.insert(kept.index(lines[i - 1]) + 1, line)
    plain.write_text(cryst1() + "".join(kept) + "END\n")
    with pytest.warns(UserWarning, match="left out: no atom takes its U"):
        model = kernels.read_model(path, on_bad_adp="iso")
    reference = kernels.read_model(plain)
    assert model.atoms == reference.atoms
    assert any("left out" in note for note in model.notes)


def test_anisou_that_matches_its_atom_reads_silently(tmp_path):
    """The same atom written differently (name not padded, ``*****`` serials, a SIGATM between) is no mismatch."""
    unpadded = anisou_of(ATOM_1, c13_16="CA  ")
    stars = ATOM_1.replace("    1", "*****", 1)
    sigatm = "SIGATM    2  CB  ALA A   1       0.010   0.010   0.010  0.00  0.10           C\n"
    for records in (
        ATOM_1 + unpadded + ATOM_2 + anisou_of(ATOM_2),
        stars + anisou_of(stars) + ATOM_2,
        stars + anisou_of(ATOM_1) + ATOM_2,  # a serial that does not parse is not compared
        ATOM_1 + ATOM_2 + sigatm + anisou_of(ATOM_2),
    ):
        path = tmp_path / "m.pdb"
        path.write_text(cryst1() + records + "END\n")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = kernels.read_model(path)
        assert model.atoms.aniso is not None and int(model.atoms.aniso.sum()) == records.count("ANISOU")


def anisotrop(rows: list[str], extra_columns: str = "") -> str:
    """A ``_atom_site_anisotrop`` loop after :func:`cif`'s two atoms (rows: id, type, six U)."""
    head = "loop_\n_atom_site_anisotrop.id\n_atom_site_anisotrop.type_symbol\n" + extra_columns
    head += "".join(f"_atom_site_anisotrop.U[{i}][{j}]\n" for i, j in ((1, 1), (2, 2), (3, 3), (1, 2), (1, 3), (2, 3)))
    return cif() + head + "".join(row + "\n" for row in rows)


@pytest.mark.parametrize(
    "rows, expected",
    [
        (["1 N 0.18X3 0.2 0.2 0 0 0", "2 C 0.2 0.2 0.2 0 0 0"], ["row 1 (id 1)", "U[1][1]", "'0.18X3', not a number"]),
        (["1 N 0.2 0.2 0.2 0 0 0", "2 C 0.2 ? 0.2 0 0 0"], ["row 2 (id 2)", "U[2][2]", "unknown (? or .)"]),
        (["1 N 0.2 0.2 0.2 0 0 nan", "2 C 0.2 0.2 0.2 0 0 0"], ["row 1 (id 1)", "U[2][3]", "'nan', a non-finite"]),
        (["1 N 0.2 0.2 0.2 0 . 0", "2 C 0.2 0.2 0.2 0 0 0"], ["row 1 (id 1)", "U[1][3]", "unknown (? or .)"]),
        (["1 N 0.2 0.2 0.2 0 0 0", "2 C 0.2 0.2 1e 0 0 0"], ["row 2 (id 2)", "U[3][3]", "'1e', not a number"]),
        (["1 N 0.2 0.2 0.2 0 0 0", "2 C 0.2 1e999 0.2 0 0 0"], ["row 2 (id 2)", "U[2][2]", "'1e999', a non-finite"]),
    ],
    ids=["letter", "question-mark", "nan", "dot", "cut-exponent", "overflow"],
)
def test_mmcif_anisotrop_value_that_is_not_a_number_names_column_row_and_value(tmp_path, rows, expected):
    path = tmp_path / "m.cif"
    path.write_text(anisotrop(rows))
    for on_bad_adp in ("raise", "iso"):  # a value that is not a number is no U to fall back from
        with pytest.raises(kernels.ModelError) as info:
            kernels.read_model(path, on_bad_adp=on_bad_adp)
        message = str(info.value)
        assert "not positive definite" not in message and "_atom_site_anisotrop" in message, message
        for part in expected:
            assert part in message, f"{part!r} not in: {message}"


@pytest.mark.parametrize(
    "rows, columns, expected",
    [
        (["7 N 0.2 0.2 0.2 0 0 0", "2 C 0.2 0.2 0.2 0 0 0"], "", ["row 1 (id 7) names no atom"]),
        (["1 C 0.2 0.2 0.2 0 0 0", "2 C 0.2 0.2 0.2 0 0 0"], "", ["type_symbol is 'C'", "type_symbol is 'N'"]),
        (["1 N CB 0.2 0.2 0.2 0 0 0", "2 C CA 0.2 0.2 0.2 0 0 0"], "_atom_site_anisotrop.pdbx_label_atom_id\n",
         ["row 1 (id 1) gives its U to row 1", "pdbx_label_atom_id is 'CB'", "label_atom_id is 'N'"]),
    ],
    ids=["unknown-id", "other-element", "other-atom-name"],
)  # fmt: skip
def test_mmcif_anisotrop_row_of_another_atom_is_refused_or_left_out(tmp_path, rows, columns, expected):
    path = tmp_path / "m.cif"
    path.write_text(anisotrop(rows, columns))
    with pytest.raises(kernels.ModelError) as info:
        kernels.read_model(path)
    for part in [*expected, "on_bad_adp='iso'"]:
        assert part in str(info.value), str(info.value)
    with pytest.warns(UserWarning, match="left out: no atom takes its U"):
        model = kernels.read_model(path, on_bad_adp="iso")
    assert model.atoms.aniso[0].item() is False  # atom 1 keeps its isotropic B
    assert model.atoms.b_iso[0].item() == 10.0


# --------------------------------------------------------------------------- implausible U


@pytest.mark.parametrize(
    "u, narrowest",
    [
        ("      1      1      1      0      0      0", "0.0001"),  # U = 1e-4 Å² (B 0.008 Å²)
        ("   2000   2000     10      0      0      0", "0.001"),  # flat along z: B 0.08 Å² there
        ("   2000   2000   2000   1995      0      0", "0.0005"),  # flat along a diagonal
    ],
    ids=["tiny", "flat-axis", "flat-diagonal"],
)
def test_u_below_zero_point_motion_warns_naming_the_atom(tmp_path, u, narrowest):
    path = tmp_path / "m.pdb"
    path.write_text(cryst1() + ATOM_1 + anisou_of(ATOM_1)[:28] + u + "       C\n" + ATOM_2 + "END\n")
    with pytest.warns(UserWarning, match=r"atom A/ALA 1/CA \(index 0\): B along its U's narrowest axis") as record:
        kernels.read_model(path)
    message = next(str(w.message) for w in record if "narrowest" in str(w.message))
    assert f"8π² × {narrowest}" in message and "below 0.5 Å²" in message, message


def test_u_of_1e8_in_mmcif_warns_and_a_plausible_u_does_not(tmp_path):
    path = tmp_path / "m.cif"
    path.write_text(anisotrop(["1 N 1e-8 1e-8 1e-8 0 0 0", "2 C 0.2 0.2 0.2 0 0 0"]))
    with pytest.warns(UserWarning, match=r"atom A/ALA 1/N \(index 0\): B along its U's narrowest axis"):
        kernels.read_model(path)
    path.write_text(anisotrop(["1 N 0.1 0.2 0.3 0.01 0.02 0.03", "2 C 0.2 0.2 0.2 0 0 0"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.read_model(path)


def test_atomset_checks_u_like_b():
    """The check is the AtomSet's, so every way atoms are made gets it, not only read_model."""
    xyz, b = np.zeros((2, 3)), [20.0, 20.0]
    u = [[0.2, 0.2, 0.2, 0, 0, 0], [1e-8, 1e-8, 1e-8, 0, 0, 0]]
    with pytest.warns(UserWarning, match=r"\(index 1\): B along its U's narrowest axis, 8π² × 1e-08 Å²"):
        kernels.AtomSet.from_elements(["C", "C"], xyz, b, u_aniso=u)
    u[1] = [float("nan")] * 6  # atom 1 isotropic at B 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.AtomSet.from_elements(["C", "C"], xyz, b, u_aniso=u)


def test_u_singular_after_the_float32_cast_says_so(tmp_path):
    # U12 = U11 - 1e-9: positive definite in float64 (smallest eigenvalue 1e-9 Å²), singular in float32.
    u = torch.tensor([[0.2, 0.2, 0.3, 0.2 - 1e-9, 0.0, 0.0]], dtype=torch.float64)
    assert torch.linalg.eigvalsh(kernels.adp.u_matrix(u))[0, 0] > 0
    path = tmp_path / "m.cif"  # gemmi stores U in float32: the file's U is refused at read time
    path.write_text(anisotrop([f"1 N {' '.join(repr(v) for v in u[0].tolist())}", "2 C 0.2 0.2 0.2 0 0 0"]))
    with pytest.raises(kernels.ModelError, match="singular within float32 rounding: gemmi stores U in float32"):
        kernels.read_model(path)
    with pytest.warns(UserWarning, match="narrowest axis"):
        atoms = kernels.AtomSet.from_elements(["C"], np.zeros((1, 3)), [20.0], u_aniso=u.numpy())
    grid = kernels.GridSpec(kernels.Cell.from_parameters(10, 10, 10), (10, 10, 10))
    kernels.splat_density(atoms, grid, backend="reference")  # float64: positive definite, splatted
    with pytest.raises(ValueError, match=r"singular within torch.float32 rounding.*cast to torch.float32"):
        kernels.splat_density(atoms.to(dtype=torch.float32), grid, backend="cpu")
