"""Small helpers shared by the backends (not public API)."""

from __future__ import annotations

import warnings

import torch

_warned: set[tuple] = set()


def warn_once(key: tuple, message: str, category=UserWarning, stacklevel: int = 3) -> None:
    """Issue ``message`` the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)


def to_float32(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """``tensor`` as float32 for a float32-only kernel; warns once per (op, input dtype)."""
    if tensor.dtype == torch.float32:
        return tensor
    warn_once(
        (op, tensor.dtype),
        f"{op}: the fast kernels compute in float32; casting {tensor.dtype} input "
        "(convert once with .to(dtype=torch.float32) to avoid the copy, or use backend='reference' for float64)",
    )
    return tensor.to(torch.float32)
