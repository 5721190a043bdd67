"""Building a program from its spec: operands, blocks, the eager run every check compares with."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ...kernels._common import loosest
from ...rule import Rule, rules
from ..tp import single_rank_group
from .mutate import _Invalid, _mutate
from .spec import FLOATS, MATMUL_K, BlockSpec, Operand, ProgramSpec

aten = torch.ops.aten


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
    # A block's own step: the block as built, and its function built again on
    # given inputs (the form, operands and mutation as they are; None where the
    # mutation no longer lands on the same node), for a check that runs the
    # form under a switch of its module (check._gdn_op_chunks).
    block: BlockSpec | None = None
    remake: Callable[[Sequence[Any]], Callable[..., tuple[torch.Tensor, ...]] | None] | None = None


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
        # The programs leave their inputs alone (the check compares them after the
        # compiled run): an in-place op on a view of an input (the "inplace"
        # mutation on a reshape of GDN's state) writes into it, so the step is
        # refused and the input put back.  Every input a value shares memory with,
        # not only those passed as they are: a strided or sliced operand is a view
        # step of its own (the "inplace" mutation on s[:, None] of a scale given as
        # a[::2] wrote a, 7 false failures in a long run).
        storages = {v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)}
        inputs = {i: a.clone() for i, a in enumerate(self.args) if a.untyped_storage().data_ptr() in storages}
        try:
            with _Dtypes() as seen:
                out = _flat(fn(*values))
        except Exception as exc:  # noqa: BLE001 - eager refuses the variant
            raise _Invalid(f"{text}: {type(exc).__name__}: {exc}") from exc
        finally:
            written = [i for i, t in inputs.items() if not _same_values(self.args[i], t)]
            for i in written:
                self.args[i].copy_(inputs[i])
        if written:
            raise _Invalid(f"{text}: writes into the program's input(s) {', '.join(f'a{i}' for i in written)}")
        if seen.undefined:
            raise _Invalid(f"{text}: {seen.undefined}")
        if seen.allocated:
            # A step that allocates with torch.empty (HQQ's unpacking) and, once
            # mutated, reads what it never wrote (the allocation itself also used)
            # has no value to check: eager, Inductor and fusepass each see other
            # garbage (8 programs of a 415-program run, errors up to 1e38).  Run
            # again with the allocations filled otherwise: the outputs must not move.
            with _Dtypes(fill=7.0):
                again = _flat(fn(*values))
            if not all(_same_values(a, b) for a, b in zip(out, again)):
                raise _Invalid(f"{text}: reads memory it never wrote (a torch.empty allocation)")
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
            if op.alpha == 1:
                return self.step(torch.add, [a, b], "add({args})")[0], "add"
            return self.step(functools.partial(torch.add, alpha=op.alpha), [a, b],
                             f"add({{args}}, alpha={op.alpha!r})")[0], "add alpha"
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
                if i == len(attempts) - 1 and isinstance(exc, _FakeRefused):
                    # A library's dtype limit (bitsandbytes in fp64), not the generator's: left out.
                    self.dropped.append(str(exc).splitlines()[0][:200])
                    return
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
                stored_strided |= dtype not in FLOATS or name in rule.packed_args
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
        if b.kind == "form" and rule.canonical is not None:
            call = functools.partial(_canonical, rule.canonical, call)
        outs = self.step(call, ins, text)
        self.steps[-1].block = b
        self.steps[-1].remake = functools.partial(
            _remake, functools.partial(_call, fn, tuple(template)), b.mutation, b.pick, mutated,
            rule.canonical if b.kind == "form" else None)
        reason = _fake_refusal(call, [self.value(r) for r in ins])
        if reason:
            raise _FakeRefused(f"{b.label}: its fake implementation refuses what eager runs ({reason})")
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


def _remake(call: Callable[..., Any], mutation: str, pick: int, mutated: str,
            canonical: Callable[..., Any] | None, values: Sequence[Any]) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """A block's step function built again on ``values``: ``call`` (its search function on its
    operands), mutated as the build did, or None where the same mutation now changes another
    node (``mutated``, the build's description of it, names the node)."""
    if mutation:
        try:
            call, again = _mutate(call, list(values), mutation, pick)
        except _Invalid:
            return None
        if again != mutated:
            return None
    if canonical is not None:
        call = functools.partial(_canonical, canonical, call)
    return lambda *a: _flat(call(*a))


def _canonical(canonical: Callable[..., Any], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn``'s outputs through the rule's ``canonical`` (see Rule.canonical)."""
    out = fn(*args)
    return canonical(*out) if isinstance(out, (tuple, list)) else canonical(out)


def _same_values(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor):
        return True
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(a, b) if not a.dtype.is_floating_point else torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


class _FakeRefused(_Invalid):
    """A block whose ops' fake implementations refuse what eager runs."""


def _fake_refusal(fn: Callable[..., Any], values: Sequence[Any]) -> str | None:
    """Why ``fn`` fails on fake copies of ``values`` where eager runs it: a library op whose fake
    implementation is stricter than its kernel (bitsandbytes' gemm_4bit on an absmax in another
    dtype).  Dynamo runs the fake one, so such a block fails its whole program's compile, plain
    Inductor's too, and every other block of the program goes unchecked.  Data-dependent shapes
    (an MoE loop over the experts a token chose) need real values: not a refusal."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)

    try:
        with FakeTensorMode() as mode:
            fn(*[mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values])
    except (DataDependentOutputException, DynamicOutputShapeException):
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return None


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

    # (and the 1-D forms F.linear and matmul take for a vector: a bf16 product of
    # 4097 terms through aten.mv was held to floor 0, one ulp of 13888 apart)
    _CONTRACTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                     aten.mv.default, aten.addmv.default, aten.dot.default)

    _ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                    aten.new_empty.default, aten.new_empty_strided.default)

    def __init__(self, fill: float = float("nan")) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()
        self.terms = 0.0  # the largest sum_k |a_k b_k| of any contraction
        self.fill = fill  # what uninitialised allocations hold (see _Builder.step)
        self.allocated = False
        self.undefined = ""  # why eager's value is not defined (an op reading past its operands' memory)
        self._carried: dict[int, tuple[torch.Tensor, float]] = {}  # id -> (tensor, the terms its error carries)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._ALLOCATIONS and isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.allocated = True
            out.fill_(self.fill if out.dtype.is_floating_point else int(self.fill) if self.fill == self.fill else 0)
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                self.dtypes.add(t.dtype)
        terms = None
        if func in self._CONTRACTIONS:
            a, b = args[-2], args[-1]
            if a.numel() and b.numel() and a.dtype.is_floating_point:
                sums = torch.nan_to_num(a.double().abs(), posinf=0.0) @ torch.nan_to_num(b.double().abs(), posinf=0.0)
                terms = sums.max().item()
        elif getattr(func, "namespace", None) == "bitsandbytes" and func.overloadpacket.__name__ == "gemm_4bit":
            terms = _bnb_terms(func, args, kwargs or {})
        else:
            terms = self._carry(func, args, kwargs or {})
        if getattr(func, "namespace", None) == "bitsandbytes" and _bnb_strided(func, args, kwargs or {}):
            # Its CPU kernels take raw pointers and read a packed weight or absmax as
            # if contiguous (bitsandbytes 0.50 without the `kernels` package): an
            # expanded weight (stride 0) read past its memory, a different eager
            # value each process (1.4 apart on one fp16 block of a long run).
            self.undefined = f"bitsandbytes' {func.overloadpacket.__name__} given a strided operand"
        if terms is not None:
            self.terms = max(self.terms, terms)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._carried[id(t)] = (t, terms)
        return out

    def _carry(self, func, args, kwargs) -> float | None:
        """The terms a contraction's summation-order error carries into this op's
        outputs: the same through views, casts, adds; times the other factor's
        largest magnitude through a multiply (a scale applied after the sum:
        fp32, a scale of 17175 made 0.0017 of floor 3.0 of difference)."""
        leaves = pytree.tree_leaves((args, kwargs))
        carried = [self._carried[id(t)][1] for t in leaves
                   if isinstance(t, torch.Tensor) and id(t) in self._carried and self._carried[id(t)][0] is t]
        if not carried:
            return None
        terms = max(carried)
        if func.overloadpacket in (aten.mul, aten.mul_):
            others = [t for t in leaves if not (isinstance(t, torch.Tensor) and id(t) in self._carried)]
            for o in others:
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                    terms *= max(1.0, torch.nan_to_num(o.double().abs(), posinf=0.0).max().item())
                elif isinstance(o, (int, float)) and not isinstance(o, bool):
                    terms *= max(1.0, abs(float(o)))
        return terms

    def floor(self, precision: torch.dtype) -> float:
        return 4 * _UNIT_ROUNDOFF.get(precision, 2.0**-8) * self.terms


# bitsandbytes ops whose ``A`` is the packed weight (read whole), not activations (read by rows).
_BNB_PACKED_A = ("dequantize_4bit", "dequantize_blockwise")


def _bnb_strided(func, args, kwargs) -> bool:
    """A bitsandbytes op given a packed weight or absmax not contiguous, or activations whose rows are
    not (what its CPU kernels' raw pointers cannot read): ``dequantize_4bit`` on codes expanded
    from one byte to [1536, 1] read past them (NaN, another value each process: 1.19 off on an
    fp16 near-miss block of a long run)."""
    names = [a.name for a in func._schema.arguments]
    b = {**dict(zip(names, args)), **kwargs}
    packed_a = func.overloadpacket.__name__ in _BNB_PACKED_A
    whole = [b.get(k) for k in ("B", "absmax", "code")] + ([b.get("A")] if packed_a else [])
    rows = [] if packed_a else [b.get("A")]
    return (any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in whole)
            or any(isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1 for t in rows))


def _bnb_terms(func, args, kwargs) -> float:
    """The largest sum_k |x_k w_k| of bitsandbytes' opaque 4-bit matmul, from its weight
    dequantized by fusepass's reference (bitsandbytes' own dequantization, tested), the
    nested absmax of double quantization expanded first; where blocks straddle rows, a
    bound (codes lie in [-1, 1]: |w| is at most the block's absmax).  Its CPU path rounds
    the dequantized weight to x's dtype before the sum, the fused op after it (seen: 0.023
    off on a bf16 output of -0.035 whose terms cancel)."""
    from fusepass.formats import bnb_absmax, dequantize_library

    names = [a.name for a in func._schema.arguments]
    b = {**dict(zip(names, args)), **kwargs}
    x, packed, absmax, shape = b.get("A"), b.get("B"), b.get("absmax"), b.get("shapeB")
    if not all(isinstance(t, torch.Tensor) and t.numel() for t in (x, packed, absmax)):
        return 0.0
    absmax = absmax.double()
    if isinstance(b.get("absmax_8bit"), torch.Tensor) and isinstance(b.get("absmax_code"), torch.Tensor):
        absmax = bnb_absmax(absmax, b["absmax_8bit"], b["absmax_code"].double(), b["absmax_offset"]).double()
    xa = torch.nan_to_num(x.double().abs(), posinf=0.0)
    n, k = shape
    bs = b.get("blocksize")
    if k % bs == 0 and packed.numel() * 2 == n * k and absmax.numel() == n * k // bs \
            and b.get("quant_type") in ("nf4", "fp4"):
        w = dequantize_library(packed.reshape(n, k // 2), absmax.reshape(n, k // bs).float(), None, None,
                               b.get("quant_type"), bs)
        return (xa.reshape(-1, k) @ torch.nan_to_num(w.double().abs(), posinf=0.0).t()).max().item()
    return (xa.sum(-1).max() * torch.nan_to_num(absmax.abs(), posinf=0.0).max()).item()


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
    single_rank_group()  # blocks of all_reduce_rms_norm hold a collective
    b = _Builder(spec, torch.device(device))
    for block in spec.blocks:
        b.block(block)
    returned = [j for s in b.steps if s.checked for j in s.outs]
    return Program(spec, b.args, b.steps, dict(b.vals), returned, b.blocks, b.dropped, dict(b.precision),
                   dict(b.scale), dict(b.floor))
