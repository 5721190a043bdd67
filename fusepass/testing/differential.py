"""Differential testing: random programs made of the registered rules' own
building blocks, compiled with fusepass and compared with eager.

A *block* is one rule's ``search`` function (the rule's reference semantics,
plain torch) or one of its declared near-misses, applied to operands drawn at
random, sometimes mutated into a near-miss:

- operands: a plain input, a matmul's output, a sum, or an earlier block's
  output (a residual stream); contiguous, transposed, a slice of wider rows,
  every other row, broadcast rows (stride 0), a broadcasting shape; another
  float dtype than the block's (mixed dtypes);
- sizes: hidden 0, 1, 7, 33, 4097, 65537, ...; leading dims (), (0,), (3,), (2, 3), ...;
- dtypes fp32/fp16/bf16 and fp64 (which must be refused or be correct);
- values: NaN, +Inf or -Inf in the main operand;
- scalars (eps) as Python numbers or as 0-d tensors (inputs, or computed in
  the graph), which the ops read when they run;
- mutations of the traced ATen graph of ``search``: an intermediate returned
  or used by another op, a reduction over another dim or without keepdim, a
  constant changed, an extra rounding, the operands of a commutative op swapped.

A *program* chains 5-10 blocks (one Dynamo graph, one Inductor compile) with
the ops real models put around them: matmuls, adds, pointwise ops.  Blocks
come from :func:`fusepass.rules`, so a rule registered later joins without a
change here; a rule whose example inputs cannot be resized by the default
(see ``Rule.sized_inputs``) declares how: the GDN rules map the drawn
``(*leading, hidden)`` to a batch, a sequence of one to three chunks and a
head size, and their forms (with their near-misses: another decay, no beta,
the state not carried, the keys scaled) become GDN programs.

Every program is compiled with fusepass (``fullgraph=True``, after
``torch._dynamo.reset()``) and checked against eager within the dtype table
(``TOLERANCES``, taken for the least precise dtype a value went through):

- *step by step*: each step re-run eagerly on the compiled program's own
  values for its inputs, so that one rewrite is judged on its own rounding;
- *end to end*: each value the program returns against the eager program on
  the same inputs (see :func:`_mismatches` for the one allowance, measured);
- its inputs are left as they were;

and its report: every refusal carries a reason, no rule failed to trace or
crashed in ``check``, no kernel fell back, and at least as many rewrites as
blocks that nothing prevents from being rewritten (a form, unmutated, its
scalars numbers, its operands in its own dtype and shapes, any layout, in one
of the rule's dtypes).  A mismatch or a failed compile is
re-run with every rule disabled: where plain Inductor disagrees with eager
the same way it is Inductor's, reported apart.  With ``triton=True`` (drawn
for some programs) the ops' CUDA implementations serve CPU tensors,
so their Triton kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels._common import clear_kernel_fallbacks, interpreting, kernel_fallbacks, loosest, tolerance
from ..report import RewriteReport, last_report, reset_reports
from ..rule import Rule, rules

aten = torch.ops.aten

# -- what a program is made of ---------------------------------------------------

MUTATIONS = ("returned", "reused", "reduction_dim", "keepdim_off", "constant", "extra_cast", "swap")
SOURCES = ("leaf", "matmul", "add", "chain")
LAYOUTS = ("contiguous", "transposed", "sliced", "strided", "expanded", "broadcast")
AFTER = ("", "matmul", "add", "relu", "scale")
SPECIALS = ("", "nan", "inf", "-inf")
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Hidden sizes: odd ones (masking), one past a power of two (one more block
# or chunk), empty; 65537 is the looped kernel's one-past-a-power-of-two.
HIDDEN = (0, 1, 7, 16, 33, 64, 128, 4097)
LARGE_HIDDEN = (65537,)
LEADING = ((), (0,), (1,), (2,), (3,), (5,), (8,), (2, 3), (3, 1), (1, 4))
# Leading dims for large rows: the CPU time of a program stays under a second.
LEADING_LARGE = ((), (1,), (2,))
MATMUL_K = 8


@dataclass(frozen=True)
class Operand:
    source: str = "leaf"  # SOURCES
    layout: str = "contiguous"  # LAYOUTS (of a leaf)
    dtype: torch.dtype | None = None  # another dtype than the block's (not for the main operand)


@dataclass(frozen=True)
class BlockSpec:
    rule: str
    kind: str  # "form" or "near-miss"
    name: str  # the form's or the near-miss's name
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] = (4, 16)  # of the main operand; its last dim is the hidden size
    scalar: float = 1e-6  # the value of every scalar the rule names (eps)
    scalar_as_tensor: bool = False
    operands: tuple[Operand, ...] = (Operand(),)  # per tensor operand, cycled
    mutation: str = ""  # "" or one of MUTATIONS
    pick: int = 0  # which node a mutation applies to, which earlier value a chain takes
    special: str = ""  # SPECIALS, in the main operand
    after: str = ""  # AFTER, applied to the block's first output

    @property
    def label(self) -> str:
        return f"{self.rule}/{self.name}" if self.kind == "form" else f"{self.rule}/near-miss:{self.name}"


@dataclass(frozen=True)
class ProgramSpec:
    blocks: tuple[BlockSpec, ...]
    seed: int = 0
    triton: bool = False  # on CPU: run the ops' Triton kernels (interpreted) instead of their torch bodies


def catalogue(only: Sequence[str] | None = None) -> list[tuple[str, str, str]]:
    """(rule, kind, name) of every form and near-miss of every registered rule (or of the rules ``only`` names)."""
    out = []
    for rule in rules():
        if only is not None and rule.name not in only:
            continue
        out += [(rule.name, "form", f.name) for f in rule.forms]
        out += [(rule.name, "near-miss", nm.name) for nm in rule.near_misses]
    return out


def catalogue_programs(per_program: int = 8, dtype: torch.dtype = torch.float32) -> list[ProgramSpec]:
    """Programs that between them hold every form and near-miss once, plain:
    the explicit examples of a run, so that every one takes part whatever is drawn."""
    blocks = [BlockSpec(rule, kind, name, dtype=dtype, shape=(3, 33)) for rule, kind, name in catalogue()]
    return [ProgramSpec(tuple(blocks[i:i + per_program]), seed=i) for i in range(0, len(blocks), per_program)]


# -- hypothesis strategies -------------------------------------------------------

def strategies(large: bool = True, min_blocks: int = 5, max_blocks: int = 10, only: Sequence[str] | None = None):
    """The Hypothesis strategy of programs over the rules registered now (or the rules ``only`` names)."""
    from hypothesis import strategies as st

    kinds = catalogue(only)
    # A region rule (``Rule.find``: the GDN loops) compiles ~10x the nodes of a
    # norm or an activation: its forms are drawn a quarter as often.
    finders = {r.name for r in rules() if r.find is not None}
    forms = [k for k in kinds if k[1] == "form" for _ in range(1 if k[0] in finders else 4)]
    misses = [k for k in kinds if k[1] == "near-miss"] or forms
    hidden = HIDDEN + (LARGE_HIDDEN if large else ())

    @st.composite
    def shapes(draw):
        h = draw(st.sampled_from(hidden))
        lead = draw(st.sampled_from(LEADING_LARGE if h > 4096 else LEADING))
        return (*lead, h)

    operand = st.builds(
        Operand,
        source=st.sampled_from(("leaf", "leaf", "leaf", "matmul", "add", "chain", "chain")),
        layout=st.sampled_from(("contiguous",) * 4 + LAYOUTS[1:]),
        dtype=st.sampled_from((None,) * 5 + FLOATS[:3]),
    )

    @st.composite
    def block(draw):
        rule, kind, name = draw(st.sampled_from(forms) if draw(st.integers(0, 4)) else st.sampled_from(misses))
        return BlockSpec(
            rule=rule, kind=kind, name=name,
            dtype=draw(st.sampled_from((torch.float32, torch.float32, torch.float16, torch.bfloat16,
                                        torch.bfloat16, torch.float64))),
            shape=draw(shapes()),
            scalar=draw(st.sampled_from((1e-6, 1e-5, 1e-6, 3e-3, 0.25))),
            scalar_as_tensor=draw(st.integers(0, 9)) == 0,
            operands=tuple(draw(st.lists(operand, min_size=4, max_size=4))),
            mutation=draw(st.sampled_from(("",) * 6 + MUTATIONS)),
            pick=draw(st.integers(0, 63)),
            special=draw(st.sampled_from(("",) * 9 + SPECIALS[1:])),
            after=draw(st.sampled_from(AFTER + ("",) * 2)),
        )

    return st.builds(
        ProgramSpec,
        blocks=st.lists(block(), min_size=min_blocks, max_size=max_blocks).map(tuple),
        seed=st.integers(0, 2**31 - 1),
        triton=st.integers(0, 3).map(lambda i: i == 0),
    )


# -- building a program ------------------------------------------------------------

Ref = tuple[str, int]  # ("a", i): the program's i-th input; ("v", j): the j-th value computed


@dataclass
class Step:
    fn: Callable[..., tuple[torch.Tensor, ...]]
    ins: tuple[Ref, ...]
    outs: tuple[int, ...]
    text: str
    checked: bool  # its outputs are returned and compared (views of inputs are not)
    # The least precise float dtype the step computes in (inputs, intermediates,
    # outputs): an fp64 output of an fp32 computation is compared as fp32.
    precision: torch.dtype = torch.float64
    # An absolute error any order of summation may make: see _Dtypes.
    floor: float = 0.0


@dataclass
class BuiltBlock:
    spec: BlockSpec  # what was built (a drawn variant that was not a valid program is simplified)
    drawn: BlockSpec
    must_rewrite: bool  # nothing about it stops its rule: it must be rewritten
    shape: tuple[int, ...] = ()  # of the main operand
    features: tuple[str, ...] = ()  # what it exercises: layouts, sources, mixed dtypes, special values


@dataclass
class Program:
    spec: ProgramSpec
    args: list[torch.Tensor]
    steps: list[Step]
    eager: dict[int, torch.Tensor]  # every value, from the eager run
    returned: list[int]
    blocks: list[BuiltBlock]
    dropped: list[str]  # drawn variants that were not valid programs
    precision: dict[int, torch.dtype]  # per value: the least precise dtype of every step it depends on
    scale: dict[int, float]  # per value: the largest finite magnitude of every value it depends on
    floor: dict[int, float]  # per value: the largest summation-order error floor of every step it depends on

    def fn(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        steps, returned = self.steps, self.returned

        def program(*args):
            vals: dict[int, torch.Tensor] = {}
            for step in steps:
                ins = [args[i] if k == "a" else vals[i] for k, i in step.ins]
                for j, out in zip(step.outs, step.fn(*ins)):
                    vals[j] = out
            return tuple(vals[j] for j in returned)

        return program

    def listing(self) -> str:
        """The program as text; ``build(spec)`` with the spec it shows rebuilds it exactly."""
        lines = [f"program seed={self.spec.seed} triton={self.spec.triton}", f"  spec: {self.spec!r}"]
        for i, a in enumerate(self.args):
            lines.append(f"  a{i}: {_tstr(a)} stride={tuple(a.stride())}")
        lines += [f"  {s.text}" for s in self.steps]
        lines.append("  return " + ", ".join(f"v{j}" for j in self.returned))
        return "\n".join(lines)


def _tstr(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    return repr(t)


def _flat(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(t for o in out for t in _flat(o))
    raise TypeError(f"a block returned {type(out).__name__}, not tensors")


def _random(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point:
        t = torch.randn(tuple(shape), generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        return t.to(dtype=dtype, device=device)
    if dtype == torch.bool:
        return (torch.rand(tuple(shape), generator=gen) > 0.5).to(device)
    low = 0 if dtype == torch.uint8 else -8
    return torch.randint(low, low + 16, tuple(shape), generator=gen, dtype=dtype).to(device)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def default_sized_inputs(rule: Rule, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Any]:
    """``rule.example_inputs(dtype)`` resized: tensors shaped like the main
    operand (the first tensor) take ``shape``, other tensors whose last dim is
    the hidden size take the new hidden size.  Tensors come back as
    meta tensors (shape and dtype only); anything else as it is."""
    examples = list(rule.example_inputs(dtype))
    main = next(t for t in examples if isinstance(t, torch.Tensor))
    hidden = main.shape[-1] if main.dim() else None
    out: list[Any] = []
    for t in examples:
        if not isinstance(t, torch.Tensor):
            out.append(t)
        elif t.shape == main.shape:
            out.append(torch.empty(shape, dtype=t.dtype, device="meta"))
        elif t.dim() and t.shape[-1] == hidden:
            out.append(torch.empty((*t.shape[:-1], shape[-1]), dtype=t.dtype, device="meta"))
        else:
            out.append(t)
    return out


class _Invalid(Exception):
    """A drawn variant that does not make a valid eager program."""


class _Builder:
    def __init__(self, spec: ProgramSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.gen = torch.Generator().manual_seed(spec.seed)
        self.args: list[torch.Tensor] = []
        self.steps: list[Step] = []
        self.vals: dict[int, torch.Tensor] = {}
        self.precision: dict[int, torch.dtype] = {}  # per value, over every step it depends on
        self.scale: dict[int, float] = {}  # per value: the largest finite magnitude of every value it depends on
        self.floor: dict[int, float] = {}  # per value: the summation-order error floor it inherits
        self.chainable: list[int] = []  # values later blocks may take as operands
        self.blocks: list[BuiltBlock] = []
        self.layout = "contiguous"
        self.dropped: list[str] = []

    # values and steps

    def value(self, ref: Ref) -> torch.Tensor:
        return self.args[ref[1]] if ref[0] == "a" else self.vals[ref[1]]

    def leaf(self, value: torch.Tensor) -> Ref:
        self.args.append(value)
        return ("a", len(self.args) - 1)

    def step(self, fn: Callable[..., Any], ins: Sequence[Ref], text: str, checked: bool = True) -> list[Ref]:
        values = [self.value(r) for r in ins]
        try:
            with _Dtypes() as seen:
                out = _flat(fn(*values))
        except Exception as exc:  # noqa: BLE001 - eager refuses the variant
            raise _Invalid(f"{text}: {type(exc).__name__}: {exc}") from exc
        precision = loosest([*seen.dtypes, *(t.dtype for t in (*values, *out))]
                            + [self.precision[r[1]] for r in ins if r[0] == "v"], default=torch.float64)
        scale = max([_magnitude(t) for t in (*values, *out)] + [self.scale[r[1]] for r in ins if r[0] == "v"],
                    default=0.0)
        floor = seen.floor(precision)
        floor = max([floor] + [self.floor[r[1]] for r in ins if r[0] == "v"])
        first = len(self.vals)
        outs = tuple(range(first, first + len(out)))
        for j, t in zip(outs, out):
            self.vals[j] = t
            self.precision[j] = precision
            self.scale[j] = scale
            self.floor[j] = floor
        names = ", ".join(f"v{j}" for j in outs)
        args = ", ".join(f"{k}{i}" for k, i in ins)
        self.steps.append(Step(lambda *a, _fn=fn: _flat(_fn(*a)), tuple(ins), outs,
                               f"{names} = {text.format(args=args)}", checked, loosest(
                                   [*seen.dtypes, *(t.dtype for t in (*values, *out))], default=torch.float64),
                               seen.floor(precision)))
        return [("v", j) for j in outs]

    def snapshot(self) -> tuple[int, int, int, int]:
        return len(self.args), len(self.steps), len(self.vals), len(self.chainable)

    def restore(self, snap: tuple[int, int, int, int]) -> None:
        a, s, v, c = snap
        del self.args[a:], self.steps[s:], self.chainable[c:]
        for j in [j for j in self.vals if j >= v]:
            del self.vals[j], self.precision[j], self.scale[j], self.floor[j]

    # operands

    def random_leaf(self, shape: Sequence[int], dtype: torch.dtype, layout: str = "contiguous",
                    special: str = "", value: torch.Tensor | None = None) -> Ref:
        shape = tuple(shape)
        r = len(shape)
        if layout == "transposed" and r >= 2:
            base_shape, view, text = (*shape[:-2], shape[-1], shape[-2]), (lambda t: t.transpose(-1, -2)), \
                "{args}.transpose(-1, -2)"
        elif layout == "sliced" and r >= 1:
            n = shape[-1]
            base_shape, view, text = (*shape[:-1], n + 3), (lambda t: t[..., :n]), f"{{args}}[..., :{n}]"
        elif layout == "strided" and r >= 1:
            base_shape, view, text = (2 * shape[0], *shape[1:]), (lambda t: t[::2]), "{args}[::2]"
        elif layout == "expanded" and r >= 1 and shape[0] != 1:
            base_shape, view, text = (1, *shape[1:]), (lambda t: t.expand(shape)), f"{{args}}.expand{shape}"
        else:
            base_shape, view, text, layout = shape, None, "", "contiguous"
        self.layout = layout  # the one applied
        if value is None or view is not None or value.dtype != dtype:
            value = _random(base_shape, dtype, self.gen, self.device)
        else:
            value = value.to(self.device)
        if special and dtype.is_floating_point and value.numel():
            flat = value.view(-1)
            flat[int(torch.randint(0, flat.numel(), (), generator=self.gen))] = float(special)
        ref = self.leaf(value)
        if view is None:
            return ref
        return self.step(view, [ref], text, checked=False)[0]

    def operand(self, op: Operand, shape: tuple[int, ...], dtype: torch.dtype, value: torch.Tensor | None,
                special: str, pick: int) -> tuple[Ref, str]:
        """The operand and the source it came from (a chain without an earlier value of its kind is a leaf)."""
        if op.source == "chain":
            fits = [j for j in self.chainable if self.vals[j].shape == shape and self.vals[j].dtype == dtype]
            if fits:
                return ("v", fits[-1 - pick % min(3, len(fits))]), "chain"
        if op.source == "matmul" and shape and dtype in FLOATS:
            a = self.random_leaf((*shape[:-1], MATMUL_K), dtype, special=special)
            w = self.leaf(_random((MATMUL_K, shape[-1]), dtype, self.gen, self.device) / math.sqrt(MATMUL_K))
            return self.step(torch.matmul, [a, w], "matmul({args})")[0], "matmul"
        if op.source == "add" and dtype in FLOATS:
            a = self.random_leaf(shape, dtype, op.layout, special=special)
            b = self.random_leaf(shape, dtype)
            return self.step(torch.add, [a, b], "add({args})")[0], "add"
        return self.random_leaf(shape, dtype, op.layout, special=special, value=value), "leaf"

    # blocks

    def block(self, b: BlockSpec) -> None:
        plain_ops = tuple(Operand() for _ in b.operands)
        attempts = [
            b,
            replace(b, operands=plain_ops, scalar_as_tensor=False),
            replace(b, mutation=""),
            replace(b, mutation="", operands=plain_ops, scalar_as_tensor=False, after=""),
        ]
        snap = self.snapshot()
        for i, attempt in enumerate(attempts):
            try:
                self._block(attempt, b)
                return
            except _Invalid as exc:
                self.restore(snap)
                if i == len(attempts) - 1:
                    raise RuntimeError(f"block {b.label} is not a valid program even plain: {exc}") from exc
                self.dropped.append(f"{b.label}: {exc}".splitlines()[0][:200])

    def _block(self, b: BlockSpec, drawn: BlockSpec) -> None:
        rule = next(r for r in rules() if r.name == b.rule)
        shape = b.shape
        if b.mutation == "keepdim_off" and len(shape) >= 2:
            # A row statistic without keepdim broadcasts along rows: a square input keeps it valid.
            shape = (shape[-1], shape[-1]) if shape[-1] <= 128 else (shape[-1],)
        seed = int(torch.randint(0, 2**31 - 1, (), generator=self.gen))
        if b.kind == "near-miss":
            nm = next(n for n in rule.near_misses if n.name == b.name)
            fn = nm.fn
            with _seeded(seed):
                raw = list(nm.inputs(b.dtype))
            scalars: dict[str, Any] = {}
            argnames = [f"arg{i}" for i in range(len(raw))]
        else:
            form = next(f for f in rule.forms if f.name == b.name)
            fn = form.search
            argnames = list(inspect.signature(fn).parameters)
            if rule.sized_inputs is not None:
                with _seeded(seed):
                    sized = rule.sized_inputs(b.dtype, shape)
                # A mapping names the inputs: forms whose arguments differ take theirs.
                raw = [sized[n] for n in argnames if n not in rule.scalars] if isinstance(sized, dict) \
                    else list(sized)
            else:
                raw = default_sized_inputs(rule, b.dtype, shape)
            scalars = {name: b.scalar for name in rule.scalars}
            if b.scalar_as_tensor and scalars and not _traces_with_tensor_scalars(
                    form.search, tuple(rule.scalars), rule.example_inputs):
                raise _Invalid(f"{b.label}: Dynamo cannot trace it with its scalars as tensors")

        # Operands, in the order of the search function's arguments.
        template: list[tuple[str, Any]] = []  # ("t", None): the next tensor operand; ("c", value)
        ins: list[Ref] = []
        mixed = False  # an operand in another dtype than the rule's inputs give it
        stored_strided = False  # a stored (integer, fp8) weight not in its own layout
        broadcast = False
        features: list[str] = []
        it = iter(raw)
        n_tensor = 0
        main_shape: tuple[int, ...] | None = None
        for name in argnames:
            if name in scalars:
                if b.scalar_as_tensor:
                    template.append(("t", None))
                    if b.pick % 2:  # computed in the graph, not an input
                        leaf = self.leaf(torch.tensor(2 * b.scalar, dtype=torch.float32, device=self.device))
                        ins.append(self.step(_scale, [leaf], "{args} * 0.5", checked=False)[0])
                        features.append("scalar computed")
                    else:
                        ins.append(self.leaf(torch.tensor(b.scalar, dtype=torch.float32, device=self.device)))
                else:
                    template.append(("c", b.scalar))
                continue
            item = next(it)
            if not isinstance(item, torch.Tensor):
                template.append(("c", item))
                continue
            op = b.operands[n_tensor % len(b.operands)]
            is_main = n_tensor == 0
            n_tensor += 1
            dtype, tshape = item.dtype, tuple(item.shape)
            if is_main:
                main_shape = tshape
            elif op.dtype is not None and dtype in FLOATS:
                dtype = op.dtype
            if op.layout == "broadcast" and not is_main and tshape:
                tshape = (*(1,) * (len(tshape) - 1), tshape[-1]) if tshape == main_shape else (1, *tshape)
                broadcast = True
            value = item if item.device.type != "meta" else None
            ref, source = self.operand(op, tshape, dtype, value, b.special if is_main else "", b.pick)
            ins.append(ref)
            mixed |= dtype != item.dtype
            features.append(f"source {source}")
            if source == "leaf" and self.layout != "contiguous":
                features.append(f"layout {self.layout}")
                # Kernels read float operands at any stride; packed weights only as stored.
                stored_strided |= dtype not in FLOATS
            if tshape != tuple(item.shape):
                features.append("layout broadcast")
            if dtype != item.dtype:
                features.append("mixed dtypes")
            template.append(("t", None))

        call = functools.partial(_call, fn, tuple(template))
        text = f"{b.label}[{str(b.dtype).replace('torch.', '')}]({{args}}"
        text += "".join(f", {k}={v!r}" for k, v in scalars.items() if not b.scalar_as_tensor) + ")"
        mutated = ""
        if b.mutation:
            gm, mutated = _mutate(call, [self.value(r) for r in ins], b.mutation, b.pick)
            call = gm
            text += f"  # {mutated}"
        outs = self.step(call, ins, text)
        must = (b.kind == "form" and not b.mutation and not b.scalar_as_tensor and not broadcast
                and b.dtype in rule.dtypes and not mixed and not stored_strided)
        if stored_strided:
            features.append("stored weight strided")
        if b.special:
            features.append(f"value {b.special}")
        if b.scalar_as_tensor and b.kind == "form" and rule.scalars:
            features.append("scalar as tensor")
        if 0 in (main_shape or ()):
            features.append("empty")
        built = BuiltBlock(b, drawn, must, main_shape or (), tuple(dict.fromkeys(features)))
        first = self.value(outs[0])
        self.chainable += [j for _, j in outs if self.vals[j].dtype.is_floating_point]
        if b.after and first.dim() >= 1 and first.dtype.is_floating_point:
            self._after(b.after, outs[0], first)
        self.blocks.append(built)

    def _after(self, kind: str, ref: Ref, val: torch.Tensor) -> None:
        if kind == "matmul":
            n = val.shape[-1]
            w = self.leaf(_random((n, MATMUL_K), val.dtype, self.gen, self.device) / math.sqrt(max(n, 1)))
            out = self.step(torch.matmul, [ref, w], "matmul({args})")
        elif kind == "add":
            other = self.random_leaf(tuple(val.shape), val.dtype)
            out = self.step(torch.add, [ref, other], "add({args})")
        elif kind == "relu":
            out = self.step(torch.relu, [ref], "relu({args})")
        else:
            out = self.step(_scale, [ref], "{args} * 0.5")
        self.chainable.append(out[0][1])


# Unit roundoff per dtype, for the summation floor below.
_UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


class _Dtypes(TorchDispatchMode):
    """The float dtypes every op computes in, and the size of its contractions.

    A matmul's K-term sums come out differently in another order (a blocked
    kernel, a scale applied before the sum or after it) by about the unit
    roundoff times sum_k |a_k b_k|, whatever the output: where the terms
    cancel, that is far above the table's atol.  A seeded run measured 0.131
    on an fp32 quantized linear with K = 65537 (sum |a b| ~ 5e6, u * that =
    0.3).  ``floor`` gives four units of roundoff of the largest such sum; a
    wrong weight, scale or group is off by the output's own magnitude.
    """

    _CONTRACTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()
        self.terms = 0.0  # the largest sum_k |a_k b_k| of any contraction

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.dtypes.add(t.dtype)
        if func in self._CONTRACTIONS:
            a, b = args[-2], args[-1]
            if a.numel() and b.numel() and a.dtype.is_floating_point:
                sums = torch.nan_to_num(a.double().abs(), posinf=0.0) @ torch.nan_to_num(b.double().abs(), posinf=0.0)
                self.terms = max(self.terms, sums.max().item())
        return out

    def floor(self, precision: torch.dtype) -> float:
        return 4 * _UNIT_ROUNDOFF.get(precision, 2.0**-8) * self.terms


def _magnitude(t: torch.Tensor) -> float:
    if not t.dtype.is_floating_point or not t.numel():
        return 0.0
    finite = t[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


@functools.lru_cache(maxsize=None)
def _traces_with_tensor_scalars(search: Callable[..., Any], scalars: tuple[str, ...],
                                example_inputs: Callable[[torch.dtype], Sequence[Any]]) -> bool:
    """Whether Dynamo traces the form with its scalars passed as 0-d tensors.

    ``F.rms_norm(x, s, w, eps=tensor)`` runs in eager but not under
    ``torch.compile`` at all (``eps`` becomes a data-dependent float Dynamo
    cannot guard on), with or without fusepass: such a program would test
    nothing.  Asked once per form, Dynamo only (~0.1 s).
    """
    fn = functools.partial(search, **{n: torch.tensor(1e-6) for n in scalars})
    try:
        torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)(*example_inputs(torch.float32))
    except Exception:  # noqa: BLE001
        return False
    finally:
        torch._dynamo.reset()
    return True


def _call(fn: Callable[..., Any], template: tuple[tuple[str, Any], ...], *tensors: torch.Tensor) -> Any:
    it = iter(tensors)
    return fn(*[next(it) if kind == "t" else value for kind, value in template])


def _scale(t: torch.Tensor) -> torch.Tensor:
    return t * 0.5


def build(spec: ProgramSpec, device: str | torch.device = "cpu") -> Program:
    """Build ``spec`` and run it eagerly; drawn variants eager rejects are simplified."""
    from . import single_rank_group

    single_rank_group()  # blocks of all_reduce_rms_norm hold a collective
    b = _Builder(spec, torch.device(device))
    for block in spec.blocks:
        b.block(block)
    returned = [j for s in b.steps if s.checked for j in s.outs]
    return Program(spec, b.args, b.steps, dict(b.vals), returned, b.blocks, b.dropped, dict(b.precision),
                   dict(b.scale), dict(b.floor))


# -- mutations of the traced search function ------------------------------------------

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


# -- the Triton kernels on CPU --------------------------------------------------------------

def op_names() -> list[str]:
    """Every op under ``torch.ops.fusepass``."""
    return sorted(name for name in dir(torch.ops.fusepass)
                  if isinstance(getattr(torch.ops.fusepass, name, None), torch._ops.OpOverloadPacket))


def cuda_impl(op: str) -> Callable[..., Any]:
    """The CUDA implementation (the Triton launcher) registered for ``fusepass::op``."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"fusepass::{op}")
    if opdef is None or "cuda" not in opdef._backend_fns:
        raise LookupError(f"fusepass::{op} has no CUDA implementation registered with torch.library.custom_op")
    return opdef._backend_fns["cuda"]


