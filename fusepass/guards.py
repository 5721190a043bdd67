"""Refusals every rule shares, whatever its pattern says.

A structural match (Inductor's ``PatternExpr.match``) proves less than the
rewrite needs:

- it lets an intermediate have users outside the match (the patterns are
  relaxed to ``MULTIPLE`` so that the refusal can name them):
  :func:`outside_use`;
- it compares only the keyword arguments the pattern itself writes
  (``_TargetArgsExpr._match`` drops the node's others before comparing), so
  ``torch.add(x, r, alpha=2)`` matches a pattern traced from ``x + r`` and
  ``addmm(b, x, w, beta=0)`` one traced from ``addmm(b, x, w)``:
  :func:`unwritten_argument`;
- a pattern is traced at example dtypes, and its casts are constants: the
  bf16 trace of ``w * h.to(x.dtype)`` has a cast to bf16, which an fp16
  input's ``.to(torch.bfloat16)`` also matches.  The engine re-traces the
  form at the graph's own dtypes (:func:`fusepass.engine.match_form`);
- the replacement must give what the matched nodes gave, dtype and shape:
  :func:`replacement_mismatch` runs it on the match's fake values first.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._inductor.pattern_matcher import Match, _TargetArgsExpr
from torch.utils import _pytree as pytree

from .match import same

_NO_DEFAULT = object()


def describe(node: torch.fx.Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    return f"{target.split('.')[0]} ({node.name})"


def outside_use(m: Match) -> str | None:
    inside = set(m.nodes)
    outputs = {o for o in m.output_nodes() if o is not None}
    for n in m.nodes:
        if n in outputs:
            continue
        if not any(isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor) for a in n.all_input_nodes):
            continue  # a constant (zeros, a mask) the graph may share: it stays for its other users
        for user in n.users:
            if user not in inside:
                if user.op == "output":
                    return (f"intermediate {describe(n)} is also used outside the pattern: it is a "
                            "graph output (in training, saved for backward)")
                return f"intermediate {describe(n)} is also used outside the pattern, by {user.name}"
    return None


def _default(target: Any, name: str) -> Any:
    schema = getattr(target, "_schema", None)
    for arg in getattr(schema, "arguments", ()):
        if arg.name == name:
            return arg.default_value if arg.has_default_value() else _NO_DEFAULT
    return _NO_DEFAULT


def same_value(a: Any, b: Any) -> bool:
    """Equal as arguments: 2 and 2.0 alike, lists and tuples alike, a graph value never equal to a constant."""
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare (a SymFloat against a number, say)
        return False


def _show(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        return f"the run-time value {value.name}"
    return repr(value).replace("torch.", "")


def unwritten_argument(m: Match) -> str | None:
    """Why a matched node carries a keyword argument its pattern does not write with a value other than the
    schema's default (the pattern was traced without it: the default is what the rule's form computes)."""
    for pattern, node in m.ctx.pattern_to_node.items():
        if isinstance(pattern, _TargetArgsExpr) and isinstance(node, torch.fx.Node):
            reason = nondefault_argument(node, written=pattern.kwargs)
            if reason:
                return reason
    return None


def _factory(node: torch.fx.Node) -> bool:
    """A tensor made from nothing (``empty``, ``full``, ``iota``): its keyword arguments (dtype, device,
    layout) make the value the graph records for it, which whoever reads it checks."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and not any(isinstance(a.type, torch.TensorType) or "Tensor" in str(a.type)
                                          for a in schema.arguments)


def nondefault_argument(node: torch.fx.Node, written: Any = ()) -> str | None:
    """Why ``node`` carries a keyword argument not in ``written`` with a value other than its schema's
    default: for nodes a rule's ``find`` takes by their target alone (an ``add`` whose ``alpha`` it ignores).
    Factories are not held to it (see :func:`_factory`)."""
    if _factory(node):
        return None
    for name, value in node.kwargs.items():
        if name in written:
            continue
        default = _default(node.target, name)
        if default is _NO_DEFAULT:
            return f"{describe(node)} takes {name}={_show(value)}, an argument the rule's form does not have"
        if not same_value(value, default):
            return (f"{describe(node)} has {name}={_show(value)}, where the rule's form computes with the "
                    f"default {name}={_show(default)}")
    return None


def _leaves(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


def replacement_mismatch(replace: Callable[..., Any], args: Sequence[Any],
                         outputs: Sequence[torch.fx.Node | None]) -> str | None:
    """Why ``replace(*args)`` would not give the matched outputs' dtypes and shapes: it is run first on the
    match's fake values (the ops' fake implementations; no kernel runs).  None when it would, or when it cannot
    be run that way (the replacement's own trace then decides)."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return None
    try:
        with fake_mode:
            got = _leaves(replace(*vals))
    except Exception:  # noqa: BLE001 - replace_by_example reports a failing replacement with its reason
        return None
    expected = [o.meta.get("val") if o is not None else None for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected)):
        if not (isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor)):
            continue
        where = f"output {i}" if len(expected) > 1 else "the output"
        if g.dtype != e.dtype:
            return (f"the op would give {where} in {str(g.dtype).replace('torch.', '')} where the graph computes "
                    f"{str(e.dtype).replace('torch.', '')}")
        if g.dim() != e.dim() or not all(same(a, b) for a, b in zip(g.shape, e.shape)):
            return f"the op would give {where} of shape {tuple(g.shape)} where the graph has {tuple(e.shape)}"
    return None
