"""Checks on a model file's bytes and fields before gemmi reads them.

gemmi reads leniently: a field ``1O.OOO`` becomes 1, a blank occupancy 0, a line cut short
takes default occupancy and B, a binary or empty file is "a structure with no atoms". These
functions find such problems first, in one pass over the text, and raise
:class:`kernels.ModelError` saying which file, line/row, atom, field and value is wrong.
Only the numbers that shape the map are checked (coordinates, occupancy, B, ANISOU U, the
cell); serial and residue numbers may be hybrid-36 and are labels, left to gemmi.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import re
import zlib

import numpy as np

from kernels._util import format_size

#: The most text (bytes after decompressing) :func:`kernels.read_model` reads unless ``max_bytes`` says more.
MAX_MODEL_BYTES = 2 * 2**30


class ModelError(ValueError):
    """A model file cannot be turned into atoms: the message names the file and the problem."""


ModelError.__module__ = "kernels.crystal"  # where users import it from (defined here, below every module raising it)

# One decimal number as PDB and mmCIF write them: optional sign, digits with at most one
# point, optional exponent; mmCIF may append a standard uncertainty in parentheses.
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_CIF_NUMBER = re.compile(rf"{_NUMBER}(?:\(\d+\))?")
_CIF_COLUMN = re.compile(rf"(?:{_NUMBER}(?:\(\d+\))?\n)*{_NUMBER}(?:\(\d+\))?")
_NUMBER_RE = re.compile(rf"\s*{_NUMBER}\s*")
# Bytes a text file may hold: tab, newlines, form feed, printable ASCII and any byte ≥ 128
# (UTF-8 or Latin-1 text in remarks). Anything else is binary data.
_TEXT_BYTES = bytes([9, 10, 11, 12, 13, *range(32, 127), *range(128, 256)])
_PDB_RECORDS = re.compile(
    rb"^(?:ATOM  |HETATM|CRYST1|HEADER|REMARK|MODEL |ENDMDL|TER|END|SEQRES|ANISOU|SCALE|ORIGX|COMPND|SOURCE|TITLE )",
    re.M,
)
_CIF_HEADER = re.compile(rb"\A(?:\s*#[^\n]*\n|\s+)*data_", re.S)
# Lines that start mmCIF tables where a PDB file has records: no PDB line starts with these.
_CIF_LINE_STARTS = (b"loop_", b"_atom_site.")
_ATOM_RECORDS = (b"ATOM  ", b"HETATM")

# ATOM/HETATM numeric fields: name, first and last column (1-based, as the PDB format
# documents them), and what a missing value means.
_ATOM_FIELDS = (
    ("x coordinate", 31, 38),
    ("y coordinate", 39, 46),
    ("z coordinate", 47, 54),
    ("occupancy", 55, 60),
    ("B-factor", 61, 66),
)
_ANISOU_FIELDS = tuple((f"U{ij}", 29 + 7 * k, 35 + 7 * k) for k, ij in enumerate(("11", "22", "33", "12", "13", "23")))
_CRYST1_FIELDS = (("a", 7, 15), ("b", 16, 24), ("c", 25, 33), ("alpha", 34, 40), ("beta", 41, 47), ("gamma", 48, 54))


def _fail(message: str):
    raise ModelError(message)


# --------------------------------------------------------------------------- the file


# Text is read and checked in blocks of this size, so that binary or blank content is refused
# after the first block that shows it, not after the whole file is held.
_BLOCK = 1 << 22
# The longest run of whitespace a model file may hold: no PDB or mmCIF writer emits megabytes of
# blank lines, and refusing them early keeps a gzip bomb of newlines from being held.
_MAX_BLANK_RUN = 16 << 20
# The first this many bytes of text must look like the format the name says.
_FORMAT_PREFIX = 1 << 20
# Deflate's largest compression ratio (a stream of one repeated byte): a gzip of n bytes holds at
# most this many times n bytes of text.
_MAX_DEFLATE_RATIO = 1032


def _too_big(where: str, what: str, max_bytes: int) -> None:
    _fail(
        f"{where}: {what}, more than the limit of {format_size(max_bytes)} (max_bytes={max_bytes}) that a model file "
        "may hold: is this the right file? To read it anyway pass a larger max_bytes"
    )


def read_model_bytes(path, where: str, is_cif: bool, max_bytes: int = MAX_MODEL_BYTES) -> tuple[bytes, bool]:
    """The file's text as bytes, decompressed when it is gzip; ``(data, was_gzip)``.

    The file is read as a stream of blocks, each checked before the next is read: binary bytes,
    a run of more than 16 MiB of blank text, a start that is not the format the name says, or
    more than ``max_bytes`` of text are refused when the block that shows them arrives. A plain
    file larger than ``max_bytes``, or a gzip whose trailer records more, is refused after its
    first block. A gzip that could hold more than ``max_bytes`` (deflate packs at most 1032 bytes
    into one) is streamed twice, the first time only checked, so no more than ``max_bytes`` is
    ever held.

    Raises ModelError for an unreadable, empty, too large, truncated or corrupt gzip, binary or
    blank file, or one that does not start as the format its name says.
    """
    try:
        raw = open(path, "rb")  # noqa: SIM115 (closed below, also on every refusal)
    except OSError as exc:
        _fail(f"{where}: cannot read the file: {exc.strerror or exc}")
    with raw:
        try:
            return _read_blocks(raw, path, where, is_cif, max_bytes)
        except OSError as exc:
            _fail(f"{where}: cannot read the file: {exc.strerror or exc}")


def _read_blocks(raw, path, where: str, is_cif: bool, max_bytes: int) -> tuple[bytes, bool]:
    size_on_disk = os.fstat(raw.fileno()).st_size
    magic = raw.read(2)
    if not magic:
        _fail(f"{where}: the file is empty (0 bytes): give a PDB or mmCIF file with atoms")
    named_gz = path.name.lower().endswith(".gz")
    compressed = magic == b"\x1f\x8b"
    if named_gz and not compressed:
        _fail(
            f"{where}: not a gzip file (it does not start with the gzip signature 1f 8b) although its name ends "
            "in .gz: if it is plain PDB/mmCIF text, remove .gz from its name; otherwise download it again"
        )
    raw.seek(0)
    isize = 0
    if compressed and size_on_disk >= 18:
        # ISIZE, the last member's uncompressed size mod 2³²: a cheap early refusal; the count while
        # decompressing below is what holds in every case.
        raw.seek(-4, os.SEEK_END)
        isize = int.from_bytes(raw.read(4), "little")
        raw.seek(0)
    sizes = (size_on_disk, isize)
    if compressed and size_on_disk * _MAX_DEFLATE_RATIO > max_bytes:
        # The text could pass max_bytes: every check runs once over the stream, holding nothing, so
        # that no more than the limit is ever held; then it is read again to keep.
        _check_blocks(raw, where, is_cif, max_bytes, compressed, sizes, keep=False)
        raw.seek(0)
    blocks = _check_blocks(raw, where, is_cif, max_bytes, compressed, sizes, keep=True)
    data = blocks[0] if len(blocks) == 1 else b"".join(blocks)
    del blocks
    if compressed and not data:
        _fail(f"{where}: the gzip file decompresses to nothing (0 bytes): give a PDB or mmCIF file with atoms")
    if not data.strip():
        inside = " after decompressing" if compressed else ""
        _fail(f"{where}: the file holds only whitespace{inside}: give a PDB or mmCIF file with atoms")
    check_format(data, is_cif, where, compressed)
    return data, compressed


def _check_blocks(raw, where: str, is_cif: bool, max_bytes: int, compressed: bool, sizes, keep: bool) -> list[bytes]:
    """Read ``raw`` (decompressing it) in blocks, refusing as soon as a block shows a problem.

    Returns the blocks when ``keep``; otherwise only checks, holding one block and 1 MiB.
    """
    size_on_disk, isize = sizes
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
    inside = " after decompressing" if compressed else ""
    blocks: list[bytes] = []
    total = blank_run = n_blocks = 0
    head = b""  # the text from its first non-blank byte, up to _FORMAT_PREFIX: its format is checked early
    head_checked = False
    while True:
        try:
            block = stream.read(_BLOCK)
        except EOFError:
            _fail(
                f"{where}: truncated gzip file: the compressed data ({size_on_disk} bytes) ends before the "
                "end-of-stream marker; download or copy it again"
            )
        except (gzip.BadGzipFile, zlib.error) as exc:
            _fail(f"{where}: corrupt gzip data ({exc}); download or copy the file again")
        if not block:
            break
        n_blocks += 1
        if total + len(block) > max_bytes:
            _too_big(where, f"the text{inside} goes on past {format_size(max_bytes)}", max_bytes)
        binary = block.translate(None, _TEXT_BYTES)
        if binary:
            offset = total + block.index(binary[:1])
            _fail(
                f"{where}: binary data{inside}, not PDB or mmCIF text (byte 0x{binary[0]:02x} at offset {offset}); "
                "is this the right file?"
            )
        blank = block.isspace()
        leading = len(block) if blank else _leading_blank(block)
        blank_run += leading
        if blank_run > _MAX_BLANK_RUN:
            _fail(
                f"{where}: more than {format_size(_MAX_BLANK_RUN)} of blank text (spaces and newlines) in a row, ending "
                f"past offset {total + len(block)}{inside}: no PDB or mmCIF file holds that; is this the right file?"
            )
        if not blank:
            blank_run = _trailing_blank(block)
            if not head_checked and len(head) < _FORMAT_PREFIX:
                head += block[0 if head else leading :][: _FORMAT_PREFIX - len(head)]
        total += len(block)
        if keep:
            blocks.append(block)
        if n_blocks == 1:
            # Sizes are refused after the first block's checks, which name binary content better.
            if size_on_disk > max_bytes and not compressed:
                _too_big(where, f"the file holds {format_size(size_on_disk)}", max_bytes)
            if isize > max_bytes:
                _too_big(where, f"its gzip trailer records {format_size(isize)} of text", max_bytes)
        elif head and not head_checked:
            # A second block: the file is long, so its start is checked now (a one-block file is
            # checked whole by the caller).
            check_format(head, is_cif, where, compressed, whole=False)
            head, head_checked = b"", True
    return blocks


def _leading_blank(block: bytes) -> int:
    """How many whitespace bytes ``block`` (not all whitespace) starts with, without copying it whole."""
    start = block[:4096]
    n = len(start) - len(start.lstrip())
    return n if n < len(start) else len(block) - len(block.lstrip())


def _trailing_blank(block: bytes) -> int:
    """How many whitespace bytes ``block`` (not all whitespace) ends with, without copying it whole."""
    tail = block[-4096:]
    n = len(tail) - len(tail.rstrip())
    return n if n < len(tail) else len(block) - len(block.rstrip())


def _starts_a_line(data: bytes, prefixes: tuple[bytes, ...]) -> bool:
    """Whether a line of ``data`` starts with one of ``prefixes`` (``bytes.find``: memchr-fast, unlike a ``^`` regex)."""
    return data.startswith(prefixes) or any(b"\n" + prefix in data for prefix in prefixes)


def check_format(data: bytes, is_cif: bool, where: str, compressed: bool, whole: bool = True) -> None:
    """Raise ModelError when the text is not the format its name says (or neither format).

    The start (the first MiB) must show the format; ``whole=False``: ``data`` is that start
    only, so atoms may still follow.
    """
    inside = " (after decompressing)" if compressed else ""
    head = data[:_FORMAT_PREFIX]
    looks_cif = _CIF_HEADER.match(data) is not None or _starts_a_line(head, _CIF_LINE_STARTS)
    if is_cif and looks_cif:
        return
    looks_pdb = _starts_a_line(head, _ATOM_RECORDS) or _PDB_RECORDS.search(head) is not None
    if is_cif:
        if looks_pdb:
            _fail(f"{where}: the text{inside} is PDB (ATOM/CRYST1 records), not mmCIF: rename the file to .pdb")
        _fail(f"{where}: not an mmCIF file{inside}: it does not start with a data_ block header")
    if looks_cif:
        _fail(
            f"{where}: this looks like mmCIF{inside} (a data_ block header, loop_ or _atom_site tables), "
            "not PDB: rename the file to .cif"
        )
    if not looks_pdb:
        first = f" in its first {format_size(len(head))}" if len(head) < len(data) or not whole else ""
        _fail(
            f"{where}: not a PDB file{inside}: none of its lines{first} is a PDB record (ATOM, HETATM, CRYST1, "
            "HEADER …)"
        )
    if whole and not _starts_a_line(data, _ATOM_RECORDS):
        _fail(f"{where}: no ATOM or HETATM records: the file has no atoms")


# --------------------------------------------------------------------------- PDB


@dataclasses.dataclass
class PdbScan:
    """What the PDB field check found that reading must act on."""

    # An ATOM/HETATM line shorter than its B field but followed by ANISOU: gemmi must see
    # the line padded with blanks (B = 0) so that B is derived from U, not defaulted.
    pad_short_lines: bool = False
    # CRYST1's six numbers as written (None: no CRYST1, or all six fields blank)
    cell: tuple[float, ...] | None = None
    # ANISOU records that do not belong to the atom record before them: (first byte, end byte
    # with the newline, message), in file order.
    stray_anisou: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)


def _as_block(lines: list[str], width: int) -> np.ndarray:
    """Columns 1..``width`` of the lines as a (width, n) uint8 array, NUL past each line's end.

    Column-major, so that the per-column work below runs over long contiguous rows.
    """
    lengths = set(map(len, lines))
    if len(lengths) == 1 and min(lengths) >= width:  # the usual file: every record the same length
        length = lengths.pop()
        rows = np.frombuffer("".join(lines).encode("latin-1"), dtype=np.uint8).reshape(len(lines), length)
        return np.ascontiguousarray(rows[:, :width].T)
    joined = "".join([line[:width].ljust(width, "\0") for line in lines])
    return np.ascontiguousarray(np.frombuffer(joined.encode("latin-1"), dtype=np.uint8).reshape(len(lines), width).T)


_BLANK = 0x1000
_CLASS_CODE = np.full(256, 0x0001, dtype=np.uint16)  # anything else
_CLASS_CODE[[0, 32]] = _BLANK  # a blank, or NUL past the end of the line
_CLASS_CODE[48:58] = 0x0100  # a digit
_CLASS_CODE[46] = 0x0010  # the decimal point
_CLASS_CODE[[43, 45]] = 0x0000  # a sign: allowed, and checked for its place only


def _fields_check(block: np.ndarray, fields, integer: bool) -> tuple[np.ndarray, np.ndarray]:
    """Which fixed-width fields hold one right-aligned number, for every line at once.

    ``block`` is (columns, lines) from :func:`_as_block`; ``fields`` are (name, first, last)
    with 1-based inclusive columns, contiguous and in order. Returns ``(bad, missing)``, each
    (lines, fields) bool: ``missing`` where the field is blank or past the end of the line,
    ``bad`` where it is neither missing nor one number (a character other than digits, one
    point and a leading sign; a blank inside or after the number; the line ending inside it).
    """
    lo, hi = fields[0][1] - 1, fields[-1][2]
    f = block[lo:hi]
    starts = [first - 1 - lo for _, first, _ in fields]
    ends = [last - lo for _, _, last in fields]
    # Each character's class as a 4-bit counter in a uint16 (other | point | digit | blank),
    # so that one sum over a field's columns (at most 8) counts all four at once.
    code = _CLASS_CODE[f]
    blank = code == _BLANK
    sign = (f == 45) | (f == 43)
    # A blank or a sign after a non-blank inside one field breaks "blanks, then one signed
    # number": counted with the other characters.
    broken = ~blank[:-1] & (blank[1:] | sign[1:])
    broken[[e - 1 for e in ends[:-1]]] = False
    code[:-1] += broken
    bad, missing = [], []
    for start, end in zip(starts, ends):
        counts = code[start:end].sum(axis=0, dtype=np.uint16)
        n_blank = counts >> 12
        field_missing = n_blank == end - start
        field_bad = (counts & 15 > 0) | ((counts >> 8) & 15 == 0) | ((counts >> 4) & 15 > (0 if integer else 1))
        field_bad |= (f[end - 1] == 0) & ~field_missing  # the line ends inside the field
        bad.append(field_bad & ~field_missing)
        missing.append(field_missing)
    return np.stack(bad, axis=1), np.stack(missing, axis=1)


def _pdb_atom_label(line: str) -> str:
    alt = line[16:17].strip()
    return (
        f"{line[21:22].strip() or '?'}/{line[17:20].strip()} {line[22:26].strip()}{line[26:27].strip()}/"
        f"{line[12:16].strip()}{f' altloc {alt}' if alt else ''}"
    )


def _line_number(text: str, line: str) -> int:
    return text.count("\n", 0, text.find(line)) + 1


def _describe(value: str) -> str:
    if not value.strip():
        return "blank"
    try:
        number = float(value)
    except ValueError:
        return f"{value.strip()!r}, not a number"
    if number != number or number in (float("inf"), float("-inf")):
        return f"{value.strip()!r}, a non-finite number"
    return f"{value.strip()!r}, not one number in the field"


def unix_newlines(data: bytes) -> bytes:
    """``data`` with CRLF and CR line ends as LF (gemmi reads either; columns and lines count the same)."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n") if b"\r" in data else data


