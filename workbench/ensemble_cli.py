"""``workbench ensemble``: the density map of many frames of one model, over the ranks torchrun starts.

:data:`DESCRIPTION` (the subcommand's help) says what it does; :func:`read_frames` reads every
frame of a file whole, :func:`run` splats a multi-model file's frames so, streams a trajectory's
through :func:`kernels.frames_from` (each rank its own share, chunk by chunk), both with
:func:`kernels.splat_ensemble`, shows progress (:class:`PlainProgress` where stderr is not a
terminal) and writes the map with :func:`kernels.write_map`.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Frames", "read_frames", "add_parser", "EnsembleError", "PlainProgress"]

#: ``workbench ensemble --help``'s description (plain text).
DESCRIPTION = """\
One density map of many frames of one model, over the ranks torchrun starts.

Frames come from a multi-model PDB/mmCIF (every model is a frame; gemmi reads them) or from an
MD trajectory with its topology (MDAnalysis, the optional [md] extra). A trajectory is streamed:
each rank reads only its contiguous share of the frames, --chunk frames at a time, so memory
stays bounded however long it is (every atom has B --md-b and occupancy 1). A multi-model file
is read whole (each model keeps its own B, occupancy and ANISOU) and every rank splats its
share. The ranks' maps are summed by one all_reduce; rank 0 shows the progress and writes the
map (complete or not at all: Ctrl-C exits with status 130 and leaves no file). Run alone it is
one process; under torchrun it joins the process group itself (gloo for --device cpu, NCCL for
--device cuda, one GPU per rank)."""

#: ``kernels.DEFAULT_CHUNK_BYTES`` in MiB, which ``--chunk``'s help states (written here: ``--help`` imports no
#: torch; tests/notebooks/test_cli_help.py checks the two agree).
DEFAULT_CHUNK_MIB = 128

#: B in Å² given to every atom of an MD trajectory (trajectories carry no B).
DEFAULT_MD_B = 20.0


class EnsembleError(ValueError):
    """The frames cannot be read or do not share the same atoms (the message says which and where)."""


@dataclass(frozen=True)
class Frames:
    """F frames of the same N atoms, as :func:`kernels.splat_ensemble` takes them.

    Attributes
    ----------
    atoms : kernels.AtomSet
        The atoms of the first frame (float64, CPU): coefficients, elements, labels.
    xyz : torch.Tensor, shape (F, N, 3), float64
        Positions in Å.
    b_iso, occ : torch.Tensor, shape (F, N), float64
        B (Å²) and occupancy of every atom in every frame.
    cell : kernels.Cell
    spacegroup : str
    notes : tuple of str
        What reading assumed (e.g. the MD B, a changing box).
    u_aniso : torch.Tensor or None, shape (F, N, 6), float64
        U (Å²) of every atom in every frame, for the atoms ``atoms.aniso`` marks (those with ANISOU
        in the first model); None for an isotropic ensemble.
    """

    atoms: object
    xyz: object
    b_iso: object
    occ: object
    cell: object
    spacegroup: str
    notes: tuple[str, ...] = ()
    u_aniso: object = None


def read_frames(
    path: str | os.PathLike,
    topology: str | os.PathLike | None = None,
    md_b: float = DEFAULT_MD_B,
    *,
    adp: str = "auto",
    radiation: str = "xray",
) -> Frames:
    """Read every frame of a multi-model PDB/mmCIF, or of an MD trajectory with its topology.

    Parameters
    ----------
    path : str or path-like
        A PDB/mmCIF file (optionally gzipped) whose models are the frames; or, with
        ``topology``, a trajectory MDAnalysis reads (DCD, XTC, TRR, multi-frame PDB, …).
    topology : str or path-like, optional
        The trajectory's topology (PDB, PSF, GRO, PRMTOP, …); needs MDAnalysis.
    md_b : float
        B in Å² of every atom of a trajectory (default 20).
    adp : {"auto", "iso"}
        Multi-model files: ``auto`` keeps the ANISOU of every model (the atoms with ANISOU in the
        first model are anisotropic in every frame; where a later model gives such an atom none, its
        U is B/(8π²)·I), ``iso`` splats B only. As :func:`kernels.read_model`.
    radiation : {"xray", "electron", "neutron"}
        Form-factor table (:func:`kernels.form_factor_coefficients`).

    Returns
    -------
    Frames

    Raises
    ------
    kernels.ModelError
        The model file is not readable (see :func:`kernels.read_model`).
    EnsembleError
        A model has other atoms than the first (naming the first difference), a trajectory without
        a box or elements, or MDAnalysis missing for a trajectory.
    """
    if topology is not None:
        return _read_trajectory(Path(path), Path(topology), md_b, radiation)
    return _read_models(Path(path), adp, radiation)


def _read_models(path: Path, adp: str, radiation: str) -> Frames:
    import gemmi
    import numpy as np
    import torch

    import kernels

    # every check of a model file, on model 1 (given explicitly: the frames are all the models)
    first = kernels.read_model(path, model_index=0, adp=adp, radiation=radiation)
    st = gemmi.read_structure(str(path))
    st.merge_chain_parts()
    from kernels.density.frames import atom_identity, different_atoms, model_rows

    n = len(first.atoms)
    xyz, b_iso, occ, u_aniso = [], [], [], []
    uses_u = first.atoms.aniso
    identities = None
    for index, model in enumerate(st):
        rows = model_rows(model)
        if identities is None:
            identities = [atom_identity(*row) for row in rows]
        problem = different_atoms(f"{path}: model {index + 1} of {len(st)} (MODEL {model.num})", rows, identities)
        if problem is None and len(rows) != n:  # model 1 as read_model read it: the same atoms
            problem = f"{path}: model 1 gives {n} atoms to read_model but {len(rows)} to gemmi: rewrite the file"
        if problem:
            raise EnsembleError(problem)
        xyz.append([atom.pos.tolist() for _, _, atom in rows])
        occ.append([atom.occ for _, _, atom in rows])
        b = [atom.b_iso for _, _, atom in rows]
        for i, (_, _, atom) in enumerate(rows):  # as read_model: B from ANISOU only where the file gives none
            if not b[i] > 0 and atom.aniso.nonzero():
                u = atom.aniso
                b[i] = 8 * math.pi**2 * (u.u11 + u.u22 + u.u33) / 3
        b_iso.append(b)
        if uses_u is not None:
            rows_u = np.zeros((n, 6))
            for i, (_, _, atom) in enumerate(rows):
                u = atom.aniso
                if u.nonzero():
                    rows_u[i] = (u.u11, u.u22, u.u33, u.u12, u.u13, u.u23)
                else:
                    rows_u[i, :3] = b[i] / (8 * math.pi**2)
            u_aniso.append(rows_u)
    f64 = torch.float64
    return Frames(
        first.atoms,
        torch.tensor(np.asarray(xyz), dtype=f64),
        torch.tensor(np.asarray(b_iso), dtype=f64),
        torch.tensor(np.asarray(occ), dtype=f64),
        first.cell,
        first.spacegroup,
        first.notes,
        None if uses_u is None else torch.tensor(np.asarray(u_aniso), dtype=f64),
    )


def _open_trajectory(path: Path, topology: Path, md_b: float, radiation: str):
    """A trajectory's universe, atoms, cell and notes, from its topology and first frame.

    Reads the first and the last frame only: the map takes the first frame's cell, and a box that
    differs in the last frame is noted.

    Returns
    -------
    (MDAnalysis.Universe, kernels.AtomSet, kernels.Cell, list of str)
        The atoms are at the first frame's positions, B ``md_b`` and occupancy 1 (float64, CPU).
    """
    from kernels.density.frames import open_universe

    for p in (path, topology):
        if not p.is_file():
            raise EnsembleError(f"{p}: no such file")
    try:
        u = open_universe(path, topology)
    except (ImportError, ValueError) as exc:
        raise EnsembleError(str(exc)) from None
    try:
        return _trajectory_atoms(u, path, topology, md_b, radiation)
    except BaseException:
        u.trajectory.close()
        raise


def _trajectory_atoms(u, path: Path, topology: Path, md_b: float, radiation: str):
    """:func:`_open_trajectory`'s atoms, cell and notes from the opened universe ``u``."""
    import numpy as np
    import torch

    import kernels

    ag = u.atoms
    try:
        elements = [str(e).strip().capitalize() for e in ag.elements]
    except Exception:
        elements = []
    if len(elements) != len(ag) or not all(elements):
        raise EnsembleError(
            f"{topology}: the topology gives no element for some atoms; use a topology with elements "
            "(e.g. a PDB with columns 77-78 filled)"
        )
    box_last = _box(_frame(u, len(u.trajectory) - 1, path), path)
    box = _box(_frame(u, 0, path), path)
    cell = kernels.Cell.from_parameters(*box)
    notes = [f"trajectory without B-factors: B = {md_b:g} Å² for every atom"]
    if np.abs(box_last - box).max() > 1e-3 * box[:3].max():
        notes.append("the box changes along the trajectory; the map uses the first frame's cell")
    labels = tuple(kernels.AtomLabel(str(a.segid), str(a.resname), int(a.resid), "", str(a.name), "") for a in ag)
    xyz = torch.tensor(ag.positions.astype(np.float64))
    try:
        atoms = kernels.AtomSet.from_elements(elements, xyz, md_b, 1.0, labels=labels, radiation=radiation)
    except ValueError as exc:
        raise EnsembleError(f"{topology}: {exc}") from exc
    return u, atoms, cell, notes


