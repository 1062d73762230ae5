"""The steps of :func:`kernels.read_model`, from a file's bytes to checked atom tensors.

Each step takes what the earlier ones made and appends what it changed or assumed to ``notes``
(the model's notes; each such note is also a warning). A step's warnings point at the caller of
``read_model`` (``stacklevel`` counts the step and ``read_model``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from kernels import _model_file
from kernels._model_file import ModelError
from kernels._util import file_problem, positive_number
from kernels.atoms import AtomLabel, AtomSet
from kernels.cell import MIN_CELL_WIDTH, Cell, _cell_problem, _format_cell
from kernels.form_factors import RADIATIONS, form_factor_coefficients

MODEL_SUFFIXES = (".pdb", ".ent", ".cif", ".mmcif")

# warnings.warn's stacklevel for a warning raised in a step (3) or in a helper of a step (4):
# the frames of the step (and helper), read_model, then read_model's caller.
_STEP = 3
_HELPER = 4


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """The arguments of :func:`kernels.read_model`, checked."""

    is_cif: bool
    model_index: int
    index_given: bool
    altlocs: str
    water: bool
    hydrogens: bool
    box_padding: float | None
    adp: str
    on_bad_adp: str
    radiation: str
    max_bytes: int


@dataclasses.dataclass
class Source:
    """The file as gemmi read it, with what the field checks found.

    ``raw_cell`` is the cell as the file writes it (None: none); ``block`` the mmCIF block read
    (None for PDB); ``cif_scan`` the mmCIF field checks (None for PDB).
    """

    structure: object
    raw_cell: tuple[float, ...] | None
    cell_source: str
    block: object = None
    cif_scan: _model_file.CifScan | None = None


@dataclasses.dataclass
class Columns:
    """One entry per atom kept, in the structure's order (chain → residue → atom)."""

    rows: list
    labels: tuple[AtomLabel, ...]
    elements: tuple[str, ...]
    xyz: np.ndarray
    occ: np.ndarray
    b_iso: np.ndarray


def check_arguments(path: Path, where: str, **given) -> ReadOptions:
    """``read_model``'s keyword arguments as :class:`ReadOptions`; ModelError naming the first bad one."""
    for name, allowed in (("adp", ("auto", "iso")), ("on_bad_adp", ("raise", "iso")), ("radiation", RADIATIONS)):
        if given[name] not in allowed:
            raise ModelError(f"{where}: {name} must be one of {allowed}, got {given[name]!r}")
    problem = file_problem(path)
    if problem:
        raise ModelError(f"{where}: {problem}")
    name = path.name.lower()
    stem = name[:-3] if name.endswith(".gz") else name
    if not stem.endswith(MODEL_SUFFIXES):
        raise ModelError(f"{where}: unknown model format; expected one of {', '.join(MODEL_SUFFIXES)} (optionally .gz)")
    altlocs = given["altlocs"]
    if not isinstance(altlocs, str) or (
        altlocs not in ("all", "first") and not (len(altlocs) == 1 and altlocs.isalnum())
    ):
        raise ModelError(f"{where}: altlocs must be 'all', 'first' or one altloc letter, got {altlocs!r}")
    model_index = 0 if given["model_index"] is None else given["model_index"]
    if isinstance(model_index, (bool, np.bool_)) or not isinstance(model_index, (int, np.integer)):
        raise ModelError(f"{where}: model_index must be an integer (0 = the first model), got {model_index!r}")
    max_bytes = given["max_bytes"]
    if isinstance(max_bytes, (bool, np.bool_)) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
        raise ModelError(f"{where}: max_bytes must be a positive integer (bytes of text), got {max_bytes!r}")
    box_padding = given["box_padding"]
    if box_padding is not None:
        try:
            box_padding = positive_number(box_padding, "box_padding", "Å")
        except ValueError as exc:
            raise ModelError(f"{where}: {exc}") from None
    return ReadOptions(
        is_cif=stem.endswith((".cif", ".mmcif")),
        model_index=int(model_index),
        index_given=given["model_index"] is not None,
        altlocs=altlocs,
        water=given["water"],
        hydrogens=given["hydrogens"],
        box_padding=box_padding,
        adp=given["adp"],
        on_bad_adp=given["on_bad_adp"],
        radiation=given["radiation"],
        max_bytes=max_bytes,
    )


