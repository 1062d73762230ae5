"""One table: (op, device type) -> the backends that can run it, in "auto" order.

``backend="auto"`` takes the first backend in the row that can run here and logs (once
per op and device) which one it chose; a backend asked for by name that cannot run
raises :class:`BackendError` saying why and what to do. Backends are imported lazily, so
a missing compiler or GPU only matters when that backend is asked for.

Users add their own backends with :func:`register_backend` (a function, the devices it
runs on and its :class:`BackendCapabilities`); a registered backend is offered wherever
the built-in ones are (``available_backends``, ``backend=name``), never picked by
``"auto"``, and :func:`unregister_backend` takes it out again.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Callable, Iterable

import torch

__all__ = [
    "BackendError",
    "BACKENDS",
    "BackendCapabilities",
    "RegisteredBackend",
    "available_backends",
    "check_backend_name",
    "backend_capabilities",
    "get_backend",
    "register_backend",
    "registered_backends",
    "resolve_backend",
    "unregister_backend",
]

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


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    """What a registered backend can take, so it is never handed what it cannot do.

    Attributes
    ----------
    gradients : bool
        The function's output is differentiable (autograd) with respect to the inputs the
        built-in backends differentiate (density: ``xyz``, ``b_iso``, ``occ``). A backend
        with ``gradients=False`` is refused (:class:`BackendError`) when an input requires
        grad, and :func:`kernels.check_backend` skips its gradient checks.
    anisotropic : bool
        The function splats anisotropic atoms (``AtomSet.u_aniso`` not None). Dispatch refuses
        (:class:`BackendError`) to hand such a set to a backend whose flag is False. A backend
        that declares True takes every atom of such a set through its U
        (:func:`kernels.adp.effective_u`), accepts a ``radius_rule=`` keyword
        (:func:`kernels.density.radius.atom_cutoff_radii`), and is held to the anisotropic
        checks of :func:`kernels.check_backend`.
    """

    gradients: bool = True
    anisotropic: bool = False

    def __post_init__(self):
        # a string such as "no" is truthy: only True and False say what the backend can do
        bad = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not isinstance(getattr(self, f.name), bool)
        }
        if bad:
            raise ValueError(f"capabilities are True or False, got {bad}")


@dataclasses.dataclass(frozen=True)
class RegisteredBackend:
    """A user's backend as :func:`register_backend` recorded it.

    Attributes
    ----------
    op, name : str
    fn : callable
        The user's function, with the signature of the op's built-in backends.
    devices : tuple of str
        Device types it runs on (``"cpu"``, ``"cuda"``).
    capabilities : BackendCapabilities
    """

    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...]
    capabilities: BackendCapabilities


# op -> name -> a user's backend; separate from BACKENDS, whose rows are the built-in
# "module:function" paths (importable in any process, which a user's function may not be).
_REGISTERED: dict[str, dict[str, RegisteredBackend]] = {}
_DEVICE_TYPES = ("cpu", "cuda")


def _capabilities(value) -> BackendCapabilities:
    if value is None:
        return BackendCapabilities()
    if isinstance(value, BackendCapabilities):
        return value
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(BackendCapabilities)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}; known: {sorted(known)}")
        bad = {k: v for k, v in value.items() if not isinstance(v, bool)}
        if bad:
            raise ValueError(f"capabilities are True or False, got {bad}")
        return BackendCapabilities(**value)
    raise TypeError(
        f"capabilities must be a kernels.BackendCapabilities or a dict such as {{'gradients': True}}, "
        f"got {type(value).__name__}"
    )


def register_backend(
    op: str,
    name: str,
    fn: Callable,
    *,
    devices: Iterable[str] = ("cpu", "cuda"),
    capabilities: BackendCapabilities | dict | None = None,
) -> RegisteredBackend:
    """Add a user's function as backend ``name`` of ``op``, offered wherever the built-in ones are.

    Parameters
    ----------
    op : str
        An op of :data:`BACKENDS` (``"density"``, ``"planarity"``, ``"tricubic"``).
    name : str
        The backend's name: not ``"auto"`` nor a built-in backend of ``op``, no ``":"``
        (the workbench writes runs as ``device:backend``). Registering a name again
        replaces the earlier function (a notebook cell run twice).
    fn : callable
        The function the op's built-in backends are, with their signature. For density:
        ``fn(atoms, grid, *, radius, cutoff) -> map``, ``atoms`` a float32
        :class:`AtomSet` on the device (``splat_density`` hands over what it got), ``grid``
        a whole-cell :class:`GridSpec`, ``radius`` float Å or None (each atom's radius from
        ``cutoff``, see :func:`kernels.cutoff_radius`), ``cutoff`` e/Å³; returns a tensor of
        ``grid.shape`` on the atoms' device, e/Å³.
    devices : iterable of str
        Device types it runs on, from ``("cpu", "cuda")``.
    capabilities : BackendCapabilities or dict, optional
        ``{"gradients": bool, "anisotropic": bool}``; default: gradients, isotropic only.

    Returns
    -------
    RegisteredBackend

    Raises
    ------
    BackendError
        ``op`` is unknown or ``name`` is ``"auto"`` or a built-in backend.
    TypeError, ValueError
        ``fn`` is not callable, ``name`` is not a plain string, ``devices`` or
        ``capabilities`` hold something unknown.
    """
    if not isinstance(op, str) or op not in BACKENDS:
        raise BackendError(f"unknown op {op!r}; known: {sorted(BACKENDS)}")
    check_backend_name(op, name)
    if not callable(fn):
        raise TypeError(f"fn must be callable (the {op} backend function), got {type(fn).__name__}")
    if isinstance(devices, str):
        devices = (devices,)
    elif not isinstance(devices, Iterable):
        raise TypeError(f"devices must be a device type or an iterable of them from {_DEVICE_TYPES}, got {devices!r}")
    devices = tuple(dict.fromkeys(devices))
    unknown = [d for d in devices if d not in _DEVICE_TYPES]
    if not devices or unknown:
        raise ValueError(f"devices must be a non-empty subset of {_DEVICE_TYPES}, got {devices}")
    entry = RegisteredBackend(op, name, fn, devices, _capabilities(capabilities))
    _REGISTERED.setdefault(op, {})[name] = entry
    _forget(op)
    return entry


def check_backend_name(op: str, name) -> None:
    """Refuse a name :func:`register_backend` would refuse for ``op``, saying why.

    A name is a non-empty printable string without ``":"`` or surrounding spaces, and neither
    ``"auto"`` nor a built-in backend of ``op`` in any letter case (``"CPU"`` would read as the
    built-in one in every list that shows it).

    Raises
    ------
    ValueError
        ``name`` is not such a string.
    BackendError
        ``name`` is ``"auto"`` or a built-in backend's name, ignoring case.
    """
    if not isinstance(name, str) or not name or name.strip() != name or ":" in name or not name.isprintable():
        raise ValueError(
            f"a backend name is a non-empty printable string without ':' or surrounding spaces, got {name!r}"
        )
    builtin = ["auto", *BACKENDS[op]]
    clash = next((b for b in builtin if b.casefold() == name.casefold()), None)
    if clash is not None:
        same = "is" if clash == name else "differs only in case from"
        raise BackendError(
            f"{name!r} {same} the built-in name {clash!r} for {op} ({builtin}); register your function under "
            "another name"
        )


def unregister_backend(op: str, name: str) -> None:
    """Remove the backend ``name`` of ``op`` that :func:`register_backend` added.

    Raises
    ------
    BackendError
        No backend ``name`` is registered for ``op`` (built-in backends cannot be removed).
    """
    if name not in _REGISTERED.get(op, {}):
        raise BackendError(f"no registered backend {name!r} for {op}; registered: {registered_backends(op)}")
    del _REGISTERED[op][name]
    _forget(op)


def registered_backends(op: str) -> list[str]:
    """Names of the user backends registered for ``op``, in registration order."""
    return list(_REGISTERED.get(op, {}))


def backend_capabilities(op: str, name: str) -> BackendCapabilities:
    """What backend ``name`` of ``op`` can take (built-in backends: gradients; the density ones anisotropic atoms too)."""
    entry = _REGISTERED.get(op, {}).get(name)
    if entry is not None:
        return entry.capabilities
    if op in BACKENDS and name in BACKENDS[op]:
        return BackendCapabilities(gradients=True, anisotropic=op in ("density", "density_frames"))
    raise BackendError(f"unknown backend {name!r} for {op}")


def _forget(op: str) -> None:
    for key in [k for k in _resolved if k[0] == op]:
        del _resolved[key]


def _names(op: str) -> list[str]:
    return [*BACKENDS[op], *_REGISTERED.get(op, {})]


def _why_not(op: str, backend: str, device: torch.device) -> str | None:
    """None if ``backend`` can run ``op`` on ``device``; otherwise the reason and the fix."""
    user = _REGISTERED.get(op, {}).get(backend)
    if user is not None:
        if device.type not in user.devices:
            return (
                f"the registered backend {backend!r} runs on {', '.join(user.devices)}, not {device.type} "
                f"(register it with devices=(..., {device.type!r}) if it can)"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"the registered backend {backend!r} on cuda needs a CUDA GPU and none is visible"
        return None
    if backend not in BACKENDS[op]:
        return f"unknown backend {backend!r} for {op}; choose one of {['auto', *_names(op)]}"
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
        return _CANNOT_IMPORT.format(backend=backend, op=op) + f" ({exc})"
    return None


_CANNOT_IMPORT = "the {backend} backend for {op} cannot be imported"


def _warn_fallback(op: str, device: torch.device, chosen: str, broken: list[str]) -> None:
    """Warn (once per op and device type) that ``backend="auto"`` fell back past a fast backend that
    would run here but cannot be imported: a missing compiled module or Triton makes every call slower,
    which a log line alone would hide."""
    import warnings

    warnings.warn(
        f"{op} on {device.type}: backend='auto' runs the slower {chosen!r} backend because "
        + "; ".join(broken)
        + ". Reinstall the package so that its C++ modules are built (pip install -e ., or bash scripts/build.sh "
        "in a checkout) and Triton is importable; kernels.available_backends() lists what runs",
        RuntimeWarning,
        stacklevel=5,  # _warn_fallback, resolve_backend, get_backend, the op's public function, its caller
    )


def _load(op: str, backend: str) -> Callable:
    user = _REGISTERED.get(op, {}).get(backend)
    if user is not None:
        return _guarded(user)
    module, func = BACKENDS[op][backend].split(":")
    return getattr(importlib.import_module(module), func)


def _requires_grad(arg) -> bool:
    if isinstance(arg, torch.Tensor):
        return arg.requires_grad
    if dataclasses.is_dataclass(arg) and not isinstance(arg, type):
        values = [getattr(arg, f.name) for f in dataclasses.fields(arg)]
    else:
        values = list(vars(arg).values()) if hasattr(arg, "__dict__") else []
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in values)


#: The floating dtypes a backend's output may have: float32 (the fast backends) or float64 (the reference).
_OUTPUT_DTYPES = (torch.float32, torch.float64)


def _expected_output(op: str, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, torch.device | None]:
    """The shape and device of the output the built-in backends of ``op`` return for these arguments.

    Read from the arguments' metadata only (no value is read back, so no host synchronisation):
    density ``grid.shape`` on the atoms' device; density_frames ``(n_frames, *grid.shape)``;
    planarity a scalar ``()`` on the positions' device; tricubic ``points.shape[:-1]`` on the
    points' device. ``None`` where an argument is not there to tell.
    """

    def arg(i, key):
        return args[i] if len(args) > i else kwargs.get(key)

    def device_of(x):
        t = getattr(x, "xyz", x)
        return t.device if isinstance(t, torch.Tensor) else None

    if op in ("density", "density_frames"):
        atoms, grid = arg(0, "atoms"), arg(1, "grid")
        shape = getattr(grid, "shape", None)
        if shape is not None and op == "density_frames":
            n_frames = kwargs.get("n_frames")
            shape = None if not isinstance(n_frames, int) else (n_frames, *shape)
        return (None if shape is None else tuple(shape)), device_of(atoms)
    if op == "planarity":
        return (), device_of(arg(0, "xyz"))
    if op == "tricubic":
        points = arg(2, "points")
        if not isinstance(points, torch.Tensor):
            return None, None
        return tuple(points.shape[:-1]), points.device
    return None, None


def _malformed(op: str, out, args: tuple, kwargs: dict) -> str | None:
    """What is wrong with a registered backend's output (type, shape, dtype, device), or None.

    Metadata only: a GPU output is judged without synchronising with the host.
    """
    if not isinstance(out, torch.Tensor):
        return f"{type(out).__name__}, not a torch.Tensor"
    shape, device = _expected_output(op, args, kwargs)
    what = "a map" if op in ("density", "density_frames") else "an output"
    if shape is not None and tuple(out.shape) != shape:
        expected = {"density": "the grid's shape", "density_frames": "n_frames maps of the grid's shape"}.get(op, "")
        return f"{what} of shape {tuple(out.shape)}; expected {shape}" + (f" ({expected})" if expected else "")
    if out.dtype not in _OUTPUT_DTYPES:
        return f"{what} of dtype {out.dtype}; expected torch.float32 (or torch.float64, as the reference returns)"
    if device is not None and out.device != device:
        return f"{what} on {out.device}; expected it on the inputs' device {device}"
    return None


def _guarded(user: RegisteredBackend) -> Callable:
    """``user.fn`` refusing inputs that need what it cannot do, and naming it when its output is malformed."""
    fn, name = user.fn, user.name

    def call(*args, **kwargs):
        atoms = args[0] if args else None
        if not user.capabilities.anisotropic and getattr(atoms, "u_aniso", None) is not None:
            raise BackendError(
                f"the registered backend {name!r} declares no anisotropic atoms (capabilities.anisotropic=False) but "
                "the atoms carry U tensors; use a backend that splats them, or atoms.replace(u_aniso=None, "
                "aniso=None) for an isotropic map (read_model(..., adp='iso') does it when reading)"
            )
        if not user.capabilities.gradients and torch.is_grad_enabled():
            if any(_requires_grad(a) for a in args):
                raise BackendError(
                    f"the registered backend {name!r} declares no gradients (capabilities.gradients=False) but an "
                    "input requires grad; use a backend with gradients or detach the inputs"
                )
        out = fn(*args, **kwargs)
        why = _malformed(user.op, out, args, kwargs)
        if why is not None:
            raise BackendError(f"the registered {user.op} backend {name!r} returned {why}")
        return out

    call.__wrapped__ = fn
    call.__name__ = getattr(fn, "__name__", name)
    return call


def available_backends(op: str, device: str | torch.device = "cpu") -> list[str]:
    """Backends that can run ``op`` on ``device`` right now: the built-in ones, then registered ones."""
    device = torch.device(device)
    return [b for b in _names(op) if _why_not(op, b, device) is None]


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
    reasons, broken = [], []
    for name in AUTO_ORDER.get(device.type, ("reference",)):
        why = _why_not(op, name, device)
        if why is None:
            key = (op, device.type, name)
            if key not in _announced:
                _announced.add(key)
                log.info("%s on %s: backend=auto chose %r", op, device.type, name)
                if broken:
                    _warn_fallback(op, device, name, broken)
            return name
        reasons.append(f"{name}: {why}")
        if why.startswith(_CANNOT_IMPORT.format(backend=name, op=op)):
            broken.append(why)
    raise BackendError(f"no backend can run {op} on {device}: " + "; ".join(reasons))


_resolved: dict[tuple[str, str, str, bool], tuple[str, Callable]] = {}


def get_backend(op: str, device: str | torch.device, backend: str = "auto") -> tuple[str, Callable]:
    """``(name, function)`` of the backend that runs ``op`` on ``device``.

    Resolved once per (op, device type, backend, interpreter setting) and cached: the
    checks import modules and query CUDA, which would cost ~0.1 ms on every kernel call. The
    interpreter setting (an environment lookup) only decides anything off CUDA devices.
    """
    if type(device) is not torch.device:
        device = torch.device(device)
    key = (op, device.type, backend, device.type != "cuda" and triton_interpreted())
    hit = _resolved.get(key)
    if hit is None:
        name = resolve_backend(op, device, backend)
        hit = _resolved[key] = (name, _load(op, name))
    return hit
