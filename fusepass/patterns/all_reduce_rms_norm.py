"""All-reduce + residual add + RMSNorm at a tensor-parallel layer boundary -> ``fusepass::all_reduce_rms_norm``.

    h = all_reduce_sum(x, group)  (+ residual)
    y = rms_norm(h, w, eps)            (any form of :mod:`fusepass.patterns.rms_norm`)
    returns (y, h)

Tensor-parallel decoders (``transformers``' ``tp_plan``, torch's
``parallelize_module``) end each attention and MLP block with a row-parallel
projection whose partial sums an all-reduce joins; Dynamo turns
``dist.all_reduce`` (in place) into ``_c10d_functional.all_reduce`` +
``wait_tensor``, and the post-grad graph then reads: all-reduce, wait, a
reshape or two, the residual add, the next norm.  The first norm of the
model follows the vocabulary-parallel embedding's all-reduce with no add:
the ``*_no_residual`` forms, where ``h`` (the reduced value) is the residual
the next block adds.

The collective's group and reduce op are strings in the graph, which traced
patterns cannot leave open, so the rule finds its regions itself (``find``):
from each all-reduce, through its wait and shape-only views, to an add and a
norm that the :mod:`~fusepass.patterns.rms_norm` rule's own patterns match.
Refused with the reason: a reduce op other than a sum, a group this process
cannot resolve, the reduced value used by anything else, a residual of
another dtype or shape.  Rules run highest priority first: this one sees the
boundary before ``add_rms_norm`` takes the add and the norm alone.

Forms (the reference semantics) call the collective on the default group,
so the tests and the differential programs need a process group: a single
rank (gloo) is enough for them; the multi-rank tests spawn gloo ranks.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
import torch.fx

from fusepass.guards import nondefault_argument
from fusepass.kernels.all_reduce_rms_norm import all_reduce_rms_norm_call
from fusepass.match import RESHAPES, MatchInfo, same, scalar_input, shape_str
from fusepass.patterns import add_rms_norm as add_norm
from fusepass.patterns import rms_norm as norm
from fusepass.rule import Form, NearMiss, Region, Rule, get_rule

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Ops between the wait and the add that only reshape: the sum commutes with them.
_VIEWS = (*RESHAPES, aten.clone.default)
# Followed too, to refuse with the reason: the op sums and adds in x's dtype.
_CASTS = (torch.ops.prims.convert_element_type.default,)


def _world() -> str:
    import torch.distributed as dist

    return dist.group.WORLD.group_name


def all_reduced(x, op="sum"):
    """``x`` all-reduced over the default group, as Dynamo writes ``dist.all_reduce``."""
    return c10d.wait_tensor(c10d.all_reduce(x, op, _world()))


def _form(name, search_norm, flags):
    def search(x, residual, weight, eps):
        h = all_reduced(x) + residual
        return search_norm(h, weight, eps), h

    def search_alone(x, weight, eps):
        h = all_reduced(x)
        return search_norm(h, weight, eps), h

    def replace(x, residual, weight, eps):
        return _call(flags, x.shape, _world(), x, residual, weight, eps)

    def replace_alone(x, weight, eps):
        return _call(flags, x.shape, _world(), x, None, weight, eps)

    return [Form(name, search, replace), Form(f"{name}_no_residual", search_alone, replace_alone, _alone_inputs)]


def _call(flags, shape, group_name, x, residual, weight, eps):
    offset, cast_before_weight = flags
    out = torch.promote_types(x.dtype, weight.dtype) if cast_before_weight else x.dtype
    # A reshape between the wait and the add commutes with the sum: reduce x in the add's shape.
    return all_reduce_rms_norm_call(x.reshape(shape), residual, weight, eps, offset, cast_before_weight, out,
                                    group_name)


# -- finding the boundaries ------------------------------------------------------------------

def _norms(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, tuple[Any, Any, str | None]]:
    """Every RMSNorm the ``rms_norm`` rule's patterns match, by its input node: (compiled form, match, why it
    must be refused or None) -- matched as the engine matches patterns, every argument and rounding checked."""
    from fusepass.engine import compile_rule, match_form  # the engine loads the rules: imported at search time

    by_target: dict[Any, list[Any]] = {}
    for cf in compile_rule(get_rule("rms_norm")):
        by_target.setdefault(cf.root_target, []).append(cf)
    found: dict[torch.fx.Node, tuple[Any, Any, str | None]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in by_target:
            continue
        for cf in by_target[node.target]:
            m, refusal, form = match_form(cf, node)
            if m is not None and isinstance(m.kwargs.get("x"), torch.fx.Node):
                if refusal is None or m.kwargs["x"] not in found:
                    found[m.kwargs["x"]] = (form, m, refusal)
                if refusal is None:
                    break
    return found


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def find(gm: torch.fx.GraphModule) -> Iterator[Region]:
    reduces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == c10d.all_reduce.default]
    if not reduces:
        return
    norms = _norms(gm)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    # Last boundary first: the engine replaces the regions in the order given,
    # and a boundary's residual is the previous boundary's output h, which a
    # replacement erases (its users, the next region's op included, then read
    # the op's output instead).
    for ar in reversed(reduces):
        region = _boundary(ar, norms)
        if region is not None:
            region.nodes.sort(key=pos.__getitem__)
            yield region


def _boundary(ar: torch.fx.Node, norms: dict[torch.fx.Node, tuple[Any, Any, str | None]]) -> Region | None:
    """The region from ``ar`` to the norm it feeds, a refusal, or None where it feeds no norm."""
    waits = [u for u in ar.users if u.target == c10d.wait_tensor.default]
    if len(ar.users) != 1 or not waits:
        return None
    chain = [waits[0]]  # the wait and the views after it: the reduced value as the add reads it
    while True:
        r = chain[-1]
        if r in norms:
            return _region(ar, chain, None, norms[r])
        users = list(r.users)
        adds = [u for u in users if u.target == aten.add.Tensor and r in u.args[:2] and u in norms]
        if len(users) == 1 and adds:
            return _region(ar, chain, adds[0], norms[adds[0]])
        if adds:
            others = ", ".join(u.name for u in users if u is not adds[0])
            return Region("", _anchor(norms[adds[0]][1]), reason=(
                f"the all-reduced value {r.name} is also used by {others}: the op returns only the sum with the "
                "residual and the norm"))
        if len(users) == 1 and users[0].target in _VIEWS + _CASTS and users[0].args[0] is r:
            chain.append(users[0])
            continue
        return None


def _anchor(m: Any) -> torch.fx.Node:
    """The norm's rsqrt: where the report places a boundary (the next block's norm)."""
    return next((n for n in m.nodes if n.target == aten.rsqrt.default), m.output_node())


def _region(ar: torch.fx.Node, chain: list[torch.fx.Node], add: torch.fx.Node | None,
            matched: tuple[Any, Any, str | None]) -> Region:
    cf, m, refusal = matched
    x, op, group = ar.args[:3]
    reduced = chain[-1]
    name = cf.form.name + ("" if add is not None else "_no_residual")
    anchor = _anchor(m)
    residual = None
    if add is not None:
        residual = add.args[1] if add.args[0] is reduced else add.args[0]
    reason = refusal or _refusal(op, group, x, reduced, residual, add)
    if reason:
        return Region(name, anchor, reason=reason)
    h = add if add is not None else reduced
    nodes = [ar, *chain, *([add] if add is not None else []), *m.nodes]
    outputs = [*(o for o in m.output_nodes() if o is not None), h]
    flags = add_norm._FORMS[cf.form.name][1]
    shape = tuple(_val(reduced).shape)
    replace = functools.partial(_replace, flags, shape, group, add is not None)
    eps = scalar_input(m.kwargs["eps"])
    args = [x, residual, m.kwargs["weight"], eps] if add is not None else [x, m.kwargs["weight"], eps]
    names = ["x", "residual", "weight", "eps"] if add is not None else ["x", "weight", "eps"]
    # The norm matched through the engine's guards, the add's alpha checked above, the collective's
    # arguments in _refusal: every argument of the region accounted for.
    return Region(name, anchor, list(dict.fromkeys(nodes)), outputs, args, replace, names=names,
                  arguments_checked=True)


def _replace(flags, shape, group_name, has_residual, x, *rest):
    residual, weight, eps = rest if has_residual else (None, *rest)
    return _call(flags, shape, group_name, x, residual, weight, eps)


def _refusal(op: Any, group: Any, x: torch.fx.Node, reduced: torch.fx.Node, residual: Any,
             add: torch.fx.Node | None) -> str | None:
    if op != "sum":
        return f"all-reduce op {op!r}, not a sum"
    if not isinstance(group, str):
        return f"process group given as {type(group).__name__}, not a registered group name"
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        _resolve_process_group(group)
    except Exception as exc:  # noqa: BLE001 - any failure: the op could not run the collective
        return f"process group {group!r} cannot be resolved in this process ({type(exc).__name__})"
    xv, rv = _val(x), _val(reduced)
    if not isinstance(xv, torch.Tensor) or not isinstance(rv, torch.Tensor) or xv.dtype != rv.dtype:
        what = f"{xv.dtype} to {rv.dtype}" if isinstance(xv, torch.Tensor) and isinstance(rv, torch.Tensor) else ""
        return f"the all-reduced value is cast ({what}) before the add and the norm: mixed dtypes"
    if add is not None:
        reason = nondefault_argument(add)
        if reason:
            return reason
    if residual is not None:
        if residual is reduced:
            return "the residual is the all-reduced value itself"
        res = _val(residual)
        if not isinstance(res, torch.Tensor):
            return "the residual is a Python number, not a tensor"
        if res.dtype != rv.dtype:
            return f"residual add mixes {rv.dtype} and {res.dtype}"
        if res.dim() != rv.dim() or not all(same(a, b) for a, b in zip(res.shape, rv.shape)):
            return f"residual add broadcasts {shape_str(rv)} with {shape_str(res)}"
    return None


def check(m: MatchInfo) -> str | None:
    return norm.check_norm(m, x_name="x")


# -- inputs, near-misses ------------------------------------------------------------------------

def example_inputs(dtype):
    return [torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)]


def _alone_inputs(dtype):
    return [torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)]


def sized_inputs(dtype, shape):
    hidden = shape[-1] if shape else 1
    meta = functools.partial(torch.empty, dtype=dtype, device="meta")
    return {"x": meta(shape), "residual": meta(shape), "weight": meta((hidden,))}


def _nm_max(x, residual, weight):
    h = all_reduced(x, "max") + residual
    return norm.search_hf(h, weight, 1e-6), h


def _nm_reduced_reused(x, residual, weight):
    s = all_reduced(x)
    h = s + residual
    return norm.search_hf(h, weight, 1e-6), h, s * 2


def _nm_mixed(x, residual, weight):
    h = all_reduced(x) + residual
    return norm.search_hf(h, weight.to(h.dtype), 1e-6), h


def _mixed_inputs(dtype):
    x, residual, weight = example_inputs(dtype)
    return [x, residual.to(torch.float16 if dtype != torch.float16 else torch.float32), weight]


RULE = Rule(
    name="all_reduce_rms_norm",
    forms=[f for name, (search, flags) in add_norm._FORMS.items() for f in _form(name, search, flags)],
    example_inputs=example_inputs,
    check=check,
    scalars={"eps": 1e-6},
    anchor=c10d.all_reduce.default,
    # Above add_rms_norm (10): the boundary's add and norm are this rule's first.
    priority=15,
    find=find,
    near_misses=[
        NearMiss("max all-reduce", _nm_max, example_inputs, "not a sum"),
        NearMiss("reduced value also used", _nm_reduced_reused, example_inputs, "also used by"),
        NearMiss("residual in another dtype", _nm_mixed, _mixed_inputs, "residual add mixes"),
    ],
    sized_inputs=sized_inputs,
    doc=__doc__,
)
