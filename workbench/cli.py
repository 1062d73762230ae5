"""Command line of the density workbench (``workbench``; :data:`DESCRIPTION` is its help).

The notebooks are the repository's ``notebooks/`` folder, which an installed package carries
as ``workbench/notebooks`` (see :func:`shipped_notebooks_dir`); ``lab`` and ``app`` copy
them into a folder of the user's (default ``~/density-workbench/notebooks``) and only ever
add missing files, so a user's edits survive every launch and every upgrade.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import warnings
from importlib import resources
from pathlib import Path

from workbench._cli_shared import (
    _UNITS_TEXT,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    _check_out,
    _error,
    _map_summary,
    _positive,
    add_grid_options,
    add_radiation_options,
)

__all__ = [
    "main",
    "WIDGET_SAVED_NOTE",
    "drop_widget_views",
    "install_notebooks",
    "notebook_dir",
    "shipped_notebooks_dir",
    "QUICKSTART",
    "NOTEBOOK_DIR_ENV",
]

#: ``workbench --help``'s description (plain text: argparse prints it as written).
DESCRIPTION = """\
Command line of the density workbench: the commands below, each with its own --help.

Run them with the Python the project is installed in (scripts/start.sh installs into .venv:
.venv/bin/workbench, or .venv/bin/python -m workbench)."""

#: ``workbench --help``'s closing lines: every exit status any command gives.
EXIT_STATUS_TEXT = """\
Exit status:
    0  success (check: every check that ran passed)
    1  a failure: a bad model file, a map too large, a failed write (check: a check failed)
    2  a usage error: bad arguments, checked before any work; nothing was computed
    3  check: the kernel could not be loaded (its module does not import, or no such function)
    4  check: the check could not run (a model unreadable, the device or backend unavailable)
  130  interrupted (Ctrl-C); nothing half-written is left
lab and app end with the server's own status."""

#: The notebook ``workbench lab`` opens and ``workbench app`` serves.
QUICKSTART = "01_quickstart.ipynb"
#: Environment variable naming the user's notebook folder (``--dir`` wins over it).
NOTEBOOK_DIR_ENV = "WORKBENCH_NOTEBOOK_DIR"
_DEFAULT_NOTEBOOK_DIR = Path("~/density-workbench/notebooks")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a whole number in 1-65535, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number in 1-65535, got {text!r}")
    return port