def parse(path: Path, where: str, opts: ReadOptions, notes: list[str]) -> Source:
    """Read and check the file's text, refuse a cell no crystal has, and let gemmi build the structure.

    ANISOU records (mmCIF anisotrop rows) that are not their atom's are refused or, with
    ``on_bad_adp="iso"``, left out with a note.
    """
    import gemmi

    data, _ = _model_file.read_model_bytes(path, where, opts.is_cif, opts.max_bytes)
    if opts.is_cif:
        doc = _gemmi_read(where, gemmi.cif.read_string, data)
        blocks = [b for b in doc if b.find_mmcif_category("_atom_site.")]
        block = blocks[0] if blocks else doc[0]
        cif_scan = _model_file.scan_mmcif(block, where)
        source = Source(None, _model_file.cif_cell_values(block, where), "_cell", block, cif_scan)
    else:
        data = _model_file.unix_newlines(data)
        pdb_scan = _model_file.scan_pdb(data, where)
        if pdb_scan.stray_anisou:
            _stray_anisou([m for _, _, m in pdb_scan.stray_anisou], where, opts.on_bad_adp, notes)
            data = _model_file.drop_records(data, pdb_scan.stray_anisou)
        source = Source(None, pdb_scan.cell, "CRYST1")
    # A cell no crystal has is refused before gemmi sees it (gemmi stops at some, not others).
    raw_cell = source.raw_cell
    if raw_cell is not None and raw_cell[:3] != (1.0, 1.0, 1.0):
        problem = _cell_problem(raw_cell)
        if problem:
            raise ModelError(
                f"{where}: impossible unit cell in {source.cell_source} ({_format_cell(raw_cell)}): {problem}. Fix "
                f"{source.cell_source}; for a model without a cell remove it and pass box_padding=<Å> "
                "(--box-padding) for a P 1 box"
            )
    if opts.is_cif:
        source.structure = _gemmi_read(where, gemmi.make_structure_from_block, source.block)
        if source.cif_scan.stray_anisou:
            _stray_anisou([m for _, m in source.cif_scan.stray_anisou], where, opts.on_bad_adp, notes)
            _clear_aniso(source.structure, {i for i, _ in source.cif_scan.stray_anisou if i is not None})
    else:
        if pdb_scan.pad_short_lines:
            data = _model_file.pad_short_atom_lines(data)
        source.structure = _gemmi_read(where, gemmi.read_pdb_string, data)
    source.structure.merge_chain_parts()
    return source


def select_model(source: Source, where: str, opts: ReadOptions, notes: list[str]) -> int:
    """Keep only model ``opts.model_index`` of the structure; return how many models the file holds."""
    st = source.structure
    if len(st) == 0:
        rows = f" from the {source.cif_scan.n_rows} rows of its _atom_site table" if source.cif_scan else ""
        raise ModelError(f"{where}: gemmi read no atoms{rows}: the file has no models")
    if not 0 <= opts.model_index < len(st):
        raise ModelError(
            f"{where}: model_index {opts.model_index} out of range; the file has {len(st)} model(s) "
            f"(model_index 0 to {len(st) - 1})"
        )
    n_models = len(st)
    if n_models > 1 and not opts.index_given:
        notes.append(
            f"the file holds {n_models} models; model 1 (MODEL {st[0].num}) was read. Choose another with "
            f"model_index= (0-based; --model N, 1-based, on the command line), or splat all {n_models} as one "
            "ensemble map with kernels.splat_ensemble (workbench ensemble on the command line)"
        )
    for i in range(len(st) - 1, -1, -1):
        if i != opts.model_index:
            del st[i]
    return n_models