def scan_pdb(data: bytes, where: str) -> PdbScan:
    """Check every ATOM/HETATM, ANISOU and CRYST1 record's numeric fields in one pass.

    ``data`` is the file's text with LF line ends (:func:`unix_newlines`); it is decoded as
    Latin-1, so a character is a byte and columns are gemmi's. Raises ModelError naming the
    line, atom, field (with its columns) and the value. ANISOU records that do not follow their
    own atom are returned in ``stray_anisou``, for the caller to refuse or drop.
    """
    scan = PdbScan()
    text = data.decode("latin-1")
    atom_lines = re.findall(r"^(?:ATOM  |HETATM).*", text, re.M)
    if atom_lines:
        block = _as_block(atom_lines, 80)
        bad, missing = _fields_check(block, _ATOM_FIELDS, integer=False)
        bad[:, :3] |= missing[:, :3]  # a blank occupancy or B is reported on its own below
        _report_atom_fields(text, atom_lines, bad, missing, where, scan)
        _check_elements(text, atom_lines, block, where)
    anisou = re.findall(r"^ANISOU.*", text, re.M) if "ANISOU" in text else []
    if anisou:
        bad, missing = _fields_check(_as_block(anisou, 70), _ANISOU_FIELDS, integer=True)
        bad |= missing
        if bad.any():
            row, col = (int(v) for v in np.argwhere(bad)[0])
            name, first, last = _ANISOU_FIELDS[col]
            line = anisou[row]
            value = line[first - 1 : last]
            count = int(bad.any(axis=1).sum())
            more = f" ({count - 1} more ANISOU records too)" if count > 1 else ""
            what = "missing (the line is cut short)" if len(line) < first else _describe(value)
            _fail(
                f"{where}: line {_line_number(text, line)}: ANISOU of atom {_pdb_atom_label(line)}: {name} "
                f"(columns {first}-{last}, an integer in 10⁻⁴ Å²) is {what}{more}: fix or remove the record"
            )
        scan.stray_anisou = _stray_anisou(data)
    cryst1 = re.search(r"^CRYST1.*", text, re.M)
    if cryst1:
        line = cryst1.group(0)
        fields = [line[first - 1 : last] for _, first, last in _CRYST1_FIELDS]
        if any(f.strip() for f in fields):
            for (name, first, last), value in zip(_CRYST1_FIELDS, fields):
                if not _NUMBER_RE.fullmatch(value):
                    _fail(
                        f"{where}: line {_line_number(text, line)}: CRYST1 {name} (columns {first}-{last}) is "
                        f"{_describe(value)}: write the cell as a b c in Å and α β γ in degrees in their columns"
                    )
            scan.cell = tuple(float(v) for v in fields)
    return scan


