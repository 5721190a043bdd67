"""The pre-trace path: known GDN-layer functions routed to the ops before Dynamo traces them.

``transformers`` keeps its own copy of ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule`` in every hybrid model file (qwen3_next,
qwen3_5, qwen3_5_moe, olmo_hybrid, ...).  Traced, the chunk function unrolls
into ~124 + 37·chunks nodes, a new graph for every chunk count; routed to
``fusepass::gdn_chunk`` first it is one node for every T, and Inductor has
nothing of it to compile.

- **What is substituted.** Every copy found in an imported
  ``transformers.models.*`` module under those names (unwrapping
  ``use_kernel_func_from_hub_with_fallback``, whose ``wrapped`` calls the
  torch function through a closure: Dynamo inlines the wrapper and meets the
  torch function, which is the object registered).  A copy is accepted by
  what it computes, not by where it lives: run once on random inputs
  (grouped heads, a padded last chunk, with and without L2 norm and initial
  state) it must equal the op within 1e-4 relative; the verdict is kept per
  code object's content, so identical copies are checked once.  A copy that
  differs (a future release with another scale, say) is left alone and the
  graph-level rules see it.  When flash-linear-attention is installed the
  wrapper calls FLA instead, and nothing here applies.
- **How.** ``torch._dynamo.substitute_in_graph`` (keyed on the function
  object; registration cannot be undone).  The substitute decides at trace
  time: it calls the op only when the compile being traced uses the fusepass
  backend with ``pretrace`` on and options that select the op's rule (the
  rule whose ``pretraced`` names the op: ``rules``/``disable_rules`` switch
  the route as they switch the rule), and otherwise traces an exact copy of
  the original (so ``backend="inductor"`` in the same process is unaffected).
- **How the option reaches trace time.** Dynamo traces before any backend is
  called, but ``torch.compile(..., backend="fusepass", options=...)`` keeps
  the options on the compiler function the tracer holds
  (``OutputGraph.compiler_fn``, a ``_TorchCompileWrapper`` with ``kwargs``).
  The substitute asks :func:`traced_options` through a function Dynamo runs
  at trace time (``assume_constant_result``).  A different ``torch.compile``
  call is a different backend object, and Dynamo's backend guard keeps their
  cache entries apart.
- **When.** :func:`arm` runs when torch resolves ``backend="fusepass"``
  (importing :mod:`fusepass.backend` through the entry point): it registers
  the copies already imported and puts an import hook on
  ``transformers.models.*`` that registers copies imported later, right after
  their module runs (Dynamo's start-of-compile callbacks would also be in
  time, but ``torch._dynamo.reset()`` removes them).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import inspect
import logging
import sys
import threading
import types
from typing import Any, Callable

import torch

from .options import Options, backend_options
from .rule import rules

log = logging.getLogger("fusepass")

# transformers' function name -> the op it is routed to.
KNOWN = {
    "torch_chunk_gated_delta_rule": "gdn_chunk",
    "torch_recurrent_gated_delta_rule": "gdn_recurrent",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d_update",
    "torch_causal_conv1d_update": "causal_conv1d_update",
}
_GDN_REQUIRED = ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel")
_REQUIRED = {"gdn_chunk": _GDN_REQUIRED, "gdn_recurrent": _GDN_REQUIRED,
             "causal_conv1d": ("hidden_states", "weight", "bias", "activation"),
             "causal_conv1d_update": ("hidden_states", "conv_state", "weight", "bias", "activation")}
# Relative error norm a copy may differ from the op by (fp32, T = 70, 8-dim
# heads: the chunked copies measure 2e-7..1e-6).
_TOL = 1e-4

_lock = threading.Lock()
_verdicts: dict[str, str | None] = {}  # code content -> None (accepted) or why not
_done: set[int] = set()  # ids of functions handled (kept alive by their modules)
_scanned: set[str] = set()
_armed = False
notes: list[str] = []  # copies found and refused, for the curious


def arm() -> None:
    """Register the copies imported so far and, once, an import hook for later ones."""
    global _armed
    with _lock:
        if not _armed:
            _armed = True
            # Dynamo's start-of-compile callbacks would do, but torch._dynamo.reset() drops them.
            sys.meta_path.insert(0, _AfterImport())
    install()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`install` after each ``transformers.models`` module is executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not name.startswith("transformers.models."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        try:
            install(ready=module.__name__)
        except Exception as exc:  # noqa: BLE001 - never break an import
            log.info("fusepass: pre-trace registration after importing %s failed: %s", module.__name__, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def install(ready: str = "") -> None:
    """Substitute every known GDN copy in the ``transformers.models`` modules imported now
    (``ready``: a module whose code has just run, though importlib has not marked it done)."""
    for name in [m for m in list(sys.modules) if m.startswith("transformers.models.") and m not in _scanned]:
        module = sys.modules.get(name)
        if name != ready and getattr(getattr(module, "__spec__", None), "_initializing", False):
            continue  # still executing (it imports another module of its package): later
        _scanned.add(name)
        # The module's own namespace only: getattr on transformers' lazy package
        # modules imports submodules, and some of those fail to import (seen on
        # the GPU machine: 85 warnings for one compile of Qwen3.5).
        namespace = getattr(module, "__dict__", {})
        for fname, op in KNOWN.items():
            fn = namespace.get(fname)
            if callable(fn):
                _register(inspect.unwrap(fn), op, f"{name}.{fname}")


def _code_key(code: types.CodeType) -> str:
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()


def _register(fn: Any, op: str, where: str) -> None:
    if not isinstance(fn, types.FunctionType) or id(fn) in _done:
        return
    _done.add(id(fn))
    params = inspect.signature(fn).parameters
    if not all(p in params for p in _REQUIRED[op]):
        notes.append(f"{where}: not substituted (parameters {list(params)})")
        return
    key = _code_key(fn.__code__) + op
    if key not in _verdicts:
        check = _check_conv if op.startswith("causal_conv1d") else _check
        _verdicts[key] = check(fn, getattr(torch.ops.fusepass, op))
    if _verdicts[key] is not None:
        notes.append(f"{where}: not substituted ({_verdicts[key]})")
        log.info("fusepass: %s not substituted: %s", where, _verdicts[key])
        return
    try:
        build = _substitute_conv if op.startswith("causal_conv1d") else _substitute
        torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(build(fn, op))
    except ValueError as exc:  # already registered by someone else
        notes.append(f"{where}: not substituted ({exc})")


def _check(fn: Callable[..., Any], op: Any) -> str | None:
    """None if ``fn`` computes ``op`` (scale d_k^-0.5) on random inputs, else the measured difference."""
    gen = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, D = 1, (70 if "chunk" in op.__name__ else 3), 1, 2, 8
    worst = 0.0
    with torch.no_grad():
        for l2norm in (True, False):
            for with_state in (False, True):
                q, k = (torch.randn(B, T, Hk, D, generator=gen) * (1 if l2norm else D ** -0.5) for _ in range(2))
                v = torch.randn(B, T, Hv, D, generator=gen)
                g = -(torch.rand(B, T, Hv, generator=gen) * 0.45 + 0.05)
                beta = torch.rand(B, T, Hv, generator=gen)
                state = torch.randn(B, Hv, D, D, generator=gen) * 0.5 if with_state else None
                try:
                    o, s = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                              use_qk_l2norm_in_kernel=l2norm)
                    eo, es = op(q, k, v, g, beta, state, l2norm, D ** -0.5)
                except Exception as exc:  # noqa: BLE001
                    return f"running it failed: {type(exc).__name__}: {exc}"
                for a, e in ((o, eo), (s, es)):
                    if a is None or a.shape != e.shape:
                        return f"returns {None if a is None else tuple(a.shape)}, the op {tuple(e.shape)}"
                    worst = max(worst, ((a.double() - e.double()).norm() / e.double().norm()).item())
    return None if worst <= _TOL else f"differs from fusepass::{op.__name__.split('.')[0]} by {worst:.3g} relative"


def _check_conv(fn: Callable[..., Any], op: Any) -> str | None:
    """None if ``fn`` computes the conv op (output, and the state it shifts) on random inputs."""
    gen = torch.Generator().manual_seed(0)
    update = "update" in op.__name__
    B, C, K = 2, 12, 4
    worst = 0.0
    with torch.no_grad():
        for bias, activation in ((False, "silu"), (True, "silu"), (True, None)):
            x = torch.randn(B, (1 if update else 9), C, generator=gen).transpose(1, 2)
            w = torch.randn(C, K, generator=gen)
            b = torch.randn(C, generator=gen) if bias else None
            state = torch.randn(B, C, K, generator=gen)
            try:
                if update:
                    s1 = state.clone()
                    out, new_state = op(x, state, w, b, activation)
                    pairs = [(fn(x, s1, w, b, activation), out), (s1, new_state)]
                else:
                    pairs = [(fn(x, w, b, activation=activation), op(x, w, b, activation))]
            except Exception as exc:  # noqa: BLE001
                return f"running it failed: {type(exc).__name__}: {exc}"
            for a, e in pairs:
                if not isinstance(a, torch.Tensor) or a.shape != e.shape:
                    return f"returns {getattr(a, 'shape', a)}, the op {tuple(e.shape)}"
                worst = max(worst, ((a.double() - e.double()).norm() / e.double().norm()).item())
    return None if worst <= _TOL else f"differs from fusepass::{op.__name__.split('.')[0]} by {worst:.3g} relative"


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """The same function under another identity: what the substitute traces when it stands aside."""
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


def _substitute(fn: types.FunctionType, op_name: str) -> Callable[..., Any]:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    original = _copy(fn)
    op = getattr(torch.ops.fusepass, op_name)

    def substitute(*args: Any, **kwargs: Any) -> Any:
        if op_name not in routed():
            return original(*args, **kwargs)
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        if bound.get("cu_seqlens") is not None or bound.get("seq_idx") is not None:
            return original(*args, **kwargs)  # packed sequences: not the op's
        q = bound["query"]
        tensors = [bound[n] for n in ("query", "key", "value", "g", "beta", "initial_state") if bound[n] is not None]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return original(*args, **kwargs)  # the op has no backward: training traces the function
        o, state = op(q, bound["key"], bound["value"], bound["g"], bound["beta"], bound["initial_state"],
                      bool(bound["use_qk_l2norm_in_kernel"]), q.shape[-1] ** -0.5)
        return o, (state if bound["output_final_state"] else None)

    substitute.__name__ = f"fusepass_{fn.__name__}"
    return substitute


def _substitute_conv(fn: types.FunctionType, op_name: str) -> Callable[..., Any]:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    original = _copy(fn)
    op = getattr(torch.ops.fusepass, op_name)
    update = op_name == "causal_conv1d_update"

    def substitute(*args: Any, **kwargs: Any) -> Any:
        if op_name not in routed():
            return original(*args, **kwargs)
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update((k, v) for k, v in kwargs.items() if k in names)
        x, weight, bias, activation = (bound.get(n) for n in ("hidden_states", "weight", "bias", "activation"))
        tensors = [t for t in (x, weight, bias) if isinstance(t, torch.Tensor)]
        if (activation not in (None, "silu", "swish") or not isinstance(x, torch.Tensor) or x.dim() != 3
                or not isinstance(weight, torch.Tensor) or weight.dim() != 2
                or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
            return original(*args, **kwargs)  # not the op's (or gradients: the op has no backward)
        if update:
            state = bound.get("conv_state")
            if not isinstance(state, torch.Tensor) or state.shape[-1] < weight.shape[-1] - 1:
                return original(*args, **kwargs)
            out, new_state = op(x, state, weight, bias, activation)
            state.copy_(new_state)  # the cache's state, shifted in place as transformers' function does
            return out
        return op(x, weight, bias, activation)

    substitute.__name__ = f"fusepass_{fn.__name__}"
    return substitute


def traced_options() -> Any:
    """fusepass's Options of the compile Dynamo is tracing now, or None (not tracing, another backend)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    ours, options = backend_options(getattr(getattr(tx, "output", None), "compiler_fn", None))
    return Options.parse(options)[0] if ours else None


def owners() -> dict[str, str]:
    """op name -> the rule whose ``pretraced`` names it: the rule a pre-trace route belongs to."""
    return {op._schema.name.split("::")[-1]: rule.name for rule in rules() for op in rule.pretraced}


@torch._dynamo.assume_constant_result
def routed() -> tuple[str, ...]:
    """Run by Dynamo while tracing a substitute: the ops this compile routes calls to -- none unless it
    uses the fusepass backend with ``pretrace`` on, and only those whose rule its options select
    (``rules``, ``disable_rules``)."""
    options = traced_options()
    if options is None or not options.pretrace:
        return ()
    return tuple(sorted(op for op, rule in owners().items() if options.enabled(rule)))
