"""A whole optimiser step, captured once in a CUDA graph and replayed: :class:`Step`.

On a GPU a fitting step of these kernels is host-bound: the kernels' device time is a fraction of
the Python, dispatch and launch work around them. :class:`Step` removes that work the way torch's
own CUDA-graph documentation captures a whole training step ("whole-network capture"): it runs a
few real steps on a side stream (the warm-up that compiles the Triton kernels, makes the plans and
the optimiser's state), then records one step — ``zero_grad``, the loss, its backward and the
optimiser's update — into a :class:`torch.cuda.CUDAGraph` and replays it for every later step.

Replaying reads and writes the same memory every time, so:

- **What may change between steps, in place:** the values of every tensor the step reads — the
  parameters (the optimiser updates them in place; ``x.copy_(...)`` or ``x.data[...] = ...`` are
  seen too), and the atoms' B, occupancy and U, the target map, a tensor learning rate — as long as
  they stay the same tensor objects with the same shapes.
- **What needs a new capture:** anything that changes a shape, a Python value or which tensor the
  loss reads: a new grid, a new atom count, a new target tensor object, a float learning rate or λ
  changed on the Python side. :meth:`Step.recapture` (or a new :class:`Step`) captures again; a
  parameter replaced by a tensor of another shape or address is noticed and recaptured by itself.

On the CPU there is nothing to capture: the step runs eagerly (the same code, the same results) and
says so once per process with a :class:`StepWarning`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["Step", "StepError", "StepResult", "StepWarning"]


class StepError(RuntimeError):
    """A step that cannot be captured or run, saying why and what to do."""


class StepWarning(UserWarning):
    """What :class:`Step` chose on its own: an eager step on the CPU, a capture repeated."""


@dataclasses.dataclass(frozen=True, eq=False)
class StepResult:
    """What one step computed, at the parameters *before* its update.

    In a replayed step these are the CUDA graph's own output tensors: the next step overwrites them.
    Read them (``float(r.loss)``, one host synchronisation) or ``.clone()`` them before calling the
    step again.

    Attributes
    ----------
    loss : torch.Tensor, shape (), float32 or float64
        The total: the sum of ``terms``, each times its weight.
    terms : dict of str to torch.Tensor
        Each named term of the loss, shape (); ``{"loss": loss}`` when the loss function returned a
        single tensor.
    grads : dict of str to tuple of torch.Tensor
        With ``term_grads=True``: each term's gradient with respect to each parameter (in the order of
        ``params``, each shaped like its parameter; zeros where a term does not depend on it). Empty
        otherwise.
    aux : dict of str to torch.Tensor
        The extra outputs the loss function returned (a map, say), detached.
    """

    loss: torch.Tensor
    terms: dict[str, torch.Tensor]
    grads: dict[str, tuple[torch.Tensor, ...]]
    aux: dict[str, torch.Tensor]


_said_eager_on_cpu = False


class Step:
    """One optimiser step — ``zero_grad``, loss, backward, update — replayed as a CUDA graph on a GPU.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn() -> loss``, reading the parameters (and anything else) from its closure. It returns
        a 0-d tensor; or a dict of named 0-d terms whose sum is the loss (``{"fit": ..., "planarity":
        lam * nll}``); or a pair ``(terms, aux)`` where ``aux`` is a dict of tensors to hand back
        without differentiating them (``{"rho": rho}``). It must not synchronise with the host
        (``.item()``, ``float(t)``, printing a tensor): on a GPU such a loss cannot be captured.
    params : sequence of torch.Tensor
        The leaves the optimiser updates (``requires_grad=True``), all on one device.
    optimizer : torch.optim.Optimizer
        Updates ``params`` in place. On a GPU an optimiser with a ``capturable`` option (Adam, AdamW,
        …) is switched to ``capturable=True``, captured or not (its step counter then lives on the
        device, as a capture needs, and an eager step does the same arithmetic); a closure-based one
        (``LBFGS``) cannot be captured and is refused.
    term_grads : bool
        Also return each term's gradient (:attr:`StepResult.grads`); the update uses their (weighted)
        sum, the same total gradient. Costs one backward pass per term over that term's part of the graph.
    weights : dict of str to float, optional
        A weight for some of the named terms (default 1): the loss is Σ weight·term, and
        :attr:`StepResult.terms` and :attr:`StepResult.grads` hold the terms and gradients unweighted, so
        a term weighted 0 is still reported (``{"planarity": lam}`` shows the restraint's pull at λ = 0).
        The weights are fixed when the step is captured: change them with a new :class:`Step`.
    capture : bool or "auto"
        ``"auto"``: capture on a CUDA device, run eagerly on the CPU. ``False``: always eager (the
        same results, the host work on every step). ``True``: capture, or raise where it cannot.
    warmup : int
        Real, eager steps run on the capture's side stream before the capture (≥ 1): they compile
        the kernels and make the plans and the optimiser's state, none of which may happen inside a
        capture.

    Raises
    ------
    StepError
        No parameters, parameters on several devices or without ``requires_grad``, a closure-based
        optimiser where a capture is asked for, ``capture=True`` on the CPU.

    Notes
    -----
    The first ``warmup`` calls are eager steps; the next one records the graph and replays it (one
    real step); every later call is one replay: one host call, the whole step on the device, no
    synchronisation. :attr:`mode` says which: ``"eager"``, ``"warming up"`` or ``"graph"``.
    ``torch.use_deterministic_algorithms(True)`` is honoured as in eager calls: a replay of a
    deterministic step gives the same bits as the same step run eagerly.

    Examples
    --------
    >>> step = kernels.fitting.Step(lambda: loss_fn(x), [x], torch.optim.Adam([x], lr=0.02))
    >>> for i in range(200):
    ...     result = step()
    >>> float(result.loss)  # one host synchronisation, when you want to read it
    """

    def __init__(
        self,
        loss_fn: Callable[[], object],
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        term_grads: bool = False,
        weights: Mapping[str, float] | None = None,
        capture: bool | str = "auto",
        warmup: int = 3,
    ):
        params = list(params)
        if not params:
            raise StepError("Step needs at least one parameter tensor to update")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor) or not p.requires_grad or not p.is_leaf:
                raise StepError(
                    f"parameter {i} must be a leaf tensor with requires_grad=True "
                    "(x = start.clone().requires_grad_(True))"
                )
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise StepError(f"the parameters are on several devices ({sorted(map(str, devices))}): put them on one")
        if capture not in (True, False, "auto"):
            raise StepError(f"capture must be True, False or 'auto', not {capture!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise StepError(f"warmup must be an integer ≥ 1, not {warmup!r}")
        self.device = params[0].device
        on_gpu = self.device.type == "cuda"
        if capture is True and not on_gpu:
            raise StepError(f"capture=True needs the parameters on a CUDA device, not {self.device}")
        self._capture = on_gpu and capture is not False
        if self._capture and isinstance(optimizer, torch.optim.LBFGS):
            raise StepError(
                "LBFGS calls its closure several times a step and reads the loss on the host, which a CUDA "
                "graph cannot hold: use Adam or SGD, or Step(..., capture=False) to run it eagerly"
            )
        self.loss_fn = loss_fn
        self.params = params
        self.optimizer = optimizer
        self.term_grads = bool(term_grads)
        self.weights = {}
        for name, w in (weights or {}).items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or abs(w) == float("inf"):
                raise StepError(f"the weight of term {name!r} must be a finite number, got {w!r}")
            self.weights[str(name)] = float(w)
        self.warmup = warmup
        self.n_steps = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: StepResult | None = None
        self._warm = 0
        self._stream = None
        self._layout = self._param_layout()
        if on_gpu:
            # Captured or not, the same arithmetic (a capturable optimiser computes its bias corrections on the
            # device): Step(capture=False) is the eager twin of the replayed step, bit for bit where kernels are.
            _make_capturable(optimizer)
        else:
            _say_eager_on_cpu()

    @property
    def mode(self) -> str:
        """``"graph"`` (replaying), ``"warming up"`` (eager steps before the capture) or ``"eager"``."""
        if not self._capture:
            return "eager"
        return "graph" if self._graph is not None else "warming up"

    def recapture(self) -> None:
        """Capture again at the next call (after a new grid, atom count or target tensor): warm-up first."""
        self._graph = None
        self._static = None
        self._warm = 0
        self._layout = self._param_layout()

    def __call__(self) -> StepResult:
        """Run one step: the loss and gradients at the current parameters, then the optimiser's update."""
        self.n_steps += 1
        if not self._capture:
            return self._eager_step()
        if self._graph is not None:
            if self._param_layout() != self._layout:
                warnings.warn(
                    "a parameter was replaced by a tensor of another shape or address: the step is captured again",
                    StepWarning,
                    stacklevel=2,
                )
                self.recapture()
            else:
                self._graph.replay()
                return self._static
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._warm < self.warmup:
            with torch.cuda.stream(stream):
                result = self._eager_step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._warm += 1
            return result
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream):
                static = self._eager_step()
        except Exception as exc:
            raise StepError(
                f"the step could not be captured in a CUDA graph ({type(exc).__name__}: {exc}). A loss that "
                "reads a value on the host (.item(), float(t), print, a Python branch on a tensor) or a kernel "
                "that synchronises (tricubic_sample in 'bounded' mode) cannot be captured: remove the "
                "synchronisation, or use Step(..., capture=False)"
            ) from exc
        self._graph, self._static = graph, static
        self._layout = self._param_layout()
        graph.replay()
        return static

    # ---------------------------------------------------------------- one step, as captured or run eagerly

    def _eager_step(self) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        terms, aux = _terms_of(self.loss_fn())
        unknown = set(self.weights) - set(terms)
        if unknown:
            raise StepError(
                f"weights name terms the loss does not return: {sorted(unknown)} (it returns {sorted(terms)})"
            )
        weight = [self.weights.get(name, 1.0) for name in terms]
        loss = _total([t if w == 1.0 else w * t for t, w in zip(terms.values(), weight)])
        grads: dict[str, tuple[torch.Tensor, ...]] = {}
        if self.term_grads:
            names = list(terms)
            total = [None] * len(self.params)
            for k, name in enumerate(names):
                g = torch.autograd.grad(terms[name], self.params, retain_graph=k < len(names) - 1, allow_unused=True)
                g = tuple(torch.zeros_like(p) if t is None else t for t, p in zip(g, self.params))
                grads[name] = g
                if weight[k] != 1.0:
                    g = tuple(weight[k] * t for t in g)
                total = [t if acc is None else acc + t for acc, t in zip(total, g)]
            for p, t in zip(self.params, total):
                p.grad = t
        else:
            loss.backward()
        self.optimizer.step()
        return StepResult(
            loss=loss.detach(),
            terms={name: t.detach() for name, t in terms.items()},
            grads=grads,
            aux={name: t.detach() for name, t in aux.items()},
        )

    def _param_layout(self) -> tuple:
        return tuple((p.data_ptr(), tuple(p.shape), p.dtype) for p in self.params)


