"""Tensor-subclass parameters (torchao's quantized weights) as plain graph inputs.

AOTAutograd takes a tensor-subclass input apart into the plain tensors it
holds on every call, in Python: per input, ``__tensor_flatten__`` at each
level, an attribute lookup per inner tensor, and ``size()``/``stride()``
through the subclass's ``__torch_function__``.  With one subclass per
quantized linear that is most of a decode step: torchao's int8 weight-only
Llama-3-8B (224 such weights) took 15.5 ms per step compiled with fusepass
under CUDA graphs on an H100, of which the GPU ran 4.2 ms; the same model
quantized with ``fusepass.quantize`` (plain int8 tensors, same kernels) took
5.5 ms.  Inductor alone pays the same.

:func:`flatten_subclass_inputs` takes them apart once, at compile time: the
graph handed to AOTAutograd takes the inner tensors as its inputs and
rebuilds each subclass at its start (:func:`rebuild`, traced through like
AOTAutograd's own rebuilding, so none of it runs in the compiled code), and
the function returned to Dynamo reads the inner tensors with one attribute
lookup each.

Reading them by name is safe because Dynamo guards every subclass input on
its type, its flatten context, the names of its inner tensors and each inner
tensor's metadata: a call that reaches the compiled function holds the same
structure the names were taken from.

Only inputs Dynamo marked static (parameters and buffers) with static shapes
and no gradient are taken apart; activations, dynamic shapes and training
stay with AOTAutograd's own handling.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@dataclass(frozen=True)
class Layout:
    """How one subclass tensor is put together from its inner tensors."""

    cls: type
    names: tuple[str, ...]
    children: tuple[Layout | None, ...]  # None: a plain tensor
    ctx: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def paths(self, prefix: str = "") -> Iterator[str]:
        """The dotted attribute path of every plain tensor inside, in flatten order."""
        for name, child in zip(self.names, self.children):
            if child is None:
                yield prefix + name
            else:
                yield from child.paths(f"{prefix}{name}.")

    def build(self, leaves: Iterator[torch.Tensor]) -> torch.Tensor:
        inner = {name: next(leaves) if child is None else child.build(leaves)
                 for name, child in zip(self.names, self.children)}
        return self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)


def layout_of(t: torch.Tensor) -> Layout | None:
    """``t``'s layout, or None for a plain tensor."""
    if not is_traceable_wrapper_subclass(t):
        return None
    names, ctx = t.__tensor_flatten__()
    return Layout(type(t), tuple(names), tuple(layout_of(getattr(t, n)) for n in names), ctx,
                  tuple(t.size()), tuple(t.stride()))


# Layouts by key, for rebuild() in the graphs of this process.  The key is a
# hash of the layout's text, so that the same model gives the same graph code
# in every process (AOTAutograd's cache keys on it); two layouts whose texts
# agree but which differ get distinct keys here, so a graph never rebuilds a
# subclass from another's layout.
_LAYOUTS: dict[str, Layout] = {}


def _key(layout: Layout) -> str:
    text = repr((layout.cls.__module__, layout.cls.__qualname__, layout.names, repr(layout.ctx), layout.size,
                 layout.stride, [repr(c) for c in layout.children]))
    base = hashlib.sha256(text.encode()).hexdigest()[:16]
    for i in range(len(_LAYOUTS) + 1):
        key = base if i == 0 else f"{base}_{i}"
        known = _LAYOUTS.setdefault(key, layout)
        if known is layout or _same(known, layout):
            return key
    raise AssertionError("unreachable")


def _same(a: Layout, b: Layout) -> bool:
    try:
        return a == b and bool(a.ctx == b.ctx)
    except Exception:  # noqa: BLE001 - a context that cannot be compared is not the same
        return False


def rebuild(key: str, *leaves: torch.Tensor) -> torch.Tensor:
    """The subclass tensor of layout ``key`` around ``leaves`` (called inside the graph, traced through)."""
    return _LAYOUTS[key].build(iter(leaves))


def _wanted(node: torch.fx.Node, value: Any) -> Layout | None:
    if not (isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value)):
        return None
    tensor_dict = node.meta.get("tensor_dict") or {}
    if (not tensor_dict.get("_dynamo_static_input_type") or value.requires_grad
            or getattr(node, "_dynamo_source", None) is None):
        return None
    fake = node.meta.get("example_value")
    if fake is None or any(not isinstance(s, int) for s in (*fake.shape, *fake.stride())):
        return None
    layout = layout_of(value)
    # Every inner tensor plain (not an opaque object) and without gradient.
    leaves = [operator.attrgetter(p)(value) for p in layout.paths()]
    if any(not isinstance(x, torch.Tensor) or is_traceable_wrapper_subclass(x) or x.requires_grad for x in leaves):
        return None
    return layout


