"""The router of a sparse MoE block -> ``fusepass::moe_router``.

    logits = x @ W^T (+ b)
    softmax        w, ids = topk(softmax(logits), k)          (Qwen3-MoE, Qwen3.5-MoE, Mixtral, OLMoE)
    topk_softmax   v, ids = topk(logits, k);  w = softmax(v)  (gpt-oss, with its bias)
    sigmoid        p = sigmoid(logits);  c = p + correction bias;  group-limited
                   ids = topk(c, k);  w = p[ids]               (DeepSeek-V3 and its family)
    then optionally  w /= sum(w) (+ 1e-20 for sigmoid),  w *= scaling,  w in the models' dtype

The region is found from the router's matmul (the ``mm``/``addmm`` feeding a
``topk`` within a few ops): everything computed from the logits through the
ops a router uses (pointwise ops, row reductions, ``topk``, ``gather``,
``scatter``, layout ops, casts) on tensors of T rows, whatever reads only
those and the router's own [E] biases.  Its outputs must be the routing
weights [T, k], the expert ids [T, k] and, optionally, the logits: the first
[T, k] weights read outside end it (what the model computes from them later is
its own), and anything else read outside (the probabilities kept for an
auxiliary loss, a sigmoid router's choice scores) refuses it.  The kind of scores is read off the
ops (sigmoid; an ``exp`` before or after the ``topk``), the group structure
off a ``topk`` of a [T, G, E / G] view, the scaling off a constant multiplier;
the region is accepted only if it equals the op on random inputs, ties
allowed (see :func:`_agree`).  The op returns the k choices by descending
score; where the model's top-k is unordered (``sorted=False``, DeepSeek-V3)
the region is taken only if nothing downstream reads that order (the experts
op, which the ``moe_experts`` rule puts there first, or a sort of the
weights).
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.kernels._common import call, tolerance
from fusepass.match import MatchInfo, hint, same
from fusepass.patterns import _moe
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
OP = torch.ops.fusepass.moe_router.default

_REDUCTIONS = {aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.mean.dim}
_ROUTING = {aten.topk.default, operator.getitem, aten.gather.default, aten.scatter.value, aten.scatter.src,
            aten._softmax.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor}
_MATMULS = {aten.mm.default, aten.addmm.default}
# Relative error norm of the logits: both accumulate in fp32 and round once;
# measured 0 on the rules' forms and five model families' routers (fp32, bf16).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# -- the example programs (reference semantics) --------------------------------------------
#
# Each returns the routing weights and, rather than the ids, the logits of the
# chosen experts: two experts of equal scores are both a right choice, and
# eager's CPU top-k picks among equals arbitrarily where the op takes the
# lower index (see fusepass.kernels.moe.router); the logits they carry are the
# same either way.  A token whose inputs are not all finite (the generator's
# NaN and inf) has scores that are all NaN or tie at inf, with logits and
# weights that do not: its weights and chosen logits are NaN on both sides.


def softmax_topk(x, weight, k=2, renormalize=True):
    """Qwen3-MoE's router (OLMoE's without renormalising)."""
    logits = F.linear(x, weight)
    w, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), ids, logits


def topk_softmax(x, weight, bias, k=2):
    """gpt-oss's router: the top-k logits, then a softmax over them."""
    logits = F.linear(x, weight, bias)
    v, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(v, dim=1, dtype=v.dtype), ids, logits


def sigmoid_groups(x, weight, correction_bias, k=4, n_group=4, topk_group=2, scaling=2.5):
    """DeepSeek-V3's router: sigmoid scores, groups ranked by their two best, the best groups compete."""
    T, E = x.shape[0], weight.shape[0]
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, ids, logits


def _chosen(w, ids, logits, *inputs):
    chosen = logits[torch.arange(ids.shape[0], device=ids.device)[:, None], ids]
    finite = torch.isfinite(inputs[0]).all(dim=-1, keepdim=True)  # per token
    for t in inputs[1:]:
        finite = finite & torch.isfinite(t).all()
    return torch.where(finite, w, float("nan")), torch.where(finite, chosen, float("nan"))