def _terms_of(out) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(terms, aux) from what a loss function returned (see :class:`Step`)."""
    aux: Mapping = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        out, aux = out
    if isinstance(out, torch.Tensor):
        terms = {"loss": out}
    elif isinstance(out, Mapping) and out:
        terms = dict(out)
    else:
        raise StepError(
            "the loss function must return a 0-d tensor, a non-empty dict of named 0-d terms, or a pair "
            f"(terms, aux dict); it returned {type(out).__name__}"
        )
    for name, t in terms.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 0:
            what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise StepError(f"loss term {name!r} must be a 0-d tensor (a scalar loss), got {what}")
        if not t.requires_grad:
            raise StepError(f"loss term {name!r} does not depend on the parameters (it has no gradient)")
    for name, t in aux.items():
        if not isinstance(t, torch.Tensor):
            raise StepError(f"aux output {name!r} must be a tensor, got {type(t).__name__}")
    return terms, dict(aux)


def _total(terms: list[torch.Tensor]) -> torch.Tensor:
    it = iter(terms)
    total = next(it)
    for t in it:
        total = total + t
    return total


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch an optimiser with a ``capturable`` option to it, moving any step counters to their parameter's device."""
    for group in optimizer.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    state["step"] = step.to(p.device, torch.float32)


def _say_eager_on_cpu() -> None:
    global _said_eager_on_cpu
    if not _said_eager_on_cpu:
        _said_eager_on_cpu = True
        warnings.warn(
            "kernels.fitting.Step runs eagerly on the CPU (CUDA graphs need a GPU; the kernels dominate a CPU step)",
            StepWarning,
            stacklevel=3,
        )