def atom_columns(source: Source, where: str, opts: ReadOptions, notes: list[str]) -> Columns:
    """The atoms the filters keep, as label, element, position, occupancy and B columns.

    Refuses a model left without atoms and an atom without an element; notes the occupancies
    taken as 1 and the B derived from ANISOU.
    """
    st = source.structure
    n_read = sum(len(res) for chain in st[0] for res in chain)
    if not opts.water:
        st.remove_waters()
    if not opts.hydrogens:
        st.remove_hydrogens()
    if opts.altlocs == "first":
        st.remove_alternative_conformations()
    elif opts.altlocs != "all":
        _keep_altloc(st, opts.altlocs)
    st.remove_empty_chains()
    rows = [(chain.name, res, atom) for chain in st[0] for res in chain for atom in res]
    if not rows:
        if n_read == 0:
            raise ModelError(f"{where}: model {opts.model_index} of the file has no atoms")
        raise ModelError(
            f"{where}: none of the {n_read} atoms of model {opts.model_index} is left after the filters "
            f"(water={opts.water}, hydrogens={opts.hydrogens}, altlocs={opts.altlocs!r}): relax them"
        )

    labels = tuple(
        AtomLabel(ch, res.name, res.seqid.num, res.seqid.icode, atom.name, atom.altloc if atom.altloc != "\0" else "")
        for ch, res, atom in rows
    )
    for i, (_, _, atom) in enumerate(rows):
        if atom.element.atomic_number == 0:
            # Unknown symbols written in the file were reported by the field checks; what is
            # left is a PDB atom with blank element columns whose name gemmi cannot read.
            raise ModelError(
                f"{where}: atom {labels[i]} has no element: columns 77-78 are blank and gemmi cannot tell the "
                f"element from its name {atom.name!r}; write its element symbol in columns 77-78"
            )
    columns = Columns(
        rows,
        labels,
        tuple(atom.element.name for _, _, atom in rows),
        np.array([atom.pos.tolist() for _, _, atom in rows], dtype=np.float64),
        np.array([atom.occ for _, _, atom in rows], dtype=np.float64),
        np.array([atom.b_iso for _, _, atom in rows], dtype=np.float64),
    )
    cif_scan = source.cif_scan
    if cif_scan is not None and cif_scan.occupancy_defaulted:
        n_def = cif_scan.occupancy_defaulted
        first = "" if n_def == cif_scan.n_rows else f", first {cif_scan.occupancy_first}"
        what = "no _atom_site.occupancy column" if n_def == cif_scan.n_rows else "occupancy ? or ."
        msg = f"{n_def} atom(s) have no occupancy ({what}{first}); taken as 1"
        warnings.warn(f"{where}: {msg}", stacklevel=_STEP)
        notes.append(msg)
    # ANISOU atoms: splat the file's isotropic B (gemmi's b_iso); derive it from U only
    # where the file gives none.
    derived = 0
    for i, (_, _, atom) in enumerate(rows):
        if not columns.b_iso[i] > 0 and atom.aniso.nonzero():
            u = atom.aniso
            columns.b_iso[i] = 8 * math.pi**2 * (u.u11 + u.u22 + u.u33) / 3
            derived += 1
    if derived:
        msg = f"{derived} atom(s) had no isotropic B; used 8π²·trace(U)/3 from their ANISOU"
        warnings.warn(f"{where}: {msg}", stacklevel=_STEP)
        notes.append(msg)
    return columns


def place_in_cell(
    source: Source, columns: Columns, where: str, opts: ReadOptions, notes: list[str]
) -> tuple[Cell, str, tuple[float, float, float] | None]:
    """The model's cell, space group and shift (Å; None when the atoms stay where the file puts them).

    The file's cell, checked against its space group; or, for a file without one and with
    ``box_padding``, a P 1 box around the atoms, which are moved into it (``columns.xyz`` and
    the structure both).
    """
    import gemmi

    st, raw_cell = source.structure, source.raw_cell
    if raw_cell is not None and raw_cell[:3] != (1.0, 1.0, 1.0):
        if tuple(st.cell.parameters) != tuple(raw_cell):
            st.cell = gemmi.UnitCell(*raw_cell)
        try:
            cell = Cell.from_gemmi(st.cell)
        except ValueError as exc:
            raise ModelError(f"{where}: {exc}") from exc
        return cell, _spacegroup(st, cell, where, source.cell_source, notes), None
    if opts.box_padding is None:
        raise ModelError(
            f"{where}: the file has no unit cell ({source.cell_source} missing or 1×1×1): pass box_padding=<Å> "
            "(--box-padding on the command line) to build a P 1 box around the atoms"
        )
    xyz = columns.xyz
    finite = np.isfinite(xyz).all(axis=1)
    if not finite.any():
        raise ModelError(f"{where}: no atom has finite coordinates, so no box can be built around them")
    lo, hi = xyz[finite].min(axis=0), xyz[finite].max(axis=0)
    edges = hi - lo + 2 * opts.box_padding
    if edges.min() < MIN_CELL_WIDTH:
        axis = int(edges.argmin())
        raise ModelError(
            f"{where}: box_padding={opts.box_padding:g} Å builds a box {edges[axis]:.3g} Å wide along "
            f"{'xyz'[axis]} (the atoms span {hi[axis] - lo[axis]:.3g} Å there), narrower than one atom "
            f"(at least {MIN_CELL_WIDTH} Å): every atom would overlap its own periodic images. Pass a padding of a "
            "few Å, about the radius of an atom's density"
        )
    cell = Cell.from_parameters(*edges)
    shift = opts.box_padding - lo
    columns.xyz = xyz + shift
    st.cell = cell.to_gemmi()
    st.spacegroup_hm = "P 1"
    for (_, _, atom), p in zip(columns.rows, columns.xyz):
        atom.pos = gemmi.Position(*p)
    notes.append(
        f"no unit cell in the file: built a P 1 box {edges[0]:.2f}×{edges[1]:.2f}×{edges[2]:.2f} Å "
        f"with {opts.box_padding:g} Å padding (atoms shifted by {shift.round(3).tolist()} Å)"
    )
    return cell, "P 1", tuple(float(v) for v in shift)


