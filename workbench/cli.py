"""Command line of the density workbench.

``workbench lab``    JupyterLab on 127.0.0.1 (token kept) with the quickstart notebook open.
``workbench app``    the quickstart notebook as a standalone Voilà app.
``workbench splat``  splat a model's density and write a CCP4 map.

The notebooks are the repository's ``notebooks/`` folder, which an installed package carries
as ``workbench/notebooks`` (see :func:`shipped_notebooks_dir`); ``lab`` and ``app`` copy
them into a folder of the user's (default ``~/density-workbench/notebooks``) and only ever
add missing files, so a user's edits survive every launch and every upgrade.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

__all__ = ["main", "install_notebooks", "notebook_dir", "shipped_notebooks_dir", "QUICKSTART", "NOTEBOOK_DIR_ENV"]

#: The notebook ``workbench lab`` opens and ``workbench app`` serves.
QUICKSTART = "01_quickstart.ipynb"
#: Environment variable naming the user's notebook folder (``--dir`` wins over it).
NOTEBOOK_DIR_ENV = "WORKBENCH_NOTEBOOK_DIR"
_DEFAULT_NOTEBOOK_DIR = Path("~/density-workbench/notebooks")


def _splat(args: argparse.Namespace) -> int:
    import torch

    import kernels

    path = Path(args.model) if args.model else kernels.example_structure()
    try:
        model = kernels.read_model(path)
    except kernels.ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but no CUDA GPU is visible; use --device cpu", file=sys.stderr)
        return 2
    atoms = model.atoms.to(device, torch.float64 if args.backend == "reference" else torch.float32)
    try:
        grid = kernels.GridSpec.for_spacing(model.cell, args.spacing, model.spacegroup)
        backend = kernels.resolve_backend("density", atoms.device, args.backend)
        print(f"model   {path} ({len(model)} atoms, cell {model.cell.parameters}, {model.spacegroup})")
        for note in model.notes:
            print(f"note    {note}")
        radius = f"{args.radius} Å for every atom" if args.radius else f"per atom, density cutoff {args.cutoff:g} e/Å³"
        print(f"grid    {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} at ≤ {args.spacing} Å; radius {radius}")
        start = time.perf_counter()
        rho = kernels.splat_density(atoms, grid, radius=args.radius, cutoff=args.cutoff, backend=backend)
        if args.symmetrize:
            rho = kernels.symmetrize(rho, grid, model.spacegroup)
        if atoms.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    except (kernels.BackendError, kernels.GridError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    electrons = float(rho.sum()) * grid.voxel_volume
    print(
        f"splat   backend {backend} on {atoms.device}: {elapsed * 1e3:.1f} ms "
        f"({'with' if args.symmetrize else 'without'} symmetry mates)"
    )
    print(f"map     max {float(rho.max()):.3f} e/Å³, {electrons:.1f} electrons in the cell")
    out = kernels.write_map(args.out, rho, grid, model.spacegroup if args.symmetrize else "P 1")
    print(f"wrote   {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("splat", help="splat a model's density onto a grid and write a CCP4 map")
    sp.add_argument("model", nargs="?", help="PDB/mmCIF file (default: the bundled 1ORC example)")
    sp.add_argument("--spacing", type=float, default=0.667, help="grid spacing in Å (default 0.667)")
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--radius", type=float, help="one cutoff radius in Å for every atom")
    group.add_argument("--cutoff", type=float, default=1e-5, help="per-atom radius from this density (e/Å³)")
    sp.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"])
    sp.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    sp.add_argument("--symmetrize", action="store_true", help="add the space group's symmetry mates")
    sp.add_argument("--out", default="map.ccp4", help="output map (default map.ccp4)")
    sp.set_defaults(func=_splat)

    for name, helptext, default_port in (
        ("lab", "start JupyterLab on 127.0.0.1 with the quickstart notebook open", 8888),
        ("app", "serve the quickstart notebook as a standalone Voilà app on 127.0.0.1", 8866),
    ):
        lp = sub.add_parser(
            name,
            help=helptext,
            description=helptext
            + ". Arguments this command does not know are passed on to "
            + ("JupyterLab (e.g. --allow-root)." if name == "lab" else "Voilà (e.g. --theme=dark)."),
        )
        lp.add_argument(
            "--dir",
            type=Path,
            help=f"folder for your copy of the notebooks (default ${NOTEBOOK_DIR_ENV} or {_DEFAULT_NOTEBOOK_DIR}); "
            "missing notebooks are copied there, existing ones are never overwritten",
        )
        lp.add_argument("--port", type=int, help=f"port on 127.0.0.1 (default: the first free one from {default_port})")
        lp.add_argument("--no-browser", action="store_true", help="do not open a web browser")
        if name == "app":
            lp.add_argument("notebook", nargs="?", default=QUICKSTART, help=f"notebook to serve (default {QUICKSTART})")
        lp.set_defaults(func=_lab if name == "lab" else _app, default_port=default_port, passthrough=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``workbench`` command.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status (``lab`` and ``app`` return the server's).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args.func(args)


# --------------------------------------------------------------------------- notebooks


def notebook_dir(path: str | os.PathLike | None = None) -> Path:
    """The user's notebook folder: ``path``, else ``$WORKBENCH_NOTEBOOK_DIR``, else ``~/density-workbench/notebooks``.

    Parameters
    ----------
    path : str or os.PathLike, optional
        An explicit folder (the ``--dir`` option).

    Returns
    -------
    pathlib.Path
        Absolute, with ``~`` expanded; not created here.
    """
    chosen = path or os.environ.get(NOTEBOOK_DIR_ENV) or _DEFAULT_NOTEBOOK_DIR
    return Path(chosen).expanduser().resolve()


def shipped_notebooks_dir() -> Path:
    """The folder holding the notebooks this installation ships.

    A built package (wheel, ``pip install .``) carries the repository's ``notebooks/`` as
    ``workbench/notebooks`` (copied there by ``setup.py``'s ``build_py``); an editable
    install or a source checkout reads ``notebooks/`` beside the ``workbench`` package.
    There is one copy of each notebook in the repository either way.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    FileNotFoundError
        Neither folder holds a notebook (a broken installation).
    """
    package = Path(str(resources.files("workbench")))
    for folder in (package / "notebooks", package.parent / "notebooks"):
        if any(folder.glob("*.ipynb")):
            return folder
    raise FileNotFoundError(
        f"no notebooks found in {package / 'notebooks'} or {package.parent / 'notebooks'}; reinstall density-workbench"
    )


def _packaged_notebooks() -> dict[str, bytes]:
    """The shipped notebooks (see :func:`shipped_notebooks_dir`): file name -> contents."""
    return {p.name: p.read_bytes() for p in sorted(shipped_notebooks_dir().glob("*.ipynb")) if p.is_file()}


def install_notebooks(dest: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Copy the packaged notebooks into ``dest``, adding only the missing ones.

    A notebook already in ``dest`` is never overwritten, whatever its contents: it may
    hold the user's edits. Delete it to get the packaged version back.

    Parameters
    ----------
    dest : str or os.PathLike
        Target folder; created (with parents) if missing.

    Returns
    -------
    copied : list of pathlib.Path
        Notebooks written by this call.
    edited : list of pathlib.Path
        Notebooks left alone whose cells differ from the packaged version's (outputs,
        execution counts and metadata do not count: running a notebook is not editing it).
    """
    dest = Path(dest).expanduser()
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"{dest} exists and is not a folder; choose another with --dir")
    dest.mkdir(parents=True, exist_ok=True)
    copied, edited = [], []
    for name, data in sorted(_packaged_notebooks().items()):
        target = dest / name
        if target.exists():
            if not _same_cells(target.read_bytes(), data):
                edited.append(target)
            continue
        # Write a temporary file and link it into place exclusively: a notebook that
        # appears meanwhile (a second launch, the user saving) is kept, never clobbered.
        tmp = dest / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        try:
            os.link(tmp, target)
            copied.append(target)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            try:
                with open(target, "xb") as fh:
                    fh.write(data)
                copied.append(target)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    return copied, edited


