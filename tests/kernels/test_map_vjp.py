"""The backends' map vector-Jacobian products (the backward alone) and the streamed second pass built on them.

``map_vjp_cpu`` and ``map_vjp_triton`` give the gradients of ``(grad · splat(atoms)).sum()`` without
running the splat; they must be bit for bit those of a forward and its autograd backward (the CPU
gather solves for the rows the forward would keep; the Triton backward reads radii computed as the
forward computes them). :func:`kernels.ensemble_gradients` then runs no forward at all.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.crystal import AtomSet
from kernels.density import cpu as cpu_backend
from kernels.density import triton as triton_backend
from kernels.density._ensemble_parts import _flatten, _weighted
from tests.kernels.test_ensemble import TRITON_DEVICE, _system

F = 3
VJP = {"cpu": (cpu_backend.splat_cpu, cpu_backend.map_vjp_cpu), "triton": (triton_backend.splat_triton, None)}


def _device(backend: str) -> torch.device:
    return TRITON_DEVICE if backend == "triton" else torch.device("cpu")


def _anisotropic(atoms: AtomSet) -> AtomSet:
    """``atoms`` with a tilted, positive definite U per atom (every third atom isotropic)."""
    n = len(atoms)
    iso_u = atoms.b_iso.detach().to(torch.float64) / (8 * math.pi**2)
    u = torch.zeros((n, 6), dtype=torch.float64)
    u[:, 0], u[:, 1], u[:, 2] = 1.6 * iso_u, 0.7 * iso_u, iso_u
    u[:, 3], u[:, 4], u[:, 5] = 0.2 * iso_u, -0.1 * iso_u, 0.05 * iso_u
    aniso = torch.arange(n) % 3 != 0
    return atoms.replace(u_aniso=u.to(atoms.dtype).to(atoms.device), aniso=aniso.to(atoms.device))


def _chunk(backend: str, kind: str, weighted: bool):
    """One chunk of F frames flattened and weighted as the ensemble's second pass builds it, its grid and ∂L/∂ρ."""
    atoms, grid, xyz, *_ = _system(torch.float32, frames=F, device=_device(backend))
    if kind == "aniso":
        atoms = _anisotropic(atoms)
    elif kind == "neutron":
        atoms = AtomSet.from_elements(
            atoms.elements, atoms.xyz.cpu(), atoms.b_iso.cpu(), atoms.occ.cpu(), radiation="neutron"
        ).to(xyz.device, torch.float32)
    n = len(atoms)
    frames = _flatten(atoms, xyz, None, None, 0, F)
    w = torch.tensor([0.5, 1.25, -0.75], dtype=torch.float32, device=xyz.device) if weighted else None
    frames = _weighted(frames, w, 0, F, n)
    gen = torch.Generator().manual_seed(7)
    upstream = torch.randn(grid.shape, generator=gen, dtype=torch.float32).to(xyz.device)
    return frames, grid, upstream


def _autograd(splat, frames: AtomSet, grid, upstream, **kw):
    """(g_xyz, g_b_iso, g_occ, g_u or None) by a forward and autograd's backward."""
    leaves = [t.detach().clone().requires_grad_() for t in (frames.xyz, frames.b_iso, frames.occ)]
    u = None if frames.u_aniso is None else frames.u_aniso.detach().clone().requires_grad_()
    at = frames.replace(xyz=leaves[0], b_iso=leaves[1], occ=leaves[2], u_aniso=u, _validate=False)
    rho = splat(at, grid, **kw)
    grads = torch.autograd.grad(rho, leaves + ([u] if u is not None else []), grad_outputs=upstream)
    return (*grads, None) if u is None else grads


CASES = [
    ("iso", None, "gemmi", False),
    ("iso", None, "gemmi", True),
    ("iso", 2.5, "gemmi", True),
    ("aniso", None, "gemmi", True),
    ("aniso", None, "eigen", False),
    ("aniso", 2.5, "gemmi", True),
    ("neutron", None, "gemmi", True),
]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize(("kind", "radius", "rule", "weighted"), CASES)
def test_map_vjp_is_bitwise_the_backward_of_a_forward(backend, kind, radius, rule, weighted):
    frames, grid, upstream = _chunk(backend, kind, weighted)
    splat = VJP[backend][0]
    vjp = cpu_backend.map_vjp_cpu if backend == "cpu" else triton_backend.map_vjp_triton
    kw = {"radius": radius, "radius_rule": rule}
    want = _autograd(splat, frames, grid, upstream, **kw)
    got = vjp(frames, grid, upstream, **kw)
    assert len(got) == 4
    for name, g, ref in zip(("xyz", "b_iso", "occ", "u_aniso"), got, want):
        if ref is None:
            assert g is None or kind == "neutron", name  # a neutron set takes the anisotropic kernels
            continue
        assert g.shape == ref.shape and g.dtype == ref.dtype and g.device == ref.device, name
        assert bool(ref.abs().max() > 0), name  # the case reaches every gradient
        assert torch.equal(g, ref), f"{name}: largest difference {float((g - ref).abs().max()):.3g}"


@pytest.mark.parametrize("kind", ["iso", "aniso"])
def test_triton_map_vjp_matches_the_deterministic_forward_too(kind):
    """Under deterministic algorithms the forward takes its radii from another launch: the same radii."""
    from tests.helpers import deterministic

    frames, grid, upstream = _chunk("triton", kind, True)
    with deterministic():
        want = _autograd(triton_backend.splat_triton, frames, grid, upstream)
        got = triton_backend.map_vjp_triton(frames, grid, upstream)
    for g, ref in zip(got, want):
        if ref is not None:
            assert torch.equal(g, ref)