# Columns 7-27 of ATOM/HETATM and ANISOU: the fields an ANISOU repeats from its atom (1-based, inclusive).
_ANISOU_IDENTITY = (
    ("serial", 7, 11),
    ("atom name", 13, 16),
    ("altloc", 17, 17),
    ("residue name", 18, 20),
    ("chain", 22, 22),
    ("residue number", 23, 26),
    ("insertion code", 27, 27),
)
# A serial that parses: decimal, or hybrid-36 (upper or lower case). Others (``*****``) are not compared.
_SERIAL = re.compile(r"-?\d+|[A-Z][0-9A-Z]{4}|[a-z][0-9a-z]{4}")


def _stray_anisou(data: bytes) -> list[tuple[int, int, str]]:
    """ANISOU records that do not follow the ATOM/HETATM record whose U they give.

    gemmi gives each ANISOU's U to the atom read last, without comparing them; the PDB format has
    the ANISOU right after its atom (a SIGATM may come between) and repeating columns 7-27 of it.
    The records are compared as bytes, all at once; only the few that differ are compared field by
    field (blanks around a value and a serial that does not parse, such as ``*****``, are not
    differences). Returns ``(start, end, message)`` per stray record, ``end`` past its newline;
    the message names the line and both records.
    """
    arr = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(arr == 10)
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [arr.size]))
    padded = np.concatenate((arr, np.zeros(32, dtype=np.uint8)))

    def columns(lines: np.ndarray, first: int, last: int) -> np.ndarray:
        """Columns ``first``..``last`` of the given lines, NUL past each line's end."""
        offsets = np.arange(first - 1, last)
        out = padded[starts[lines, None] + offsets]
        out[offsets[None, :] >= (ends[lines] - starts[lines])[:, None]] = 0
        return out

    record = columns(np.arange(starts.size), 1, 6)
    kind = np.zeros(starts.size, dtype=np.int8)  # 1 atom, 2 SIGATM, 3 ANISOU
    for code, name in ((1, b"ATOM  "), (1, b"HETATM"), (2, b"SIGATM"), (3, b"ANISOU")):
        kind[(record == np.frombuffer(name, dtype=np.uint8)).all(axis=1)] = code
    anisou = np.flatnonzero(kind == 3)
    before = anisou - 1
    after_sigatm = (before >= 0) & (kind[np.maximum(before, 0)] == 2)
    before[after_sigatm] -= 1
    has_atom = (before >= 0) & (kind[np.maximum(before, 0)] == 1)
    same = np.zeros(anisou.size, dtype=bool)
    same[has_atom] = (columns(anisou[has_atom], 7, 27) == columns(before[has_atom], 7, 27)).all(axis=1)
    text_of = lambda k: data[starts[k] : ends[k]].decode("latin-1")  # noqa: E731
    stray = []
    for i in np.flatnonzero(~same):
        k, j = int(anisou[i]), int(before[i])
        line = text_of(k)
        if not has_atom[i]:
            previous = "the start of the file" if j < 0 else f"line {j + 1} ({text_of(j)[:6].strip() or 'blank'})"
            stray.append(
                (
                    int(starts[k]),
                    int(ends[k]) + 1,
                    f"line {k + 1}: the ANISOU record {line[:27].rstrip()!r} follows {previous}, not "
                    "the ATOM/HETATM record of its atom, so gemmi would give its U to whichever atom was read last",
                )
            )
            continue
        atom_line = text_of(j)
        differ = []
        for name, first, last in _ANISOU_IDENTITY:
            mine, theirs = line[first - 1 : last].strip(), atom_line[first - 1 : last].strip()
            if mine == theirs or (name == "serial" and not (_SERIAL.fullmatch(mine) and _SERIAL.fullmatch(theirs))):
                continue
            differ.append(f"{name} {mine or 'blank'!r} vs {theirs or 'blank'!r}")
        if differ:
            stray.append(
                (
                    int(starts[k]),
                    int(ends[k]) + 1,
                    f"line {k + 1}: the ANISOU record {line[:27].rstrip()!r} follows line {j + 1}, the "
                    f"{atom_line[:6].strip()} record {atom_line[:27].rstrip()!r} of another atom "
                    f"({', '.join(differ)}), so gemmi would give that atom this U",
                )
            )
    return stray


