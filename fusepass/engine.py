"""The pass: normalise the post-grad graph, run every rule, record what happened.

Patterns are traced from each rule's plain-torch ``search`` functions with
Inductor's machinery (``fwd_only`` + ``fx_to_pattern``), once per dtype, kept
on disk for the next process (the pattern cache, below), and matched with
Inductor's ``PatternExpr.match``.  fusepass drives the matching itself rather
than through ``PatternMatcherPass`` so that every refusal keeps its reason:

- intermediates may have users outside the match in the pattern (``MULTIPLE``);
  a match whose intermediate *is* used elsewhere is refused here, naming it
  (this is also how training graphs are refused: the forward saves ``rsqrt``
  for the backward);
- the rule's ``check`` gives the semantic reasons (shapes, dtypes, eps kind);
- ``verify`` mode runs the match and its replacement on random inputs;
- anchors the rules did not consume are near-misses, explained by the rule.

A rule with a ``find`` hook (a region whose size depends on the input, such
as an unrolled loop) locates its own candidates; the engine treats each
:class:`~fusepass.rule.Region` as a match: the same outside-use refusal,
``check``, report and replacement (:func:`_run_finder`).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import itertools
import logging
import math
import os
import pickle
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    MULTIPLE,
    Match,
    MultiOutputPattern,
    PatternExpr,
    _TargetExpr,
    fwd_only,
    fx_to_pattern,
    is_match,
    stable_topological_sort,
)
from torch.utils import _pytree as pytree

from .kernels import fingerprint as kernel_data_fingerprint
from .kernels._common import inline_kernels, planning_inline
from .match import MatchInfo, concrete, hint, scalar_input
from .guards import nondefault_argument, outside_use, replacement_mismatch, unwritten_argument
from .matvec import decompose_kept_matvecs
from .options import Options
from .regions import inline_op_nodes, region_match
from .report import GraphReport, Hit, Refusal
from .rule import Form, Region, Rule, rules

log = logging.getLogger("fusepass")
aten = torch.ops.aten

# -- graph normalisation -----------------------------------------------------

# Reductions whose dim list is canonicalised to negative form: the HF norm writes
# mean(-1), F.rms_norm's decomposition writes mean([ndim-1]); after this both
# read mean([-1]) whatever the rank, so one pattern covers any leading dims.
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}


def normalize(graph: torch.fx.Graph) -> int:
    changed = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _REDUCTIONS]:
        if len(node.args) < 2 or not isinstance(node.args[0], torch.fx.Node):
            continue
        val = node.args[0].meta.get("val")
        dims = node.args[1]
        if not isinstance(val, torch.Tensor) or not isinstance(dims, (list, tuple)):
            continue
        rank = val.dim()
        new = [d - rank if isinstance(d, int) and d >= 0 else d for d in dims]
        if list(dims) != new:
            node.args = (node.args[0], new, *node.args[2:])
            changed += 1
    return changed


# -- pattern compilation -----------------------------------------------------

@dataclass
class CompiledForm:
    rule: Rule
    form: Form
    dtype: torch.dtype
    variant: str  # "" or "swapped"
    pattern: PatternExpr
    argnames: list[str]
    # The dtype of each tensor argument as traced (None: not a tensor): the
    # pattern's casts are constants that mean what they mean at these dtypes.
    arg_dtypes: tuple[torch.dtype | None, ...] = ()
    # Other (form, dtype) traces that gave this very pattern, each with its
    # argument names and traced dtypes: the fp32 trace of the upcasting norm
    # and the fp16 trace of the one without casts are one pattern, each right
    # at its own dtypes.  The pattern is matched once; the trace whose dtypes
    # are the graph's is the match's form.
    aliases: list[tuple[Form, torch.dtype, str, tuple[str, ...], tuple[torch.dtype | None, ...]]] = \
        field(default_factory=list)

    def traces(self) -> list[CompiledForm]:
        """This form and its aliases, each as a CompiledForm of the same pattern."""
        return [self] + [replace(self, form=f, dtype=d, variant=v, argnames=list(a), arg_dtypes=t, aliases=[])
                         for f, d, v, a, t in self.aliases]

    @property
    def root_target(self) -> Any:
        p = self.pattern.outputs[0] if isinstance(self.pattern, MultiOutputPattern) else self.pattern
        return p.fns[0]


# Keyed by the rule object: registering a rule under a taken name (replace=True)
# makes a new object, so its patterns are traced afresh without the registry
# having to tell the engine.
_compiled: dict[int, tuple[Rule, list[CompiledForm]]] = {}

# Scalar stand-ins for the trace: exactly representable in fp32 (F.rms_norm
# rounds eps to fp32 before it reaches the graph) and unlikely to collide with
# a real constant of the search function.
_SCALAR_STAND_INS = [2.0**-20 * 1.171875, 2.0**-17 * 1.359375, 2.0**-13 * 1.4375, 2.0**-9 * 1.5625]


def _trace_inputs(rule: Rule, form: Form, dtype: torch.dtype) -> tuple[list[str], list[Any], dict[str, float]]:
    argnames = list(inspect.signature(form.search).parameters)
    examples = rule.inputs(form, dtype)
    workaround = {name: _SCALAR_STAND_INS[i] for i, name in enumerate(rule.scalars)}
    args, it = [], iter(examples)
    for name in argnames:
        args.append(workaround[name] if name in workaround else next(it))
    return argnames, args, workaround


def _functional(gm: torch.fx.GraphModule) -> None:
    """Turn the in-place ops some decompositions emit (``add_`` in F.rms_norm's)
    into their functional twins, as functionalisation does for the real graph."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        packet = target._schema.name.split("::")[-1]
        if not (packet.endswith("_") and target._schema.is_mutable):
            continue
        functional = getattr(getattr(aten, packet[:-1], None), target._overloadname, None)
        if functional is not None:
            node.target = functional
    gm.recompile()


class _AnySize:
    """Stands for the sizes of a reshape in a traced pattern (``Rule.any_reshape``)."""


def _reshapes(gm: torch.fx.GraphModule, any_size: bool) -> None:
    """``view`` -> ``reshape`` as Inductor has it in the post-grad graph, and
    with ``any_size`` the sizes of reshapes and expands (a ``bmm``'s broadcast
    operands) made a wildcard (fx_to_pattern ignores _AnySize)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (aten.view.default, aten.reshape.default):
            node.target = aten.reshape.default
        if any_size and node.target in (aten.reshape.default, aten.expand.default):
            node.args = (node.args[0], _AnySize())


def _swap_last_commutative(gm: torch.fx.GraphModule) -> bool:
    commutative = {aten.mul.Tensor, aten.add.Tensor}
    for node in reversed(gm.graph.nodes):
        if node.op == "call_function" and node.target in commutative:
            a, b = node.args[:2]
            if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and a is not b:
                node.args = (b, a, *node.args[2:])
                gm.recompile()
                return True
            return False
    return False


def _relax_users(pattern: PatternExpr) -> None:
    """Let intermediates have outside users structurally; the engine refuses those with a reason."""
    outputs = pattern.outputs if isinstance(pattern, MultiOutputPattern) else [pattern]
    seen: set[int] = set()

    def walk(p: Any) -> None:
        if isinstance(p, (list, tuple)):
            for q in p:
                walk(q)
            return
        if not isinstance(p, _TargetExpr) or id(p) in seen:
            return
        seen.add(id(p))
        if all(p is not o for o in outputs):
            p.users = MULTIPLE
        for a in itertools.chain(getattr(p, "args", ()), getattr(p, "kwargs", {}).values()):
            walk(a)

    for o in outputs:
        walk(o)


def compile_rule(rule: Rule) -> list[CompiledForm]:
    """The rule's patterns: from this process's memory, else from the pattern cache on disk, else traced
    (and stored for the next process)."""
    cached = _compiled.get(id(rule))
    if cached is not None and cached[0] is rule:
        return cached[1]
    key = _pattern_key(rule)
    out = _load_patterns(rule, key)
    if out is None:
        out = _trace_rule(rule)
        _store_patterns(rule, key, out)
    _compiled[id(rule)] = (rule, out)
    return out


def _trace_rule(rule: Rule) -> list[CompiledForm]:
    out: list[CompiledForm] = []
    seen: dict[str, CompiledForm] = {}
    for form in rule.forms:
        for dtype in rule.dtypes:
            argnames, args, workaround = _trace_inputs(rule, form, dtype)
            for variant in ("", "swapped") if rule.commutative_root else ("",):
                pattern = _trace_form(form, variant, argnames, args, workaround, rule.any_reshape)
                if pattern is None:
                    continue
                key = repr(pattern)
                if key in seen:  # e.g. fp32 traces of forms that differ only in casts
                    first = seen[key]
                    trace = (form, dtype, variant, tuple(argnames), _dtypes(args))
                    if all((t.form, t.arg_dtypes) != (form, trace[4]) for t in first.traces()):
                        first.aliases.append(trace)
                    continue
                seen[key] = CompiledForm(rule, form, dtype, variant, pattern, argnames, _dtypes(args))
                out.append(seen[key])
    return out


def _dtypes(args: list[Any]) -> tuple[torch.dtype | None, ...]:
    return tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args)


def _trace_form(form: Form, variant: str, argnames: list[str], args: list[Any], workaround: dict[str, float],
                any_reshape: bool) -> PatternExpr | None:
    """``form.search`` traced on ``args`` into a pattern (None: the variant does not exist for it)."""
    gm = fwd_only(form.search, args)
    _functional(gm)
    normalize(gm.graph)
    if variant and not _swap_last_commutative(gm):
        return None
    _reshapes(gm, any_reshape)  # last: the graph no longer runs after it
    pattern = fx_to_pattern(gm, argnames=argnames, scalar_workaround=workaround, ignore_types=(_AnySize,))
    _relax_users(pattern)
    return pattern


# -- matching at the graph's own dtypes ------------------------------------------------
#
# A pattern traced at bf16 holds its casts as constants (to fp32 and back to
# bf16); an fp16 graph that casts to bf16 matches it node for node, yet the
# rule's form -- and its replacement -- round to the input's own dtype.  So a
# match whose tensors are not of the dtypes the pattern was traced at is
# re-matched against the form traced at the graph's dtypes: only a graph that
# is the form at its own dtypes is rewritten.  Models have few dtype mixes;
# each trace is kept for the process.

_retraced: dict[tuple[int, int, str, tuple[Any, ...]], PatternExpr | str] = {}


def _graph_dtypes(cf: CompiledForm, m: Match) -> tuple[torch.dtype | None, ...]:
    """The graph's dtype for each of ``cf``'s traced tensor arguments (in ``cf.argnames`` order)."""
    out = []
    for name, traced in zip(cf.argnames, cf.arg_dtypes):
        val = m.kwargs.get(name)
        val = val.meta.get("val") if isinstance(val, torch.fx.Node) else val
        out.append(val.dtype if isinstance(val, torch.Tensor) and traced is not None else traced)
    return tuple(out)


def _retrace(cf: CompiledForm, dtypes: tuple[torch.dtype | None, ...]) -> PatternExpr | str:
    key = (id(cf.rule), id(cf.form), cf.variant, dtypes)
    got = _retraced.get(key)
    if got is None:
        argnames, args, workaround = _trace_inputs(cf.rule, cf.form, cf.dtype)
        args = [a.to(d) if isinstance(a, torch.Tensor) and d is not None and a.dtype != d else a
                for a, d in zip(args, dtypes)]
        try:
            got = _trace_form(cf.form, cf.variant, argnames, args, workaround, cf.rule.any_reshape)
            if got is None:
                got = "its operands do not commute at these dtypes"
        except Exception as exc:  # noqa: BLE001 - a form that cannot run at these dtypes computes nothing here
            got = f"the form does not trace at these dtypes ({type(exc).__name__}: {str(exc)[:100]})"
        _retraced[key] = got
    return got


def _casts(nodes: list[torch.fx.Node]) -> list[str]:
    casts = []
    for n in nodes:
        if n.target == torch.ops.prims.convert_element_type.default and len(n.args) > 1:
            casts.append(str(n.args[1]).replace("torch.", ""))
    return sorted(set(casts))


def match_form(cf: CompiledForm, node: torch.fx.Node) -> tuple[Match | None, str | None, CompiledForm]:
    """``cf``'s pattern matched at ``node``: (None, None, cf) where it does not match; else the match, why it
    must be refused whatever the rule's check says (a node carrying an argument the pattern does not write,
    roundings that differ from the form's at the graph's own dtypes) or None, and the trace it is a match of
    (``cf`` or one of its aliases)."""
    m = cf.pattern.match(node)
    if not is_match(m):
        return None, None, cf
    reason = unwritten_argument(m)
    if reason:
        return m, reason, cf
    traces = cf.traces()
    for t in traces:
        if _graph_dtypes(t, m) == tuple(t.arg_dtypes):
            return m, None, t
    dtypes = _graph_dtypes(cf, m)
    at = ", ".join(f"{n}: {str(d).replace('torch.', '')}" for n, d in zip(cf.argnames, dtypes) if d is not None)
    first = None
    for t in traces:
        pattern = _retrace(t, _graph_dtypes(t, m))
        if isinstance(pattern, str):
            first = first or f"at the graph's dtypes ({at}) {pattern}"
            continue
        m2 = pattern.match(node)
        if is_match(m2):
            return m2, unwritten_argument(m2), t
    casts = ", ".join(_casts(m.nodes)) or "none"
    return m, first or (f"the graph rounds differently from the rule's form at its own dtypes ({at}): the form "
                        f"traced at {str(cf.dtype).replace('torch.', '')} matched, with casts to {casts}"), cf


# -- the pattern cache ---------------------------------------------------------
#
# Tracing every form of every rule in every dtype takes seconds (4.9 s for
# the built-in rules on a 2-core CPU, 3.5 s of it the quantized linears), paid
# by every process that compiles a graph afresh.  Inductor ships its own
# patterns serialised; fusepass keeps each rule's traced patterns in a file
# keyed by everything that decides the trace: the rule's sources and the
# files they live in, fusepass's own files (the normalisation, helpers a
# search function calls) and the torch version (its decompositions).  A file
# that fails to load is ignored and the rule traced again.

_PATTERN_FORMAT = "fusepass-patterns-4"
_package_digest: str | None = None


def pattern_cache_dir() -> Path | None:
    """Where traced patterns are kept: ``FUSEPASS_PATTERN_CACHE`` (a folder; ``0`` keeps them in memory
    only), else ``~/.cache/fusepass/patterns`` (``XDG_CACHE_HOME`` honoured)."""
    env = os.environ.get("FUSEPASS_PATTERN_CACHE")
    if env is not None:
        return None if env.strip() in ("", "0") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusepass" / "patterns"


def _package_files_digest() -> str:
    global _package_digest
    if _package_digest is None:
        h = hashlib.sha256()
        files = itertools.chain(_PACKAGE.glob("*.py"), _PACKAGE.glob("kernels/**/*.py"),
                                _PACKAGE.glob("patterns/**/*.py"))
        for path in sorted(files):
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
        _package_digest = h.hexdigest()
    return _package_digest


def _pattern_key(rule: Rule) -> str:
    h = hashlib.sha256()
    for part in (_PATTERN_FORMAT, torch.__version__, _package_files_digest(), rule.sources(),
                 f"commutative_root={rule.commutative_root}"):
        h.update(part.encode())
        h.update(b"\0")
    fns = [fn for fn in [rule.example_inputs] + [f for form in rule.forms for f in (form.search, form.example_inputs)]
           if fn is not None]
    files = {getattr(getattr(fn, "__code__", None), "co_filename", "") for fn in fns}
    for name in sorted(files):
        try:
            h.update(Path(name).read_bytes())
        except OSError:
            h.update(name.encode())
    # What the source text does not show: values a function closes over or
    # defaults to (one ``def`` in a loop makes functions of one source).
    for fn in fns:
        for value in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).items(), *_cells(fn)):
            h.update(_value_text(value).encode())
    return h.hexdigest()[:32]


def _cells(fn: Any) -> list[Any]:
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append(None)
    return out


def _value_text(value: Any) -> str:
    """A text for a closed-over value: a function by its name and source (its repr has an address, which
    would make every key new: a missed cache, never a wrong one)."""
    if callable(value) and hasattr(value, "__code__"):
        try:
            return f"{value.__qualname__}:{inspect.getsource(value)}"
        except (OSError, TypeError):
            return f"{value.__qualname__}:{value.__code__.co_code!r}"
    return repr(value)


class _PatternPickler(pickle.Pickler):
    # Ops are pybind objects pickle cannot take: they travel by name, and
    # Inductor's MULTIPLE is compared by identity, so it travels as a tag.
    def persistent_id(self, obj: Any) -> Any:
        if obj is MULTIPLE:
            return ("multiple",)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        return None


class _PatternUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "multiple":
            return MULTIPLE
        namespace, name = pid[1].split("::")
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, pid[2]) if pid[0] == "op" else packet


def _pattern_file(rule: Rule, key: str) -> Path | None:
    folder = pattern_cache_dir()
    if folder is None:
        return None
    safe = "".join(c if c.isalnum() else "_" for c in rule.name)
    return folder / f"{safe}-{key}.pkl"


def _load_patterns(rule: Rule, key: str) -> list[CompiledForm] | None:
    path = _pattern_file(rule, key)
    if path is None or not path.is_file():
        return None
    try:
        with path.open("rb") as f, warnings.catch_warnings():
            # The patterns' pytree specs unpickle through LeafSpec's deprecated constructor.
            warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
            entries = _PatternUnpickler(f).load()
        return [CompiledForm(rule, rule.forms[i], dtype, variant, pattern, list(argnames), tuple(arg_dtypes),
                             [(rule.forms[j], d, v, tuple(names), tuple(t)) for j, d, v, names, t in aliases])
                for i, dtype, variant, pattern, argnames, arg_dtypes, aliases in entries]
    except Exception as exc:  # noqa: BLE001 - a stale or broken file: trace again
        log.debug("fusepass: pattern cache %s not used (%s: %s)", path, type(exc).__name__, exc)
        return None


def _store_patterns(rule: Rule, key: str, forms: list[CompiledForm]) -> None:
    path = _pattern_file(rule, key)
    if path is None:
        return
    index = {id(form): i for i, form in enumerate(rule.forms)}
    entries = [(index[id(cf.form)], cf.dtype, cf.variant, cf.pattern, cf.argnames, cf.arg_dtypes,
                [(index[id(f)], d, v, names, t) for f, d, v, names, t in cf.aliases]) for cf in forms]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        _PatternPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(entries)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, path)
        for old in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.pkl"):
            if old != path:  # the same rule's patterns under an older key
                old.unlink(missing_ok=True)
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation only
        log.debug("fusepass: patterns of rule %s not cached (%s: %s)", rule.name, type(exc).__name__, exc)


# -- where a node came from ----------------------------------------------------

def where(node: torch.fx.Node) -> tuple[str, str]:
    """(module path, file:line) of the user's code that produced ``node``."""
    path = ""
    # A node a rule put in the graph (an op call under the view that carries the
    # replaced node's metadata) is named by its first user that has a name.
    named = [node, *(u for u in node.users if u.meta.get("nn_module_stack"))]
    node = next((n for n in named if n.meta.get("nn_module_stack")), node)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        path = path.replace("L['self'].", "").replace("L['self']", "")
        for prefix in ("L__self___", "L['fn'].", "L['args'][0]."):
            path = path.replace(prefix, "")
    source = ""
    trace = node.meta.get("stack_trace") or ""
    for line in reversed(trace.strip().splitlines()):
        line = line.strip()
        if line.startswith("File "):
            parts = line.split('"')
            if len(parts) >= 3:
                lineno = parts[2].split(",")[1].strip().replace("line ", "")
                source = f"{Path(parts[1]).name}:{lineno}"
            break
    return path, source