def displacements(
    source: Source, columns: Columns, where: str, opts: ReadOptions, notes: list[str]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(u_aniso (N, 6), aniso (N,))`` of the atoms with ANISOU, or ``(None, None)`` for an isotropic model.

    With ``adp="iso"``, or no ANISOU in the file, the model is isotropic. A U that is not
    positive definite is refused, or (``on_bad_adp="iso"``) its atom turned isotropic with a note.
    """
    if opts.adp != "auto":
        return None, None
    rows = columns.rows
    flags = np.array([atom.aniso.nonzero() for _, _, atom in rows], dtype=bool)
    if not flags.any():
        return None, None
    u_aniso = np.zeros((len(rows), 6))
    for i in np.flatnonzero(flags):
        u = rows[i][2].aniso
        u_aniso[i] = (u.u11, u.u22, u.u33, u.u12, u.u13, u.u23)
    if opts.is_cif and not np.isfinite(u_aniso[flags]).all():
        _model_file.check_anisotrop_values(source.block, where)  # gemmi's NaN for a value that is no number
    _check_adp(u_aniso, flags, columns.labels, where, opts.on_bad_adp, notes)
    return u_aniso, flags


def atom_set(columns: Columns, u_aniso, flags, where: str, radiation: str) -> AtomSet:
    """The checked :class:`AtomSet` (float64, CPU), its form factors from ``radiation``'s table."""
    try:
        a, b = form_factor_coefficients(columns.elements, radiation, columns.labels)
        return AtomSet(
            torch.from_numpy(columns.xyz),
            torch.from_numpy(columns.b_iso),
            torch.from_numpy(columns.occ),
            a,
            b,
            columns.elements,
            columns.labels,
            None if u_aniso is None else torch.from_numpy(u_aniso),
            None if flags is None else torch.from_numpy(flags),
            radiation=radiation,
        ).check()
    except ValueError as exc:
        raise ModelError(f"{where}: {exc}") from exc


def _check_adp(u_aniso: np.ndarray, flags: np.ndarray, labels, where: str, on_bad_adp: str, notes: list[str]) -> None:
    """Refuse, or (``on_bad_adp="iso"``) turn isotropic in place, the atoms whose U is not positive definite."""
    from kernels.adp import bad_adp, rounding_margin

    bad, _finite, lam = bad_adp(torch.from_numpy(u_aniso), torch.from_numpy(flags))
    if not bad.any():
        return
    idx = bad.nonzero().flatten().tolist()
    lam = lam.numpy()
    described = [f"{labels[i]} (eigenvalues {', '.join(f'{v:.4g}' for v in lam[i])} Å²)" for i in idx[:5]]
    # gemmi keeps U in float32: values positive definite in the file can be singular once rounded.
    rounded = [
        i
        for i in idx
        if np.isfinite(lam[i]).all() and abs(lam[i][0]) <= rounding_margin(torch.float32) * abs(lam[i]).max()
    ]
    note = (
        f"; of these, {len(rounded)} ({labels[rounded[0]]} first) are singular within float32 rounding: gemmi "
        "stores U in float32, and that cast makes a U this close to singular lose positive definiteness even "
        "where the file's values have it"
        if rounded
        else ""
    )
    more = f" and {len(idx) - 5} more" if len(idx) > 5 else ""
    what = f"{len(idx)} atom(s) have an ANISOU U that is not positive definite: {'; '.join(described)}{more}{note}"
    if on_bad_adp == "raise":
        raise ModelError(
            f"{where}: {what}. No Gaussian has that shape. Read with on_bad_adp='iso' to splat these atoms at "
            "their isotropic B (the others stay anisotropic), or adp='iso' for an isotropic model"
        )
    flags[idx] = False
    u_aniso[idx] = 0.0
    msg = f"{what}; splatted at their isotropic B instead"
    warnings.warn(f"{where}: {msg}", stacklevel=_HELPER)
    notes.append(msg)


def _stray_anisou(messages: list[str], where: str, on_bad_adp: str, notes: list[str]) -> None:
    """Refuse ANISOU records (or ``_atom_site_anisotrop`` rows) that are not their atom's, or warn.

    With ``on_bad_adp="iso"`` the caller leaves them out: no atom takes their U, and the atom
    gemmi would have given it stays isotropic at its B.
    """
    more = f" ({len(messages) - 1} more such ANISOU records)" if len(messages) > 1 else ""
    if on_bad_adp == "raise":
        raise ModelError(
            f"{where}: {messages[0]}{more}. Give each atom its own ANISOU record (in PDB right after its "
            "ATOM/HETATM record, with the same serial, name, residue, chain and altloc), or remove the record; "
            "or read with on_bad_adp='iso' to leave such records out"
        )
    msg = (
        f"{messages[0]}{more}; left out: no atom takes its U (the atom it would have gone to stays isotropic at its B)"
    )
    warnings.warn(f"{where}: {msg}", stacklevel=_HELPER)
    notes.append(msg)


def _clear_aniso(st, serials: set[str]) -> None:
    """Make the atoms with these ``_atom_site.id`` values isotropic (U all zero, as gemmi marks it)."""
    if not serials:
        return
    for model in st:
        for chain in model:
            for res in chain:
                for atom in res:
                    if str(atom.serial) in serials:
                        atom.aniso = type(atom.aniso)(0, 0, 0, 0, 0, 0)


def _gemmi_read(where: str, fn, *args):
    """``fn(*args)`` with gemmi's parse errors turned into a ModelError naming the file."""
    try:
        return fn(*args)
    except (RuntimeError, ValueError, OSError) as exc:
        # gemmi's text can span lines and end in a newline or a full stop: one clean sentence.
        detail = " ".join(str(exc).split()).rstrip(".;: ")
        raise ModelError(
            f"{where}: cannot read the file: {detail}. Is it complete and in PDB or mmCIF format?"
        ) from exc


# Crystal system -> the cell metric its space groups need (said when a cell contradicts one).
_SYSTEM_RULES = {
    "monoclinic": "two of the angles 90°",
    "orthorhombic": "α = β = γ = 90°",
    "tetragonal": "a = b and α = β = γ = 90°",
    "trigonal": "a = b, α = β = 90°, γ = 120° (hexagonal axes) or a = b = c, α = β = γ (rhombohedral axes)",
    "hexagonal": "a = b, α = β = 90°, γ = 120°",
    "cubic": "a = b = c and α = β = γ = 90°",
}


def _spacegroup(st, cell: Cell, where: str, source: str, notes: list[str]) -> str:
    """The model's space group name, checked against its cell.

    Unknown or missing group: P 1 with a warning (the asymmetric-unit map is still right;
    only symmetry mates are lost, and the user may mean P 1). A group whose symmetry the
    cell's metric breaks by more than 0.1 % of its largest term (~0.05 % in a length,
    ~0.06° in an angle): ModelError, as symmetry mates and the grid would be wrong. Within
    that but beyond gemmi's own 10⁻³ Å² test: a warning (rounded or unconstrained cells).
    """
    import gemmi

    hm = st.spacegroup_hm.strip()
    sg = st.find_spacegroup()
    if sg is None:
        msg = (
            f"space group {hm!r} is not one gemmi knows; using P 1 (no symmetry mates)"
            if hm
            else "the file gives no space group; using P 1 (no symmetry mates)"
        )
        warnings.warn(
            f"{where}: {msg}: fix the space group in {'CRYST1 columns 56-66' if source == 'CRYST1' else 'the file'}",
            stacklevel=_HELPER,
        )
        notes.append(msg)
        return "P 1"
    unit_cell = gemmi.UnitCell(*cell.parameters)
    if not unit_cell.is_compatible_with_spacegroup(sg):
        scale = max(cell.parameters[:3]) ** 2
        system = sg.crystal_system_str()
        if not unit_cell.is_compatible_with_spacegroup(sg, 1e-3 * scale):
            rule = _SYSTEM_RULES.get(system, "a cell its symmetry maps onto itself")
            raise ModelError(
                f"{where}: the space group {sg.hm} ({system}) does not fit the cell in {source} "
                f"({_format_cell(cell.parameters)}): a {system} group needs {rule}. Fix the cell or the space "
                "group (P 1 fits any cell)"
            )
        msg = (
            f"the cell ({_format_cell(cell.parameters)}) fits {sg.hm} ({system}) only approximately "
            "(within 0.1 % of its metric); symmetry mates are placed with the group's exact operators"
        )
        warnings.warn(f"{where}: {msg}", stacklevel=_HELPER)
        notes.append(msg)
    return sg.hm


def _keep_altloc(st, letter: str):
    for chain in st[0]:
        for res in chain:
            for i in range(len(res) - 1, -1, -1):
                alt = res[i].altloc
                if alt not in ("\0", " ", "", letter):
                    del res[i]
