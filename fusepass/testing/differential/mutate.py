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
        n = choose([c for c in calls if _tensor_val(c).dtype.is_floating_point])
        dtype = _tensor_val(n).dtype
        low = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        users = list(n.users)
        with g.inserting_after(n):
            down = g.call_function(torch.ops.prims.convert_element_type.default, (n, low))
        with g.inserting_after(down):
            up = g.call_function(torch.ops.prims.convert_element_type.default, (down, dtype))
        for u in users:
            u.replace_input_with(n, up)
        what = f"{n.name} rounded to {low}"
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
