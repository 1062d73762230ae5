"""One definition per op: the eager autograd Function and the ``torch.library`` op, built from it.

An :class:`OpDef` holds what an op is — its launcher (``forward``), its backward, the shapes of
its outputs without running it (``fake``) and its schema — and nothing else. From it:

- :func:`eager_function` builds the ``torch.autograd.Function`` eager calls apply. It bypasses
  the dispatcher, whose Python kernels add host time to every call (the arguments boxed and
  unboxed, the autograd kernel, and with a gradient the backward op's dispatch: about twice the
  Function's forward + backward on the CPU, ``benchmarks/bench_call_overhead.py --compiled-ops``).
- :func:`register` registers the ``torch.library`` custom ops ``name`` and ``name_backward``
  (schema, implementation, fake implementation and autograd), which ``torch.compile`` traces. A
  compiled graph calls them at every run, so they are registered with the least per-call Python
  the dispatcher allows (one pass through it; no ``torch.library.custom_op`` wrappers).

Both run the same ``forward`` and ``backward`` callables, so the two paths cannot drift apart.

The call state
    ``forward`` and ``backward`` take a host object first, ``call``: whatever the launcher needs
    besides tensors (a plan of launch constants, a grid, flags). Eager callers build it directly
    (and may pass one of their own, as tests and benchmarks do with a plan); the op builds it
    from its plain arguments with ``OpDef.call`` (cached by the op's author where it is costly).

Aliasing
    A custom op's outputs may not alias its inputs. A saved output that *is* one of the inputs
    (a placeholder the launcher passes where nothing is written) is returned by the op as an
    empty (0,) tensor of its dtype, so ``fake`` must give (0,) there and ``backward`` must not read
    such a saved output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

__all__ = ["OpDef", "eager_function", "register"]


@dataclasses.dataclass(frozen=True, eq=False)
class OpDef:
    """What an op is, written once.

    Attributes
    ----------
    name : str
        ``"namespace::op"``; the backward op is ``"namespace::op_backward"``.
    inputs : tuple of str
        The schema of each tensor input, in order (``"Tensor xyz"``, ``"Tensor? u_aniso"``).
    params : tuple of str
        The schema of each plain argument after them (``"float[] cell"``, ``"float? radius"``).
    grads : tuple of int
        Indices into ``inputs`` of the inputs the backward returns gradients for, in its output order.
    saved : int
        How many tensors ``forward`` returns after the result, kept for the backward.
    call : callable
        ``call(inputs, params) -> state``: the host state ``forward`` and ``backward`` take, from the
        op's arguments (tuples of the tensor inputs and of the plain arguments).
    forward : callable
        ``forward(state, *inputs) -> (result, *saved)``. Runs without autograd recording.
    backward : callable
        ``backward(state, grad, *inputs, *saved) -> tuple`` of ``len(grads)`` tensors, each shaped like
        its input.
    fake : callable
        ``fake(*inputs, *params) -> (result, *saved)``: empty tensors of the outputs' shapes and
        dtypes (no kernel runs; the inputs may be fake tensors).
    fake_grads : callable, optional
        ``fake_grads(*inputs, *params)``: the backward's outputs, when ``torch.empty_like`` of each
        input in ``grads`` is not their shape (an optional input that is None).
    """

    name: str
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    grads: tuple[int, ...]
    saved: int
    call: Callable
    forward: Callable
    backward: Callable
    fake: Callable
    fake_grads: Callable | None = None


def eager_function(op: OpDef) -> type[torch.autograd.Function]:
    """The autograd Function of ``op`` for eager calls: ``Fn.apply(state, *inputs) -> result``.

    ``state`` is what ``op.call`` would return (the caller builds it). The backward returns None for
    inputs that need no gradient, and computes nothing when none does. Not twice differentiable: a
    backward with ``create_graph=True`` raises.
    """
    n_in = len(op.inputs)
    grads = op.grads
    forward, backward = op.forward, op.backward
    none = (None,) * (n_in + 1)
    # Every input differentiable (planarity, tricubic): the inputs are saved_tensors as they are, which
    # saves the host time of rebuilding the argument list on each call.
    every = grads == tuple(range(n_in))

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, state, *inputs):
            out = forward(state, *inputs)
            # The differentiable inputs through save_for_backward (autograd checks they are not modified in
            # place before the backward); the rest as they are (each saved tensor costs host time).
            if every:
                ctx.save_for_backward(*inputs)
                ctx.rest = out[1:]
            else:
                ctx.save_for_backward(*[inputs[i] for i in grads])
                ctx.rest = (inputs, out[1:])
            ctx.state = state
            return out[0]

        @staticmethod
        def backward(ctx, grad):
            # Not twice differentiable: the backward launches kernels autograd cannot see. Checked here
            # rather than with once_differentiable, whose wrapper costs tens of µs of host time per call.
            if torch.is_grad_enabled():
                raise RuntimeError(f"{op.name} is not twice differentiable (backward with create_graph=True)")
            need = ctx.needs_input_grad
            if every:
                g = backward(ctx.state, grad, *ctx.saved_tensors, *ctx.rest)
                if all(need[1:]):
                    return (None, *g)
                return (None, *(t if n else None for t, n in zip(g, need[1:])))
            if not any(need[i + 1] for i in grads):
                return none
            inputs, saved = ctx.rest
            inputs = list(inputs)
            for i, t in zip(grads, ctx.saved_tensors):
                inputs[i] = t
            g = backward(ctx.state, grad, *inputs, *saved)
            out = list(none)
            for k, i in enumerate(grads):
                if need[i + 1]:
                    out[i + 1] = g[k]
            return tuple(out)

    # Named at creation, so that its graph nodes are named after the op (``DensityCpuBackward``).
    return type(_camel(op.name.split("::")[1]), (Function,), {"__doc__": Function.__doc__})


def register(op: OpDef):
    """Register ``op`` and its backward as ``torch.library`` custom ops; returns the forward op.

    Forward: ``name(*inputs, *params) -> (result, *saved)``. Backward:
    ``name_backward(grad, *inputs, *saved, *params) -> grads``. Autograd of the forward calls the
    backward op, so a compiled graph holds both. A single output or gradient is a plain ``Tensor``
    in the schema, not a 1-tuple. Not twice differentiable: a backward through the forward op with
    ``create_graph=True`` raises.

    Both ops are defined with ``torch.library.Library`` (``define``, ``impl``, ``register_fake``), not
    ``torch.library.custom_op``: inside a compiled graph the ops run at every call, and custom_op's
    wrappers (a Python autograd layer that redispatches, then a checking wrapper around the
    implementation) double their host cost. Here a call costs one pass through the dispatcher:

    - the forward's Autograd kernel applies an autograd Function when a gradient is needed; otherwise
      it calls the implementation itself, or, where a key below autograd takes part (fake tensors,
      functionalization, a dispatch mode), redispatches below autograd;
    - the backward op has no Autograd kernel (the dispatcher's C++ fallback passes a call on to the
      implementation): it runs inside the forward's backward, which refuses ``create_graph=True``.
      Called by hand on inputs that require grad, its outputs carry torch's "no autograd kernel"
      warning node, not a gradient.

    Each implementation is registered for every backend (``CompositeExplicitAutograd``); the outputs
    never alias the inputs (checked by ``torch.library.opcheck`` in the tests, not at every call).
    """
    n_in, n_par, n_saved, n_grads = len(op.inputs), len(op.params), op.saved, len(op.grads)
    grads = op.grads
    outs = "Tensor" if n_saved == 0 else f"({', '.join(['Tensor'] * (1 + n_saved))})"
    b_outs = "Tensor" if n_grads == 1 else f"({', '.join(['Tensor'] * n_grads)})"
    saved_schema = [f"Tensor saved{k}" for k in range(n_saved)]
    schema = f"({', '.join((*op.inputs, *op.params))}) -> {outs}"
    b_schema = f"({', '.join(('Tensor grad', *op.inputs, *saved_schema, *op.params))}) -> {b_outs}"
    namespace, name = op.name.split("::")
    call, forward, backward = op.call, op.forward, op.backward

    def impl(*args):
        inputs = args[:n_in]
        result, *saved = forward(call(inputs, args[n_in:]), *inputs)
        if not n_saved:
            return result
        # An op's outputs may not alias its inputs: a placeholder input passed back is returned empty.
        return (result, *(t.new_empty(0) if any(t is i for i in inputs) else t for t in saved))

    def impl_backward(*args):
        inputs = args[1 : 1 + n_in]
        g = backward(call(inputs, args[1 + n_in + n_saved :]), args[0], *args[1 : 1 + n_in + n_saved])
        return g[0] if n_grads == 1 else tuple(g)

    def fake(*args):
        out = op.fake(*args)
        return tuple(out) if n_saved else out[0]

    def fake_backward(*args):
        inputs, params = args[1 : 1 + n_in], args[1 + n_in + n_saved :]
        if op.fake_grads is not None:
            g = tuple(op.fake_grads(*inputs, *params))
        else:
            g = tuple(torch.empty_like(inputs[i]) for i in grads)
        return g[0] if n_grads == 1 else g

    lib = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES.append(lib)
    b_name = f"{name}_backward"
    for op_name, op_schema, op_impl, op_fake in (
        (name, schema, impl, fake),
        (b_name, b_schema, impl_backward, fake_backward),
    ):
        lib.define(op_name + op_schema, tags=(torch.Tag.pt2_compliant_tag,))
        lib.impl(op_name, op_impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{op_name}", op_fake, lib=lib)
    ops = getattr(torch.ops, namespace)
    fwd_op, bwd_op = getattr(ops, name).default, getattr(ops, b_name).default

    redispatch = fwd_op._handle.redispatch_boxed
    after_autograd = torch._C._after_autograd_keyset
    below_autograd = torch._C._AutoDispatchBelowAutograd
    none = (None,) * (1 + n_in + n_par)

    class Function(torch.autograd.Function):
        """The forward op's autograd: ``apply(keyset, *inputs, *params)``, the backward through ``bwd_op``."""

        @staticmethod
        def forward(ctx, keyset, *args):
            with below_autograd():
                output = redispatch(keyset & after_autograd, *args)
            ctx.save_for_backward(*args[:n_in], *(output[1:] if n_saved else ()))
            ctx.params = args[n_in:]
            return output

        @staticmethod
        def backward(ctx, grad, *_saved_grads):
            # The backward op has no autograd of its own (see register's docstring).
            if torch.is_grad_enabled():
                raise RuntimeError(f"{op.name} is not twice differentiable (backward with create_graph=True)")
            g = bwd_op(grad, *ctx.saved_tensors, *ctx.params)
            if n_grads == 1:
                g = (g,)
            need = ctx.needs_input_grad
            out = list(none)
            for k, i in enumerate(grads):
                if need[1 + i]:
                    out[1 + i] = g[k]
            return tuple(out)

    Function = type(_camel(name) + "Op", (Function,), {"__doc__": Function.__doc__})
    # Per dispatch key set below autograd (as raw bits): whether a backend kernel is all that runs below,
    # so that the implementation may be called directly. The sets seen are few: one per device and mode.
    direct = {}
    backends = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
    grad_enabled, any_requires_grad = torch.is_grad_enabled, torch._C._any_requires_grad

    def autograd_kernel(keyset, *args):
        if grad_enabled() and any_requires_grad(*args):
            return Function.apply(keyset, *args)
        below = keyset & after_autograd
        bits = below.raw_repr()
        plain = direct.get(bits)
        if plain is None:
            # ADInplaceOrView falls through for a functional op; any other key ranks above the backends.
            top = below.remove(torch._C.DispatchKey.ADInplaceOrView).highestPriorityTypeId()
            plain = direct[bits] = top in backends
        with below_autograd():
            return impl(*args) if plain else redispatch(below, *args)

    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return fwd_op


def _camel(name: str) -> str:
    return name.title().replace("_", "")


#: The libraries that hold the registered ops (an op is deregistered when its library is collected).
_LIBRARIES: list[torch.library.Library] = []
