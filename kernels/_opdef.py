"""One definition per op: the eager autograd Function and the ``torch.library`` op, built from it.

An :class:`OpDef` holds what an op is — its launcher (``forward``), its backward, the shapes of
its outputs without running it (``fake``) and its schema — and nothing else. From it:

- :func:`eager_function` builds the ``torch.autograd.Function`` eager calls apply. It bypasses
  the dispatcher: a Python custom op costs tens of µs of host time per call (schema parsing,
  the generated autograd node, fake-tensor bookkeeping), several times the GPU work of a small
  model.
- :func:`register` registers the ``torch.library`` custom ops ``name`` and ``name_backward``
  (with ``register_fake`` and ``register_autograd``), which ``torch.compile`` traces. Inside a
  compiled graph the dispatch cost is paid once at trace time.

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

    Function.__name__ = Function.__qualname__ = op.name.split("::")[1].title().replace("_", "") + "Function"
    return Function


def register(op: OpDef):
    """Register ``op`` and its backward as ``torch.library`` custom ops; returns the forward op.

    Forward: ``name(*inputs, *params) -> (result, *saved)``. Backward:
    ``name_backward(grad, *inputs, *saved, *params) -> grads``. Autograd of the forward calls the
    backward op, so a compiled graph holds both.
    """
    n_in, n_par, n_saved, n_grads = len(op.inputs), len(op.params), op.saved, len(op.grads)
    # One output is a plain Tensor in the schema (the op returns it, not a 1-tuple).
    outs = "Tensor" if n_saved == 0 else f"({', '.join(['Tensor'] * (1 + n_saved))})"
    saved_schema = [f"Tensor saved{k}" for k in range(n_saved)]
    schema = f"({', '.join((*op.inputs, *op.params))}) -> {outs}"
    # Likewise one gradient: "-> (Tensor)" is a plain Tensor in the schema, so a 1-tuple is unwrapped.
    b_outs = "Tensor" if n_grads == 1 else f"({', '.join(['Tensor'] * n_grads)})"
    b_schema = f"({', '.join(('Tensor grad', *op.inputs, *saved_schema, *op.params))}) -> {b_outs}"
    namespace, name = op.name.split("::")

    def impl(*args):
        inputs, params = args[:n_in], args[n_in:]
        result, *saved = op.forward(op.call(inputs, params), *inputs)
        # An op's outputs may not alias its inputs: a placeholder input passed back is returned empty.
        if not n_saved:
            return result
        return (result, *(t.new_empty(0) if any(t is i for i in inputs) else t for t in saved))

    def fake(*args):
        out = op.fake(*args)
        return out if n_saved else out[0]

    def impl_backward(*args):
        grad, inputs = args[0], args[1 : 1 + n_in]
        saved, params = args[1 + n_in : 1 + n_in + n_saved], args[1 + n_in + n_saved :]
        g = tuple(op.backward(op.call(inputs, params), grad, *inputs, *saved))
        return g[0] if n_grads == 1 else g

    def fake_backward(*args):
        inputs, params = args[1 : 1 + n_in], args[1 + n_in + n_saved :]
        if op.fake_grads is not None:
            g = tuple(op.fake_grads(*inputs, *params))
        else:
            g = tuple(torch.empty_like(inputs[i]) for i in op.grads)
        return g[0] if n_grads == 1 else g

    fwd = torch.library.custom_op(op.name, impl, mutates_args=(), schema=schema)
    fwd.register_fake(fake)
    bwd = torch.library.custom_op(f"{op.name}_backward", impl_backward, mutates_args=(), schema=b_schema)
    bwd.register_fake(fake_backward)
    bwd_op = getattr(getattr(torch.ops, namespace), f"{name}_backward")

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_in], *(output[1:] if n_saved else ()))
        ctx.params = inputs[n_in:]
        ctx.present = [t is not None for t in inputs[:n_in]]

    def backward(ctx, grad, *_saved_grads):
        tensors = ctx.saved_tensors
        g = bwd_op(grad, *tensors, *ctx.params)
        if n_grads == 1:
            g = (g,)
        out = [None] * (n_in + n_par)
        for k, i in enumerate(op.grads):
            if ctx.present[i]:
                out[i] = g[k]
        return tuple(out)

    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd
