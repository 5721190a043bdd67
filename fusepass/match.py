"""What a rule's ``check`` sees: the matched inputs and nodes, as fake tensors."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
# Ops that only reshape a tensor (the same elements in the same order).
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default)


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

    def scalar_refusal(self, name: str, like: torch.Tensor) -> str | None:
        """Why input ``name`` (a Python number in the search function) cannot
        go to an op beside ``like``: None for a number, or a 0-dim tensor the
        op reads at run time (:func:`tensor_scalar_refusal`)."""
        if self.is_node(name):
            return tensor_scalar_refusal(name, self.inputs[name], like)
        value = self.val(name)
        return None if isinstance(value, (int, float)) else f"{name} is {type(value).__name__}, not a Python number"

    @property
    def output_val(self) -> Any:
        return self.outputs[0].meta.get("val")


def scalar_input(arg: Any) -> Any:
    """A Python float Dynamo made a graph input, as that input; anything else as it is.

    With ``dynamic=True`` torch does not specialise floats
    (``specialize_float=False``): an eps held in a module attribute or a
    global reaches the post-grad graph as a 0-dim fp64 CPU placeholder,
    converted to fp32 where it is added, and Dynamo does not guard on its
    value.  The rules pass the placeholder itself to the op, which reads it
    when it runs; the ops compute in fp32 (the convert's rounding), and the
    convert, left without users, no longer costs a CPU kernel per call.
    """
    if not (isinstance(arg, torch.fx.Node) and arg.target == torch.ops.prims.convert_element_type.default
            and arg.args[1] == torch.float32):
        return arg
    src = arg.args[0]
    val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if (src.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() == 0
            and val.dtype.is_floating_point and val.device.type == "cpu"):
        return src
    return arg


def tensor_scalar_refusal(name: str, node: torch.fx.Node, like: torch.Tensor) -> str | None:
    """Why ``node`` (what the graph feeds a scalar of the search function, such
    as eps) cannot be a 0-dim tensor an op beside ``like`` reads when it runs;
    None when it can."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return f"{name} is a {type(val).__name__} ({node.name}), not a number or a 0-dim tensor"
    if val.dim() != 0:
        return f"{name} is a tensor of shape {shape_str(val)} ({node.name}), not one number per call"
    if not val.dtype.is_floating_point:
        return f"{name} is a {val.dtype} tensor ({node.name}), not a float"
    if like.device.type == "cuda":
        # The op reads such an eps on CUDA too (the kernel loads a device
        # one, a CPU one is read on the host), but the rules inline their
        # kernels into Inductor's code only for a constant eps, and the op
        # call's host cost at decode sizes has not been measured against
        # Inductor's own norm; a CPU eps would also be read once at a CUDA
        # graph's capture.
        return (f"{name} is a run-time value ({node.name}; dynamic=True does not specialise Python floats): on "
                "CUDA fusepass inlines its kernel only with a constant eps; left to Inductor")
    if val.device != like.device:
        return f"{name} is on {val.device} ({node.name}), the op runs on {like.device}"
    return None  # read by the CPU body when the op runs


def arguments(node: torch.fx.Node) -> dict[str, Any]:
    """An op node's arguments by schema name, in schema order, defaults filled in (an argument with
    neither a value nor a default is left out)."""
    got = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            got[a.name] = node.args[i]
        elif a.name in node.kwargs:
            got[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            got[a.name] = a.default_value
    return got


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


@contextlib.contextmanager
def concrete() -> Iterator[None]:
    """Real tensors inside a compile (a rule's proof on random inputs, verify
    mode): fake mode off, no autograd, and the Python dispatcher off.

    Inductor runs its passes with the Python dispatcher on.  That dispatcher
    resolves the dispatch key of each op overload once and caches it
    (``OpOverload._dispatch_cache``, torch 2.13), and torch does not drop the
    entry when the kernel it names goes away: a ``torch.library`` CPU kernel
    registered over a fusepass op and removed again (``_scoped_library``)
    leaves ``CPU -> CPU`` behind, and the op's next call on CPU tensors under
    that dispatcher jumps through the now empty table slot -- a segfault, not
    an exception.  The C++ dispatcher's own table follows every
    (de)registration, and it is what eager code and the compiled program
    call through at run time.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad(), torch._C._DisablePythonDispatcher():
        yield
