"""A low-overhead launch path for Triton kernels whose specialisation the caller knows.

``kernel[grid](*args)`` goes through ``JITFunction.run`` on every call: it binds the
arguments, specialises each one (dtype, alignment, ints equal to 1 or divisible by 16),
hashes the result into a cache key, checks the kernel's globals and builds launch
metadata, before the C launcher runs. On the H100 host that is 13 µs for one argument and
27 µs for 30, most of an eager call of a small op. :class:`FastLauncher` keeps the
compiled kernel of the first call under a key the caller computes (the constexprs and
whatever else changes the specialisation) and calls its C launcher directly afterwards:
``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)``, the call ``JITFunction.run`` itself ends with (read from
Triton 3.7.1; the GPU test checks the Triton installed there takes it too).

The caller's key must cover everything Triton specialises on: the kernels launched
through here mark their int arguments ``do_not_specialize`` (an int equal to 1 would
otherwise become a constant) and the caller adds the 16-byte alignment of every pointer
that can come from a user (a caching-allocator tensor is always aligned) and the dtypes
it does not fix itself.

The normal launch is used instead (always correct, only slower) when Triton runs in the
interpreter, when a launch hook is installed (profilers such as proton read the launch
metadata), when a compiled kernel does not have the attributes above, and if the first
direct call of a launcher raises ``TypeError``/``AttributeError`` (a Triton whose launcher
takes other arguments); that launcher then stays on the normal path. The device tests run
both paths and compare them.
"""

from __future__ import annotations

import torch

__all__ = ["FastLauncher", "fast_launch_enabled"]

try:
    from triton import knobs as _knobs
except ImportError:  # a Triton without knobs (older than 3.4): launcher arguments unknown
    _knobs = None

_enabled = _knobs is not None


def fast_launch_enabled(enabled: bool | None = None) -> bool:
    """Whether :class:`FastLauncher` may launch directly; ``enabled`` sets it (for tests).

    Returns the setting in force after the call.
    """
    global _enabled
    if enabled is not None:
        _enabled = bool(enabled) and _knobs is not None
    return _enabled


def _hooks_idle() -> bool:
    """True when no launch hook is installed (a hook is None, or an empty HookChain on 3.7)."""
    rt = _knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class FastLauncher:
    """Launch one ``@triton.jit`` kernel, directly after the first call of each specialisation.

    Parameters
    ----------
    kernel : triton.JITFunction
        The kernel. Every argument is passed positionally in its signature order,
        constexprs included.

    Notes
    -----
    :meth:`__call__` takes ``key``, a hashable the caller builds from everything that
    changes the compiled kernel (see the module docstring). Two calls with the same key
    must compile to the same kernel: the second reuses the first's.
    """

    __slots__ = ("kernel", "compiled", "verified", "broken")

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}  # key -> (run, function, packed_metadata)
        self.verified = False  # a direct call has gone through
        self.broken = False  # a direct call was refused: normal launches only

    def __call__(self, grid: tuple[int, int, int], key, args: tuple, device: torch.device):
        """Launch ``kernel[grid](*args)`` on the current stream of ``device``.

        Parameters
        ----------
        grid : tuple of 3 int
            Programs along each axis.
        key : hashable
            The specialisation key (see the class notes).
        args : tuple
            All kernel arguments in signature order, constexprs included.
        device : torch.device
            The device of the tensors (a CUDA device, or the CPU under the interpreter).
        """
        hit = self.compiled.get(key)
        if hit is not None and _enabled and _hooks_idle():
            run, function, metadata = hit
            stream = torch._C._cuda_getCurrentRawStream(device.index)
            if self.verified:
                run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args)
                return
            try:
                # The launcher checks every argument ahead of the launch: a refusal has launched nothing.
                run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *args)
            except (TypeError, AttributeError, SystemError):
                self.broken = True
                self.compiled.clear()
            else:
                self.verified = True
                return
        compiled = self.kernel[grid](*args)
        if hit is None and device.type == "cuda" and not self.broken:
            try:
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            except AttributeError:  # not a CompiledKernel of the expected shape
                self.broken = True