def _splat(args: argparse.Namespace) -> int:
    import torch

    import kernels
    from kernels._util import file_problem
    from kernels.mapio import map_header_problem

    # Every argument is checked before anything is read or computed (and before anything is printed).
    path = Path(args.model) if args.model else kernels.example_structure()
    problem = file_problem(path)
    if problem:
        return _error(f"model {path}: {problem}; give a PDB or mmCIF file", EXIT_USAGE)
    problem = _check_out(Path(args.out))
    if problem:
        return _error(problem, EXIT_USAGE)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda asked for, but no CUDA GPU is visible; use --device cpu", EXIT_USAGE)
    try:
        backend = kernels.resolve_backend("density", torch.device(device), args.backend)
    except kernels.BackendError as exc:
        return _error(f"--backend {args.backend}: {exc}", EXIT_USAGE)

    try:
        model = kernels.read_model(
            path,
            model_index=None if args.model_number is None else args.model_number - 1,
            box_padding=args.box_padding,
            adp=args.adp,
            on_bad_adp=args.on_bad_adp,
            radiation=args.radiation,
        )
    except kernels.ModelError as exc:
        if args.model_number is not None and "model_index" in str(exc):
            return _error(f"--model {args.model_number}: {_models_in(path)}", EXIT_USAGE)
        hint = " (on this command line: --on-bad-adp iso, or --adp iso)" if "on_bad_adp='iso'" in str(exc) else ""
        if args.box_padding is not None and f"box_padding={args.box_padding:g} Å" in str(exc):
            return _error(str(exc).replace("box_padding=", "--box-padding "), EXIT_USAGE)
        return _error(f"{exc}{hint}", EXIT_FAILURE)
    if args.box_padding is not None and model.shift is None:
        return _error(
            f"--box-padding {args.box_padding:g}: {path} has a unit cell ({_cell_text(model.cell)}, "
            f"{model.spacegroup}) and the map is computed in it; --box-padding builds a P 1 box only for a "
            "model without a cell: leave it out",
            EXIT_USAGE,
        )
    atoms = model.atoms
    if model.shift is not None:
        # Splat the atoms at the file's coordinates (the box is periodic, so they wrap into it) and
        # write the map from the voxel at the box's corner: the map lies over the input model.
        atoms = atoms.replace(xyz=atoms.xyz - torch.tensor(model.shift, dtype=atoms.xyz.dtype))
    atoms = atoms.to(device, torch.float64 if backend == "reference" else torch.float32)
    units = kernels.density_unit(args.radiation)
    try:
        grid = kernels.GridSpec.for_spacing(model.cell, args.spacing, model.spacegroup)
        write_grid = grid
        if model.shift is not None:
            # the voxel at the box's corner, -shift in Å, starts the written map (the box is orthogonal)
            origin = tuple(
                math.floor(-s * n / edge) for s, n, edge in zip(model.shift, grid.shape, model.cell.parameters)
            )
            write_grid = kernels.GridSpec(grid.cell, grid.shape, origin, grid.sampling)
        problem = map_header_problem(write_grid)  # before the splat: the header is written after it
        if problem:
            return _error(f"{path}: the atoms lie too far from the origin for a CCP4 map: {problem}", EXIT_FAILURE)
        which = f", model {model.model_index + 1} of {model.n_models}" if model.n_models > 1 else ""
        print(
            f"model   {path}{which} ({_count(len(model), 'atom')}, cell {_cell_text(model.cell)}, {model.spacegroup})"
        )
        n_aniso = 0 if atoms.aniso is None else int(atoms.aniso.sum())
        blur = f", blur {args.blur:g} Å²" if args.blur else ""
        print(f"atoms   {args.radiation} form factors, {_count(n_aniso, 'atom')} with anisotropic U{blur}")
        for note in model.notes:
            if not args.warned.said(note):  # a warning already said it, on stderr
                print(f"note    {note}")
        radius = (
            f"{args.radius:g} Å for every atom" if args.radius else f"per atom, density cutoff {args.cutoff:g} {units}"
        )
        print(f"grid    {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} at ≤ {args.spacing:g} Å; radius {radius}")
        start = time.perf_counter()
        rho = kernels.splat_density(
            atoms, grid, radius=args.radius, cutoff=args.cutoff, backend=backend, blur=args.blur
        )
        if args.symmetrize:
            rho = kernels.symmetrize(rho, grid, model.spacegroup)
        if atoms.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    except (kernels.BackendError, kernels.GridError, ValueError) as exc:
        return _error(f"{exc}", EXIT_FAILURE)
    except MemoryError as exc:
        return _error(
            f"out of memory ({exc or 'no detail'}): use a coarser --spacing or a smaller --radius", EXIT_FAILURE
        )
    print(
        f"splat   backend {backend} on {atoms.device}: {elapsed * 1e3:.1f} ms "
        f"({'with' if args.symmetrize else 'without'} symmetry mates)"
    )
    if args.symmetrize:
        whose = f"the model and its symmetry mates ({model.spacegroup})"
    else:
        whose = f"the model's own {_count(len(model), 'atom')} only (--symmetrize adds the symmetry mates)"
    print(f"map     {_map_summary(rho, grid, args.radiation)} in the cell, from {whose}")
    if model.shift is not None:
        origin = write_grid.origin
        rho = torch.roll(rho, shifts=tuple(-o for o in origin), dims=(0, 1, 2))
        print(f"origin  map starts at voxel {origin}: it lies over the atoms at the file's coordinates")
    try:
        out = kernels.write_map(
            args.out, rho, write_grid, model.spacegroup if args.symmetrize else "P 1", radiation=args.radiation
        )
    except (OSError, ValueError) as exc:
        return _error(f"cannot write the map to {args.out}: {exc}", EXIT_FAILURE)
    print(f"wrote   {out}")
    return EXIT_OK


def _count(n: int, noun: str) -> str:
    # workbench.compute.text.count's rule; importing it loads the whole compute package (0.1 s of views)
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _cell_text(cell) -> str:
    """The six cell parameters as a person writes them (39.516, not 39.516000000000005)."""
    a, b, c, al, be, ga = cell.parameters
    return f"{a:g} {b:g} {c:g} Å, {al:g} {be:g} {ga:g}°"