@contextlib.contextmanager
def triton_on_cpu(ops: Sequence[str] | None = None) -> Iterator[None]:
    """Serve the ops (default: all) on CPU tensors with their CUDA implementations.

    With ``TRITON_INTERPRET=1`` set before the kernels were decorated, that
    runs the Triton kernels under the interpreter, through the same launcher
    and fallback a GPU takes; compiled programs reach them through the
    dispatcher as they reach the CPU bodies.
    """
    if not interpreting():
        raise RuntimeError("triton_on_cpu needs TRITON_INTERPRET=1 set before fusepass is imported")
    with scoped_impls({op: cuda_impl(op) for op in ops or op_names()}, "CPU"):
        yield


def _uncache_dispatch(ops: Sequence[str]) -> None:
    for op in ops:
        packet = getattr(torch.ops.fusepass, op)
        for name in packet.overloads():
            cache = getattr(getattr(packet, name), "_dispatch_cache", None)
            if cache is not None:
                cache.clear()


@contextlib.contextmanager
def scoped_impls(impls: dict[str, Callable[..., Any]], key: str = "CPU") -> Iterator[None]:
    """Register ``impls`` (op name -> function) for fusepass ops under dispatch
    ``key`` for the duration.

    ``torch.library._scoped_library`` removes the kernels on exit, but not
    what the Python dispatcher (on in every Inductor compile) cached about
    them: each op overload keeps the key a call resolved to
    (``OpOverload._dispatch_cache``).  A call under the override caches
    ``CPU -> CPU``; after the override is gone, the next such call on CPU
    tensors jumps through the empty CPU slot and the process dies (a rule's
    verify in a later compile did, after tests/test_ops.py).  A call before the
    override caches ``CPU -> CompositeExplicitAutograd``, and that dispatcher
    then never sees the override.  The caches of the ops named are cleared
    once the override is in place and again once it is gone.
    """
    try:
        with torch.library._scoped_library("fusepass", "IMPL") as lib:
            for op, fn in impls.items():
                lib.impl(op, fn, key)
            _uncache_dispatch(list(impls))
            yield
    finally:
        _uncache_dispatch(list(impls))


