"""Finding plain linear layers in a post-grad graph (shared by ``linear_siblings``
and ``linear_one``): ``mm(x, B)`` / ``addmm(bias, x, B)`` with B the transpose
of the weight, as ``F.linear`` decomposes."""

from __future__ import annotations

import torch
import torch.fx

from fusepass.match import RESHAPES

aten = torch.ops.aten
VIEWS = (aten.permute.default, aten.t.default, *RESHAPES)


def val(n):
    """The fake value a node carries (None for a non-node)."""
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def is_call(n, target) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target == target


def root(n):
    """The node a chain of views starts from (a weight's placeholder under its transpose)."""
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in VIEWS:
        n = n.args[0]
    return n


def product(node: torch.fx.Node):
    """(x, B, bias) of ``mm(x, B)`` / ``addmm(bias, x, B)`` (1-D bias) in a kernel dtype, else None."""
    if is_call(node, aten.mm.default):
        x, b, bias = node.args[0], node.args[1], None
    elif is_call(node, aten.addmm.default) and len(node.args) == 3:
        bias, x, b = node.args
        bv = val(bias)
        if not isinstance(bv, torch.Tensor) or bv.dim() != 1:
            return None
    else:
        return None
    xv, wv = val(x), val(b)
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and xv.dim() == 2 and wv.dim() == 2):
        return None
    if bias is not None and val(bias).dtype != xv.dtype:
        return None
    return x, b, bias