def drop_records(data: bytes, spans: list[tuple[int, int, str]]) -> bytes:
    """``data`` without the byte ranges ``(start, end, _)`` of ``spans`` (in file order, disjoint)."""
    kept, at = [], 0
    for start, end, _ in spans:
        kept.append(data[at:start])
        at = end
    kept.append(data[at:])
    return b"".join(kept)


def _report_atom_fields(text: str, lines: list[str], bad, missing, where: str, scan: PdbScan) -> None:
    rows = np.flatnonzero(bad.any(axis=1))
    if rows.size:
        row = int(rows[0])
        name, first, last = _ATOM_FIELDS[int(np.flatnonzero(bad[row])[0])]
        line = lines[row]
        value = line[first - 1 : last]
        if not value.strip():
            what = f"missing (the line ends at column {len(line)})" if len(line) < first else "blank"
        elif len(line) < last:
            what = f"{value.strip()!r}, cut short (the line ends at column {len(line)})"
        else:
            what = _describe(value)
        more = f" ({rows.size - 1} more atoms too)" if rows.size > 1 else ""
        _fail(
            f"{where}: line {_line_number(text, line)}: atom {_pdb_atom_label(line)}: the {name} "
            f"(columns {first}-{last}) is {what}{more}: write one number right-aligned in those columns"
        )
    rows = np.flatnonzero(missing[:, 3])
    if rows.size:
        line = lines[rows[0]]
        more = f" ({rows.size - 1} more atoms too)" if rows.size > 1 else ""
        state = "blank" if len(line) >= 55 else f"missing (the line ends at column {len(line)})"
        _fail(
            f"{where}: line {_line_number(text, line)}: atom {_pdb_atom_label(line)}: the occupancy (columns 55-60) "
            f"is {state}{more}: gemmi would read it as 0 or 1; write the occupancy (1.00 for a fully occupied site)"
        )
    rows = np.flatnonzero(missing[:, 4])
    if rows.size:
        # A missing B is allowed only where the next record is the atom's ANISOU (B comes from U).
        start = 0
        for row in rows:
            line = lines[row]
            pos = text.find(line, start)
            start = pos + len(line)
            following = text[start + 1 : start + 12]
            if not (following.startswith("ANISOU") and following[6:11] == line[6:11]):
                more = f" ({rows.size - 1} more atoms lack B)" if rows.size > 1 else ""
                state = "blank" if len(line) >= 61 else f"missing (the line ends at column {len(line)})"
                _fail(
                    f"{where}: line {_line_number(text, line)}: atom {_pdb_atom_label(line)}: the B-factor "
                    f"(columns 61-66) is {state} and no ANISOU record follows{more}: write the B-factor in Å²"
                )
            if len(line) < 66:
                scan.pad_short_lines = True


