"""Shared test helpers: real structures, cached models, gemmi reference maps, verbose comparisons."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
import kernels.testing
from kernels.crystal import AtomSet

DATA = Path(__file__).resolve().parent / "data"
STRUCTURES = {
    "1orc": kernels.example_structure("1orc"),
    "1pfe": kernels.example_structure("1pfe"),
    "1aki": kernels.example_structure("1aki"),
    "3o5r": DATA / "3o5r.cif.gz",
    "5h73": DATA / "5h73.cif.gz",
    "3wip": DATA / "3wip.cif.gz",
}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")


def free_port(first: int) -> int:
    """The first port from ``first`` that 127.0.0.1 can bind now, in this pytest-xdist worker's own range.

    Worker ``gwN`` starts its search 2,000 ports above worker ``gw(N-1)``: two workers that start
    servers at the same moment would otherwise both find ``first`` free before either binds it.
    """
    from workbench.cli import _free_port

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return _free_port(first + 2000 * index)


def leaf_atoms(atoms: AtomSet, dtype: torch.dtype) -> AtomSet:
    """Copy of ``atoms`` in ``dtype`` whose xyz, b_iso, occ (and u_aniso, when set) are leaves requiring grad."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).clone().requires_grad_()

    u = None if atoms.u_aniso is None else leaf(atoms.u_aniso)
    return atoms.replace(
        xyz=leaf(atoms.xyz), b_iso=leaf(atoms.b_iso), occ=leaf(atoms.occ), a=atoms.a.to(dtype), b=atoms.b.to(dtype),
        u_aniso=u, _validate=False,
    )  # fmt: skip


@functools.cache
def model(name: str) -> kernels.Model:
    """The structure ``name`` read with default options, ANISOU kept (cached: do not modify).

    Atoms whose ANISOU is not positive definite (3O5R has one) are splatted at their B
    (``on_bad_adp="iso"``; the warning saying so is expected here and silenced).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "(?s).*not positive definite", UserWarning)
        return kernels.read_model(STRUCTURES[name], on_bad_adp="iso")


@functools.cache
def gemmi_density(name: str, spacing: float = 2.0 / 3.0, cutoff: float = 1e-5, symmetry: bool = False) -> np.ndarray:
    """gemmi's DensityCalculatorX map of exactly what :func:`model` splats (ANISOU where it uses U); cached."""
    return kernels.testing.gemmi_density_of_model(model(name), spacing, cutoff, symmetry=symmetry)


def report(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> str:
    """How many elements of ``out`` miss ``|out-ref| <= atol + rtol|ref|`` and the worst one."""
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    diff = (out - ref).abs()
    bad = diff > atol + rtol * ref.abs()
    flat = int(diff.argmax())
    idx = np.unravel_index(flat, tuple(diff.shape)) if diff.ndim else ()
    return (
        f"{int(bad.sum())} of {diff.numel()} elements over tolerance (atol {atol:.2e}, rtol {rtol:.2e}); "
        f"worst at {tuple(int(i) for i in idx)}: got {float(out.reshape(-1)[flat]):.8g}, "
        f"expected {float(ref.reshape(-1)[flat]):.8g} (|diff| {float(diff.max()):.3e}, max|ref| {float(ref.abs().max()):.3e})"
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """Assert ``|out − ref| ≤ atol + rtol·|ref|`` elementwise, with a verbose report on failure."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out_d, ref_d = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out_d).all(), "non-finite values in the output"
    ok = (out_d - ref_d).abs() <= atol + rtol * ref_d.abs()
    assert bool(ok.all()), report(out, ref, atol, rtol)


def assert_kernel_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """docs/kernels.md's float32 contract: ``|out − ref| ≤ 1e-5·max|ref| + 1e-5·|ref|``."""
    scale = float(ref.detach().abs().max()) if ref.numel() else 0.0
    assert_close(out, ref, atol=1e-5 * scale, rtol=1e-5)


def run_compiled(script: str, root: Path, timeout: float = 600) -> str:
    """stdout of ``python -c script`` in ``root`` without ``TRITON_INTERPRET`` (Triton compiles for real;
    ``root`` first on the path); asserts it exits 0, with its stderr's end as the message."""
    import os
    import subprocess
    import sys

    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@contextlib.contextmanager
def deterministic(on: bool = True, *, warn_only: bool = False):
    """``torch.use_deterministic_algorithms(on, warn_only=warn_only)`` inside, the caller's setting restored after."""
    was, was_warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)
