"""One table: (op, device type) -> the backends that can run it, in "auto" order.

``backend="auto"`` takes the first backend in the row that can run here and logs (once
per op and device) which one it chose; a backend asked for by name that cannot run
raises :class:`BackendError` saying why and what to do. Backends are imported lazily, so
a missing compiler or GPU only matters when that backend is asked for.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable

import torch

__all__ = ["BackendError", "BACKENDS", "available_backends", "resolve_backend", "get_backend"]

log = logging.getLogger("kernels")


class BackendError(RuntimeError):
    """A backend was asked for that cannot run here (no GPU, extension not built, …)."""


# op -> backend name -> "module:function"
BACKENDS: dict[str, dict[str, str]] = {
    "density": {
        "reference": "kernels.density.reference:splat_reference",
        "cpu": "kernels.density.cpu:splat_cpu",
        "triton": "kernels.density.triton:splat_triton",
    },
    # F frames of N atoms (frame-major) -> (F, nx, ny, nz): splat_ensemble(reduce="none")
    "density_frames": {
        "reference": "kernels.density.reference:splat_frames_reference",
        "cpu": "kernels.density.cpu:splat_frames_cpu",
        "triton": "kernels.density.triton:splat_frames_triton",
    },
    "planarity": {
        "reference": "kernels.planarity.reference:planarity_nll_reference",
        "cpu": "kernels.planarity.cpu:planarity_nll_cpu",
        "triton": "kernels.planarity.triton:planarity_nll_triton",
    },
    "tricubic": {
        "reference": "kernels.tricubic.reference:tricubic_reference",
        "cpu": "kernels.tricubic.cpu:tricubic_cpu",
        "triton": "kernels.tricubic.triton:tricubic_triton",
    },
}

# device type -> "auto" order
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu", "reference"),
    "cuda": ("triton", "reference"),
}

_announced: set[tuple[str, str, str]] = set()


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, no GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _why_not(op: str, backend: str, device: torch.device) -> str | None:
    """None if ``backend`` can run ``op`` on ``device``; otherwise the reason and the fix."""
    if backend not in BACKENDS[op]:
        return f"unknown backend {backend!r} for {op}; choose one of {['auto', *BACKENDS[op]]}"
    if backend == "triton":
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "the triton backend needs a CUDA GPU and none is visible"
        elif not triton_interpreted():
            return (
                "the triton backend runs on CUDA tensors; move the data to a GPU "
                "(or set TRITON_INTERPRET=1 before importing kernels to run it slowly in the interpreter)"
            )
    if backend == "cpu" and device.type != "cpu":
        return f"the cpu backend needs CPU tensors, got {device}; use .to('cpu') or backend='auto'"
    try:
        _load(op, backend)
    except ImportError as exc:
        return f"the {backend} backend for {op} cannot be imported ({exc})"
    return None


def _load(op: str, backend: str) -> Callable:
    module, func = BACKENDS[op][backend].split(":")
    return getattr(importlib.import_module(module), func)


def available_backends(op: str, device: str | torch.device = "cpu") -> list[str]:
    """Backends that can run ``op`` on ``device`` right now."""
    device = torch.device(device)
    return [b for b in BACKENDS[op] if _why_not(op, b, device) is None]


def resolve_backend(op: str, device: str | torch.device, backend: str = "auto") -> str:
    """Name of the backend that will run ``op`` on ``device``.

    Raises
    ------
    BackendError
        ``backend`` was named and cannot run here, or no backend can (with the reason).
    """
    device = torch.device(device)
    if op not in BACKENDS:
        raise BackendError(f"unknown op {op!r}; known: {sorted(BACKENDS)}")
    if backend != "auto":
        why = _why_not(op, backend, device)
        if why is not None:
            raise BackendError(why)
        return backend
    reasons = []
    for name in AUTO_ORDER.get(device.type, ("reference",)):
        why = _why_not(op, name, device)
        if why is None:
            key = (op, device.type, name)
            if key not in _announced:
                _announced.add(key)
                log.info("%s on %s: backend=auto chose %r", op, device.type, name)
            return name
        reasons.append(f"{name}: {why}")
    raise BackendError(f"no backend can run {op} on {device}: " + "; ".join(reasons))


_resolved: dict[tuple[str, str, str, bool], tuple[str, Callable]] = {}


def get_backend(op: str, device: str | torch.device, backend: str = "auto") -> tuple[str, Callable]:
    """``(name, function)`` of the backend that runs ``op`` on ``device``.

    Resolved once per (op, device type, backend, interpreter setting) and cached: the
    checks import modules and query CUDA, which would cost ~0.1 ms on every kernel call.
    """
    device = torch.device(device)
    key = (op, device.type, backend, triton_interpreted())
    hit = _resolved.get(key)
    if hit is None:
        name = resolve_backend(op, device, backend)
        hit = _resolved[key] = (name, _load(op, name))
    return hit
