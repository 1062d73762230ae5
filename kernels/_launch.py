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
Triton 3.7.1; the GPU test checks the Triton installed there takes it too). Every Triton
op of the package (density, planarity, tricubic) launches through here.

The caller's key must cover everything Triton specialises on: the kernels launched
through here mark their int arguments ``do_not_specialize`` (an int equal to 1 would
otherwise become a constant) and their per-atom pointers ``do_not_specialize_on_alignment``
where a view may start anywhere, and the caller adds the constexprs, ``num_warps``, ``maxnreg``, the
dtypes it does not fix itself, the device index and the 16-byte alignment of every pointer
that can come from a user (a caching-allocator tensor is always aligned).

The normal launch is used instead (always correct, only slower) when Triton runs in the
interpreter (it returns no compiled kernel, so nothing is kept), when a launch hook is
installed (profilers such as proton read the launch metadata), when a compiled kernel does
not have the attributes above, and if the first direct call of a launcher raises
``TypeError``/``AttributeError``/``SystemError`` (a Triton whose launcher takes other
arguments); that launcher then stays on the normal path. Either launch runs with the
tensors' device current, made so for the call when it is not: Triton compiles for, loads on
and launches to the current device, on its current stream. The device tests run both paths
and compare them.
"""

from __future__ import annotations

import torch

__all__ = ["FastLauncher", "ceil_div", "fast_launch_enabled"]

try:
    from triton import knobs as _knobs
    from triton.compiler import CompiledKernel as _CompiledKernel
except ImportError:  # a Triton without knobs (older than 3.4): launcher arguments unknown
    _knobs = None
    _CompiledKernel = ()  # isinstance(x, ()) is False: no compiled kernel is ever kept

# Triton 3.7 keeps each launch hook as a HookChain (empty when nothing is installed), 3.6 as a
# callable or None. Only an exact HookChain with no calls counts as idle: any other object may be
# a hook that wants the launch metadata the direct call does not build.
_HookChain = getattr(_knobs, "HookChain", None)
# The current CUDA device, without torch.cuda.current_device()'s lazy-init check: it is read only
# once a kernel has been launched on a CUDA tensor (CUDA is initialised). Absent in CPU builds of
# torch, where no CUDA launch happens.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

_enabled = _knobs is not None


def ceil_div(n: int, d: int) -> int:
    """⌈n / d⌉ for ints n ≥ 0, d > 0: a launch grid's program count.

    Plain int arithmetic for the per-call launch sites: in Triton 3.7 ``triton.cdiv`` is a
    ``ConstexprFunction``, whose host call costs ~1.5 µs (it unwraps constexpr arguments first).
    """
    return -(-n // d)


def fast_launch_enabled(enabled: bool | None = None) -> bool:
    """Whether :class:`FastLauncher` may launch directly; ``enabled`` sets it (for tests).

    Parameters
    ----------
    enabled : bool, optional
        The new setting; None leaves it as it is. True has no effect on a Triton without
        ``triton.knobs``.

    Returns
    -------
    bool
        The setting in force after the call.
    """
    global _enabled
    if enabled is not None:
        _enabled = bool(enabled) and _knobs is not None
    return _enabled


def _hooks_idle() -> bool:
    """True when no launch hook is installed: each hook None or an empty ``HookChain``."""
    rt = _knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is None or (type(enter) is _HookChain and not enter.calls)) and (
        leave is None or (type(leave) is _HookChain and not leave.calls)
    )


class FastLauncher:
    """Launch one ``@triton.jit`` kernel, directly after the first call of each specialisation.

    Parameters
    ----------
    kernel : triton.JITFunction
        The kernel. Every argument is passed positionally in its signature order,
        constexprs included.

    Attributes
    ----------
    compiled : dict
        key -> ``(run, function, packed_metadata)`` of the kept compiled kernel.
    verified : bool
        A direct call has gone through.
    broken : bool
        A direct call was refused: normal launches only, from then on.

    Notes
    -----
    :meth:`__call__` takes ``key``, a hashable the caller builds from everything that
    changes the compiled kernel (see the module docstring). Two calls with the same key
    must compile to the same kernel: the second reuses the first's.
    """

    __slots__ = ("kernel", "compiled", "verified", "broken")

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict = {}
        self.verified = False
        self.broken = False

    def __call__(
        self,
        grid: tuple[int, int, int],
        key,
        args: tuple,
        device: torch.device,
        num_warps: int | None = None,
        maxnreg: int | None = None,
    ) -> None:
        """Launch ``kernel[grid](*args, num_warps=num_warps, maxnreg=maxnreg)`` on the current stream of ``device``.

        Parameters
        ----------
        grid : tuple of 3 int
            Programs along each axis.
        key : hashable
            The specialisation key (see the class notes); it includes ``device.index`` and
            ``num_warps`` when the caller varies them.
        args : tuple
            All kernel arguments in signature order, constexprs included.
        device : torch.device
            The device of the tensors (a CUDA device, or the CPU under the interpreter); a CUDA
            device without an index is the current one. A CUDA device other than the current one
            is made current for the launch, so the kernel runs there, on that device's current stream.
        num_warps : int, optional
            Warps per program; Triton's default (4) when None.
        maxnreg : int, optional
            Registers per thread the compile may use (ptxas' register cap; backends without the
            option ignore it); the compiler's choice when None. Part of the compiled kernel: the
            caller's key must include it when it varies.
        """
        hit = self.compiled.get(key)
        if hit is not None and _enabled and _hooks_idle():
            if device.index is None:  # torch.device("cuda"): the current device
                device = torch.device("cuda", _current_device())
            if _current_device() != device.index:
                # The kept function was loaded in its device's context and the launcher launches in
                # the current context: the call goes again with the tensors' device current.
                with torch.cuda.device(device.index):
                    return self(grid, key, args, device, num_warps, maxnreg)
            run, function, metadata = hit
            stream = _raw_stream(device.index)
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
        if device.type == "cuda" and device.index is not None and _current_device() != device.index:
            # JITFunction.run compiles for, loads on and launches to the current device and its stream.
            with torch.cuda.device(device.index):
                self._normal(grid, key, args, device, num_warps, maxnreg, hit is None)
        else:
            self._normal(grid, key, args, device, num_warps, maxnreg, hit is None)

    def _normal(
        self, grid, key, args: tuple, device: torch.device, num_warps: int | None, maxnreg: int | None, keep: bool
    ) -> None:
        """``kernel[grid](*args)``; its compiled kernel is kept under ``key`` when ``keep``."""
        options = {}
        if num_warps is not None:
            options["num_warps"] = num_warps
        if maxnreg is not None:
            options["maxnreg"] = maxnreg
        compiled = self.kernel[grid](*args, **options)
        # The interpreter returns no CompiledKernel (and runs CPU tensors): nothing is kept there.
        if keep and not self.broken and device.type == "cuda" and isinstance(compiled, _CompiledKernel):
            try:
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            except AttributeError:  # not a CompiledKernel of the expected shape
                self.broken = True