def _frame(u, index: int, path: Path):
    """Timestep ``index`` (0-based) of ``u``'s trajectory; EnsembleError naming the frame when it cannot be read."""
    try:
        return u.trajectory[index]
    except Exception as exc:  # MDAnalysis raises OSError, EOFError, ValueError … for a damaged frame
        raise EnsembleError(
            f"{path}: frame {index + 1} of {len(u.trajectory)} cannot be read ({exc}): the trajectory is damaged "
            "or cut short there; rewrite it, or copy the readable frames out with MDAnalysis"
        ) from None


def _box(ts, path: Path):
    """The box (a, b, c, α, β, γ) of one MDAnalysis timestep; EnsembleError when it has none."""
    import numpy as np

    if ts.dimensions is None or not np.all(np.asarray(ts.dimensions[:3]) > 0):
        raise EnsembleError(f"{path}: frame {ts.frame} has no periodic box; the map needs a unit cell")
    return np.asarray(ts.dimensions, dtype=np.float64)


def _read_trajectory(path: Path, topology: Path, md_b: float, radiation: str) -> Frames:
    import numpy as np
    import torch

    u, atoms, cell, notes = _open_trajectory(path, topology, md_b, radiation)
    ag = u.atoms
    positions, boxes = [], []
    for ts in u.trajectory:
        boxes.append(_box(ts, path))
        positions.append(ag.positions.astype(np.float64))
    boxes = np.asarray(boxes)
    changes = "the box changes along the trajectory; the map uses the first frame's cell"
    if changes not in notes and np.abs(boxes - boxes[0]).max() > 1e-3 * boxes[0, :3].max():
        notes.append(changes)
    xyz = torch.tensor(np.asarray(positions), dtype=torch.float64)
    f, n = xyz.shape[:2]
    b = torch.full((f, n), float(md_b), dtype=torch.float64)
    return Frames(atoms, xyz, b, torch.ones((f, n), dtype=torch.float64), cell, "P 1", tuple(notes))


