"""Finding the two halves of a sparse MoE block in a post-grad graph (shared by
``moe_router`` and ``moe_experts``).

How transformers' MoE code traces depends on the experts implementation
(``grouped_mm``: sort, histc offsets, two ``_grouped_mm``; the opaque
``transformers::grouped_mm_fallback`` op in fp32/fp16; ``batched_mm``: each
(token, choice) pair's expert weights gathered and one ``bmm``) and on the
model (gate and up halves or interleaved, biases, transposed weights, a
clamped activation), and one model's graph holds as many copies as it has
MoE layers.  No fixed pattern covers that, so each rule slices its region by
dataflow from an anchor, names the region's inputs by their shapes and
dtypes, and accepts it only where the region, cut out of the graph as a small
FX graph, and the op agree on random inputs (:func:`run_region`).  What is
left to the verdict is numbers, not structure: a rewrite the op does not
compute cannot pass, whatever the region looks like.

A verdict is kept per region *structure* (its nodes' ops and constants, its
inputs' shapes and dtypes), so a model of 48 identical layers runs the proof
once per compile, not 48 times.  It holds for the op implementation that ran
it: whoever registers another one for the same device (a test serving the ops
with their interpreted Triton kernels on CPU) calls :meth:`Verdicts.forget_all`.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fusepass.match import concrete, hint, same

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that only change how a tensor is viewed or copied: a region takes them
# when nobody else reads them (a weight's permute, a flatten of the routing).
LAYOUT = {
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.clone.default, aten.t.default, aten.transpose.int, aten.alias.default,
}
CASTS = {prims.convert_element_type.default, aten._to_copy.default}
# Ops of a dequantisation computed from stored weights in the graph
# (``fusepass.quantize``'s experts, and their int4 unpack).
DEQUANT = LAYOUT | CASTS | {
    aten.mul.Tensor, aten.sub.Tensor, aten.add.Tensor, aten.div.Tensor, aten.bitwise_and.Scalar,
    aten.bitwise_right_shift.Tensor_Scalar, aten.__rshift__.Scalar, aten.stack.default, aten.cat.default,
    aten.slice.Tensor, aten.select.int, aten.index.Tensor, aten.unbind.int, operator.getitem,
}


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def tensor(n: Any) -> torch.Tensor | None:
    v = val(n)
    return v if isinstance(v, torch.Tensor) else None


def position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def constant(n: torch.fx.Node) -> bool:
    """Made from sizes alone (an ``empty``, an ``iota``, a ``full``): no tensor flows into it."""
    return n.op == "call_function" and not any(
        isinstance(v, torch.Tensor) for a in n.all_input_nodes for v in pytree.tree_leaves(val(a)))


def shape_is(t: torch.Tensor | None, *shape: Any) -> bool:
    return t is not None and t.dim() == len(shape) and all(same(a, b) for a, b in zip(t.shape, shape))


def is_int(t: torch.Tensor | None) -> bool:
    return t is not None and not t.is_floating_point() and t.dtype != torch.bool


def shape_text(n: Any) -> str:
    t = tensor(n)
    if t is None:
        return repr(val(n))
    return f"{str(t.dtype).replace('torch.', '')}[{', '.join(str(s) for s in t.shape)}]"


def descendants(start: Iterable[torch.fx.Node], until: int, pos: dict[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """Every node computed from ``start`` up to graph position ``until`` (inclusive)."""
    out: set[torch.fx.Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in out and u.op == "call_function" and pos[u] <= until:
                out.add(u)
                stack.append(u)
    return out


def backward(root: torch.fx.Node, inside: Callable[[torch.fx.Node], bool]) -> tuple[set[torch.fx.Node], list[torch.fx.Node]]:
    """(the nodes ``root`` depends on through nodes ``inside`` accepts, root included; the
    nodes feeding them that it did not accept)."""
    core: set[torch.fx.Node] = set()
    boundary: dict[torch.fx.Node, None] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        if n in core:
            continue
        core.add(n)
        for a in n.all_input_nodes:
            if a in core:
                continue
            if a.op == "call_function" and inside(a):
                stack.append(a)
            else:
                boundary[a] = None
    return core, [b for b in boundary if b not in core]


def absorb(core: set[torch.fx.Node], boundary: list[torch.fx.Node], takes: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node]:
    """Move into ``core`` the boundary nodes that only ``core`` reads and ``takes`` accepts
    (a layout op, a constant), walking on to their inputs; returns the new boundary."""
    bound = dict.fromkeys(boundary)
    changed = True
    while changed:
        changed = False
        for b in list(bound):
            if b.op != "call_function" or not b.users or any(u not in core for u in b.users) or not takes(b):
                continue
            core.add(b)
            del bound[b]
            for a in b.all_input_nodes:
                if a not in core:
                    bound[a] = None
            changed = True
    return list(bound)


def param_chain(n: torch.fx.Node, ops: set[Any], limit: int = 64) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """(the nodes of ``ops`` computing ``n`` from graph inputs, those inputs), or None if
    anything else flows in (an activation, an op outside ``ops``, more than ``limit`` nodes)."""
    nodes: dict[torch.fx.Node, None] = {}
    leaves: dict[torch.fx.Node, None] = {}
    stack = [n]
    while stack:
        m = stack.pop()
        if m in nodes or m in leaves:
            continue
        if m.op in ("placeholder", "get_attr"):
            leaves[m] = None
            continue
        if tensor(m) is None and m.op == "call_function" and m.target is not operator.getitem:
            leaves[m] = None  # a size
            continue
        if m.op != "call_function" or (m.target not in ops and not constant(m)):
            return None
        nodes[m] = None
        if len(nodes) > limit:
            return None
        stack.extend(m.all_input_nodes)
    return list(nodes), list(leaves)


# -- cutting a region out and running it ------------------------------------------


def extract(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node],
            outputs: list[torch.fx.Node]) -> torch.fx.GraphModule:
    """``nodes`` (in graph order) as a GraphModule taking ``inputs`` and returning ``outputs``."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for b in inputs:
        env[b] = g.placeholder(b.name)
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def concrete_shape(n: torch.fx.Node) -> list[int]:
    return [hint(s) for s in tensor(n).shape]