# -- running and checking ---------------------------------------------------------------------

@dataclass
class Outcome:
    program: Program
    report: RewriteReport | None
    failures: list[str]  # fusepass's: each one a mismatch or a broken report
    inductor: list[str]  # plain Inductor disagrees with eager the same way (not counted against fusepass)
    seconds: float


def _compare(actual: torch.Tensor, expected: torch.Tensor, precision: torch.dtype, scale: float = 1.0,
             floor: float = 0.0) -> str | None:
    """``None`` if ``actual`` is ``expected`` within the table for ``precision``
    (atol scaled by ``scale``, see _mismatches, and at least ``floor``, see
    _Dtypes), else what differs."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{_tstr(actual)} vs {_tstr(expected)}"
    tol = tolerance(loosest([precision, expected.dtype], default=torch.float64))
    if expected.dtype.is_floating_point:
        # At the edge of the dtype's range one rounding more or less is the
        # difference between the largest finite value and an infinity (an fp16
        # product of K = 65537 terms: 65504 fused where eager's two roundings
        # gave inf).  An infinity against a finite value of the same sign
        # within the table of the largest finite one is that, not an error.
        edge = torch.finfo(expected.dtype).max * (1 - 2 * tol.rtol)
        both = torch.isinf(actual) ^ torch.isinf(expected)
        near = both & (torch.sign(actual) == torch.sign(expected)) & (torch.minimum(
            actual.double().abs(), expected.double().abs()) >= edge)
        if near.any():
            actual = torch.where(near, expected, actual)
    try:
        torch.testing.assert_close(actual, expected, atol=max(tol.atol * max(1.0, scale), floor), rtol=tol.rtol,
                                   equal_nan=True)
    except AssertionError as exc:
        finite = torch.isfinite(expected) & torch.isfinite(actual)
        err = (actual.double() - expected.double())[finite].abs().max().item() if finite.any() else float("nan")
        first = str(exc).strip().splitlines()
        return f"max abs error {err:.3g} ({'; '.join(first[:2])})"
    return None


# Inductor settings for the programs:
# - the FX graph cache off: random programs never hit it, the pass runs every
#   time and nothing piles up on disk;
# - emulate_precision_casts: by default Inductor keeps fused intermediates in
#   fp32 where eager rounds them to bf16/fp16; plain Inductor then disagreed
#   with eager beyond the table in 15 of 20 seeded programs (errors up to
#   0.047), and an output plain Inductor gets wrong cannot be charged to
#   fusepass.  With emulation: 0 of 20 (fp64 outputs of fp32 work aside, see
#   Step.precision);
# - scalar C++ kernels (simdlen 1): C++ compilation is most of a program's
#   time on CPU; vector kernels took 12% longer to build (61 s against 54 s
#   for 8 programs, cold cache, 2 cores).  fusepass's rewrites do not depend
#   on it.
INDUCTOR_CONFIG: dict[str, Any] = {"fx_graph_cache": False, "emulate_precision_casts": True, "cpp.simdlen": 1}


def _compile_run(program: Program, options: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], RewriteReport]:
    torch._dynamo.reset()
    reset_reports()
    compiled = torch.compile(program.fn(), backend="fusepass", options=options, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(INDUCTOR_CONFIG):
        out = compiled(*program.args)
    return out, last_report()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def _mismatches(program: Program, out: Sequence[torch.Tensor]) -> list[str]:
    """Step by step (each step on the compiled values of its inputs), then end to end.

    End to end, a value computed in bf16/fp16 downstream of a rewrite may
    differ from eager by more than the table without anything being wrong: the
    fused op rounds once where eager rounds twice (one ulp of its output), and
    a later add that cancels (y + r with y ~ -r) keeps that absolute
    difference while the sum shrinks.  A 150-program run measured 0.0625 (one
    bf16 ulp at 8..16) on sums of magnitude ~0.1, against atol 0.016.  Such
    values get the table's atol scaled by the largest magnitude that flows
    into them (two ulps of it); the step-by-step check, which sees each
    rewrite on its own inputs, keeps the table as it is.

    A step whose eager run overflows in an intermediate (an fp16 matmul's
    result beyond 65504, scaled back into range after) gives an infinity
    where the fused op, which keeps the intermediate in fp32, gives the
    finite value: the step is then held to its own computation in fp64, and
    the values that depend on it are not compared end to end with eager.
    """
    found = []
    got = dict(zip(program.returned, out))
    env: dict[int, torch.Tensor] = {}
    overflowed: set[int] = set()
    for step in program.steps:
        ins = [program.args[i] if k == "a" else env[i] for k, i in step.ins]
        if any(k != "a" and i in overflowed for k, i in step.ins):
            overflowed.update(step.outs)
        ref = step.fn(*ins)
        for j, r in zip(step.outs, ref):
            if step.checked:
                err = _compare(got[j], r, step.precision, floor=step.floor)
                if err and _eager_overflowed(step, ins, got[j], r, list(step.outs).index(j)):
                    overflowed.add(j)
                    err = None
                if err:
                    found.append(f"v{j} step ({step.text.split(' = ', 1)[1][:80]}): {err}")
                env[j] = got[j]
            else:
                env[j] = r
    for j in program.returned:
        if j in overflowed:
            continue
        half = program.precision[j] in (torch.float16, torch.bfloat16)
        err = _compare(got[j], program.eager[j], program.precision[j], program.scale[j] if half else 1.0,
                       program.floor[j])
        if err:
            found.insert(0, f"v{j} end to end: {err}")
    return found


def _eager_overflowed(step: Step, ins: list[torch.Tensor], actual: torch.Tensor, expected: torch.Tensor,
                      index: int) -> bool:
    """Whether ``expected`` (the step run eagerly) has infinities where ``actual`` is finite because eager
    overflowed in an intermediate: the step run in fp64 agrees with ``actual`` within the table."""
    if not (actual.dtype.is_floating_point and actual.shape == expected.shape):
        return False
    if not (torch.isinf(expected) & torch.isfinite(actual)).any():
        return False
    try:
        truth = step.fn(*[t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                          for t in ins])[index].double()
    except Exception:  # noqa: BLE001 - a step that needs its dtypes has no fp64 truth
        return False
    tol = tolerance(actual.dtype)
    a = actual.double()
    ok = (torch.isclose(a, truth, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
          | (torch.isinf(a) & (truth.abs() > torch.finfo(actual.dtype).max)))
    return bool(ok.all())


def run(program: Program, triton: bool | None = None) -> Outcome:
    """Compile ``program`` with fusepass, run it once, check it against eager and check the report."""
    t0 = time.perf_counter()
    triton = program.spec.triton if triton is None else triton
    on_cpu = all(a.device.type == "cpu" for a in program.args)
    # On a GPU the ops' CUDA implementations are the kernels; on CPU they need the interpreter.
    kernels = triton_on_cpu() if triton and on_cpu and interpreting() else contextlib.nullcontext()
    failures: list[str] = []
    inductor: list[str] = []
    report = None
    clear_kernel_fallbacks()
    pristine = [a.clone() for a in program.args]
    plain_options = {"disable_rules": [r.name for r in rules()]}
    with kernels:
        try:
            out, report = _compile_run(program, {})
        except Exception:  # noqa: BLE001 - fusepass must not take the program down
            failed = "compile or run failed:\n" + traceback.format_exc(limit=8)
            try:
                _compile_run(program, plain_options)
            except Exception as exc:  # noqa: BLE001
                inductor.append(f"plain Inductor fails too ({type(exc).__name__}): {failed}")
            else:
                failures.append(failed)
        else:
            changed = [f"a{i}" for i, (a, p) in enumerate(zip(program.args, pristine)) if not _same_bits(a, p)]
            if changed:
                failures.append(f"the compiled program wrote into its inputs {', '.join(changed)}")
                for a, p in zip(program.args, pristine):
                    a.copy_(p)
            found = _mismatches(program, out)
            if found:
                # Whose is it?  Plain Inductor on the same program.
                try:
                    plain, _ = _compile_run(program, plain_options)
                    plain_found = _mismatches(program, plain)
                except Exception:  # noqa: BLE001
                    plain_found = []
                same = {m.split(":")[0] for m in plain_found}
                inductor += [m for m in found if m.split(":")[0] in same]
                failures += [m for m in found if m.split(":")[0] not in same]
            failures += _report_problems(program, report)
        fallbacks = kernel_fallbacks()
        if fallbacks:
            failures.append(f"kernels fell back: {fallbacks}")
        clear_kernel_fallbacks()
    return Outcome(program, report, failures, inductor, time.perf_counter() - t0)


def _report_problems(program: Program, report: RewriteReport) -> list[str]:
    problems = []
    for r in report.refusals:
        if not (r.reason or "").strip():
            problems.append(f"refusal without a reason: {r}")
    for g in report.graphs:
        problems += [f"note: {n}" for n in g.notes if "could not be traced" in n or "raised" in n]
    problems += [f"refusal from a crash: {r.rule}: {r.reason}" for r in report.refusals
                 if r.reason.startswith(("check raised", "explain raised", "replacement failed"))]
    must = sum(1 for b in program.blocks if b.must_rewrite)
    if len(report.hits) < must:
        problems.append(f"{must} block(s) must be rewritten, {len(report.hits)} were; "
                        f"refusals: {sorted(set(report.reasons()))}")
    for b in program.blocks:
        nm_reason = _near_miss_reason(b.spec)
        plain = not b.spec.mutation and all(o == Operand() for o in b.spec.operands)
        if nm_reason and plain:
            if not any(nm_reason in r for r in report.reasons()):
                problems.append(f"{b.spec.label}: no refusal with {nm_reason!r}; got {sorted(set(report.reasons()))}")
    return problems


def _near_miss_reason(b: BlockSpec) -> str:
    if b.kind != "near-miss":
        return ""
    rule = next(r for r in rules() if r.name == b.rule)
    return next(n.reason for n in rule.near_misses if n.name == b.name)


# -- statistics ------------------------------------------------------------------------------

def reason_key(reason: str) -> str:
    """A refusal reason without the node names, shapes and numbers of one program."""
    s = re.sub(r"\b[a-z][a-z0-9_]*?_\d+\b", "<node>", reason)
    s = re.sub(r"\((?:[a-z_]+|<node>)\)", "(<node>)", s)
    s = re.sub(r"\((?:-?\d+(?:, )?)*,?\)", "(<shape>)", s)
    s = re.sub(r"\[(?:-?\d+(?:, )?)*\]", "[<dims>]", s)
    s = re.sub(r"\b\d+(?:\.\d+)?(?:e[-+]?\d+)?\b", "<n>", s)
    s = re.sub(r"users: [^)]*", "users: ...", s)
    return s


@dataclass
class Stats:
    programs: int = 0
    blocks: int = 0
    triton_programs: int = 0
    kinds: Counter = field(default_factory=Counter)
    mutations: Counter = field(default_factory=Counter)
    features: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    hidden: Counter = field(default_factory=Counter)
    dropped: int = 0
    must_rewrite: int = 0
    rewrites: Counter = field(default_factory=Counter)
    refusals: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    inductor: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, o: Outcome) -> None:
        p = o.program
        self.programs += 1
        self.triton_programs += bool(p.spec.triton)
        self.blocks += len(p.blocks)
        self.dropped += len(p.dropped)
        for b in p.blocks:
            self.kinds[b.spec.label] += 1
            self.mutations[b.spec.mutation or "none"] += 1
            self.features.update(b.features)
            self.dtypes[str(b.spec.dtype).replace("torch.", "")] += 1
            self.hidden[b.shape[-1] if b.shape else 1] += 1
            self.must_rewrite += b.must_rewrite
        if o.report is not None:
            for h in o.report.hits:
                self.rewrites[f"{h.rule}/{h.form}"] += 1
            for r in o.report.refusals:
                self.refusals[(r.rule, reason_key(r.reason))] += 1
        if o.failures:
            self.failures.append(p.listing() + "\n" + "\n".join(f"  !! {f}" for f in o.failures))
        if o.inductor:
            self.inductor.append(p.listing() + "\n" + "\n".join(f"  ?? {f}" for f in o.inductor))
        self.seconds += o.seconds

    def summary(self) -> str:
        lines = [
            f"fusepass differential run: {self.programs} programs ({self.triton_programs} on the Triton kernels), "
            f"{self.blocks} blocks, {sum(self.rewrites.values())} rewrites, {sum(self.refusals.values())} refusals, "
            f"{len(self.failures)} failing programs, {len(self.inductor)} with Inductor-only mismatches, "
            f"{self.seconds:.0f} s",
            f"  blocks that must be rewritten: {self.must_rewrite}; drawn variants eager rejected "
            f"(simplified): {self.dropped}",
            "  blocks: " + ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())),
            "  mutations: " + ", ".join(f"{k} {n}" for k, n in sorted(self.mutations.items())),
            "  operands and values: " + ", ".join(f"{k} {n}" for k, n in sorted(self.features.items())),
            "  dtypes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.dtypes.items())),
            "  hidden sizes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.hidden.items())),
            "  rewrites: " + ", ".join(f"{k} {n}" for k, n in sorted(self.rewrites.items())),
            "  refusals by reason:",
        ]
        lines += [f"    {n:5d}  {rule}: {reason}" for (rule, reason), n in self.refusals.most_common()]
        if self.inductor:
            lines.append("  Inductor-only mismatches (plain Inductor disagrees with eager the same way), by last line:")
            last = Counter(_last_line(text) for text in self.inductor)
            lines += [f"    {n:5d}  {line[:160]}" + (" (known: see KNOWN_INDUCTOR_BUGS)" if known_inductor_bug(line) else "")
                      for line, n in last.most_common()]
        return "\n".join(lines)

    def unexplained_inductor(self) -> list[str]:
        """Inductor-only mismatches that are not a known Inductor bug."""
        return [text for text in self.inductor if not known_inductor_bug(text)]


# Inductor failures with a known cause outside fusepass: a program plain
# Inductor cannot compile or run is not held against the threshold on
# Inductor-only mismatches (it is still listed in the summary).
KNOWN_INDUCTOR_BUGS = {
    # Inductor's CPU lowering of an int8 weight-only matmul (mm of x and
    # int8 -> float weights times a scale) calls _weight_int8pack_mm, which
    # requires a contiguous weight; the quantized-linear near-misses with a
    # transposed or strided int8 weight hit it (torch 2.13, CPU; 5 of 206
    # seeded programs).
    "_weight_int8pack_mm_cpu : expect B to be contiguous": "Inductor CPU int8 weight-only mm on a strided weight",
}


def known_inductor_bug(text: str) -> str | None:
    return next((why for sig, why in KNOWN_INDUCTOR_BUGS.items() if sig in text), None)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""
