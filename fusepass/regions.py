"""Replacing part of a graph by a traced function, as a pattern's match is replaced.

:func:`region_match` makes an Inductor ``Match`` of a
:class:`~fusepass.rule.Region` (nodes a rule's ``find`` hook located, or one
node), so that ``Match.replace_by_example`` traces the replacement into the
graph.  :func:`inline_op_nodes` uses it for the fusepass op nodes already in a
graph (the pre-trace path puts ``fusepass::gdn_chunk`` calls there before
Dynamo traces): on CUDA each becomes its inlined launches, as a rule's
replacement does (:func:`fusepass.kernels._common.call`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._inductor.pattern_matcher import Match, MatchContext, PatternExpr

from .kernels._common import inline_forms
from .match import arguments
from .rule import Region


class _RegionOutput(PatternExpr):
    """Stands for one output of a region in the Match built for it."""

    def _match(self, node: Any, ctx: Any) -> Any:  # never matched: the region is given
        raise NotImplementedError


def region_match(graph: torch.fx.Graph, region: Region) -> Match:
    """The region as an Inductor Match, so replacement goes the way a pattern's does."""
    keys = [_RegionOutput() for _ in region.outputs]
    ctx = MatchContext(keys, dict(zip(keys, region.outputs)), graph=graph)
    m = Match(ctx, keys[0])
    m.nodes = list(region.nodes)
    return m


def _op_args(node: torch.fx.Node) -> list[Any]:
    """An op node's arguments in schema order, defaults filled in."""
    got = arguments(node)
    missing = [a.name for a in node.target._schema.arguments if a.name not in got]
    if missing:
        raise TypeError(f"{node.target}: no value for {missing[0]}")
    return list(got.values())


def _packed(node: torch.fx.Node, traced):
    """``traced`` as the one output of the op node it replaces.  An op returning
    a list (``Tensor[]``) returns it as one value, which Inductor's replacement
    then takes apart for the node's ``getitem`` users; returned bare, a list of
    one tensor was matched to the node itself, leaving ``getitem(tensor, 0)``
    (``linear_siblings`` of one weight: Inductor's lowering refused it, and on
    the H200 the whole graph was compiled again without inlining)."""
    returns = node.target._schema.returns
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        return lambda *args: (traced(*args),)
    return traced


def inline_op_nodes(gm: torch.fx.GraphModule) -> tuple[int, list[str]]:
    """Replace each fusepass op node whose inlined form takes its arguments (see
    :func:`fusepass.kernels._common.register_inline`) by that form's launches,
    while :func:`fusepass.kernels._common.inline_kernels` is on.  Returns (how
    many, why any that could not be were not): such a node stays an op call."""
    forms = inline_forms()
    done, failed = 0, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in forms:
            continue
        form = forms[node.target]
        try:
            args = _op_args(node)
            vals = list(torch.fx.map_arg(args, lambda a: a.meta.get("val")))  # (lists of nodes too: Tensor[])
            if not form.ok(*vals):
                continue
            region = Region(form="inline", anchor=node, nodes=[node], outputs=[node], args=args)
            region_match(gm.graph, region).replace_by_example(_packed(node, form.traced), args)
        except Exception as exc:  # noqa: BLE001 - the op call stays, correct and slower
            failed.append(f"{node.name} ({node.target}): {type(exc).__name__}: {exc}".splitlines()[0][:300])
            continue
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done, failed
