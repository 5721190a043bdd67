"""Mutations of a block: its search function traced to ATen, one node changed."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten


class _Invalid(Exception):
    """A drawn variant eager (or the trace) refuses: the builder simplifies the block."""



_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)
_COMMUTATIVE = (aten.mul.Tensor, aten.add.Tensor, aten.maximum.default, aten.minimum.default)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ALPHAS = (2, -1, 0.5, 0)
_DTYPES = (torch.float64, torch.float32)
# Keyword arguments user code can give these ops at values other than their
# defaults, each changing what the op computes (or, for a memory format and
# a reduction's dtype equal to its input's, only how): Inductor's matcher
# does not compare the ones a pattern does not write.
_KWARGS: dict[Any, dict[str, tuple[Any, ...]]] = {
    aten.add.Tensor: {"alpha": _ALPHAS},
    aten.sub.Tensor: {"alpha": _ALPHAS},
    aten.add.Scalar: {"alpha": (2, -1)},
    aten.addmm.default: {"beta": (0, 0.5, 2), "alpha": (2, 0.5, -1)},
    aten.baddbmm.default: {"beta": (0, 0.5, 2), "alpha": (2, 0.5, -1)},
    aten.sum.dim_IntList: {"dtype": _DTYPES},
    aten.mean.dim: {"dtype": _DTYPES},
    aten.cumsum.default: {"dtype": _DTYPES},
    aten.clone.default: {"memory_format": (torch.contiguous_format,)},
}
# Ops with a variant that takes one more keyword argument.
_VARIANTS: dict[Any, tuple[Any, str, tuple[Any, ...]]] = {
    aten.div.Tensor: (aten.div.Tensor_mode, "rounding_mode", ("floor", "trunc")),
}
# Functional op -> its in-place twin (what x.add_(r) becomes before functionalisation).
_INPLACE = {
    aten.add.Tensor: aten.add_.Tensor, aten.sub.Tensor: aten.sub_.Tensor, aten.mul.Tensor: aten.mul_.Tensor,
    aten.div.Tensor: aten.div_.Tensor, aten.add.Scalar: aten.add_.Scalar, aten.mul.Scalar: aten.mul_.Scalar,
}


def _tensor_val(n: torch.fx.Node) -> Any:
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _mutate(fn: Callable[..., Any], inputs: list[torch.Tensor], mutation: str, pick: int) -> tuple[Any, str]:
    """Trace ``fn`` to ATen (as the post-grad graph has it) and apply ``mutation``."""
    from torch._inductor.pattern_matcher import fwd_only

    try:
        gm = fwd_only(fn, inputs)
    except Exception as exc:  # noqa: BLE001
        raise _Invalid(f"trace for {mutation}: {type(exc).__name__}: {exc}") from exc
    g = gm.graph
    output = next(n for n in g.nodes if n.op == "output")
    outs = pytree.tree_leaves(output.args[0])
    calls = [n for n in g.nodes if n.op == "call_function" and _tensor_val(n) is not None]
    inner = [n for n in calls if n not in outs]

    def choose(cands: list[torch.fx.Node]) -> torch.fx.Node:
        if not cands:
            raise _Invalid(f"nothing to apply {mutation} to")
        return cands[pick % len(cands)]

    if mutation == "returned":
        n = choose(inner)
        output.args = (tuple(outs) + (n,),)
        what = f"{n.name} also returned"
    elif mutation == "reused":
        n = choose(inner)
        with g.inserting_after(n):
            use = g.call_function(aten.mul.Tensor, (n, 1.5))
        output.args = (tuple(outs) + (use,),)
        what = f"{n.name} also used by {use.name}"
    elif mutation in ("reduction_dim", "keepdim_off"):
        n = choose([r for r in calls if r.target in _REDUCTIONS and len(r.args) >= 2])
        rank = n.args[0].meta["val"].dim()
        dims = [d % rank if rank else d for d in n.args[1]]
        if mutation == "reduction_dim":
            others = [d for d in range(rank) if d not in dims]
            if not others:
                raise _Invalid("no other dim to reduce over")
            new = [others[pick % len(others)]]
            what = f"{n.name} over dim {new} instead of {list(n.args[1])}"
            n.args = (n.args[0], new, *n.args[2:])
        else:
            keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            if not keep:
                raise _Invalid("keepdim is already off")
            n.args = (n.args[0], n.args[1], False, *n.args[3:])
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "keepdim"}
            what = f"{n.name} without keepdim"
    elif mutation == "constant":
        cands = [(n, i) for n in calls for i, a in enumerate(n.args)
                 if i > 0 and isinstance(a, (int, float)) and not isinstance(a, bool)]
        if not cands:
            raise _Invalid("no constant to change")
        n, i = cands[pick % len(cands)]
        old = n.args[i]
        new = old * 3 if isinstance(old, float) else old + 1
        n.args = (*n.args[:i], new, *n.args[i + 1:])
        what = f"{n.name}: constant {old!r} -> {new!r}"
    elif mutation == "extra_cast":
        floats = [c for c in calls if _tensor_val(c).dtype.is_floating_point]
        n = choose(floats)
        dtype = _tensor_val(n).dtype
        others = [d for d in _FLOATS if d != dtype]
        low = others[(pick // max(1, len(floats))) % len(others)]
        users = list(n.users)
        with g.inserting_after(n):
            down = g.call_function(torch.ops.prims.convert_element_type.default, (n, low))
        with g.inserting_after(down):
            up = g.call_function(torch.ops.prims.convert_element_type.default, (down, dtype))
        for u in users:
            u.replace_input_with(n, up)
        what = f"{n.name} rounded to {low}"
    elif mutation == "cast":
        edges = [(n, u) for n in calls if _tensor_val(n).dtype.is_floating_point for u in n.users
                 if u.op == "call_function"]
        if not edges:
            raise _Invalid("no edge to cast on")
        n, u = edges[pick % len(edges)]
        dtypes = [d for d in _FLOATS if d != _tensor_val(n).dtype]
        dtype = dtypes[(pick // len(edges)) % len(dtypes)]
        with g.inserting_before(u):
            cast = g.call_function(torch.ops.prims.convert_element_type.default, (n, dtype))
        u.replace_input_with(n, cast)
        what = f"{u.name} takes {n.name} as {dtype}"
    elif mutation == "kwarg":
        cands = [(n, name, v) for n in calls for name, vals in _KWARGS.get(n.target, {}).items() for v in vals]
        cands += [(n, name, v) for n in calls if n.target in _VARIANTS for name, v in
                  ((_VARIANTS[n.target][1], v) for v in _VARIANTS[n.target][2])]
        if not cands:
            raise _Invalid("no op that takes a keyword argument")
        n, name, value = cands[pick % len(cands)]
        if n.target in _VARIANTS and name == _VARIANTS[n.target][1]:
            n.target = _VARIANTS[n.target][0]
        n.kwargs = {**n.kwargs, name: value}
        what = f"{n.name} with {name}={value!r}"
    elif mutation == "inplace":
        # In place on an intermediate only this op reads (on an input it would
        # write into the program's inputs, on a shared value change the program).
        cands = [n for n in calls if n.target in _INPLACE and isinstance(n.args[0], torch.fx.Node)
                 and n.args[0].op == "call_function" and len(n.args[0].users) == 1
                 and _tensor_val(n.args[0]) is not None and _tensor_val(n.args[0]).dtype == _tensor_val(n).dtype
                 and tuple(_tensor_val(n.args[0]).shape) == tuple(_tensor_val(n).shape)]
        n = choose(cands)
        n.target = _INPLACE[n.target]
        what = f"{n.name} in place"
        alphas = _KWARGS.get({v: k for k, v in _INPLACE.items()}[n.target], {}).get("alpha")
        if alphas and pick % 2:
            n.kwargs = {**n.kwargs, "alpha": alphas[(pick // 2) % len(alphas)]}
            what += f" with alpha={n.kwargs['alpha']!r}"
    elif mutation == "swap":
        n = choose([c for c in calls if c.target in _COMMUTATIVE and len(c.args) >= 2
                    and isinstance(c.args[0], torch.fx.Node) and isinstance(c.args[1], torch.fx.Node)
                    and c.args[0] is not c.args[1]])
        n.args = (n.args[1], n.args[0], *n.args[2:])
        what = f"{n.name}: operands swapped"
    else:
        raise ValueError(f"unknown mutation {mutation!r}")
    g.lint()
    gm.recompile()
    return gm, f"mutation {mutation}: {what}"