def _check_elements(text: str, lines: list[str], block: np.ndarray, where: str) -> None:
    import gemmi

    codes = block[76].astype(np.uint16) << 8 | block[77]
    for code in np.unique(codes):
        symbol = bytes([int(code) >> 8, int(code) & 255]).replace(b"\0", b" ").decode("latin-1").strip()
        if symbol and gemmi.Element(symbol).atomic_number == 0:
            rows = np.flatnonzero(codes == code)
            line = lines[rows[0]]
            more = f" ({rows.size - 1} more atoms too)" if rows.size > 1 else ""
            _fail(
                f"{where}: line {_line_number(text, line)}: atom {_pdb_atom_label(line)} has an unknown element "
                f"{symbol!r} in columns 77-78{more}: write its element symbol there (e.g. C, N, O, FE)"
            )


def pad_short_atom_lines(data: bytes) -> bytes:
    """ATOM/HETATM lines shorter than 66 columns padded with blanks (gemmi then reads B as 0)."""
    return re.sub(rb"^((?:ATOM  |HETATM)[^\n\r]{0,59})(?=\r?$)", lambda m: m.group(1).ljust(66), data, flags=re.M)


# --------------------------------------------------------------------------- mmCIF

# The _atom_site columns gemmi 0.7 needs to build atoms at all (it reads none without them),
# and the ones whose absence it fills with a default.
_CIF_GEMMI_NEEDS = ("id", "type_symbol", "label_alt_id", "label_asym_id")
_CIF_COORDS = ("Cartn_x", "Cartn_y", "Cartn_z")


