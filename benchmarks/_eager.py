"""Timing helpers for the eager-path benchmarks: a call as the user makes it, its host cost, its
CUDA-graph replay, and the floor any eager PyTorch + Triton op pays on the same machine.

Four measurements of one callable ``fn`` (no arguments; it does everything the user's call does,
e.g. ``(kernels.splat_density(atoms, grid) * w).sum().backward()``):

- :func:`eager_stats`: CUDA events around each call after warm-up, synchronised after every call
  (no graph). What a notebook or a refinement loop that reads its loss each step sees.
- host time (in :func:`measure_side_by_side`): wall time of the Python call alone, without a
  synchronisation, while the GPU queue is kept busy by a sleep kernel enqueued before each call,
  so every launch returns as soon as it is queued: the host's cost of issuing the call (Python,
  autograd, allocations, launches). A call that synchronises inside shows up here as the wait for
  the queued sleep.
- :func:`graph_stats`: ``fn`` captured once in a CUDA graph and replayed, CUDA events around each
  replay: the GPU time.
- :func:`measure_side_by_side`: eager and host statistics of several callables (an op, its floor,
  its peers) taken interleaved, in blocks of :data:`BLOCK` calls (each after :data:`SETTLE`
  untimed ones) in an order rotated each round, so a drift of the shared host moves every
  callable alike and their ratios hold; then each one's graph replay. :func:`measure` is the same
  for one callable.
- :func:`floor_function` / :func:`floor_custom_op`: the floor. An autograd Function (or a
  ``torch.library`` custom op with a registered autograd formula) that zeroes an output of the
  op's shape and launches one empty Triton kernel forward, and one empty Triton kernel backward
  (returning empty gradients): what an eager op costs on this host with no work in it. Timed
  with the same helpers and the same surrounding user code as the op.

On a CPU device (the ``--smoke`` runs of the benchmarks) events become wall clock, host time is
the same wall clock, and graphs are not available (reported as such).
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Sequence

import torch

#: Timed calls per measurement (median, 10th and 90th percentile of these).
REPS = 50
#: Warm-up: at least this many calls, and for at least this long (clocks ramp up from idle).
WARMUP_CALLS = 5
WARMUP_S = 0.2
#: Timed calls of one callable in a row in :func:`measure_side_by_side` (and between two drains of the
#: GPU queue in its host measurement): few enough that a drift of the host meets every callable.
BLOCK = 10
#: Untimed calls before each block of :func:`measure_side_by_side`: on the H100 host the first calls of
#: a density forward+backward after another implementation's ran up to 1.7× slower and settled within
#: about eight calls (``results/eager_switch_probe_h100_2026-11-26.log``), so a block times the call as
#: a loop of it runs.
SETTLE = 10


def summary(times_ms: list[float]) -> dict:
    """``median_ms``, ``p10_ms``, ``p90_ms`` and ``reps`` of per-call times in ms."""
    t = sorted(times_ms)
    n = len(t)
    return {
        "median_ms": statistics.median(t),
        "p10_ms": t[(n - 1) // 10],
        "p90_ms": t[min(n - 1, (9 * n) // 10)],
        "reps": n,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(fn: Callable[[], object], device: torch.device, calls: int | None = None, seconds: float | None = None):
    """Call ``fn`` at least ``calls`` times and for at least ``seconds`` (compilation, caches, clocks;
    defaults :data:`WARMUP_CALLS`, :data:`WARMUP_S`)."""
    calls = WARMUP_CALLS if calls is None else calls
    seconds = WARMUP_S if seconds is None else seconds
    t_end = time.perf_counter() + seconds
    i = 0
    while i < calls or time.perf_counter() < t_end:
        fn()
        i += 1
    _sync(device)


def eager_stats(fn: Callable[[], object], device: torch.device, reps: int = REPS, warmup: bool = True) -> dict:
    """Per-call time of ``fn`` called eagerly, synchronised after each call.

    Parameters
    ----------
    fn : callable
        Takes no arguments; one call of the operation as the user makes it.
    device : torch.device
        CUDA: CUDA events recorded before and after each call on the current stream. CPU: wall
        clock.
    reps : int
        Timed calls after warm-up.
    warmup : bool
        Run :func:`warm_up` first.

    Returns
    -------
    dict
        ``median_ms``, ``p10_ms``, ``p90_ms``, ``reps``, ``method``.
    """
    if warmup:
        warm_up(fn, device)
    times = [eager_call_ms(fn, device) for _ in range(reps)]
    return {**summary(times), "method": _EAGER_METHOD[device.type == "cuda"]}


_EAGER_METHOD = {True: "CUDA events around each call, synchronised after each", False: "wall clock per call (CPU)"}


def eager_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of ``fn``: CUDA events around it, synchronised after (CPU: wall clock), in ms."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _sleep_cycles(device: torch.device, busy_ms: float) -> int:
    """GPU cycles of a ``busy_ms`` sleep kernel (0 off CUDA)."""
    return int(busy_ms * _cycles_per_ms()) if device.type == "cuda" else 0


def _host_call_ms(fn: Callable[[], object], device: torch.device, sleep_cycles: int) -> float:
    """Wall clock of one call of ``fn`` without a sync, a sleep kernel of ``sleep_cycles`` queued first (CUDA)."""
    if device.type == "cuda":
        torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _host_method(device: torch.device, busy_ms: float, block: int) -> str:
    if device.type != "cuda":
        return "wall clock per call (CPU: the work included)"
    return (
        f"wall clock of the call, no sync, a {busy_ms} ms sleep kernel queued before each, "
        f"the queue drained after every {block} calls"
    )


_CYCLES_PER_MS: float | None = None


def _cycles_per_ms() -> float:
    """GPU clock cycles per ms of ``torch.cuda._sleep``, measured once with CUDA events."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        torch.cuda._sleep(1_000_000)  # first launch loads the kernel
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS = 20_000_000 / max(a.elapsed_time(b), 1e-3)
    return _CYCLES_PER_MS


