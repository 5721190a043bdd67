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
        _install_experts(name, namespace)


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


# -- MoE experts: the per-expert loop ------------------------------------------------------
#
# transformers' experts classes (``@use_experts_implementation``) dispatch on
# ``config._experts_implementation``; ``eager`` calls the class's own forward,
# a Python loop over the experts hit that breaks the graph at ``nonzero`` and
# never reaches a backend.  That original forward (the decorator keeps it as
# ``forward.__wrapped__``) is routed to ``fusepass::moe_experts``.  A copy is
# accepted by what it computes: run on a stand-in module (4 experts, hidden 24,
# intermediate 8, 6 tokens, fp32, one expert left without tokens) under each
# layout it may serve -- [E, 2I, H] weights or [E, H, 2I] with biases, the
# default gate (``act_fn(gate) * up`` on the halves) with SiLU, GELU and
# GELU-tanh, or the class's own ``_apply_gate`` read as gpt-oss's clamped form
# -- it must equal the op within 1e-4 relative; what it passes is kept per
# class.  At trace time the substitute routes a call only for a module whose
# flags (``is_transposed``, ``has_bias``, gate, activation) name a layout its
# class passed, no expert parallelism, no post-expert norm, and no gradients
# wanted; anything else traces the original.

_EXPERTS_FORWARD = "use_experts_implementation.<locals>.wrapper.<locals>.forward"
_experts_accepted: dict[int, frozenset] = {}  # id(original forward) -> {(activation, layout, transposed, bias)}
_experts_verdicts: dict[str, frozenset] = {}  # code content -> the same, for identical copies
_ACT_CLASSES: dict[type, str] | None = None
# transformers' names of activations that may compute one of the op's (each class is checked).
_ACT_NAMES = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate")


def _install_experts(name: str, namespace: dict[str, Any]) -> None:
    """Substitute the eager forward of every experts class defined in ``namespace``."""
    for cname, cls in list(namespace.items()):
        fwd = getattr(cls, "forward", None) if isinstance(cls, type) else None
        code = getattr(fwd, "__code__", None)
        if getattr(code, "co_qualname", "") != _EXPERTS_FORWARD or getattr(cls, "__module__", "") != name:
            continue
        original = getattr(fwd, "__wrapped__", None)
        if isinstance(original, types.FunctionType) and id(original) not in _done:
            _done.add(id(original))
            _register_experts(cls, original, f"{name}.{cname}.forward")


def _activation_classes() -> dict[type, str]:
    """transformers' activation classes that compute one of the op's activations, checked on random inputs."""
    global _ACT_CLASSES
    if _ACT_CLASSES is None:
        from transformers import activations

        from .kernels.moe.experts import _activation

        gen = torch.Generator().manual_seed(0)
        gu = torch.randn(16, 8, generator=gen) * 3
        out: dict[type, str] = {}
        classes = {torch.nn.SiLU, torch.nn.GELU}
        for n in _ACT_NAMES:
            entry = activations.ACT2CLS.get(n)
            if isinstance(entry, type):
                classes.add(entry)
        for cls in classes:
            try:
                act = cls()
                got = act(gu[:, :4]) * gu[:, 4:]
            except Exception:  # noqa: BLE001 - a class that needs arguments: not one of ours
                continue
            for name in ("silu", "gelu", "gelu_tanh"):
                want = _activation(gu, name, "halves", 0.0, 0.0, lambda t: t)
                if ((got - want).norm() / want.norm()).item() <= 1e-6:
                    out[cls] = name
                    break
        _ACT_CLASSES = out
    return _ACT_CLASSES


class _StandIn(torch.nn.Module):
    """What an experts forward reads of its module, for checking a copy."""

    def __init__(self, cls: type, E: int, H: int, I: int, transposed: bool, bias: bool, act: Any,
                 gen: torch.Generator) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, I
        self.hidden_size, self.intermediate_size = H, I
        w1, w2 = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5, torch.randn(E, H, I, generator=gen) * I ** -0.5
        if transposed:
            w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        self.gate_up_proj, self.down_proj = torch.nn.Parameter(w1), torch.nn.Parameter(w2)
        if bias:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(E, 2 * I, generator=gen) * 0.1)
            self.down_proj_bias = torch.nn.Parameter(torch.randn(E, H, generator=gen) * 0.1)
        self.act_fn = act
        self.alpha, self.limit = 1.5, 2.5  # not gpt-oss's own: the copy must read them
        self.has_gate, self.has_bias, self.is_transposed = True, bias, transposed
        self.has_post_expert_norm, self._is_expert_parallel = False, False
        self._apply_gate = types.MethodType(cls._apply_gate, self)


def _register_experts(cls: type, original: types.FunctionType, where: str) -> None:
    key = _code_key(original.__code__) + _code_key(getattr(cls._apply_gate, "__code__", original.__code__))
    if key not in _experts_verdicts:
        _experts_verdicts[key] = _check_experts(cls, original)
    accepted = _experts_accepted[id(original)] = _experts_verdicts[key]
    if not accepted:
        notes.append(f"{where}: not substituted (computes fusepass::moe_experts in none of its layouts)")
        return
    try:
        torch._dynamo.substitute_in_graph(original, skip_signature_check=True)(_substitute_experts(cls, original))
    except ValueError as exc:  # already registered by someone else
        notes.append(f"{where}: not substituted ({exc})")


