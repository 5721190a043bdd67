"""The rule API: what a rewrite rule is, and the registry that holds them.

A rule is the same thing whether fusepass ships it or a user writes it:

- ``forms``: one or more :class:`Form` -- a ``search`` function in plain torch
  (it *is* the reference semantics) and the ``replace`` function that computes
  the same thing with one fused op.  Each form is traced once per dtype in
  ``dtypes`` into an ATen pattern with Inductor's pattern machinery.
- ``example_inputs(dtype)``: small inputs for that trace (scalars named in
  ``scalars`` become wildcards, so ``eps=1e-6`` matches any eps); a form whose
  arguments differ (fewer of them, another rank) brings its own.
- ``check(match)``: ``None`` to accept a structural match, or a short reason
  to refuse it.  Reasons reach the report.
- ``anchor`` / ``explain``: the op that marks a place where the rule *could*
  have applied (``rsqrt`` for RMSNorm).  An anchor left in the graph after
  matching is a near-miss; ``explain(node)`` says why it did not match, or
  returns ``None`` when the place is not an attempt at all.

Rules run in ``priority`` order (higher first): ``add_rms_norm`` must see the
residual add before ``rms_norm`` takes the norm alone, ``rms_norm_gated`` the
whole gated norm before either of them or ``swiglu`` takes a part.

A subgraph whose size depends on the input (a loop Dynamo unrolled, such as
the GDN chunk loop) cannot be one traced pattern.  Such a rule gives ``find``
instead: ``find(gm)`` yields :class:`Region` candidates (the nodes, their
outputs, the replacement's arguments, or a reason to refuse); the engine
still refuses intermediates used outside, reports, and replaces.  Its
``forms`` are then example programs (the reference semantics the tests and
the differential generator compile), not patterns.  ``pretraced`` names the
ops a pre-trace substitution puts in the graph for the rule's subgraph: the
report counts each such node as a hit of form ``pretrace``.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx

from .formats import KERNEL_DTYPES
from .match import MatchInfo

Reason = str | None


@dataclass(frozen=True)
class Form:
    """One source form of a rule: ``search`` (plain torch) and its ``replace``."""

    name: str
    search: Callable[..., Any]
    replace: Callable[..., Any]
    # Inputs for this form's trace where the rule's do not fit it (None: the
    # rule's ``example_inputs``, as many as ``search`` takes).
    example_inputs: Callable[[torch.dtype], Sequence[Any]] | None = None


@dataclass(frozen=True)
class NearMiss:
    """A program the rule must refuse, with a fragment of the expected reason.

    ``fn(*inputs)`` is compiled with fusepass; the rule must not rewrite it,
    the report must carry a refusal containing ``reason`` (unless ``reason`` is
    empty: a program that must simply not match), and the result must equal
    eager.  ``inputs(dtype)`` builds the inputs.
    """

    name: str
    fn: Callable[..., Any]
    inputs: Callable[[torch.dtype], Sequence[Any]]
    reason: str


@dataclass
class Region:
    """A place a rule's ``find`` located: replace ``nodes`` by ``replace(*args)``.

    ``outputs`` are the region's nodes whose users outside it take the
    replacement's outputs, in the order ``replace`` returns them (``None``: an
    output nobody reads).  ``args`` are ``fx.Node`` s or Python values.  A
    ``reason`` refuses the region (the engine reports it at ``anchor``).
    """

    form: str
    anchor: torch.fx.Node
    nodes: list[torch.fx.Node] = field(default_factory=list)
    outputs: list[torch.fx.Node | None] = field(default_factory=list)
    args: list[Any] = field(default_factory=list)
    replace: Callable[..., Any] | None = None
    reason: Reason = None
    names: list[str] = field(default_factory=list)  # of ``args``, for ``check``'s MatchInfo
    # Whether ``find`` has proved every argument of every node means what the
    # replacement computes: by running the region's own nodes against it on
    # random inputs (the GDN finders), or by matching through the engine's
    # guards.  Otherwise the engine refuses a region any of whose nodes
    # carries a keyword argument at other than its default (an ``add`` with
    # ``alpha=2`` that a finder took by its target alone).
    arguments_checked: bool = False


@dataclass(frozen=True)
class Rule:
    name: str
    forms: Sequence[Form]
    example_inputs: Callable[[torch.dtype], Sequence[Any]]
    check: Callable[[MatchInfo], Reason] = lambda m: None
    dtypes: Sequence[torch.dtype] = KERNEL_DTYPES
    scalars: Mapping[str, float] = field(default_factory=dict)
    anchor: Any = None  # an OpOverload, or a tuple of them
    explain: Callable[[torch.fx.Node], Reason] | None = None
    priority: int = 0
    # Ops whose operands commute: each form is also traced with the operands of
    # its *last* such op swapped, since the matcher compares argument order.
    commutative_root: bool = False
    near_misses: Sequence[NearMiss] = ()
    doc: str = ""
    # Inputs for a given shape of the main operand (the search function's first
    # tensor argument; its last dim is the hidden size), used by the
    # differential tests to draw odd, huge and empty sizes.  None: the shapes
    # of ``example_inputs(dtype)``, with every tensor shaped like the main
    # operand taking the new shape and every other tensor whose last dim is the
    # hidden size (a weight) taking the new hidden size.  A dict maps the
    # search functions' argument names to inputs (forms with other arguments).
    sized_inputs: Callable[[torch.dtype, tuple[int, ...]], Sequence[Any] | dict[str, Any]] | None = None
    # The sizes given to ``reshape``/``view`` in the traced patterns match any
    # sizes: one pattern then covers every leading shape flattened around a
    # matmul and every group view of a weight.  ``check`` must prove from the
    # matched values that the reshapes mean what the search function meant.
    any_reshape: bool = False
    # Arguments of the forms that a library kernel behind them reads as packed
    # values whatever their strides (bitsandbytes' absmax): the rule refuses a
    # strided one, and the differential generator expects no rewrite then.
    packed_args: tuple[str, ...] = ()
    # Applied by the differential generator to a form's outputs, in eager and
    # compiled alike, where the model admits several right answers: one
    # representative of them (an MoE router's choice among experts whose
    # weights underflowed to 0, a tie that eager's top-k breaks arbitrarily,
    # or of a token whose scores are all NaN).
    # Traced after the form's own nodes, so it is no part of the pattern.
    canonical: Callable[..., Any] | None = None
    # Rules whose rewrites this rule's finder starts from (its forms are plain
    # torch: those rules make the ops it looks for, as linear_siblings groups
    # the dequantising rules' calls): enabled beside it when its forms are
    # checked alone, and a form's block must be rewritten only where they are.
    builds_on: tuple[str, ...] = ()

    def inputs(self, form: Form, dtype: torch.dtype) -> list[Any]:
        """Example inputs for ``form`` in ``dtype``: one per argument of its ``search`` not in ``scalars``."""
        examples = list((form.example_inputs or self.example_inputs)(dtype))
        wanted = [p for p in inspect.signature(form.search).parameters if p not in self.scalars]
        return examples[:len(wanted)]
    # A region finder instead of traced patterns (see the module docstring).
    find: Callable[[torch.fx.GraphModule], Iterable[Region]] | None = None
    pretraced: tuple[Any, ...] = ()  # OpOverloads a pre-trace substitution emits for this rule

    def sources(self) -> str:
        """Source text of everything that decides what the rule does (for the cache key)."""
        parts = [self.name, repr(sorted(self.scalars.items())), repr(self.dtypes), str(self.priority)]
        parts.append(f"any_reshape={self.any_reshape} builds_on={self.builds_on}")
        for fn in [self.example_inputs, self.check, self.explain, self.find] + [
            f for form in self.forms for f in (form.search, form.replace, form.example_inputs)
        ]:
            if fn is None:
                continue
            try:
                parts.append(inspect.getsource(fn))
            except (OSError, TypeError):
                code = getattr(fn, "__code__", None)
                parts.append(repr(code.co_code) if code is not None else repr(fn))
        return "\n".join(parts)

    def anchors(self) -> tuple[Any, ...]:
        if self.anchor is None:
            return ()
        return self.anchor if isinstance(self.anchor, tuple) else (self.anchor,)


BUILTIN_RULE_MODULES = (
    "fusepass.patterns.moe_router",
    "fusepass.patterns.moe_experts",
    "fusepass.patterns.rms_norm_gated",
    "fusepass.patterns.all_reduce_rms_norm",
    "fusepass.patterns.add_rms_norm",
    "fusepass.patterns.rms_norm",
    "fusepass.patterns.swiglu",
    "fusepass.patterns.geglu",
    "fusepass.patterns.dequant_matmul",
    "fusepass.patterns.dequant_matmul_int4",
    "fusepass.patterns.dequant_matmul_torchao",
    "fusepass.patterns.dequant_matmul_bnb",
    "fusepass.patterns.dequant_matmul_gptq",
    "fusepass.patterns.dequant_matmul_hqq",
    "fusepass.patterns.library_ops",
    "fusepass.patterns.gdn_chunk",
    "fusepass.patterns.gdn_recurrent",
    "fusepass.patterns.causal_conv1d",
    "fusepass.patterns.linear_siblings",
    "fusepass.patterns.linear_one",
    "fusepass.patterns.dequant_matmul_gated",
    "fusepass.patterns.decode_attention",
    "fusepass.patterns.matmul_k1",
)

_lock = threading.Lock()
_rules: dict[str, Rule] = {}
_builtins_loaded = False


def register_rule(rule: Rule, *, replace: bool = False) -> Rule:
    """Add a rule to the registry that every fusepass compile uses.

    Registering a name twice is an error unless ``replace=True``.
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"register_rule takes a fusepass.Rule, got {type(rule).__name__}")
    if not rule.forms and rule.find is None:
        raise ValueError(f"rule {rule.name!r} has no forms and no find")
    with _lock:
        if rule.name in _rules and not replace and _rules[rule.name] is not rule:
            raise ValueError(f"a rule named {rule.name!r} is already registered (pass replace=True)")
        _rules[rule.name] = rule
    return rule


def unregister_rule(name: str) -> None:
    with _lock:
        _rules.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded:
            return
        _builtins_loaded = True
    for module in BUILTIN_RULE_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:  # not written yet in this checkout
                continue
            raise
        register_rule(mod.RULE, replace=True)


def rules() -> list[Rule]:
    """All registered rules, built-ins first loaded lazily, highest priority first."""
    _load_builtins()
    with _lock:
        return sorted(_rules.values(), key=lambda r: -r.priority)


def get_rule(name: str) -> Rule:
    for rule in rules():
        if rule.name == name:
            return rule
    raise KeyError(f"no rule named {name!r}; known: {', '.join(r.name for r in rules())}")