def graph_stats(fn: Callable[[], object], device: torch.device, reps: int = REPS) -> dict:
    """``fn`` captured once in a CUDA graph, then replayed: CUDA events around each replay.

    Warm-up runs on a side stream (as ``torch.cuda.graphs`` requires). Raises ``RuntimeError`` on
    a CPU device; capture errors (a synchronising call, say) propagate.

    Returns
    -------
    dict
        ``median_ms``, ``p10_ms``, ``p90_ms``, ``reps``, ``back_to_back_mean_ms``, ``method``.
    """
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    out = {**summary(times), "back_to_back_mean_ms": a.elapsed_time(b) / reps}
    out["method"] = "CUDA graph replay, CUDA events around each replay"
    del graph
    return out


def measure_side_by_side(
    fns: dict, device: torch.device, reps: int = REPS, graph: bool = True,
    host: bool = True, block: int = BLOCK, settle: int = SETTLE, busy_ms: float = 2.0,
) -> dict:  # fmt: skip
    """Eager, host and (CUDA) graph statistics of several callables, the eager and host calls interleaved.

    Each callable is warmed up, then its eager calls run in blocks of ``block`` timed calls, each
    after ``settle`` untimed ones, the callables in an order rotated by one each round, until each
    has ``reps``; the host calls (wall clock without a sync, a sleep kernel of ``busy_ms`` queued
    before each so launches only enqueue; the queue drained after each block) the same way. Measured one after the
    other, a shared host's drift of a few tens of µs between measurements moved single eager ratios
    by ±0.3; interleaved, every callable sees it alike. Graph replays (device time, steadier)
    follow one callable at a time.

    Parameters
    ----------
    fns : dict
        Name (any hashable) → callable taking no arguments (one call as the user makes it).
    device : torch.device
        As for :func:`eager_stats`.
    reps : int
        Timed calls of each callable per measurement.
    graph, host : bool
        Also replay each from a CUDA graph (CUDA only); also measure host time.
    block, settle : int
        Timed calls of one callable in a row, and untimed calls before them (defaults :data:`BLOCK`,
        :data:`SETTLE`).

    Returns
    -------
    dict
        Name → ``{"eager", "host", "graph"}`` (those measured), each a statistics dict or ``{"error": ...}``: a
        callable that raises is recorded with its error and left out of the rest of that
        measurement.
    """
    out: dict = {name: {} for name in fns}
    live = {}
    for name, fn in fns.items():
        try:
            warm_up(fn, device)
            live[name] = fn
        except Exception as exc:  # a failing callable is a result, not a crash of the benchmark
            out[name] = {key: error_record(exc) for key in ("eager", "host", "graph")}
            _sync_after_error(device)
    sleep = _sleep_cycles(device, busy_ms)
    timers = {"eager": (lambda fn: eager_call_ms(fn, device), _EAGER_METHOD[device.type == "cuda"])}
    if host:
        timers["host"] = (lambda fn: _host_call_ms(fn, device, sleep), _host_method(device, busy_ms, block))
    settle = settle if len(live) > 1 else 0  # one callable: nothing to settle from
    for key, (call_ms, method) in timers.items():
        times: dict = {name: [] for name in live}
        order = list(live)
        for r in range(-(-reps // block) if order else 0):
            k = r % len(order)
            for name in order[k:] + order[:k]:
                if name not in times:
                    continue
                try:
                    for _ in range(settle):
                        live[name]()
                    _sync(device)
                    for _ in range(min(block, reps - len(times[name]))):
                        times[name].append(call_ms(live[name]))
                    _sync(device)
                except Exception as exc:
                    out[name][key] = error_record(exc)
                    del times[name]
                    _sync_after_error(device)
        if len(live) > 1:
            method = f"{method}; interleaved with {list(live)} in blocks of {block} after {settle} untimed calls"
        for name, t in times.items():
            out[name][key] = {**summary(t), "method": method}
    for name, fn in live.items() if graph else ():
        if device.type != "cuda":
            out[name]["graph"] = {"error": "not measured: CUDA graphs need a CUDA device"}
            continue
        try:
            out[name]["graph"] = graph_stats(fn, device, reps)
        except Exception as exc:
            out[name]["graph"] = error_record(exc)
            _sync_after_error(device)
    return out


def measure(fn: Callable[[], object], device: torch.device, reps: int = REPS, graph: bool = True) -> dict:
    """Eager, host and (CUDA) graph statistics of ``fn`` (:func:`measure_side_by_side` of one callable).

    Returns
    -------
    dict
        ``eager``, ``host`` and ``graph``: each the statistics dict of its helper, or
        ``{"error": "..."}`` where that measurement raised (a graph on the CPU, a capture that
        synchronises, ...).
    """
    out = measure_side_by_side({"fn": fn}, device, reps, graph)["fn"]
    return out if graph else {**out, "graph": {"error": "not requested"}}


def kernel_profile(
    fn: Callable[[], object], device: torch.device, calls: int = 20, top: int = 4, host_top: int = 0
) -> dict | None:
    """What the GPU does during one call of ``fn``: the work behind an eager time.

    ``fn`` is warmed up, then called ``calls`` times under ``torch.profiler`` (CPU and CUDA activity).
    Every device-side event (kernels, memsets, copies) is counted; divided by ``calls`` they give the
    kernels launched per call and their summed device time per call. An eager time far above that sum is
    host- or launch-bound: the GPU waits on Python, the dispatcher and the launches, not on the kernels.

    Parameters
    ----------
    fn : callable
        One call as the user makes it (no arguments).
    device : torch.device
        Only CUDA is profiled; any other device returns None.
    calls, top, host_top : int
        Profiled calls, and how many device events and host (CPU) events to name, largest summed time
        first (host events by their self CPU time: the dispatcher's and Python's share of the call).

    Returns
    -------
    dict or None
        ``{"calls", "device_events_per_call", "device_ms_per_call", "wall_ms_per_call", "top": [{"name",
        "per_call", "ms_per_call"}, ...], "host_top": [...]}``; ``wall_ms_per_call`` is the profiled loop's wall time over
        ``calls`` (profiling adds host time, so it is only read against ``device_ms_per_call``).
    """
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    warm_up(fn, device, calls=3, seconds=0.0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    rows, host = [], []
    for ev in prof.key_averages():
        if ev.device_type != DeviceType.CUDA:
            host.append((ev.self_cpu_time_total / 1e3 / calls, ev.count / calls, ev.key))
            continue
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = ev.self_cuda_time_total
        rows.append((us / 1e3 / calls, ev.count / calls, ev.key))
    rows.sort(reverse=True)
    host.sort(reverse=True)
    return {
        "calls": calls,
        "device_events_per_call": sum(r[1] for r in rows),
        "device_ms_per_call": sum(r[0] for r in rows),
        "wall_ms_per_call": wall_ms / calls,
        "top": [{"name": k[:120], "per_call": n, "ms_per_call": ms} for ms, n, k in rows[:top]],
        "host_top": [{"name": k[:120], "per_call": n, "self_ms_per_call": ms} for ms, n, k in host[:host_top]],
    }


def _sync_after_error(device: torch.device) -> None:
    """Synchronise after a failed call (a CUDA error surfaces here rather than in the next measurement)."""
    try:
        _sync(device)
    except Exception:
        pass


def error_record(exc: BaseException) -> dict:
    """``{"error": "Type: message", "traceback": last lines}`` for the JSON."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": "".join(tb[-4:])[-3000:]}


# ----------------------------------------------------------------------------------------------
# The floor
# ----------------------------------------------------------------------------------------------

_EMPTY_KERNEL = None


def _empty_kernel():
    """A Triton kernel that stores one zero (the smallest launch that does something)."""
    global _EMPTY_KERNEL
    if _EMPTY_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _floor_empty(ptr, n, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            tl.store(ptr + pid, 0.0, mask=pid < n)

        _EMPTY_KERNEL = _floor_empty
    return _EMPTY_KERNEL


class _Floor(torch.autograd.Function):
    """Forward: zeros of ``shape`` and one empty launch; backward: one empty launch, empty grads."""

    @staticmethod
    def forward(ctx, shape, *inputs):
        out = torch.zeros(shape, dtype=torch.float32, device=inputs[0].device)
        _empty_kernel()[(1,)](out, 1, BLOCK=16)
        ctx.like = [(t.shape, t.dtype, t.device) for t in inputs]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [torch.empty(s, dtype=d, device=dev) for s, d, dev in ctx.like]
        _empty_kernel()[(1,)](grads[0], 1, BLOCK=16)
        return (None, *grads)


def floor_function(shape: Sequence[int]) -> Callable[..., torch.Tensor]:
    """The floor as a plain autograd Function: ``f(*inputs)`` returns zeros of ``shape`` (float32).

    Parameters
    ----------
    shape : sequence of int
        Shape of the op's output (the map, a scalar loss, the samples).

    Returns
    -------
    callable
        ``f(*inputs) -> torch.Tensor`` of ``shape``, float32, on ``inputs[0].device``;
        differentiable with respect to every input (empty gradients, one launch).
    """
    shape = tuple(int(s) for s in shape)
    return lambda *inputs: _Floor.apply(shape, *inputs)


_CUSTOM_FLOOR = None


def _custom_floor_ops():
    """Register (once) the floor as ``torch.library`` custom ops ``eager_bench_floor::fwd/bwd``."""
    global _CUSTOM_FLOOR
    if _CUSTOM_FLOOR is not None:
        return _CUSTOM_FLOOR

    @torch.library.custom_op("eager_bench_floor::fwd", mutates_args=())
    def floor_fwd(inputs: list[torch.Tensor], shape: list[int]) -> torch.Tensor:
        out = torch.zeros(shape, dtype=torch.float32, device=inputs[0].device)
        _empty_kernel()[(1,)](out, 1, BLOCK=16)
        return out

    @floor_fwd.register_fake
    def _(inputs, shape):
        return inputs[0].new_empty(shape, dtype=torch.float32)

    @torch.library.custom_op("eager_bench_floor::bwd", mutates_args=())
    def floor_bwd(grad: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = [torch.empty_like(t) for t in inputs]
        _empty_kernel()[(1,)](grads[0], 1, BLOCK=16)
        return grads

    @floor_bwd.register_fake
    def _(grad, inputs):
        return [torch.empty_like(t) for t in inputs]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[0])
        ctx.n_shape = len(inputs[1])

    def backward(ctx, grad):
        # the gradient of ``shape`` must mirror its pytree: None for a non-empty list of ints (one
        # leaf to torch.library), [] for the empty list of a scalar output (no leaves)
        return floor_bwd(grad, list(ctx.saved_tensors)), (None if ctx.n_shape else [])

    floor_fwd.register_autograd(backward, setup_context=setup_context)
    _CUSTOM_FLOOR = floor_fwd
    return floor_fwd


def floor_custom_op(shape: Sequence[int]) -> Callable[..., torch.Tensor]:
    """The floor through ``torch.library.custom_op`` (forward op + backward op, autograd registered).

    What the eager floor becomes when the ops are ``torch.library`` custom ops: the dispatcher
    and the custom-op autograd wrapper on top of :func:`floor_function`'s work.

    Parameters
    ----------
    shape : sequence of int
        Shape of the op's output.

    Returns
    -------
    callable
        ``f(*inputs) -> torch.Tensor`` of ``shape``, float32, differentiable in every input.
    """
    op = _custom_floor_ops()
    shape = [int(s) for s in shape]
    return lambda *inputs: op(list(inputs), shape)


def custom_ops_called(fn: Callable[[], object]) -> list[str]:
    """Names of the non-aten dispatcher ops one call of ``fn`` runs (``torch.library`` custom ops).

    Empty when the op is a plain autograd Function around Triton launches (launches do not pass
    through the dispatcher).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns = getattr(func, "namespace", "aten")
            if ns not in ("aten", "prim", "prims") and str(func) not in seen:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with _Record():
        fn()
    return seen


def floor_cases(shape: Sequence[int], inputs: Sequence[torch.Tensor], upstream: torch.Tensor | None) -> dict:
    """The floor callables for an op with output ``shape`` and differentiable ``inputs``.

    Parameters
    ----------
    shape : sequence of int
        The op's output shape.
    inputs : sequence of torch.Tensor
        Leaves requiring grad (the op's differentiable inputs), on the op's device.
    upstream : torch.Tensor or None
        The weight the benchmark multiplies the op's output by before ``.sum().backward()``
        (None: the output is a scalar and ``.backward()`` is called on it directly).

    Returns
    -------
    dict
        ``{"function": {"fwd": fn, "fwd_bwd": fn}, "custom_op": {...}}``, each ``fn`` taking no
        arguments and doing what the op's benchmark callable does around the floor.
    """
    out = {}
    for name, make in (("function", floor_function), ("custom_op", floor_custom_op)):
        f = make(shape)

        def fwd(f=f):
            with torch.no_grad():
                return f(*inputs)

        def fwd_bwd(f=f):
            for t in inputs:
                t.grad = None
            y = f(*inputs)
            (y if upstream is None else (y * upstream).sum()).backward()

        out[name] = {"fwd": fwd, "fwd_bwd": fwd_bwd}
    return out


class PartTimeout(Exception):
    """A benchmark part ran past its time limit."""


class Deadline:
    """A part's time limit: ``check()`` raises :class:`PartTimeout` once ``seconds`` have passed,
    and ``SIGALRM`` interrupts Python code that runs past it (main thread, POSIX only).

    Use as a context manager around one part.
    """

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = float(seconds), what

    def __enter__(self):
        import signal

        self.t_end = time.monotonic() + self.seconds
        self._old = None
        if hasattr(signal, "SIGALRM"):

            def _alarm(signum, frame):
                raise PartTimeout(f"{self.what}: time limit of {self.seconds:.0f} s reached")

            self._old = signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def check(self) -> None:
        if time.monotonic() > self.t_end:
            raise PartTimeout(f"{self.what}: time limit of {self.seconds:.0f} s reached")

    def __exit__(self, *exc):
        import signal

        if self._old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
        return False


def environment() -> dict:
    """Device, versions and host, for the JSON."""
    import os
    import platform

    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["device_count"] = torch.cuda.device_count()
    else:
        env["device"] = "cpu"
    return env


def gpu_tag() -> str:
    """``h100``, ``h200``, ``a100``, ... from the device name, ``gpu`` when unknown, ``cpu`` without CUDA."""
    import re

    if not torch.cuda.is_available():
        return "cpu"
    m = re.search(r"\b([AHBL]\d{2,3})\b", torch.cuda.get_device_name())
    return m.group(1).lower() if m else "gpu"