# -- bytes ---------------------------------------------------------------------

def _nbytes(val: Any) -> int:
    total = 0
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            total += hint(t.numel()) * t.element_size()
    return total


def fused_bytes(m: Match) -> int:
    """What the fused op reads and writes per call: its inputs once, its outputs once.

    A floor on the memory traffic of the subgraph, whoever runs it; divided by
    a measured time it gives the op's bandwidth.  Not a saving: Inductor fuses
    most of these subgraphs too, and the op-by-op traffic eager would move is
    no baseline anyone compiling runs (it counted 1.2 GB per call on a 2-layer
    hybrid model).
    """
    return _io_bytes(m.nodes, [o for o in m.output_nodes() if o is not None])


def _io_bytes(nodes: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> int:
    """The bytes of ``nodes``' inputs from outside them plus those of ``outputs``, each once."""
    inside = set(nodes)
    external = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    return sum(_nbytes(a.meta.get("val")) for a in external) + sum(_nbytes(o.meta.get("val")) for o in outputs)


def _verify(cf: CompiledForm, m: Match, args: list[Any]) -> str | None:
    """Run the match's search function and its replacement on random inputs."""
    from .kernels._common import tolerance

    def real(a: Any, ints: bool = True) -> Any:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if not isinstance(val, torch.Tensor):
            return val
        shape = [hint(s) for s in val.shape]
        if val.dtype.is_floating_point:  # fp8 has no randn of its own
            return torch.randn(shape, device=val.device).to(val.dtype)
        if val.dtype == torch.bool:
            return torch.rand(shape, device=val.device) > 0.5
        if not ints:
            return torch.zeros(shape, dtype=val.dtype, device=val.device)
        low = 0 if val.dtype == torch.uint8 else -8
        return torch.randint(low, low + 16, shape, dtype=val.dtype, device=val.device)

    def draw(ints: bool) -> list[Any]:
        values = [real(a, ints) for a in args]
        # A scalar the graph feeds as a tensor (dynamic=True's eps) takes the
        # rule's own value: a random one may be negative (a NaN norm proves nothing).
        return [torch.full_like(c, cf.rule.scalars[n]) if n in cf.rule.scalars and isinstance(c, torch.Tensor)
                else c for n, c in zip(cf.argnames, values)]

    with concrete():  # see concrete(): never under the Python dispatcher
        values = draw(ints=True)
        try:
            expected = pytree.tree_leaves(cf.form.search(*values))
        except (IndexError, RuntimeError):
            # Integers that index (GPTQ's g_idx picks a group's scale): random ones fall outside; zeros
            # index every tensor that has a row, the float operands stay random.
            values = draw(ints=False)
            try:
                expected = pytree.tree_leaves(cf.form.search(*values))
            except Exception as exc:  # noqa: BLE001
                return f"verification could not run the pattern on random inputs ({type(exc).__name__}: {exc})"
        actual = pytree.tree_leaves(cf.form.replace(*values))
        truth: list[Any] | None = None
        for i, (e, a) in enumerate(zip(expected, actual)):
            if e.shape != a.shape or e.dtype != a.dtype:
                return f"verification failed: replacement gives {a.dtype}{tuple(a.shape)}, search {e.dtype}{tuple(e.shape)}"
            tol = tolerance(e.dtype)
            if torch.allclose(a, e, atol=tol.atol, rtol=tol.rtol, equal_nan=True):
                continue
            err = _max_err(a, e)
            # The search function rounds too: a bf16 matmul of a dequantised
            # weight rounds every weight to bf16 before a K-long sum, so near a
            # cancellation its result is off by ~sqrt(K) ulps of the terms,
            # where a kernel that sums in fp32 and scales after is not (H100,
            # int8 dequant_matmul: 0.5-4 apart, every rewrite refused).  So the
            # replacement is held to the search run in fp64 instead, within
            # the table's rtol and an atol of twice the search's own largest
            # distance from it (plus the table's atol).  A wrong kernel is
            # off by the size of its outputs.
            if truth is None:
                truth = _in_fp64(cf.form.search, values) or []
            t = truth[i] if i < len(truth) else None
            if t is None or t.shape != e.shape:
                return f"verification failed: max abs error {err:.3g} on random inputs (atol {tol.atol}, rtol {tol.rtol})"
            err_a, err_e = _max_err(a, t), _max_err(e, t)
            # A search that overflows where fp64 does not (fp16 exp(exp(x)) on
            # randn: ~1% of elements) has an infinite error, and that atol
            # would pass any finite answer, however wrong.
            if not math.isfinite(err_e) or not torch.allclose(a.double(), t, atol=2 * err_e + tol.atol,
                                                              rtol=tol.rtol, equal_nan=True):
                return (f"verification failed: max abs error {err:.3g} on random inputs (atol {tol.atol}, rtol "
                        f"{tol.rtol}); against the search in fp64 {err_a:.3g}, the search's own {err_e:.3g}")
    return None


def _max_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| in fp64, positions where the two agree (equal infinities, both NaN) counting 0."""
    x, y = x.double(), y.double()
    same = (x == y) | (x.isnan() & y.isnan())
    return torch.where(same, 0.0, (x - y).abs()).max().item()


def _in_fp64(search: Any, values: list[Any]) -> list[Any] | None:
    """``search`` on ``values`` with every floating tensor in fp64 (None if it cannot run so, or
    gives anything but floating tensors)."""
    try:
        up = [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values]
        leaves = pytree.tree_leaves(search(*up))
    except Exception:  # noqa: BLE001 - a search that needs its dtypes: no fp64 truth
        return None
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
        return None
    return [t.double() for t in leaves]


# -- the pass --------------------------------------------------------------------

def _anchor_of(rule: Rule, m: Match) -> torch.fx.Node:
    anchors = rule.anchors()
    for n in m.nodes:
        if n.target in anchors:
            return n
    return m.output_node()


def _run_finder(rule: Rule, gm: torch.fx.GraphModule, options: Options, report: GraphReport,
                refused: dict[tuple[str, torch.fx.Node], Refusal]) -> None:
    try:
        regions = list(rule.find(gm))
    except Exception as exc:  # noqa: BLE001 - a broken finder must not break the compile
        report.notes.append(f"rule {rule.name}: find raised {type(exc).__name__}: {exc}")
        return
    # Last region first: a region may read what an earlier one computes (a
    # convolution of a convolution's output), and replacing the earlier one
    # first would leave the later one's arguments pointing at erased nodes.
    # Replaced in this order, the later region's op reads the earlier region's
    # nodes, which the earlier replacement then rewires to its own op.
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions.sort(key=lambda r: -pos.get(r.anchor, -1))
    for region in regions:
        if region.reason:
            path, source = where(region.anchor)
            refused.setdefault((rule.name, region.anchor), Refusal(rule.name, region.reason, path, source))
            continue
        if not region.arguments_checked:
            reason = next(filter(None, (nondefault_argument(n) for n in region.nodes)), None)
            if reason:
                path, source = where(region.anchor)
                refused.setdefault((rule.name, region.anchor), Refusal(rule.name, reason, path, source))
                continue
        stale = [n for n in (*region.nodes, *region.args) if isinstance(n, torch.fx.Node) and n._erased]
        if stale:  # overlapping regions: the first one replaced took these nodes
            path, source = where(region.anchor)
            refused.setdefault((rule.name, region.anchor), Refusal(
                rule.name, f"its nodes overlap a region replaced before it ({stale[0].name})", path, source))
            continue
        m = region_match(gm.graph, region)
        info = MatchInfo(rule.name, region.form, _region_dtype(region),
                         dict(zip(region.names, region.args)), list(region.nodes), list(region.outputs))
        _apply(rule, m, info, region.anchor, region.form, region.replace, region.args, options, report, refused)


def _apply(rule: Rule, m: Match, info: MatchInfo, anchor: torch.fx.Node, form: str, replace: Any, args: list[Any],
           options: Options, report: GraphReport, refused: dict[tuple[str, torch.fx.Node], Refusal],
           verify: Any = None, refusal: str | None = None) -> bool:
    """Accept or refuse one match (a pattern's or a found region's): ``refusal``
    (what :func:`match_form` found), the outside-use refusal, the rule's
    ``check``, the replacement's dtypes and shapes, ``verify`` mode, then the
    replacement and the report's hit.  True when the match was replaced."""
    path, source = where(anchor)
    try:
        reason = refusal or outside_use(m) or rule.check(info)
        if reason is None:
            reason = replacement_mismatch(replace, args, [o for o in m.output_nodes()])
        if reason is None and verify is not None:
            reason = verify()
    except Exception as exc:  # noqa: BLE001
        reason = f"check raised {type(exc).__name__}: {exc}"
    if reason:
        refused.setdefault((rule.name, anchor), Refusal(rule.name, reason, path, source))
        return False
    moved = fused_bytes(m)
    out_val = info.output_val
    try:
        # Replacements put op calls in the graph; the pass turns them into their
        # launches after every rule ran (inline_op_nodes), so that a later rule
        # still sees the ops (linear_siblings groups dequant_matmul calls).
        with inline_kernels(False):
            m.replace_by_example(replace, args)
    except Exception as exc:  # noqa: BLE001
        refused[(rule.name, anchor)] = Refusal(
            rule.name, f"replacement failed: {type(exc).__name__}: {exc}", path, source)
        return False
    refused.pop((rule.name, anchor), None)
    report.hits.append(Hit(rule.name, form, path, source, moved,
                           str(getattr(out_val, "dtype", "")).replace("torch.", "")))
    return True


def _region_dtype(region: Region) -> torch.dtype:
    for a in region.args:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            return val.dtype
    return torch.float32


def _count_pretraced(rule: Rule, graph: torch.fx.Graph, report: GraphReport) -> None:
    """A call routed to the op before tracing is already the op: a hit found by the pre-trace path."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in rule.pretraced:
            path, source = where(node)
            val = pytree.tree_leaves(node.meta.get("val"))
            dtype = str(val[0].dtype).replace("torch.", "") if val and isinstance(val[0], torch.Tensor) else ""
            # The op's own traffic, counted as fused_bytes counts a match's.
            report.hits.append(Hit(rule.name, "pretrace", path, source, _io_bytes([node], [node]), dtype))


def run_rules(gm: torch.fx.GraphModule, options: Options, graph_id: str = "") -> GraphReport:
    graph = gm.graph
    report = GraphReport(graph_id=graph_id)
    t0 = time.perf_counter()
    if options.dump_graphs:
        _dump(options.dump_graphs, graph_id, "before", gm)
    normalize(graph)
    active = [r for r in rules() if options.enabled(r.name)]
    refused: dict[tuple[str, torch.fx.Node], Refusal] = {}
    for rule in rules():  # every op node the pre-trace path put here is in the report, whoever routed it
        if rule.pretraced:
            _count_pretraced(rule, graph, report)
    for rule in active:
        if rule.find is not None:
            _run_finder(rule, gm, options, report, refused)
            continue
        try:
            forms = compile_rule(rule)
        except Exception as exc:  # noqa: BLE001 - a broken rule must not break the compile
            report.notes.append(f"rule {rule.name} could not be traced: {type(exc).__name__}: {exc}")
            continue
        by_target: dict[Any, list[CompiledForm]] = {}
        for cf in forms:
            by_target.setdefault(cf.root_target, []).append(cf)
        candidates = [n for n in graph.nodes if n.op == "call_function" and n.target in by_target]
        for node in reversed(candidates):
            for cf in by_target[node.target]:
                if node._erased:
                    break
                m, refusal, cf = match_form(cf, node)
                if m is None:
                    continue
                # A scalar Dynamo made a graph input: the input, not its convert.
                args = [scalar_input(m.kwargs[name]) if name in rule.scalars else m.kwargs[name]
                        for name in cf.argnames]
                info = MatchInfo(rule.name, cf.form.name, cf.dtype, dict(zip(cf.argnames, args)),
                                 list(m.nodes), [o for o in m.output_nodes() if o is not None])
                verify = (lambda cf=cf, m=m, args=args: _verify(cf, m, args)) if options.verify else None
                label = cf.form.name + (f" ({cf.variant})" if cf.variant else "")
                if _apply(rule, m, info, _anchor_of(rule, m), label, cf.form.replace, args, options, report,
                          refused, verify=verify, refusal=refusal):
                    break
    # Near-misses: anchors no rule consumed and no check already explained.
    for rule in active:
        if rule.explain is None:
            continue
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in rule.anchors():
                continue
            if (rule.name, node) in refused:
                continue
            try:
                reason = rule.explain(node)
            except Exception as exc:  # noqa: BLE001
                reason = f"explain raised {type(exc).__name__}: {exc}"
            if reason:
                path, source = where(node)
                refused[(rule.name, node)] = Refusal(rule.name, reason, path, source)
    if report.hits:
        # A replacement goes where the match's first output was; an input made
        # later in the graph (a weight computed as 1 + w, say) must move up.
        stable_topological_sort(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    report.refusals = list(refused.values())
    for h in report.hits:
        report.attempts[h.rule] += 1
    for r in report.refusals:
        report.attempts[r.rule] += 1
    report.match_seconds = time.perf_counter() - t0
    if options.dump_graphs:
        _dump(options.dump_graphs, graph_id, "after", gm)
    return report


def _dump(folder: str, graph_id: str, stage: str, gm: torch.fx.GraphModule) -> None:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    name = (graph_id or "graph").replace("/", "_").replace(" ", "_")
    (path / f"{name}.{stage}.txt").write_text(str(gm.graph))


# Files whose text decides what the pass does: any change must miss the cache.
_PACKAGE = Path(__file__).resolve().parent


_source_hashes: dict[tuple[Any, ...], tuple[list[Rule], str]] = {}


def _source_hash(options: Options) -> str:
    # Once per process for given options, rule objects and kernel data:
    # Inductor asks for the pass's uuid several times per graph (30 ms each on
    # 2 cores).  The rules are kept with the hash so that their ids are never
    # reused; the plans may change in a process (``fusepass tune``).
    current = rules()
    memo = (options.cache_key(), tuple(id(r) for r in current), kernel_data_fingerprint())
    if memo not in _source_hashes:
        _source_hashes[memo] = (current, _hash_sources(options))
    return _source_hashes[memo][1]


def _hash_sources(options: Options) -> str:
    h = hashlib.sha256()
    for path in sorted(itertools.chain(_PACKAGE.glob("*.py"), _PACKAGE.glob("kernels/**/*.py"),
                                       _PACKAGE.glob("patterns/_*.py"))):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    files: set[str] = set()
    for rule in rules():
        if options.enabled(rule.name):
            h.update(rule.sources().encode())
            # The whole file of each function the rule holds: the helpers they call live there (a change
            # to one alone was served from the cache, the report restored as it was before).
            fns = [rule.example_inputs, rule.check, rule.explain, rule.find] + [
                f for form in rule.forms for f in (form.search, form.replace, form.example_inputs)]
            files |= {getattr(getattr(inspect.unwrap(fn), "__code__", None), "co_filename", "")
                      for fn in fns if fn is not None}
    for name in sorted(files - {""}):
        try:
            h.update(Path(name).read_bytes())
        except OSError:
            h.update(name.encode())
    h.update(repr(options.cache_key()).encode())
    h.update(kernel_data_fingerprint().encode())  # the plans a compile chose kernels by
    # The environment's FUSEPASS_ settings, some read once at import (FUSEPASS_ATTENTION_WRITE picks the
    # graph's form, FUSEPASS_ATTENTION_CFG the inlined launches): a graph compiled under one is not served
    # under another (an A/B on the H200 was, its report restored as the first process wrote it).
    h.update(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("FUSEPASS_"))).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def _passes(configured: Any) -> tuple[Any, ...]:
    """The pass(es) a user configured: torch 2.11 takes one, later versions a list."""
    if configured is None:
        return ()
    return tuple(configured) if isinstance(configured, (list, tuple)) else (configured,)


class FusePass(CustomGraphPass):
    """The post-grad pass handed to Inductor; chains a pass the user configured."""

    def __init__(self, options: Options, chained: Any = None, sink: Any = None, graph_id: str = "") -> None:
        self.options = options
        self.chained = _passes(chained)
        self.sink = sink
        self.graph_id = graph_id

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in self.chained:
            user_pass(graph)
        gm = graph.owning_module
        with planning_inline(bool(self.options.inline_kernels)):
            report = run_rules(gm, self.options, self.graph_id)
        with inline_kernels(self.options.inline_kernels):
            _, failed = inline_op_nodes(gm)  # the rules' op calls and the pre-trace path's
        report.notes += [f"an op call stayed through the dispatcher: inlining it failed: {f}" for f in failed]
        try:
            n = decompose_kept_matvecs(gm)
        except Exception as exc:  # noqa: BLE001 - the kept mm is correct, only not Inductor's fused form
            report.notes.append(f"a matrix-vector mm on a quantized weight stayed an mm: {type(exc).__name__}: {exc}")
        else:
            if n:
                report.notes.append(f"{n} matrix-vector mm(s) on quantized weights that no rule took: decomposed "
                                    "as Inductor does under coordinate-descent tuning")
        if self.sink is not None:
            self.sink(report)

    def uuid(self) -> Any:
        parts: list[Any] = [_source_hash(self.options)]
        for user_pass in self.chained:
            uid = user_pass.uuid() if hasattr(user_pass, "uuid") else None
            if uid is None:
                return None  # the chained pass opted out of caching
            parts.append(uid)
        return hashlib.sha256(repr(parts).encode()).hexdigest()

