"""``workbench ensemble``: the density map of many frames of one model, over the ranks torchrun starts.

:data:`DESCRIPTION` (the subcommand's help) says what it does; :func:`read_frames` reads the
frames, :func:`run` splats them with :func:`kernels.splat_ensemble` and writes the map with
:func:`kernels.write_map`.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Frames", "read_frames", "add_parser", "EnsembleError"]

#: ``workbench ensemble --help``'s description (plain text).
DESCRIPTION = """\
One density map of many frames of one model, over the ranks torchrun starts.

Frames come from a multi-model PDB/mmCIF (every model is a frame; gemmi reads them) or from an
MD trajectory with its topology (MDAnalysis, the optional [md] extra). Every rank reads the
frames once and splats its contiguous share; the maps are summed by one all_reduce and rank 0
prints the progress and writes the map. Run alone it is one process; under torchrun it joins
the process group itself (gloo for --device cpu, NCCL for --device cuda, one GPU per rank)."""

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
    labels, n = first.atoms.labels, len(first.atoms)
    xyz, b_iso, occ, u_aniso = [], [], [], []
    uses_u = first.atoms.aniso
    for index, model in enumerate(st):
        rows = [(chain.name, res, atom) for chain in model for res in chain for atom in res]
        where = f"{path}: model {index + 1} of {len(st)} (MODEL {model.num})"
        if len(rows) != n:
            raise EnsembleError(
                f"{where} has {len(rows)} atoms but model 1 has {n}: the frames of an ensemble must be the same "
                "atoms in the same order"
            )
        for i, (ch, res, atom) in enumerate(rows):
            label = kernels.AtomLabel(
                ch, res.name, res.seqid.num, res.seqid.icode, atom.name, atom.altloc if atom.altloc != "\0" else ""
            )
            if label != labels[i] or atom.element.name != first.atoms.elements[i]:
                raise EnsembleError(
                    f"{where}: atom {i + 1} is {label} ({atom.element.name}) where model 1 has {labels[i]} "
                    f"({first.atoms.elements[i]}): the frames of an ensemble must be the same atoms in the same order"
                )
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


def _read_trajectory(path: Path, topology: Path, md_b: float, radiation: str) -> Frames:
    import numpy as np
    import torch

    import kernels

    try:
        import MDAnalysis
    except ImportError:
        raise EnsembleError(
            "reading an MD trajectory needs MDAnalysis: pip install 'density-workbench[md]' (or MDAnalysis)"
        ) from None
    for p in (path, topology):
        if not p.is_file():
            raise EnsembleError(f"{p}: no such file")
    try:
        u = MDAnalysis.Universe(str(topology), str(path))
    except Exception as exc:  # MDAnalysis raises many types for unreadable input
        raise EnsembleError(f"MDAnalysis cannot read {path} with topology {topology}: {exc}") from exc
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
    positions, boxes = [], []
    for ts in u.trajectory:
        if ts.dimensions is None or not np.all(np.asarray(ts.dimensions[:3]) > 0):
            raise EnsembleError(f"{path}: frame {ts.frame} has no periodic box; the map needs a unit cell")
        positions.append(ag.positions.astype(np.float64))
        boxes.append(np.asarray(ts.dimensions, dtype=np.float64))
    boxes = np.asarray(boxes)
    cell = kernels.Cell.from_parameters(*boxes[0])
    notes = [f"trajectory without B-factors: B = {md_b:g} Å² for every atom"]
    if np.abs(boxes - boxes[0]).max() > 1e-3 * boxes[0, :3].max():
        notes.append("the box changes along the trajectory; the map uses the first frame's cell")
    labels = tuple(kernels.AtomLabel(str(a.segid), str(a.resname), int(a.resid), "", str(a.name), "") for a in ag)
    xyz = torch.tensor(np.asarray(positions), dtype=torch.float64)
    try:
        atoms = kernels.AtomSet.from_elements(elements, xyz[0], md_b, 1.0, labels=labels, radiation=radiation)
    except ValueError as exc:
        raise EnsembleError(f"{topology}: {exc}") from exc
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


def run(args: argparse.Namespace) -> int:
    """The ``ensemble`` subcommand (see :func:`add_parser`); returns the exit status."""
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
    try:
        start = time.perf_counter()
        try:
            frames = read_frames(path, args.topology, args.md_b, adp=args.adp, radiation=args.radiation)
        except (kernels.ModelError, EnsembleError) as exc:
            return _error(f"{exc}", EXIT_FAILURE) if rank == 0 else EXIT_FAILURE
        f, n = frames.xyz.shape[:2]
        say(f"frames  {f} of {n} atoms from {path} ({time.perf_counter() - start:.2f} s)", flush=True)
        for note in frames.notes:
            if not args.warned.said(note):  # a warning already said it, on stderr
                say(f"note    {note}")
        dtype = torch.float64 if backend == "reference" else torch.float32
        atoms = frames.atoms.to(device, dtype)
        xyz, b_iso, occ = (t.to(device, dtype) for t in (frames.xyz, frames.b_iso, frames.occ))
        u_aniso = None if frames.u_aniso is None else frames.u_aniso.to(device, dtype)
        weights = None if args.sum else torch.full((f,), 1.0 / f, dtype=dtype, device=device)
        grid = kernels.GridSpec.for_spacing(frames.cell, args.spacing, frames.spacegroup)
        lo, hi = kernels.frame_share(f, group)
        say(f"grid    {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} at ≤ {args.spacing:g} Å; backend {backend}")
        if group is not None:
            say(
                f"ranks   {world} ({'nccl' if device.startswith('cuda') else 'gloo'}); rank 0 splats frames {lo}–{hi - 1}"
            )
        start = time.perf_counter()
        rho = kernels.splat_ensemble(
            atoms, xyz, grid, weights=weights, b_iso=b_iso, occ=occ, u_aniso=u_aniso, radius=args.radius,
            cutoff=args.cutoff, backend=backend, process_group=group, blur=args.blur,
        )  # fmt: skip
        if rho.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        what = "sum" if args.sum else "mean"
        say(f"splat   {f} frames ({what}) on {world} rank(s): {elapsed * 1e3:.1f} ms, {f / elapsed:.1f} frames/s")
        if rank == 0:
            electrons = float(rho.sum()) * grid.voxel_volume
            if not math.isfinite(electrons):  # read here anyway; a GPU splat is not read back to check
                return _error(
                    "the map holds non-finite values (weights or B that overflow the map's float range?); "
                    f"nothing was written to {args.out}",
                    EXIT_FAILURE,
                )
            whose = "the mean of the frames" if weights is not None else "the sum of the frames"
            say(f"map     {_map_summary(rho, grid, args.radiation)} in the cell ({whose}; no symmetry mates)")
            try:
                out = kernels.write_map(args.out, rho, grid, "P 1", radiation=args.radiation)
            except (OSError, ValueError) as exc:
                return _error(f"cannot write the map to {args.out}: {exc}", EXIT_FAILURE)
            say(f"wrote   {out}")
        return EXIT_OK
    except (kernels.BackendError, kernels.GridError, ValueError) as exc:
        return _error(f"{exc}", EXIT_FAILURE) if rank == 0 else EXIT_FAILURE
    finally:
        if group is not None:
            import torch.distributed as dist

            dist.barrier()  # no rank exits while rank 0 still writes its map (or reports its failure)
            dist.destroy_process_group()


def add_parser(sub, positive) -> None:
    """Register ``ensemble`` on the ``workbench`` subparsers ``sub``; ``positive`` builds number types."""
    from workbench._cli_shared import _UNITS_TEXT, add_grid_options, add_radiation_options

    ep = sub.add_parser(
        "ensemble",
        help="splat every frame of a multi-model file or MD trajectory into one ensemble map (torchrun for ranks)",
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
    ep.add_argument("--out", default="map.ccp4", help="output CCP4 map file, written by rank 0 (default map.ccp4)")
    ep.set_defaults(func=run)