def _gate_kind(cls: type) -> str:
    """``default`` for transformers' own gate (act_fn on the halves), else ``own``."""
    gate = getattr(cls, "_apply_gate", None)
    return "default" if getattr(gate, "__qualname__", "") == "_default_apply_gate" else "own"


def _check_experts(cls: type, original: types.FunctionType) -> frozenset:
    """The layouts (activation, gate layout, transposed, bias) in which ``original`` computes the op."""
    op = torch.ops.fusepass.moe_experts
    E, H, I, T, k = 4, 24, 8, 6, 2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [1, 0], [3, 1], [0, 3]])  # expert 2 without tokens
    w = torch.rand(T, k, generator=gen) + 0.1
    if _gate_kind(cls) == "default":
        acts = [(cls_, name, "halves") for cls_, name in _activation_classes().items()
                if cls_ in (torch.nn.SiLU, torch.nn.GELU) or cls_.__module__.startswith("transformers")]
        acts = list({name: (c, name, layout) for c, name, layout in acts}.values())
    else:
        acts = [(None, "gpt_oss", "interleaved")]
    accepted = set()
    with torch.no_grad():
        for act_cls, name, layout in acts:
            for transposed, bias in ((False, False), (True, True), (True, False), (False, True)):
                m = _StandIn(cls, E, H, I, transposed, bias, act_cls() if act_cls else None, gen)
                try:
                    got = original(m, x, ids, w)
                    want = op(x, ids, w, m.gate_up_proj, m.down_proj, getattr(m, "gate_up_proj_bias", None),
                              getattr(m, "down_proj_bias", None), None, None, None, None, name, layout, transposed,
                              "none", 0, m.alpha, m.limit)
                except Exception:  # noqa: BLE001 - not this layout
                    continue
                if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                        ((got.double() - want.double()).norm() / want.double().norm()).item() <= _TOL:
                    accepted.add((name, layout, transposed, bias))
    return frozenset(accepted)


def _experts_layout(module: Any, gate: str, acts: tuple[tuple[type, str], ...]) -> tuple[str, str, bool, bool] | None:
    """The module's (activation, layout, transposed, bias), or None where the op does not serve it
    (``gate``: its class's :func:`_gate_kind`, found before tracing: Dynamo does not see a function's
    ``__qualname__``)."""
    if not getattr(module, "has_gate", False) or getattr(module, "has_post_expert_norm", False) \
            or getattr(module, "_is_expert_parallel", False):
        return None
    transposed, bias = bool(getattr(module, "is_transposed", False)), bool(getattr(module, "has_bias", False))
    if gate == "default":
        act = getattr(module, "act_fn", None)
        for act_cls, name in acts:  # pairs, not a dict keyed by class: Dynamo traces this
            if type(act) is act_cls:
                return (name, "halves", transposed, bias)
        return None
    return ("gpt_oss", "interleaved", transposed, bias)


def _substitute_experts(cls: type, fn: types.FunctionType) -> Callable[..., Any]:
    params = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    original = _copy(fn)
    op = torch.ops.fusepass.moe_experts
    accepted = _experts_accepted[id(fn)]
    acts = tuple(_activation_classes().items())
    gate = _gate_kind(cls)

    def substitute(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "moe_experts" not in routed() or len(args) + len(kwargs) != 3:
            return original(self, *args, **kwargs)
        bound = dict(zip(params, args))
        bound.update(kwargs)
        if set(bound) != set(params):
            return original(self, *args, **kwargs)
        x, ids, w = (bound[p] for p in params)
        layout = _experts_layout(self, gate, acts)
        if layout not in accepted or not isinstance(x, torch.Tensor) or x.dim() != 2:
            return original(self, *args, **kwargs)
        name, gate_layout, transposed, bias = layout
        b1 = self.gate_up_proj_bias if bias else None
        b2 = self.down_proj_bias if bias else None
        fmt = getattr(self, "_fusepass_fmt", "none")  # experts fusepass.quantize converted: their stored codes
        if fmt == "none":
            w1, w2, quant, group = self.gate_up_proj, self.down_proj, (None, None, None, None), 0
        else:
            w1, w2, transposed = self.gate_up_proj_q, self.down_proj_q, False  # stored [E, N, K]
            quant = (self.gate_up_proj_scale, getattr(self, "gate_up_proj_zero", None), self.down_proj_scale,
                     getattr(self, "down_proj_zero", None))
            group = self._fusepass_group_size
        tensors = [x, w, w1, w2] + ([b1, b2] if bias else [])
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return original(self, *args, **kwargs)  # the op has no backward: training traces the loop
        alpha = float(getattr(self, "alpha", 0.0)) if name == "gpt_oss" else 0.0
        limit = float(getattr(self, "limit", 0.0)) if name == "gpt_oss" else 0.0
        return op(x, ids, w, w1, w2, b1, b2, *quant, name, gate_layout, transposed, fmt, group, alpha, limit)

    substitute.__name__ = f"fusepass_{fn.__name__}"
    return substitute