def canonical(w, chosen, *rest):
    """One answer among the equally right ones (the differential generator's ``Rule.canonical``).

    - The chosen logits where the weight is nonzero: a weight of exactly 0 is a probability
      that underflowed, tied with every other expert's, and which of those a top-k picks is
      the implementation's.  A softmax saturated to [1, 0, ...] in fp32 (logits to 459) had
      eager's CPU top-k and the op's lowest index choose experts whose logits were 330 apart,
      weights equal.
    - A token whose weights are NaN (inputs not all finite: scores all NaN) chose nothing
      in particular: its rows of anything else the program reads of the router (a mutation
      returns an intermediate) are NaN, or -1 for integers.  All-NaN correction biases had
      eager choose experts 10, 11, 12, 9 and the op 0, 1, 2, 3; the ids, sorted and returned,
      were 13.5 apart."""
    chosen = torch.where(w != 0, chosen, 0.0)
    none = torch.isnan(w).any(dim=-1)  # [T]

    def rows(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != none.shape[0]:
            return t
        return torch.where(none.reshape(-1, *[1] * (t.dim() - 1)), float("nan") if t.is_floating_point() else -1, t)

    return (w, chosen, *(rows(t) for t in rest))


def search_softmax(x, weight):
    return _chosen(*softmax_topk(x, weight), x, weight)


def search_topk_softmax(x, weight, bias):
    return _chosen(*topk_softmax(x, weight, bias), x, weight, bias)


def search_sigmoid(correction_bias, x, weight):
    # The correction bias first: the generator's special values (NaN, inf) go into the first
    # argument, and one expert's NaN or inf choice score is still one top-k without ties.
    return _sorted(*sigmoid_groups(x, weight, correction_bias), x, weight, correction_bias)


def _sorted(w, ids, logits, *inputs):
    """``_chosen`` for an unordered top-k (sorted=False: any order of the same choice is the
    model's answer), in ascending order of the chosen logits (the weights' order: a sigmoid of
    them), equal logits by expert id.  Not by the weights themselves: rounded to fp16 or bf16
    they tie where the logits do not (a sigmoid saturates to 1.0; fp16 scores 0.679199 twice in
    eager, 0.679199 and 0.679688 from the op, one ulp apart and both within the table), and the
    chosen logits then came in another order, 12.4 apart (long run 8, seed 1424239416)."""
    ids, by_id = ids.sort(dim=-1)
    w = w.gather(1, by_id)
    chosen = logits[torch.arange(ids.shape[0], device=ids.device)[:, None], ids]
    order = chosen.sort(dim=-1, stable=True)[1]
    return _chosen(w.gather(1, order), ids.gather(1, order), logits, *inputs)


def _replace_softmax(x, weight):
    w, ids, logits = call(OP, x, weight, None, None, "softmax", 2, True, 1, 1, 1.0, x.dtype, x.dtype)
    return _chosen(w, ids, logits, x, weight)


def _replace_topk_softmax(x, weight, bias):
    w, ids, logits = call(OP, x, weight, bias, None, "topk_softmax", 2, False, 1, 1, 1.0, x.dtype, x.dtype)
    return _chosen(w, ids, logits, x, weight, bias)


def _replace_sigmoid(correction_bias, x, weight):
    w, ids, logits = call(OP, x, weight, None, correction_bias, "sigmoid", 4, True, 4, 2, 2.5, torch.float32,
                          torch.float32)
    return _sorted(w, ids, logits, x, weight, correction_bias)


def sized(dtype, T=5, H=32, E=8, bias=False, groups=False):
    gen = torch.Generator().manual_seed(T * 1000 + H * 10 + E)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (torch.randn(E, H, generator=gen) * 2 * max(H, 1) ** -0.5).to(dtype)
    d = dict(x=x, weight=w)
    if bias:
        d["bias"] = (torch.randn(E, generator=gen) * 0.5).to(dtype)
    if groups:
        d["correction_bias"] = torch.randn(E, generator=gen) * 0.1
    return d


def example_inputs(dtype):
    return list(sized(dtype).values())


def _bias_inputs(dtype):
    return list(sized(dtype, bias=True).values())


def _group_inputs(dtype):
    d = sized(dtype, E=16, groups=True)
    return [d["correction_bias"], d["x"], d["weight"]]


def sized_inputs(dtype, shape):
    """(*leading, hidden): T the leading dims' product (0 too), the hidden size as drawn (8 to
    256: a router is a small matmul), 16 experts (in 4 groups for the sigmoid form)."""
    T = 1
    for s in shape[:-1]:
        T *= s
    # At least 8: Inductor turns a matmul over 0 or 1 features into zeros or a broadcast product,
    # and no router's logits come from those.
    H = min(max(shape[-1], 8), 256)
    d = sized(dtype, T=T, H=H, E=16, bias=True, groups=True)
    return d


# -- near-misses -----------------------------------------------------------------------------


def _nm_values_reused(correction_bias, x, weight):
    """DeepSeek-V3's final top-k values (choice scores, bias included) also read: the op hands on
    the weights gathered from the sigmoid scores, not these."""
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + correction_bias
    top, ids = torch.topk(choice, k=4, dim=-1)
    w = scores.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return (*_chosen(w, ids, logits, x, weight, correction_bias), top.amax(dim=0))


def _nm_probs_reused(x, weight):
    logits = F.linear(x, weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, ids = torch.topk(probs, 2, dim=-1)
    return (*_chosen(w.to(logits.dtype), ids, logits, x, weight), probs.mean(0))


def _nm_relu_scores(x, weight):
    logits = F.linear(x, weight)
    w, ids = torch.topk(torch.relu(logits), 2, dim=-1)
    return _chosen(w, ids, logits, x, weight)


# -- finding regions ----------------------------------------------------------------------------


def _router_op(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    if t in _moe.LAYOUT or t in _moe.CASTS or t in _REDUCTIONS or t in _ROUTING:
        return True
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags


def _rows(n: torch.fx.Node, T: Any) -> bool:
    """Every tensor ``n`` gives has T rows (and two dims or more): the router's shapes."""
    leaves = [v for v in torch.utils._pytree.tree_leaves(_moe.val(n)) if isinstance(v, torch.Tensor)]
    return bool(leaves) and all(v.dim() >= 2 and same(v.shape[0], T) for v in leaves)


def _small(n: torch.fx.Node, E: Any) -> bool:
    """A router parameter: a 0-d tensor or one value per expert."""
    t = _moe.tensor(n)
    return t is not None and (t.dim() == 0 or (t.dim() == 1 and same(t.shape[0], E)))


@dataclass
class Found:
    anchor: torch.fx.Node  # the final topk
    mm: torch.fx.Node
    logits: torch.fx.Node  # the matmul, or the add of its bias
    x: torch.fx.Node
    weight_t: torch.fx.Node  # what the matmul reads: W^T
    weight: torch.fx.Node | None  # W itself where the graph transposes it
    bias: torch.fx.Node | None
    correction: torch.fx.Node | None
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    tw: torch.fx.Node
    ids: torch.fx.Node
    logits_out: bool
    sizes: list[torch.fx.Node]


def _outputs(R: set[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    return sorted({n for n in R if any(u not in R for u in n.users)}, key=pos.__getitem__)


def _logits_of(t: torch.fx.Node, T: Any, limit: int = 40) -> torch.fx.Node | None:
    """The router matmul upstream of ``t`` (through T-row tensors, breadth first)."""
    seen = {t}
    frontier = [t]
    while frontier and len(seen) < limit:
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen or a.op != "call_function" or not _rows(a, T):
                    continue
                seen.add(a)
                if a.target in _MATMULS:
                    return a
                nxt.append(a)
        frontier = nxt
    return None


def _slice(t: torch.fx.Node, pos: dict[torch.fx.Node, int]) -> Found | str | None:
    src = _moe.tensor(t.args[0])
    if src is None or src.dim() < 2:
        return None
    T = src.shape[0]
    mm = _logits_of(t, T)
    if mm is None:
        return None  # top-k of scores no matmul made here: not a router this rule can take
    lt = _moe.tensor(mm)
    if lt is None or lt.dim() != 2:
        return None
    E = lt.shape[1]
    if mm.target == aten.addmm.default:
        bias, x, wt = mm.args[0], mm.args[1], mm.args[2]
        if not _small(bias, E) or _moe.tensor(bias).dim() != 1 or mm.kwargs:
            return "the router's addmm scales its operands (beta/alpha): not a plain linear"
    else:
        bias, (x, wt) = None, mm.args[:2]
    logits = mm
    if bias is None and len(mm.users) == 1:
        (u,) = mm.users
        if u.target == aten.add.Tensor and len(u.args) == 2 and u.args[0] is mm and _small(u.args[1], E) \
                and _moe.tensor(u.args[1]).dim() == 1 and not u.kwargs:
            logits, bias = u, u.args[1]
    # Everything the router computes from the logits.
    R: set[torch.fx.Node] = {mm, logits}
    frontier = {u for n in R for u in n.users}
    changed = True
    while changed:
        changed = False
        for u in sorted(frontier - R, key=pos.__getitem__):
            if not _router_op(u) or not _rows(u, T):
                continue
            ins = [a for a in u.all_input_nodes if a not in R]
            if any(not (_moe.constant(a) or _small(a, E) or isinstance(_moe.val(a), (int, float, torch.SymInt,
                                                                                       torch.SymFloat)))
                   for a in ins):
                continue
            R.add(u)
            R.update(a for a in ins if _moe.constant(a))  # shared ones stay for their other readers
            frontier.update(u.users)
            changed = True
    if t not in R:
        return None  # a top-k of something computed from another router's scores: not this router's
    # Layout ops at the edge only reshape an output for its readers: theirs, not the router's.
    trimmed = True
    while trimmed:
        trimmed = False
        for n in list(R):
            if n.target in _moe.LAYOUT and n.users and all(u not in R for u in n.users):
                R.discard(n)
                trimmed = True
    outs = _outputs(R, pos)
    ids = [n for n in outs if _moe.is_int(_moe.tensor(n)) and _moe.tensor(n).dim() == 2]
    if len(ids) != 1:
        return None if not ids else "the router hands on more than one set of expert ids"
    k = _moe.tensor(ids[0]).shape[1]
    weights = [n for n in outs if _moe.tensor(n) is not None and _moe.tensor(n).is_floating_point()
               and _moe.shape_is(_moe.tensor(n), T, k)]
    if len(weights) > 1:
        # What the model computes from the routing weights (a scale, a cast) grew into the region
        # with them: the first weights read outside end it.
        first = min(weights, key=pos.__getitem__)
        after = _moe.descendants([first], len(pos), pos) & R
        if ids[0] not in after:
            R -= after
            outs = _outputs(R, pos)
    tws = [n for n in outs if _moe.tensor(n) is not None and _moe.tensor(n).is_floating_point()
           and _moe.shape_is(_moe.tensor(n), T, k)]
    extra = [n for n in outs if n not in ids and n not in tws and n is not logits]
    if extra or len(tws) != 1:
        what = extra[0] if extra else (tws[1] if tws else None)
        if what is None:
            return "the router's routing weights are not read after it"
        user = next(u for u in what.users if u not in R)
        where = "a graph output" if user.op == "output" else user.name
        return (f"intermediate {what.name} {_moe.shape_text(what)} of the router is also used outside it, by {where} "
                "(the op hands on the routing weights, the ids and the logits only)")
    anchor = ids[0].args[0] if ids[0].target is operator.getitem else ids[0]
    # The router's inputs.
    weight = None
    if wt.op == "call_function" and wt.target in (aten.permute.default, aten.t.default) and len(wt.users) == 1 \
            and (wt.target == aten.t.default or list(wt.args[1]) == [1, 0]):
        weight = wt.args[0]
        R.add(wt)
    boundary = {a for n in R for a in n.all_input_nodes if a not in R}
    known = {x, wt if weight is None else weight, bias}
    correction = [b for b in boundary if b not in known and _small(b, E) and _moe.tensor(b).dim() == 1]
    sizes = [b for b in boundary if isinstance(_moe.val(b), (int, float, torch.SymInt, torch.SymFloat))]
    stray = [b for b in boundary if b not in known and b not in correction and b not in sizes]
    if stray:
        return "the router also reads " + ", ".join(f"{b.name} {_moe.shape_text(b)}" for b in stray)
    if len(correction) > 1:
        return "the router adds " + ", ".join(b.name for b in correction) + ": more than one correction bias"
    inputs = [x, wt if weight is None else weight] + ([bias] if bias is not None else []) + correction + sizes
    nodes = sorted(R, key=pos.__getitem__)
    return Found(anchor, mm, logits, x, wt, weight, bias, correction[0] if correction else None, nodes, inputs,
                 tws[0], ids[0], logits in outs, sizes)


@dataclass(frozen=True)
class Spec:
    kind: str
    top_k: int
    renormalize: bool
    n_group: int
    topk_group: int
    scaling: float
    logits_dtype: torch.dtype
    weights_dtype: torch.dtype
    has_bias: bool
    has_correction: bool
    weight_given: bool  # the graph holds W (else W^T, transposed back in the replacement)

    def describe(self) -> str:
        parts = [self.kind, f"top-{self.top_k}"] + (["renormalised"] if self.renormalize else [])
        if self.n_group > 1:
            parts.append(f"{self.topk_group} of {self.n_group} groups")
        if self.scaling != 1.0:
            parts.append(f"scaling {self.scaling:g}")
        return ", ".join(parts)


def _call(spec: Spec, want_logits: bool, x, w, *rest):
    rest = list(rest)
    bias = rest.pop(0) if spec.has_bias else None
    cb = rest.pop(0) if spec.has_correction else None
    weight = w if spec.weight_given else w.t()
    tw, ids, logits = call(OP, x, weight, bias, cb, spec.kind, spec.top_k, spec.renormalize, spec.n_group,
                           spec.topk_group, spec.scaling, spec.logits_dtype, spec.weights_dtype)
    return tw, ids, (logits if want_logits else None)


def _hints(f: Found) -> tuple[list[str], list[tuple[int, int]], list[float], str | None]:
    targets = [n.target for n in f.nodes]
    topks = [n for n in f.nodes if n.target == aten.topk.default]
    groups = [(1, 1)]
    three = [n for n in topks if _moe.tensor(n.args[0]).dim() == 3]
    if three:
        G = hint(_moe.tensor(three[0].args[0]).shape[1])
        two = [n for n in topks if _moe.tensor(n.args[0]).dim() == 2 and same(_moe.tensor(n.args[0]).shape[1], G)]
        groups = [(G, int(n.args[1])) for n in two] or [(G, 1)]
    final = f.anchor
    before = _upstream(final)
    if aten.sigmoid.default in targets:
        kinds = ["sigmoid"]
    elif any(n.target in (aten.exp.default, aten._softmax.default) for n in before if n in set(f.nodes)):
        kinds = ["softmax"]
    elif aten.exp.default in targets or aten._softmax.default in targets:
        kinds = ["topk_softmax"]
    else:
        ops = sorted({str(n.target).split(".")[-2] for n in f.nodes if isinstance(n.target, torch._ops.OpOverload)
                      and torch.Tag.pointwise in n.target.tags})
        return [], groups, [1.0], ("the router's scores are none of softmax, softmax of the top-k logits, sigmoid "
                                   f"(pointwise ops: {', '.join(ops) or 'none'})")
    scalings = [float(a) for n in f.nodes if n.target == aten.mul.Tensor and n not in before
                for a in n.args[1:2] if isinstance(a, (int, float)) and not isinstance(a, bool) and a not in (0, 1)]
    return kinds, groups, list(dict.fromkeys(scalings + [1.0]))[:3], None


def _upstream(n: torch.fx.Node, limit: int = 200) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [n]
    while stack and len(seen) < limit:
        m = stack.pop()
        for a in m.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _candidates(f: Found) -> tuple[list[Spec], str | None]:
    kinds, groups, scalings, reason = _hints(f)
    if reason:
        return [], reason
    k = int(hint(_moe.tensor(f.ids).shape[1]))
    ldt, wdt = _moe.tensor(f.logits).dtype, _moe.tensor(f.tw).dtype
    out = []
    for kind, (ng, tg), scaling, renorm in itertools.product(kinds, groups, scalings, (True, False)):
        if (ng > 1 or f.correction is not None) and kind != "sigmoid":
            continue
        out.append(Spec(kind, k, renorm, ng, tg, scaling, ldt, wdt, f.bias is not None, f.correction is not None,
                        f.weight is not None))
    return out, None if out else "no reading of the router fits (a correction bias or groups without sigmoid scores)"


def _agree(ids_a: torch.Tensor, w_a: torch.Tensor, ids_e: torch.Tensor, w_e: torch.Tensor,
           score: torch.Tensor) -> str | None:
    """None if the op's (ids, weights) are the region's: per token the same experts with the same
    weights in any order, or, where the experts differ, experts of exactly the same choice scores
    (``score`` [T, E], from the op's logits) and the same weights: eager's CPU top-k picks among
    equal scores arbitrarily, the op takes the lower index."""
    tol = tolerance(w_e.dtype)

    def near(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        a, e = a.double(), e.double()
        return ((a - e).abs() <= tol.atol + tol.rtol * e.abs()) | (a.isnan() & e.isnan())

    ia, oa = ids_a.sort(dim=-1)
    ie, oe = ids_e.sort(dim=-1)
    same_ids = (ia == ie).all(dim=-1)
    if not near(w_a.gather(1, oa), w_e.gather(1, oe))[same_ids].all():
        return "the same experts get other routing weights"
    ties = ~same_ids
    if ties.any():
        sa = score[ties].gather(1, ids_a[ties]).sort(dim=-1)[0]
        se = score[ties].gather(1, ids_e[ties].long()).sort(dim=-1)[0]
        if not ((sa == se) | (sa.isnan() & se.isnan())).all():
            return f"{int(ties.sum())} of {ids_a.shape[0]} tokens go to experts of other scores"
        if not near(w_a[ties].sort(dim=-1)[0], w_e[ties].sort(dim=-1)[0]).all():
            return "experts of equal scores get other routing weights"
    return None


# Rows of random input the check draws in all: a region seen on too few rows
# can agree with the op by chance (a DeepSeek-V3 router whose group score
# sums the top-2 *indices* instead of values picked the same groups as the op
# on its one probe row, T = 1, and was rewritten: errors up to 6.4).
_PROBE_ROWS = 64
_MAX_PROBES = 16


def _probe(f: Found, seed: int) -> list[Any]:
    """Random values for the region's inputs (the router's scales), draw ``seed``."""
    gens: dict[torch.device, torch.Generator] = {}
    vals: list[Any] = []
    for b in f.inputs:
        t = _moe.tensor(b)
        if t is None:
            vals.append(_moe.size_value(b))
            continue
        shape = _moe.concrete_shape(b)
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        r = torch.randn(shape, generator=gens[t.device], device=t.device)
        if b is f.x:
            pass
        elif b is f.weight or b is f.weight_t:
            r = r * 2 * max(shape[-1] if b is f.weight else shape[0], 1) ** -0.5
        elif b is f.bias:
            r = r * 0.5
        else:
            r = r * 0.1
        vals.append(r.to(device=t.device, dtype=t.dtype))
    return vals


def _verify(f: Found, cands: list[Spec]) -> tuple[int | None, str]:
    """The first candidate that agrees with the region on every probe (about _PROBE_ROWS random rows)."""
    outputs = [f.tw, f.ids] + ([f.logits] if f.logits_out else [])
    gm = _moe.extract(f.nodes, f.inputs, outputs)
    rows = max(1, (_moe.concrete_shape(f.x) or [1])[0])
    probes = min(_MAX_PROBES, -(-_PROBE_ROWS // rows))
    with _moe.concrete():
        draws = []
        for seed in range(probes):
            vals = _probe(f, seed)
            try:
                draws.append((vals, gm(*vals)))
            except Exception as exc:  # noqa: BLE001
                return None, f"the region does not run on random inputs: {type(exc).__name__}: {str(exc)[:160]}"
        best = (float("inf"), "")
        for i, spec in enumerate(cands):
            for vals, expected in draws:
                err, why = _disagreement(spec, vals, expected, f.logits_out)
                if why:
                    best = min(best, (err, f"{spec.describe()}: {why}"))
                    break
            else:
                return i, ""
    return None, best[1]


def _disagreement(spec: Spec, vals: list[Any], expected: Any, logits_out: bool) -> tuple[float, str]:
    """(a distance, why) where the op read as ``spec`` differs from the region's ``expected`` on ``vals``;
    (0, "") where it agrees."""
    x, w, args = vals[0], vals[1], list(vals[2:])
    bias = args.pop(0) if spec.has_bias else None
    cb = args.pop(0) if spec.has_correction else None
    try:
        tw, ids, logits = OP(x, w if spec.weight_given else w.t(), bias, cb, spec.kind, spec.top_k,
                             spec.renormalize, spec.n_group, spec.topk_group, spec.scaling, spec.logits_dtype,
                             spec.weights_dtype)
    except Exception as exc:  # noqa: BLE001
        return float("inf"), f"{type(exc).__name__}: {str(exc)[:160]}"
    if tw.dtype != expected[0].dtype or tw.shape != expected[0].shape:
        return float("inf"), (f"weights {tw.dtype}{tuple(tw.shape)}, the region's "
                              f"{expected[0].dtype}{tuple(expected[0].shape)}")
    if logits_out:
        err = _moe.rel_error(logits, expected[2])
        if logits.dtype != expected[2].dtype or err > REL_TOL.get(logits.dtype, 1e-5):
            return err, f"logits differ (relative error {err:.3g})"
    score = logits.float()
    if spec.kind == "sigmoid":
        score = torch.sigmoid(score) + (cb.float() if cb is not None else 0.0)
    why = _agree(ids, tw, expected[1], expected[0], score)
    if why is None:
        return 0.0, ""
    return _moe.rel_error(tw.sort(-1)[0], expected[0].sort(-1)[0]), why


_verdicts = _moe.Verdicts()


def find(gm: torch.fx.GraphModule):
    # The engine replaces the regions latest first (one block's output is the next one's x).
    graph = gm.graph
    pos = _moe.position(graph)
    covered: set[torch.fx.Node] = set()
    for t in [n for n in graph.nodes if n.op == "call_function" and n.target == aten.topk.default]:
        if t in covered:
            continue
        f = _slice(t, pos)
        if f is None:
            continue
        if isinstance(f, str):
            yield Region("router", t, reason=f)
            continue
        covered.update(f.nodes)
        x, w = _moe.tensor(f.x), _moe.tensor(f.weight if f.weight is not None else f.weight_t)
        cands, reason = _candidates(f)
        dtype = None if x.dtype in SUPPORTED and w.dtype in SUPPORTED else \
            f"x is {x.dtype}, the router weight {w.dtype}: the router kernel takes fp32, fp16 and bf16"
        if reason:
            yield Region("router", f.anchor, reason=reason)
            continue
        rounding = _rounded_before_choice(f)
        if rounding:
            yield Region("router", f.anchor, reason=rounding)
            continue
        outputs = [f.tw, f.ids] + ([f.logits] if f.logits_out else [])
        key = _moe.canonical(f.nodes, f.inputs, outputs)
        chosen, why = _verdicts.get(key, lambda: _verify(f, cands))
        if chosen is None:  # (the dtype too, where the kernel lacks it: both reasons hold)
            yield Region("router", f.anchor, reason=(f"{dtype}; and " if dtype else "") + (
                f"the region does not compute fusepass::moe_router ({len(cands)} reading(s) tried; closest: {why})"))
            continue
        if dtype:
            yield Region("router", f.anchor, reason=dtype)
            continue
        reader = _order_reader(f) if _unordered(f.anchor) else None
        if reader is not None:
            yield Region("router", f.anchor, reason=(
                f"the model's top-k is unordered (sorted=False) and {reader.name} reads the order of the chosen "
                "experts: the op orders them by score"))
            continue
        spec = cands[chosen]
        args = [n for n in f.inputs if _moe.tensor(n) is not None]
        names = ["x", "weight"] + (["bias"] if spec.has_bias else []) + (["correction_bias"] if spec.has_correction
                                                                          else [])
        yield Region(spec.kind, f.anchor, f.nodes, [f.tw, f.ids, f.logits if f.logits_out else None], args,
                     functools.partial(_call, spec, f.logits_out), names=names,
                     arguments_checked=True)  # _verify ran these very nodes


def _rounded_before_choice(f: Found) -> str | None:
    """A cast to a narrower float between the logits and a top-k: the op computes
    the scores from the logits in fp32 and chooses on them, so a rounding there
    can choose other experts than the model does (near-tied group scores of a
    sigmoid router rounded to bf16: ids 8.6 off eager; random probes seldom
    meet such ties)."""
    region = set(f.nodes)
    # The region's nodes a top-k reads (walked back in graph order), and those after the logits.
    chooses = {n.args[0] for n in f.nodes if n.target == aten.topk.default}
    for n in reversed(f.nodes):
        if n in chooses:
            chooses.update(a for a in n.all_input_nodes if a in region)
    after_logits = {f.logits}
    for n in f.nodes:
        if any(a in after_logits for a in n.all_input_nodes):
            after_logits.add(n)
    for n in f.nodes:
        if n.target not in _moe.CASTS or n not in chooses or n not in after_logits:
            continue
        src, dst = _moe.tensor(n.all_input_nodes[0]), _moe.tensor(n)
        if src is not None and dst is not None and src.dtype.is_floating_point and dst.dtype.is_floating_point \
                and torch.finfo(dst.dtype).eps > torch.finfo(src.dtype).eps:
            return (f"{n.name} rounds the router's scores from {src.dtype} to {dst.dtype} before it chooses the "
                    "experts; the op computes and compares them in fp32")
    return None


def _unordered(topk: torch.fx.Node) -> bool:
    return not (topk.args[4] if len(topk.args) > 4 else topk.kwargs.get("sorted", True))


def _order_reader(f: Found) -> torch.fx.Node | None:
    """Where the model's top-k is unordered (``sorted=False``: DeepSeek-V3), a reader of the
    ids or weights that may depend on the order of the k choices (the op returns them by
    descending score), or None.  Order-free readers: the experts op (the ``moe_experts`` rule
    runs first), a sort of either along the choices, and a gather of the other by that sort's order."""
    members = set(f.nodes)

    def sorts_of(t):  # sorts of t along the k choices
        return {u for u in t.users if u.target in (aten.sort.default, aten.sort.stable)
                and (u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", -1)) in (-1, 1)}

    def orders_of(sorts):  # the permutations those sorts give
        return {g for s in sorts for g in s.users if g.target is operator.getitem and g.args[1] == 1}

    sorts = sorts_of(f.tw) | sorts_of(f.ids)
    orders = {f.tw: orders_of(sorts_of(f.ids)), f.ids: orders_of(sorts_of(f.tw))}
    for out in (f.tw, f.ids):
        for u in out.users:
            if u in members or u.target == torch.ops.fusepass.moe_experts.default or u in sorts:
                continue
            # One output gathered by the order that sorting the other gives: order-free too.
            if u.target == aten.gather.default and u.args[0] is out and u.args[2] in orders[out]:
                continue
            return u
    # That order itself is the permutation from the top-k's order to the sorted one: read by anything
    # but such a gather it hands the top-k's order on (the differential run's ids.sort()[1] * 1.5: the
    # op's descending order gave [0, 1.5, 3, 4.5] where eager's CPU top-k gave [4.5, 1.5, 3, 0]).
    for out, order in orders.items():
        for g in order:
            for u in g.users:
                if not (u.target == aten.gather.default and u.args[0] is out and u.args[2] is g):
                    return u
    return None


def check(m: MatchInfo) -> str | None:
    x, w = m.val("x"), m.val("weight")
    if x.dtype not in SUPPORTED or w.dtype not in SUPPORTED:
        return f"x is {x.dtype}, the router weight {w.dtype}: the router kernel takes fp32, fp16 and bf16"
    if x.device.type not in ("cuda", "cpu"):
        return f"no fusepass kernel for device {x.device.type}"
    return None


RULE = Rule(
    name="moe_router",
    forms=[
        Form("softmax", search_softmax, _replace_softmax),
        Form("topk_softmax", search_topk_softmax, _replace_topk_softmax, example_inputs=_bias_inputs),
        Form("sigmoid_groups", search_sigmoid, _replace_sigmoid, example_inputs=_group_inputs),
    ],
    example_inputs=example_inputs,
    dtypes=(torch.float32, torch.bfloat16),
    find=find,
    check=check,
    priority=30,
    near_misses=[
        NearMiss("top-k values also used", _nm_values_reused, _group_inputs, "also used outside"),
        NearMiss("probabilities also used", _nm_probs_reused, example_inputs, "also used outside"),
        NearMiss("relu scores", _nm_relu_scores, example_inputs, "none of softmax"),
    ],
    sized_inputs=sized_inputs,
    canonical=canonical,
    doc=__doc__,
)