def size_value(n: torch.fx.Node) -> Any:
    v = val(n)
    return hint(v) if isinstance(v, torch.SymInt) else v


def rel_error(a: torch.Tensor, e: torch.Tensor) -> float:
    """||a - e|| / ||e|| in fp64 (inf where either is not finite, 0 for empty tensors)."""
    a, e = a.double(), e.double()
    if not e.numel():
        return 0.0
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    return (a - e).norm().item() / max(e.norm().item(), 1e-30)


def run_region(gm: torch.fx.GraphModule, inputs: list[Any]) -> tuple[Any, ...]:
    with concrete():
        return tuple(gm(*inputs))


def canonical(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> str:
    """A text that two regions share exactly when they compute the same thing the same way
    on inputs of the same shapes: their verdicts are interchangeable."""
    names = {b: f"in{i}" for i, b in enumerate(inputs)}
    names.update({n: f"n{i}" for i, n in enumerate(nodes)})

    def text(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return names.get(a, "?")
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(text(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{text(v)}" for k, v in sorted(a.items())) + "}"
        return repr(a)

    parts = [f"in{i}:{shape_text(b)}:{getattr(tensor(b), 'device', '')}" for i, b in enumerate(inputs)]
    for n in nodes:
        parts.append(f"{names[n]}={n.target}({text(n.args)};{text(n.kwargs)})")
    parts.append("out:" + text(outputs))
    return "\n".join(parts)


class Verdicts:
    """Verdicts per region structure (see the module docstring), at most ``size`` kept."""

    _all: "weakref.WeakSet[Verdicts]" = weakref.WeakSet()

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._d: dict[str, Any] = {}
        Verdicts._all.add(self)

    @classmethod
    def forget_all(cls) -> None:
        """Drop every verdict: the ops' implementations changed since they were made."""
        for v in list(cls._all):
            with v._lock:
                v._d.clear()

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._d:
                return self._d[key]
        result = compute()
        with self._lock:
            if len(self._d) >= self.size:
                self._d.pop(next(iter(self._d)))
            self._d[key] = result
        return result