@dataclasses.dataclass
class CifScan:
    """What the mmCIF check found that reading must act on."""

    occupancy_defaulted: int = 0  # rows without an occupancy (column absent, or ? / .)
    occupancy_first: str = ""
    n_rows: int = 0
    # _atom_site_anisotrop rows that name no atom of the _atom_site table, or another atom than
    # their identifying columns say: (the _atom_site.id gemmi gives the U to, or None, message).
    stray_anisou: list[tuple[str | None, str]] = dataclasses.field(default_factory=list)


def _cif_row_label(block, i: int) -> str:
    def value(tag):
        col = block.find_values(f"_atom_site.{tag}")
        return col[i] if len(col) > i else "?"

    chain = value("auth_asym_id") if len(block.find_values("_atom_site.auth_asym_id")) else value("label_asym_id")
    comp = value("label_comp_id") if len(block.find_values("_atom_site.label_comp_id")) else value("auth_comp_id")
    seq = value("auth_seq_id") if len(block.find_values("_atom_site.auth_seq_id")) else value("label_seq_id")
    name = value("label_atom_id") if len(block.find_values("_atom_site.label_atom_id")) else value("auth_atom_id")
    return f"row {i + 1} (_atom_site.id {value('id')}, atom {chain}/{comp} {seq}/{name.strip(chr(34))})"