def test_map_vjp_of_no_atoms_is_empty():
    frames, grid, upstream = _chunk("cpu", "iso", False)
    none = frames.replace(xyz=frames.xyz[:0], b_iso=frames.b_iso[:0], occ=frames.occ[:0], a=frames.a[:0],
                          b=frames.b[:0], elements=[], labels=[], _validate=False)  # fmt: skip
    for vjp, device in ((cpu_backend.map_vjp_cpu, "cpu"), (triton_backend.map_vjp_triton, TRITON_DEVICE)):
        g_xyz, g_b, g_occ, g_u = vjp(none.to(device), grid, upstream.to(device))
        assert g_xyz.shape == (0, 3) and g_b.shape == (0,) and g_occ.shape == (0,) and g_u is None


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kind", ["iso", "aniso"])
def test_streamed_gradients_are_bitwise_the_tensor_paths(backend, kind):
    """An atom's gradient is its own sum over its voxels (no atomics), whichever frames share a call: the
    streamed gradients are the tensor path's bit for bit, weighted, with B and occupancy."""
    atoms, grid, xyz, *_ = _system(torch.float32, frames=10, device=_device(backend))
    if kind == "aniso":
        atoms = _anisotropic(atoms)
    n = len(atoms)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float32).to(xyz.device)
    x = xyz.clone().requires_grad_()
    b = atoms.b_iso.expand(10, n).clone().requires_grad_()
    o = atoms.occ.expand(10, n).clone().requires_grad_()
    rho = kernels.splat_ensemble(atoms, x, grid, b_iso=b, occ=o, weights=[0.3] * 10, backend=backend, blur=1.5)
    (rho * upstream).sum().backward()
    parts = {}
    kernels.ensemble_gradients(
        atoms, (c for c in xyz.split([3, 1, 4, 2])), grid, upstream, out=lambda s, e, g: parts.update({s: g}),
        wrt=("xyz", "b_iso", "occ"), weights=0.3, backend=backend, blur=1.5,
    )  # fmt: skip
    for name, want in (("xyz", x.grad), ("b_iso", b.grad), ("occ", o.grad)):
        got = torch.cat([parts[s][name] for s in sorted(parts)])
        assert torch.equal(got, want), f"{name}: largest difference {float((got - want).abs().max()):.3g}"


class _Counted:
    """Calls of a module function, counted and passed through (the real function runs)."""

    def __init__(self, monkeypatch, module, name: str):
        self.calls, real = 0, getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


# (module, its forward launchers, its backward launchers)
LAUNCHERS = {
    "cpu": (cpu_backend, ("_splat",), ("_gather", "_gather_aniso")),
    "triton": (triton_backend, ("_forward", "_forward_aniso"), ("_backward", "_backward_aniso")),
}


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("kind", ["iso", "aniso"])
def test_the_second_pass_runs_the_backward_alone(monkeypatch, backend, kind):
    atoms, grid, xyz, *_ = _system(torch.float32, frames=10, device=_device(backend))
    if kind == "aniso":
        atoms = _anisotropic(atoms)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(4)).to(xyz.device)
    module, fwd_names, bwd_names = LAUNCHERS[backend]
    fwd = [_Counted(monkeypatch, module, name) for name in fwd_names]
    bwd = [_Counted(monkeypatch, module, name) for name in bwd_names]
    kernels.splat_ensemble(atoms, (c for c in xyz.split(4)), grid, backend=backend)
    assert sum(c.calls for c in fwd) == 3 and sum(c.calls for c in bwd) == 0  # the counts see the first pass
    chunks = []
    kernels.ensemble_gradients(
        atoms, (c for c in xyz.split(4)), grid, upstream, out=lambda s, e, g: chunks.append(s), backend=backend,
        wrt=("xyz", "occ"),
    )  # fmt: skip
    assert chunks == [0, 4, 8]
    assert sum(c.calls for c in fwd) == 3, "the second pass ran a forward splat"
    assert sum(c.calls for c in bwd) == 3  # one backward per chunk


def test_a_registered_backend_recomputes_its_forward_in_the_second_pass():
    """A user's backend has no backward of its own to call: the second pass runs its splat with autograd."""
    from tests.helpers import assert_kernel_close
    from tests.kernels import user_backends as ub

    calls = []

    def mine(atoms, grid, *, radius, cutoff):
        calls.append(len(atoms))
        return ub.correct(atoms, grid, radius=radius, cutoff=cutoff)

    kernels.register_backend("density", "vjp_mine", mine, devices=("cpu",))
    try:
        atoms, grid, xyz, *_ = _system(torch.float32, frames=5)
        upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(4))
        x = xyz.clone().requires_grad_()
        (kernels.splat_ensemble(atoms, x, grid, backend="vjp_mine", weights=[0.5] * 5) * upstream).sum().backward()
        calls.clear()
        parts = {}
        kernels.ensemble_gradients(
            atoms, xyz, grid, upstream, out=lambda s, e, g: parts.update({s: g["xyz"]}), backend="vjp_mine",
            weights=0.5, chunk=2,
        )  # fmt: skip
        assert calls == [2 * len(atoms), 2 * len(atoms), len(atoms)]  # one forward per chunk
        assert_kernel_close(torch.cat([parts[s] for s in sorted(parts)]), x.grad)
    finally:
        kernels.unregister_backend("density", "vjp_mine")
