"""What a rule's ``check`` sees: the matched inputs and nodes, as fake tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true


@dataclass
class MatchInfo:
    """A structural match of one form of a rule, before it is accepted.

    ``inputs`` maps the search function's argument names to what the graph
    feeds them: an ``fx.Node`` for tensors (and for anything that was a Python
    scalar in the search function but is a tensor in the graph), or the Python
    value itself.
    """

    rule: str
    form: str
    dtype: torch.dtype
    inputs: dict[str, Any]
    nodes: list[torch.fx.Node]
    outputs: list[torch.fx.Node]

    def val(self, name: str) -> Any:
        """The fake tensor (or Python value) for input ``name``."""
        value = self.inputs[name]
        if isinstance(value, torch.fx.Node):
            return value.meta.get("val")
        return value

    def is_node(self, name: str) -> bool:
        return isinstance(self.inputs[name], torch.fx.Node)

    @property
    def output_val(self) -> Any:
        return self.outputs[0].meta.get("val")


def same(a: Any, b: Any) -> bool:
    """Shape/size equality that never specialises a dynamic dimension."""
    return bool(statically_known_true(a == b))


def shape_str(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return "(" + ", ".join(str(s) for s in t.shape) + ")"
    return repr(t)


def hint(v: Any) -> int:
    """A concrete size for a possibly symbolic one, without adding a guard."""
    if isinstance(v, torch.SymInt):
        node = v.node
        h = getattr(node, "hint", None)
        if h is not None:
            return int(h)
        return int(node.shape_env.size_hint(node.expr))
    return int(v)