def scan_mmcif(block, where: str) -> CifScan:
    """Check the ``_atom_site`` table of an mmCIF block: the columns exist, the numbers parse.

    Raises ModelError naming the column, row, atom and value.
    """
    import gemmi

    scan = CifScan()
    table = block.find_mmcif_category("_atom_site.")
    present = {tag.split(".", 1)[1] for tag in table.tags}
    if not present:
        _fail(f"{where}: no _atom_site table: the mmCIF file has no atoms")
    n = len(block.find_values(f"_atom_site.{next(iter(present))}"))
    scan.n_rows = n
    if n == 0:
        _fail(f"{where}: the _atom_site table has no rows: the mmCIF file has no atoms")
    missing = [f"_atom_site.{c}" for c in (*_CIF_COORDS, "type_symbol", "B_iso_or_equiv") if c not in present]
    if missing:
        what = "coordinate" if any(m.split(".")[1] in _CIF_COORDS for m in missing) else "required"
        _fail(
            f"{where}: the _atom_site table has no {', '.join(missing)} column ({what} data "
            f"missing for all {n} atoms): the file is incomplete; export it again with those columns"
        )
    gemmi_missing = [f"_atom_site.{c}" for c in _CIF_GEMMI_NEEDS if c not in present]
    for pair in (("label_atom_id", "auth_atom_id"), ("label_comp_id", "auth_comp_id"), ("label_seq_id", "auth_seq_id")):
        if not any(p in present for p in pair):
            gemmi_missing.append(f"_atom_site.{pair[0]} (or {pair[1]})")
    if gemmi_missing:
        _fail(
            f"{where}: the _atom_site table has no {', '.join(gemmi_missing)} column, which gemmi needs to read "
            "atoms: export the file again as complete PDBx/mmCIF"
        )
    for name in (*_CIF_COORDS, "B_iso_or_equiv", "occupancy"):
        if name not in present:
            continue
        values = list(block.find_values(f"_atom_site.{name}"))
        if _CIF_COLUMN.fullmatch("\n".join(values)):
            continue
        unknown = [i for i, v in enumerate(values) if v in ("?", ".")]
        if name == "occupancy":
            unknown_set = set(unknown)
            bad = [i for i, v in enumerate(values) if i not in unknown_set and not _CIF_NUMBER.fullmatch(v)]
            if not bad:
                scan.occupancy_defaulted = len(unknown)
                scan.occupancy_first = _cif_row_label(block, unknown[0])
                continue
        else:
            bad = [i for i, v in enumerate(values) if not _CIF_NUMBER.fullmatch(v)]
        i = bad[0]
        value = values[i]
        what = "unknown (? or .)" if value in ("?", ".") else _describe(value)
        more = f" ({len(bad) - 1} more rows too)" if len(bad) > 1 else ""
        _fail(f"{where}: {_cif_row_label(block, i)}: _atom_site.{name} is {what}{more}: write a number there")
    if "occupancy" not in present:
        scan.occupancy_defaulted = n
    symbols = block.find_values("_atom_site.type_symbol")
    for symbol in set(symbols):
        text = gemmi.cif.as_string(symbol)
        if gemmi.Element(text).atomic_number == 0:
            rows = [i for i, s in enumerate(symbols) if s == symbol]
            more = f" ({len(rows) - 1} more rows too)" if len(rows) > 1 else ""
            _fail(
                f"{where}: {_cif_row_label(block, rows[0])} has an unknown element {text!r} in "
                f"_atom_site.type_symbol{more}: write its element symbol there (e.g. C, N, O, FE)"
            )
    _scan_anisotrop(block, where, scan)
    return scan


_ANISOTROP_U = tuple(f"U[{i}][{j}]" for i, j in ((1, 1), (2, 2), (3, 3), (1, 2), (1, 3), (2, 3)))
# _atom_site_anisotrop columns that repeat the atom's identity, and the _atom_site column each repeats;
# of a label/auth pair only the first present is compared (either names the atom).
_ANISOTROP_IDENTITY = (
    (("type_symbol", "type_symbol"),),
    (("pdbx_label_atom_id", "label_atom_id"), ("pdbx_auth_atom_id", "auth_atom_id")),
    (("pdbx_label_alt_id", "label_alt_id"),),
    (("pdbx_label_comp_id", "label_comp_id"), ("pdbx_auth_comp_id", "auth_comp_id")),
    (("pdbx_label_asym_id", "label_asym_id"), ("pdbx_auth_asym_id", "auth_asym_id")),
    (("pdbx_label_seq_id", "label_seq_id"), ("pdbx_auth_seq_id", "auth_seq_id")),
)