def flatten_subclass_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Flattened | None:
    """Take the static subclass inputs of Dynamo's graph ``gm`` apart, in place.

    Returns the new example inputs, a function that wraps the compiled graph
    so that it takes Dynamo's arguments, and one that puts ``gm`` back; None
    (``gm`` untouched) when there is nothing to take apart.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return None
    layouts = [_wanted(n, x) for n, x in zip(placeholders, example_inputs)]
    if not any(layouts):
        return None
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables.builder import GraphArg

    new_inputs: list[Any] = []
    getters: list[Callable[[Any], tuple[Any, ...]] | None] = []
    taken: list[tuple[torch.fx.Node, Layout, list[torch.fx.Node]]] = []
    for node, value, layout in zip(placeholders, example_inputs, layouts):
        if layout is None:
            new_inputs.append(value)
            getters.append(None)
            continue
        paths = list(layout.paths())
        get = operator.attrgetter(*paths)
        getters.append(get if len(paths) > 1 else (lambda x, _g=get: (_g(x),)))
        fake = node.meta["example_value"]
        source = node._dynamo_source  # type: ignore[attr-defined]
        static = node.meta["tensor_dict"]["_dynamo_static_input_type"]
        leaves = []
        with gm.graph.inserting_before(node):
            for path in paths:
                leaf = gm.graph.placeholder(f"{node.name}__{path.replace('.', '__')}")
                real, leaf_fake = operator.attrgetter(path)(value), operator.attrgetter(path)(fake)
                # What AOTAutograd reads off a Dynamo placeholder: the fake
                # value, the source (guards on duplicated inputs) and the
                # static mark (CUDA graphs copy every input not marked).
                leaf.meta.update(example_value=leaf_fake, val=leaf_fake,
                                 tensor_dict={"_dynamo_static_input_type": static})
                leaf_source = source
                for part in path.split("."):
                    leaf_source = AttrSource(leaf_source, part)
                leaf._dynamo_source = leaf_source  # type: ignore[attr-defined]
                if "grapharg" in node.meta:
                    leaf.meta["grapharg"] = GraphArg(leaf_source, real, False, leaf_fake)
                leaves.append(leaf)
                new_inputs.append(real)
        taken.append((node, layout, leaves))
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    undo: list[tuple[str, dict[str, Any], Any, torch.fx.Node, list[torch.fx.Node]]] = []
    for node, layout, leaves in taken:
        with gm.graph.inserting_before(first):
            built = gm.graph.call_function(rebuild, (_key(layout), *leaves))
        built.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val", "stack_trace")})
        node.replace_all_uses_with(built)
        undo.append((node.name, dict(node.meta), getattr(node, "_dynamo_source", None), built, leaves))
        gm.graph.erase_node(node)
    gm.recompile()

    def restore() -> None:
        """Put ``gm`` back as Dynamo gave it."""
        for name, meta, source, built, leaves in undo:
            with gm.graph.inserting_before(leaves[0]):
                node = gm.graph.placeholder(name)
            node.meta.update(meta)
            node._dynamo_source = source  # type: ignore[attr-defined]
            built.replace_all_uses_with(node)
            gm.graph.erase_node(built)
            for leaf in leaves:
                gm.graph.erase_node(leaf)
        gm.recompile()

    n_flat = len(new_inputs)
    first = next(i for i, g in enumerate(getters) if g is not None)
    first_cls = layouts[first].cls

    def wrap(compiled: Callable[..., Any]) -> Callable[..., Any]:
        # Dynamo builds the call to the compiled graph from its placeholders
        # after the backend returns (torch 2.11-2.13): each leaf has a source
        # (above), so Dynamo's own bytecode passes the inner tensors and the
        # call goes straight through.  A Dynamo that passes the graph's
        # original arguments gets them taken apart here.
        def call(*args: Any) -> Any:
            if len(args) == n_flat and type(args[first]) is not first_cls:
                return compiled(*args)
            flat: list[Any] = []
            for a, get in zip(args, getters):
                if get is None:
                    flat.append(a)
                else:
                    flat.extend(get(a))
            return compiled(*flat)

        return call

    return Flattened(new_inputs, wrap, restore, len(taken))


@dataclass
class Flattened:
    """What :func:`flatten_subclass_inputs` did: the new example inputs, the
    wrapper for the compiled graph, how to undo it, and how many inputs."""

    example_inputs: list[Any]
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    restore: Callable[[], None]
    count: int