def _cells(data: bytes) -> list[tuple[str, str]] | None:
    """(cell type, source) of every cell of a notebook file; None if it is not notebook JSON."""
    try:
        cells = json.loads(data)["cells"]
        return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"]) for c in cells]
    except (ValueError, KeyError, TypeError):
        return None


def _same_cells(a: bytes, b: bytes) -> bool:
    """True when two notebook files have the same cells (what a person writes), whatever their outputs."""
    if a == b:
        return True
    cells = _cells(a)
    return cells is not None and cells == _cells(b)


def _prepare_notebooks(args: argparse.Namespace) -> Path | None:
    """Install the notebooks for ``lab``/``app`` and say what happened; None on error (printed)."""
    dest = notebook_dir(args.dir)
    try:
        copied, edited = install_notebooks(dest)
    except (OSError, FileNotFoundError) as exc:
        print(f"error: cannot set up the notebooks in {dest}: {exc}", file=sys.stderr)
        return None
    print(f"notebooks  {dest}")
    for path in copied:
        print(f"  copied   {path.name}")
    for path in edited:
        print(f"  kept     {path.name} (your edits; delete it to get the packaged version back)")
    return dest


def _free_port(start: int) -> int:
    """The first port from ``start`` that 127.0.0.1 can bind now."""
    for port in range(start, start + 100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on 127.0.0.1 in {start}–{start + 99}; choose one with --port")


def _serve(cmd: list[str], url: str, token: str) -> int:
    """Run a server command with the token in its environment (not its argv) and wait for it.

    SIGTERM and SIGHUP sent to this process (a service manager, a closed terminal, a test
    harness) are passed on to the server, which then shuts its kernels down before it
    exits; without that the server and its kernels would outlive this process.
    """
    env = dict(os.environ, JUPYTER_TOKEN=token)
    print(f"open       {url}", flush=True)
    print("stop with  Ctrl-C", flush=True)
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    forwarded = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {}
    try:
        for sig in forwarded:
            previous[sig] = signal.signal(sig, forward)
    except ValueError:  # not the main thread (called from a test's thread): nothing to forward
        pass
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                # The server got the same SIGINT (same process group) and asks or shuts
                # down itself; wait for it rather than leave it running behind us.
                continue
        return 130 if code == -signal.SIGINT else code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # an unexpected error here: never leave the server behind
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _lab(args: argparse.Namespace) -> int:
    if not _has_module("jupyterlab"):
        print("error: JupyterLab is not installed; pip install jupyterlab", file=sys.stderr)
        return 2
    dest = _prepare_notebooks(args)
    if dest is None:
        return 2
    port = args.port or _free_port(args.default_port)
    # Keep the user's own token if they set one; otherwise a fresh random one per launch.
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_urlsafe(24)
    page = f"/lab/tree/{QUICKSTART}"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",  # the printed URL must be the one served
        f"--ServerApp.root_dir={dest}",
        f"--LabApp.default_url={page}",
        f"--ServerApp.open_browser={not args.no_browser}",
        *args.extra,
    ]
    return _serve(cmd, f"http://127.0.0.1:{port}{page}?token={token}", token)


def _app(args: argparse.Namespace) -> int:
    dest = _prepare_notebooks(args)
    if dest is None:
        return 2
    notebook = dest / args.notebook
    if not notebook.is_file():
        names = ", ".join(sorted(p.name for p in dest.glob("*.ipynb")))
        print(f"error: no notebook {notebook}; choose one of: {names}", file=sys.stderr)
        return 2
    port = args.port or _free_port(args.default_port)
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_urlsafe(24)
    if not _has_module("voila"):
        print("error: Voilà is not installed; pip install voila", file=sys.stderr)
        return 2
    cmd = [
        sys.executable,
        "-m",
        "voila",
        str(notebook),
        "--Voila.ip=127.0.0.1",
        f"--port={port}",
        "--Voila.port_retries=0",
        # Voilà serves without auth unless asked; --token makes it take JUPYTER_TOKEN.
        "--token",
        *(["--no-browser"] if args.no_browser else []),
        *args.extra,
    ]
    return _serve(cmd, f"http://127.0.0.1:{port}/?token={token}", token)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