def _models_in(path: Path) -> str:
    """How many models ``path`` holds, as the answer to a ``--model`` out of range."""
    import gemmi

    n = len(gemmi.read_structure(str(path)))
    return f"{path} holds {_count(n, 'model')}; choose --model 1 to {n}" if n else f"{path} holds no models"


class _OneLineWarnings:
    """Shows each warning of a command once, as one line on stderr without the source location.

    The kernels warn (``warnings.warn``) where a library caller needs to hear it; on the command
    line the same text would come with a file path and line number, once per call site, and again
    as the model's note. Here it is ``warning: <message>``, each message once; a note whose text a
    warning already gave is not printed again (:meth:`said`).
    """

    def __init__(self):
        self.shown: list[str] = []

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = " ".join(str(message).split())
        if text not in self.shown:
            self.shown.append(text)
            print(f"warning: {text}", file=sys.stderr, flush=True)

    def said(self, note: str) -> bool:
        """True when a warning shown already carries ``note``."""
        return any(note in text for text in self.shown)


def _model_number(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a model number is a whole number from 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a model number is a whole number from 1 (1 = the first), got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The ``workbench`` argument parser with every subcommand (plain-text help throughout)."""
    parser = argparse.ArgumentParser(
        prog="workbench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXIT_STATUS_TEXT,
    )
    # metavar: the usage line says COMMAND, so that the list below is the one place each is named
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    sp = sub.add_parser(
        "splat",
        help="Splat one model's density onto a grid and write a CCP4 map",
        description="Splat a model's density onto a grid and write a CCP4 map. " + _UNITS_TEXT,
    )
    sp.add_argument("model", nargs="?", help="PDB/mmCIF file (default: the bundled 1ORC example)")
    sp.add_argument(
        "--model",
        dest="model_number",
        metavar="N",
        type=_model_number,
        help="which model of a multi-model file to splat, 1 = the first (default: the first; the output says "
        "when the file holds more). workbench ensemble splats them all into one map",
    )
    add_grid_options(sp)
    sp.add_argument(
        "--box-padding",
        type=_positive("--box-padding", "Å"),
        help="for a model without a unit cell: build a P 1 box around the atoms with this margin in Å; the map's "
        "origin puts it over the file's coordinates (default: none; refused for a model with a cell)",
    )
    sp.add_argument(
        "--adp",
        default="auto",
        choices=["auto", "iso"],
        help="auto: atoms with ANISOU records splat their U; iso: every atom at its isotropic B (default auto)",
    )
    sp.add_argument(
        "--on-bad-adp",
        default="raise",
        choices=["raise", "iso"],
        help="an ANISOU U that is not positive definite: refuse the file (raise) or splat that atom at its B "
        "(iso) (default raise)",
    )
    add_radiation_options(sp)
    sp.add_argument(
        "--symmetrize",
        action="store_true",
        help="add the space group's symmetry mates (default: the model's own atoms only)",
    )
    sp.add_argument("--out", default="map.ccp4", help="output CCP4 map file (default map.ccp4)")
    sp.set_defaults(func=_splat)

    from workbench.ensemble_cli import add_parser as add_ensemble_parser

    add_ensemble_parser(sub, _positive)

    from workbench.check_cli import add_parser as add_check_parser

    add_check_parser(sub, _positive)

    from workbench.sf_cli import add_parser as add_sf_parser

    add_sf_parser(sub, _positive)

    for name, helptext, default_port in (
        ("lab", "Start JupyterLab on 127.0.0.1 (token kept) with the quickstart notebook open", 8888),
        ("app", "Serve the quickstart notebook as a standalone Voilà app on 127.0.0.1", 8866),
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
        lp.add_argument(
            "--port", type=_port, help=f"port on 127.0.0.1 (default: the first free one from {default_port})"
        )
        lp.add_argument("--no-browser", action="store_true", help="do not open a web browser (default: open one)")
        if name == "app":
            lp.add_argument("notebook", nargs="?", default=QUICKSTART, help=f"notebook to serve (default {QUICKSTART})")
        lp.set_defaults(func=_lab if name == "lab" else _app, default_port=default_port, passthrough=True)
    for subparser in sub.choices.values():
        subparser.set_defaults(command_parser=subparser)  # a usage error shows this command's usage
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
        The exit status: 0 success, 2 a usage error (bad arguments, checked before any work),
        1 any other failure (a bad model file, a map too large, a failed write); ``lab`` and
        ``app`` return the server's once it runs. Errors are one line on stderr, never a
        traceback.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        # the command's usage and one line, as argparse gives for the command's own arguments
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        if getattr(args, "passthrough", False):
            return args.func(args)  # lab, app: the server's own output
        args.warned = _OneLineWarnings()
        with warnings.catch_warnings():
            # every user-facing warning reaches the handler, which says each text once (libraries'
            # deprecation notices stay under Python's default filters: not the user's concern)
            warnings.simplefilter("always", UserWarning)
            warnings.simplefilter("always", RuntimeWarning)
            warnings.showwarning = args.warned.show
            return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:  # a Python without the project's dependencies (the system one, say)
        return _error(
            f"{sys.executable} cannot import {exc.name!r}, which workbench {args.command} needs: run it with the "
            "Python the project is installed in (scripts/start.sh installs into .venv: .venv/bin/workbench), "
            "or pip install -e . into this one",
            EXIT_FAILURE,
        )


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
    ``workbench/notebooks`` (installed there by ``CMakeLists.txt``); an editable
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
    except OSError as exc:
        detail = exc if isinstance(exc, NotADirectoryError) else (exc.strerror or exc)
        print(
            f"error: cannot set up the notebooks in {dest}: {detail}; choose another folder with --dir", file=sys.stderr
        )
        return None
    print(f"notebooks  {dest}")
    for path in copied:
        print(f"  copied   {path.name}")
    for path in edited:
        print(f"  kept     {path.name} (your edits; delete it to get the packaged version back)")
    return dest


def _choose_port(args: argparse.Namespace) -> int | None:
    """The port to serve on: ``--port`` if 127.0.0.1 can bind it now, else the first free one; None on error (printed)."""
    if args.port is None:
        try:
            return _free_port(args.default_port)
        except OSError as exc:
            _error(str(exc), EXIT_FAILURE)
            return None
    try:
        _probe(args.port)
    except OSError as exc:
        _error(
            f"--port {args.port}: cannot listen on 127.0.0.1:{args.port} ({exc.strerror or exc}); "
            "choose another --port or leave it out to take the first free one",
            EXIT_USAGE,
        )
        return None
    return args.port


def _probe(port: int) -> None:
    """Bind 127.0.0.1:``port`` as the server will, then let it go; OSError if the server could not.

    The server (tornado) listens with SO_REUSEADDR, so a port whose last connections are still in
    TIME_WAIT (a server stopped a moment ago) is one it can take; the probe sets it too, or it
    would refuse such a port for a minute. A port another process listens on still fails to bind.
    Windows' SO_REUSEADDR would let the bind steal a port in use, so the probe leaves it unset there.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if os.name != "nt":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _free_port(start: int) -> int:
    """The first port from ``start`` that 127.0.0.1 can bind now."""
    for port in range(start, start + 100):
        try:
            _probe(port)
        except OSError:
            continue
        return port
    raise OSError(f"no free port on 127.0.0.1 in {start}–{start + 99}; choose one with --port")


def server_environment(token: str) -> dict[str, str]:
    """The environment of the server ``lab`` and ``app`` start (its notebook kernels inherit it).

    ``JUPYTER_TOKEN`` is the token (kept out of the server's argv). ``OMP_WAIT_POLICY`` is
    ``PASSIVE`` unless the user's environment sets it: the views are drawn by a Python thread
    right after each OpenMP splat, and with OpenMP's default (active) waiting the splat's idle
    threads spin and starve that thread on a small machine, about tripling the slider-to-image
    latency on two cores (benchmarks/README.md, "Workbench"). OpenMP reads the variable once,
    when ``import torch`` loads it, so it is set here, in the environment of every process that
    will draw views, before any of them starts; importing ``workbench`` sets nothing.

    Parameters
    ----------
    token : str
        The server's access token.

    Returns
    -------
    dict of str to str
        A copy of this process's environment with the variables above.
    """
    env = dict(os.environ, JUPYTER_TOKEN=token)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def browser_available() -> bool:
    """Whether Python's ``webbrowser`` finds a browser to open here (the server asks it the same way).

    Returns
    -------
    bool
        False on a headless machine (no display, no ``BROWSER``, no console browser).
    """
    import webbrowser

    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return True


def _open_browser(args: argparse.Namespace) -> bool:
    """Whether the server should open a browser: asked for and one found; says plainly when none is."""
    if args.no_browser:
        return False
    if browser_available():
        return True
    print("browser    none found on this machine: open the URL below in a browser")
    return False


def _serve(cmd: list[str], url: str, token: str) -> int:
    """Run a server command in :func:`server_environment` and wait for it.

    SIGTERM and SIGHUP sent to this process (a service manager, a closed terminal, a test
    harness) are passed on to the server, which then shuts its kernels down before it
    exits; without that the server and its kernels would outlive this process.
    """
    env = server_environment(token)
    print(f"open       {url}", flush=True)
    print("stop with  Ctrl-C", flush=True)
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        return _error(f"cannot start {' '.join(cmd[2:4])}: {exc}", EXIT_FAILURE)

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
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # an unexpected error here: never leave the server behind
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
#: What a saved notebook shows where a live widget was (see :func:`drop_widget_views`).
WIDGET_SAVED_NOTE = "(a live widget: run this cell to show it again)"


def drop_widget_views(model: dict, **_) -> None:
    """A Jupyter server pre-save hook: replace each widget's output in a saved notebook by a one-line note.

    A widget's output names a model that lives in the kernel; a notebook reopened from the file
    (Lab autosaves while you work) has no such kernel, and Lab shows "Error displaying widget: model
    not found" where the app was, until the cell runs again. The open page keeps its live widgets:
    the hook changes only what is written to disk. ``workbench lab`` installs it.

    Parameters
    ----------
    model : dict
        The contents model being saved (``type``, ``content``); a notebook's ``content`` is changed in place.
    """
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    for cell in model["content"].get("cells", ()):
        for output in cell.get("outputs", ()) if cell.get("cell_type") == "code" else ():
            data = output.get("data")
            if isinstance(data, dict) and _WIDGET_VIEW in data:
                output["data"] = {"text/plain": WIDGET_SAVED_NOTE}


def _lab(args: argparse.Namespace) -> int:
    if not _has_module("jupyterlab"):
        return _error("JupyterLab is not installed; pip install jupyterlab", EXIT_FAILURE)
    port = _choose_port(args)
    if port is None:
        return EXIT_USAGE if args.port is not None else EXIT_FAILURE
    dest = _prepare_notebooks(args)
    if dest is None:
        return EXIT_USAGE
    # Keep the user's own token if they set one; otherwise a fresh random one per launch.
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_urlsafe(24)
    page = f"/lab/tree/{QUICKSTART}"
    cmd = [
        sys.executable,
        "-m",
        "workbench._server",  # jupyterlab, less a warning (workbench/_server.py)
        "jupyterlab",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",  # the printed URL must be the one served
        f"--ServerApp.root_dir={dest}",
        f"--LabApp.default_url={page}",
        f"--ServerApp.open_browser={_open_browser(args)}",
        "--ContentsManager.pre_save_hook=workbench.cli.drop_widget_views",
        *args.extra,
    ]
    return _serve(cmd, f"http://127.0.0.1:{port}{page}?token={token}", token)


def _app(args: argparse.Namespace) -> int:
    if not _has_module("voila"):
        return _error("Voilà is not installed; pip install voila", EXIT_FAILURE)
    port = _choose_port(args)
    if port is None:
        return EXIT_USAGE if args.port is not None else EXIT_FAILURE
    dest = _prepare_notebooks(args)
    if dest is None:
        return EXIT_USAGE
    notebook = dest / args.notebook
    if not notebook.is_file():
        names = ", ".join(sorted(p.name for p in dest.glob("*.ipynb")))
        return _error(f"no notebook {notebook}; choose one of: {names}", EXIT_USAGE)
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_urlsafe(24)
    cmd = [
        sys.executable,
        "-m",
        "workbench._server",
        "voila",
        str(notebook),
        "--Voila.ip=127.0.0.1",
        f"--port={port}",
        "--Voila.port_retries=0",
        # Voilà serves without auth unless asked; --token makes it take JUPYTER_TOKEN.
        "--token",
        *([] if _open_browser(args) else ["--no-browser"]),
        *args.extra,
    ]
    return _serve(cmd, f"http://127.0.0.1:{port}/?token={token}", token)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