def _distributed(device: str):
    """(process group or None, rank, world size, device) — the group only under torchrun.

    Each rank ends when its launcher dies (:func:`kernels._util.end_with_launcher`).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
        return None, 0, 1, device
    import torch
    import torch.distributed as dist

    from kernels._util import end_with_launcher

    end_with_launcher()

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size(), device


class PlainProgress:
    """Progress as a few plain lines on a stream that is not a terminal (a log file, a pipe).

    A callable ``progress(done, total)`` as :func:`kernels.splat_ensemble` takes it. It writes
    ``progress  done/total frames (p %), r frames/s, ETA t`` at the first call, then each time
    another tenth of the frames is done (at most one line a second), and at the end: a log gets
    about a dozen lines, not a bar rewritten with carriage returns.

    Parameters
    ----------
    stream : text file
        Where the lines go (``sys.stderr`` in the CLI).
    whose : str
        Whose frames are counted, said after the count (e.g. ``" of rank 0's share"``).
    """

    def __init__(self, stream, whose: str = ""):
        self.stream, self.whose = stream, whose
        self.start = time.perf_counter()
        self.said_at: float | None = None
        self.said_tenth = -1

    def __call__(self, done: int, total: int | None) -> None:
        from kernels._progress import _duration

        now = time.perf_counter()
        tenth = 10 * done // total if total else self.said_tenth + 1
        end = total is not None and done >= total
        if not (self.said_at is None or end or (tenth > self.said_tenth and now - self.said_at >= 1.0)):
            return
        self.said_at, self.said_tenth = now, tenth
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        if total:
            left = f"ETA {_duration((total - done) / rate)}" if rate > 0 and not end else f"in {_duration(elapsed)}"
            text = f"{done}/{total} frames{self.whose} ({100.0 * done / total:.0f} %), {rate:.1f} frames/s, {left}"
        else:
            text = f"{done} frames{self.whose}, {rate:.1f} frames/s, in {_duration(elapsed)}"
        print(f"progress  {text}", file=self.stream, flush=True)


def _progress(args: argparse.Namespace, rank: int, world: int):
    """What :func:`kernels.splat_ensemble` gets as ``progress=``: a bar on a terminal, plain lines
    otherwise; rank 0 counts its own share (the ranks read theirs at the same pace)."""
    import sys

    if rank != 0 or args.no_progress:
        return None
    return True if sys.stderr.isatty() else PlainProgress(sys.stderr, " of rank 0's share" if world > 1 else "")


def run(args: argparse.Namespace) -> int:
    """The ``ensemble`` subcommand (see :func:`add_parser`); returns the exit status."""
    import contextlib
    import sys
    import warnings

    import torch

    import kernels
    from kernels._util import file_problem
    from workbench._cli_shared import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, _check_out, _error, _map_summary

    path = Path(args.frames)
    for p, what in ((path, "frames"), (Path(args.topology) if args.topology else None, "topology")):
        problem = None if p is None else file_problem(p)
        if problem:
            return _error(f"{what} {p}: {problem}", EXIT_USAGE)
    problem = _check_out(Path(args.out))
    if problem:
        return _error(problem, EXIT_USAGE)
    if args.device == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda asked for, but no CUDA GPU is visible; use --device cpu", EXIT_USAGE)
    try:
        backend = kernels.resolve_backend("density", torch.device(args.device), args.backend)
    except kernels.BackendError as exc:
        return _error(f"--backend {args.backend}: {exc}", EXIT_USAGE)

    group, rank, world, device = _distributed(args.device)
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = torch.float64 if backend == "reference" else torch.float32
    if args.topology is not None:
        # MDAnalysis's notices of future changes (its DCD reader's, at every read) are not the user's
        # concern; imported first, since its import puts its own filter for them first
        with contextlib.suppress(ImportError):
            import MDAnalysis  # noqa: F401
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"MDAnalysis\b")
    interrupted, source = False, None
    try:
        start = time.perf_counter()
        try:
            if args.topology is not None:
                frames = None
                universe, atoms, cell, notes = _open_trajectory(path, Path(args.topology), args.md_b, args.radiation)
                universe.trajectory.close()  # the frames are read through frames_from
                source = kernels.frames_from(path, args.topology, chunk=args.chunk, dtype=dtype)
                f, n, spacegroup = source.n_frames, source.n_atoms, "P 1"
            else:
                frames = read_frames(path, adp=args.adp, radiation=args.radiation)
                atoms, cell, notes, spacegroup = frames.atoms, frames.cell, frames.notes, frames.spacegroup
                f, n = frames.xyz.shape[:2]
                # every model's B and U, read here on the host: a GPU splat reads none back to warn
                from kernels.density._ensemble_parts import _warn_tiny

                _warn_tiny(atoms, frames.b_iso, frames.u_aniso, 0, f, 0)
        except (kernels.ModelError, EnsembleError) as exc:
            return _error(f"{exc}", EXIT_FAILURE) if rank == 0 else EXIT_FAILURE
        how = (
            f"streamed in chunks of ≤ {source.chunk} frames"
            if frames is None
            else f"read whole, {time.perf_counter() - start:.2f} s"
        )
        say(f"frames  {f} of {n} atoms from {path}: frames 0–{f - 1} ({how})", flush=True)
        for note in notes:
            if not args.warned.said(note):  # a warning already said it, on stderr
                say(f"note    {note}")
        atoms = atoms.to(device, dtype)
        grid = kernels.GridSpec.for_spacing(cell, args.spacing, spacegroup)
        lo, hi = kernels.frame_share(f, group)
        say(f"grid    {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} at ≤ {args.spacing:g} Å; backend {backend}")
        if group is not None:
            what = "reads and splats" if frames is None else "splats"
            say(
                f"ranks   {world} ({'nccl' if device.startswith('cuda') else 'gloo'}); rank 0 {what} frames {lo}–{hi - 1}"
            )
        common = dict(
            radius=args.radius, cutoff=args.cutoff, backend=backend, process_group=group, blur=args.blur,
            chunk=args.chunk, progress=_progress(args, rank, world),
        )  # fmt: skip
        start = time.perf_counter()
        if frames is None:
            # streaming: the atoms' own B and occupancy in every frame; each rank reads only its share
            rho = kernels.splat_ensemble(atoms, source, grid, reduce="sum", **common)
            if not args.sum:
                rho = rho / f
        else:
            rho = kernels.splat_ensemble(
                atoms,
                frames.xyz.to(device, dtype),
                grid,
                weights=None if args.sum else torch.full((f,), 1.0 / f, dtype=dtype, device=device),
                b_iso=frames.b_iso.to(device, dtype),
                occ=frames.occ.to(device, dtype),
                u_aniso=None if frames.u_aniso is None else frames.u_aniso.to(device, dtype),
                **common,
            )
        if rho.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        what = "sum" if args.sum else "mean"
        say(f"splat   {f} frames ({what}) on {world} rank(s): {elapsed:.2f} s, {f / elapsed:.1f} frames/s", flush=True)
        if rank == 0:
            electrons = float(rho.sum()) * grid.voxel_volume
            if not math.isfinite(electrons):  # read here anyway; a GPU splat is not read back to check
                return _error(
                    "the map holds non-finite values (weights or B that overflow the map's float range?); "
                    f"nothing was written to {args.out}",
                    EXIT_FAILURE,
                )
            whose = "the mean of the frames" if not args.sum else "the sum of the frames"
            say(f"map     {_map_summary(rho, grid, args.radiation)} in the cell ({whose}; no symmetry mates)")
            try:
                out = kernels.write_map(args.out, rho, grid, "P 1", radiation=args.radiation)
            except (OSError, ValueError) as exc:
                return _error(f"cannot write the map to {args.out}: {exc}", EXIT_FAILURE)
            say(f"wrote   {out}")
        return EXIT_OK
    except KeyboardInterrupt:
        # write_map renames a complete temporary file onto --out and removes it when interrupted
        interrupted = True
        if rank == 0:
            print(f"\ninterrupted: nothing was written to {args.out}", file=sys.stderr, flush=True)
        return 130
    except (kernels.BackendError, kernels.GridError, ValueError) as exc:
        return _error(f"{exc}", EXIT_FAILURE) if rank == 0 else EXIT_FAILURE
    finally:
        if source is not None:
            source.close()
        if group is not None:
            import torch.distributed as dist

            if not interrupted:  # every rank got the SIGINT; a barrier would wait on ranks that left
                dist.barrier()  # no rank exits while rank 0 still writes its map (or reports its failure)
            dist.destroy_process_group()


def _positive_int(what: str):
    """An argparse type: a whole number ≥ 1 (frames)."""

    def parse(text: str) -> int:
        if not (text.strip().isdigit() and int(text) >= 1):  # digits only: no sign, point or exponent
            raise argparse.ArgumentTypeError(f"must be a whole number of frames ≥ 1, got {text!r}")
        return int(text)

    parse.__name__ = what
    parse.unit = "frames"
    return parse


def add_parser(sub, positive) -> None:
    """Register ``ensemble`` on the ``workbench`` subparsers ``sub``; ``positive`` builds number types."""
    from workbench._cli_shared import _UNITS_TEXT, add_grid_options, add_radiation_options

    ep = sub.add_parser(
        "ensemble",
        help="One map of every model of a multi-model file or frame of an MD trajectory (torchrun for ranks)",
        description=DESCRIPTION + "\n\n" + _UNITS_TEXT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ep.add_argument("frames", help="multi-model PDB/mmCIF (every model a frame), or a trajectory with --topology")
    ep.add_argument(
        "--topology",
        help="topology of an MD trajectory, read with MDAnalysis, the [md] extra (default: none; FRAMES is then "
        "a multi-model PDB/mmCIF)",
    )
    ep.add_argument(
        "--md-b",
        type=positive("--md-b", "Å²"),
        default=DEFAULT_MD_B,
        help=f"B in Å² of every atom of a trajectory (default {DEFAULT_MD_B:g})",
    )
    add_grid_options(ep)
    ep.add_argument("--sum", action="store_true", help="sum the frames' maps (default: their mean)")
    ep.add_argument(
        "--adp",
        default="auto",
        choices=["auto", "iso"],
        help="keep each model's ANISOU (auto) or splat B only (iso) (default auto)",
    )
    add_radiation_options(ep)
    ep.add_argument(
        "--chunk",
        type=_positive_int("--chunk"),
        default=None,
        help="frames read and splatted at a time, per rank (default: for a trajectory, as many frames as fit in "
        f"{DEFAULT_CHUNK_MIB} MiB of positions, kernels.DEFAULT_CHUNK_BYTES; for a multi-model file, as "
        "splat_ensemble splits them)",
    )
    ep.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (default: a bar with frames/s and ETA on a terminal, a few plain lines otherwise)",
    )
    ep.add_argument("--out", default="map.ccp4", help="output CCP4 map file, written by rank 0 (default map.ccp4)")
    ep.set_defaults(func=run)