def check_anisotrop_values(block, where: str) -> None:
    """Raise ModelError naming the ``_atom_site_anisotrop`` U value that is not a number.

    gemmi reads such a value (``?``, ``nan``, ``0.18X3``) as NaN; the caller looks for this only
    when a U it read is not finite, so a good file costs nothing here.
    """
    table = block.find_mmcif_category("_atom_site_anisotrop.")
    present = {tag.split(".", 1)[1] for tag in table.tags}
    ids = list(block.find_values("_atom_site_anisotrop.id")) if "id" in present else []

    def label(i: int) -> str:
        return f"_atom_site_anisotrop row {i + 1}" + (f" (id {ids[i]})" if i < len(ids) else "")

    for name in _ANISOTROP_U:
        if name not in present:
            continue
        values = list(block.find_values(f"_atom_site_anisotrop.{name}"))
        bad = [
            i for i, v in enumerate(values) if not _CIF_NUMBER.fullmatch(v) or not math.isfinite(float(v.split("(")[0]))
        ]
        if not bad:
            continue
        value = values[bad[0]]
        what = "unknown (? or .)" if value in ("?", ".") else _describe(value)
        more = f" ({len(bad) - 1} more rows too)" if len(bad) > 1 else ""
        _fail(
            f"{where}: {label(bad[0])}: _atom_site_anisotrop.{name} is {what}{more}: write U in Å² there, or "
            "remove the row to keep that atom isotropic"
        )


def _scan_anisotrop(block, where: str, scan: CifScan) -> None:
    """Find ``_atom_site_anisotrop`` rows that name no atom of ``_atom_site``, or another atom.

    gemmi gives each row's U to the atom whose ``_atom_site.id`` it names, and drops a row whose id
    is no atom's without a word. Rows that name no atom, or an atom other than their own
    identifying columns (element, atom name, residue …) say, go to ``scan.stray_anisou``.
    """
    table = block.find_mmcif_category("_atom_site_anisotrop.")
    present = {tag.split(".", 1)[1] for tag in table.tags}
    if "id" not in present:
        return
    ids = list(block.find_values("_atom_site_anisotrop.id"))

    def label(i: int) -> str:
        return f"_atom_site_anisotrop row {i + 1} (id {ids[i]})"

    site_ids = {v: i for i, v in enumerate(block.find_values("_atom_site.id"))}
    rows = np.array([site_ids.get(v, -1) for v in ids], dtype=np.int64)
    for i in np.flatnonzero(rows < 0):
        scan.stray_anisou.append(
            (None, f"{label(i)} names no atom: no _atom_site.id is {ids[i]}, so gemmi would drop its U silently")
        )
    site_columns = {tag.split(".", 1)[1] for tag in block.find_mmcif_category("_atom_site.").tags}
    named = rows >= 0
    for choices in _ANISOTROP_IDENTITY:
        pair = next(((m, t) for m, t in choices if m in present and t in site_columns), None)
        if pair is None:
            continue
        mine, theirs = pair
        values = np.array(list(block.find_values(f"_atom_site_anisotrop.{mine}")), dtype=object)
        want = np.array(list(block.find_values(f"_atom_site.{theirs}")), dtype=object)[np.maximum(rows, 0)]
        differ = named & (values != want)  # object arrays: compared in C, no Python loop for a good file
        for i in np.flatnonzero(differ):
            if {"?", "."} & {values[i], want[i]}:
                continue
            scan.stray_anisou.append(
                (
                    ids[i],
                    f"{label(i)} gives its U to {_cif_row_label(block, int(rows[i]))}, but its {mine} is "
                    f"{values[i]!r} where that atom's {theirs} is {want[i]!r}",
                )
            )
            named[i] = False  # one message per row
    order = {v: i for i, v in enumerate(ids)}
    scan.stray_anisou.sort(key=lambda entry: -1 if entry[0] is None else order[entry[0]])


def cif_cell_values(block, where: str) -> tuple[float, ...] | None:
    """The six ``_cell`` parameters as numbers, None when the file gives none (all ? or absent).

    Raises ModelError for a value that is not a number.
    """
    import gemmi

    tags = ("length_a", "length_b", "length_c", "angle_alpha", "angle_beta", "angle_gamma")
    raw = [block.find_value(f"_cell.{t}") for t in tags]
    if all(v is None or v in ("?", ".") for v in raw[:3]):
        return None
    values = []
    for tag, value in zip(tags, raw):
        if value is None or value in ("?", "."):
            if tag.startswith("angle"):
                values.append(90.0)  # mmCIF's documented default for a missing angle
                continue
            _fail(f"{where}: _cell.{tag} is {'missing' if value is None else value!r}: give all three cell lengths")
        if not _CIF_NUMBER.fullmatch(value):
            _fail(f"{where}: _cell.{tag} is {_describe(gemmi.cif.as_string(value))}: write the cell as numbers")
        values.append(gemmi.cif.as_number(value))
    return tuple(values)
