"""Finding Gated DeltaNet regions in a post-grad graph (shared by ``gdn_chunk``
and ``gdn_recurrent``).

Dynamo unrolls the chunk loop (and the recurrent token loop), so a region's
size depends on T and no fixed pattern fits.  A region is found by what
every form of the function does, whatever its length:

1. **Anchor**: ``cumsum`` of the log decay (chunk forms: the
   ``solve_triangular`` one and the older row loop) or ``exp`` of it (the
   token loop).
2. **Output**: the first ``transpose(1, 2)`` (``permute [0, 2, 1, 3]``)
   downstream of the anchor in node order takes the output back from
   ``[B, H, T, D]`` to the caller's ``[B, T, H, D]``; the casts that follow
   it (``.to(dtype, contiguous)``) belong to the region.
3. **Body**: everything the output depends on, walking back until the
   function's own ``transpose(1, 2)`` of each input (q, k, v, g, beta), a
   graph input (the initial state) or a size.  The final state is what the
   body computes that the output does not need (the last state update), read
   outside (a graph output, a ``copy_`` into the cache) or by nobody.
4. **Inputs**: the tensors entering those transposes, as they arrive
   (strided views, g fp32, beta bf16 or 2·sigmoid); a ``repeat_interleave``
   of q and k over heads just before is taken into the op, which repeats
   itself.  Roles follow from shapes (q, k ``[B,T,Hk,Dk]``, v ``[B,T,Hv,Dv]``,
   g, beta ``[B,T,Hv]``, state ``[B,Hv,Dk,Dv]``), the L2 norm from an
   ``rsqrt`` in the body, the scale from the constant q is multiplied (or
   divided) by.
5. **Proof**: the body, cut out as a small FX graph, and the op run on random
   inputs of the traced shapes (hints of symbolic sizes); a candidate is
   accepted only if both outputs agree (relative error norm).  Anything else
   is refused with the measured error or what was missing.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.utils import _pytree as pytree

from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.match import concrete, hint, same
from fusepass.rule import Region

aten = torch.ops.aten
prims = torch.ops.prims

# Relative error norm (||a - e|| / ||e||) a region and the op may differ by
# on random inputs.  Measured (the rules' forms, T = 3..100, 8-dim heads): fp32
# 0.9e-7..1.5e-7 for o and the state; fp16 o up to 7.4e-6, bf16 o up to 1.6e-4
# (both sides round one fp32 value, so most elements agree bitwise).  Every
# near-miss is off by 0.19 (state not carried) to 1.5.  The margins leave room
# for the chunked sum's fp32 drift at long T.
REL_TOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 5e-3, torch.bfloat16: 1e-2}

_CASTS = (prims.convert_element_type.default, aten.clone.default, aten._to_copy.default)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _tensor(n: Any) -> torch.Tensor | None:
    v = _val(n)
    return v if isinstance(v, torch.Tensor) else None


def _is_transpose12(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target == aten.permute.default
            and list(n.args[1]) in ([0, 2, 1, 3], [0, 2, 1]))


def _position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


@dataclass
class Body:
    anchor: torch.fx.Node
    out_permute: torch.fx.Node
    o_out: torch.fx.Node
    state_out: torch.fx.Node | None
    nodes: list[torch.fx.Node]  # in graph order
    boundary: list[torch.fx.Node]  # nodes outside feeding the body
    entries: dict[torch.fx.Node, torch.fx.Node]  # input transpose -> the tensor it transposes


def _output_permute(anchor: torch.fx.Node, pos: dict[torch.fx.Node, int], limit: int = 20000) -> torch.fx.Node | None:
    """The earliest 4-d transpose(1, 2) downstream of ``anchor`` (explores nothing after it)."""
    heap = [(pos[u], u) for u in anchor.users]
    heapq.heapify(heap)
    seen: set[torch.fx.Node] = set()
    while heap and len(seen) < limit:
        _, n = heapq.heappop(heap)
        if n in seen:
            continue
        seen.add(n)
        t = _tensor(n)
        if _is_transpose12(n) and t is not None and t.dim() == 4:
            return n
        for u in n.users:
            if u not in seen and u.op != "output":
                heapq.heappush(heap, (pos[u], u))
    return None


def _constant(n: torch.fx.Node) -> bool:
    """Made from sizes alone (zeros, a mask): an output buffer's layout, not an input."""
    return n.op == "call_function" and not any(_tensor(a) is not None for a in n.all_input_nodes)


def _is_boundary(n: torch.fx.Node) -> bool:
    if n.op in ("placeholder", "get_attr"):
        return True
    return _tensor(n) is None  # sizes (SymInt nodes) and other non-tensors


def _mutating(n: torch.fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def slice_body(anchor: torch.fx.Node, pos: dict[torch.fx.Node, int]) -> Body | None:
    """The region around ``anchor`` by dataflow, or None if there is no output transpose."""
    perm = _output_permute(anchor, pos)
    if perm is None:
        return None
    chain = [perm]  # the output: the transpose, then casts
    while len(chain[-1].users) == 1:
        (u,) = chain[-1].users
        if u.op != "call_function" or u.target not in _CASTS:
            break
        chain.append(u)
    o_out = chain[-1]
    inside: set[torch.fx.Node] = set()
    boundary: dict[torch.fx.Node, None] = {}
    entries: dict[torch.fx.Node, torch.fx.Node] = {}
    stack = [perm]
    while stack:
        n = stack.pop()
        if n in inside:
            continue
        inside.add(n)
        if n is not perm and _is_transpose12(n) and not _constant(n.args[0]):
            entries[n] = n.args[0]
            boundary[n.args[0]] = None
            continue
        for a in n.all_input_nodes:
            if a in inside:
                continue
            if _is_boundary(a):
                boundary[a] = None
            else:
                stack.append(a)
    inside.update(chain)
    if anchor not in inside:
        return None
    # The final state: computed from the body, not needed by the output, and
    # not read off the output buffer either (a second transpose of the buffer
    # feeding the model's next matmul: taken for the state, it left the real
    # state "an intermediate used outside").
    o_chain = {perm.args[0], *chain}
    extra: set[torch.fx.Node] = set()
    frontier = sorted({u for n in inside for u in n.users if u not in inside}, key=pos.__getitem__)
    changed = True
    while changed:
        changed = False
        for u in frontier:
            if u in extra or u.op != "call_function" or _mutating(u) or _tensor(u) is None:
                continue
            ins = u.all_input_nodes
            if all(a in inside or a in extra or a in boundary or _is_boundary(a) for a in ins) and \
                    any(a in inside or a in extra for a in ins) and not o_chain.intersection(ins):
                extra.add(u)
                frontier += [w for w in u.users if w not in inside and w not in extra]
                changed = True
    # Sizes read off the body's tensors (symbolic shapes: sym_size of a chunked
    # view) belong to it when only the body uses them.
    body = inside | extra
    changed = True
    while changed:
        changed = False
        for b in list(boundary):
            if b.op == "call_function" and _tensor(b) is None and b.users and all(u in body for u in b.users):
                body.add(b)
                del boundary[b]
                boundary.update({a: None for a in b.all_input_nodes if a not in body and a not in boundary})
                changed = True
    inside |= {b for b in body if b not in extra}
    # Read outside the body: the output, and the final state (the token loop's
    # last state feeds its last output too, so it may be inside).
    body = inside | extra
    sinks = [n for n in body if n not in o_chain and not _constant(n) and _tensor(n) is not None
             and _tensor(n).dim() == 4 and any(u not in body for u in n.users)]
    state_out = max(sinks, key=pos.__getitem__) if sinks else None
    nodes = sorted(body, key=pos.__getitem__)
    return Body(anchor, perm, o_out, state_out, nodes, list(boundary), entries)


def _unrepeat(x: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """``repeat_interleave(x, r, dim=2)`` as post-grad has it -> (x, its nodes); else (x, [])."""
    chain = []
    n = x
    views = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
    for targets in (views, (aten.clone.default,), (aten.expand.default,), (aten.unsqueeze.default,)):
        if n.op != "call_function" or n.target not in targets or len(n.users) > 1 and n is not x:
            return x, []
        chain.append(n)
        n = n.args[0]
    src, out, wide = _tensor(n), _tensor(x), _tensor(chain[2])
    if src is None or out is None or wide is None or src.dim() != 4 or chain[-1].args[1] != 3:
        return x, []
    # [B, T, Hk, D] -> [B, T, Hk, r, D] -> [B, T, Hk * r, D]: each head r times in a row.
    B, T, Hk, D = src.shape
    r = wide.shape[3]
    if not (wide.dim() == 5 and all(same(a, b) for a, b in zip(wide.shape, (B, T, Hk, r, D)))
            and out.dim() == 4 and all(same(a, b) for a, b in zip(out.shape, (B, T, Hk * r, D)))):
        return x, []
    return n, chain


@dataclass
class Candidate:
    roles: dict[str, torch.fx.Node | None]  # q k v g beta state
    flag: bool
    scale: float


def _scales(body: Body) -> list[float]:
    found: list[float] = []
    for n in body.nodes:
        if n.op != "call_function" or n.target not in (aten.mul.Tensor, aten.div.Tensor) or len(n.args) < 2:
            continue
        c, t = n.args[1], _tensor(n.args[0])
        if isinstance(c, bool) or not isinstance(c, (int, float)) or t is None or t.dim() != 4 or c in (0, 1, -1):
            continue
        found.append(float(c) if n.target == aten.mul.Tensor else 1.0 / float(c))
    return list(dict.fromkeys(found))


def candidates(body: Body) -> tuple[list[Candidate], str | None]:
    """Role assignments to try, most likely first, or a reason there are none."""
    four = [b for b in dict.fromkeys(body.entries.values()) if _tensor(b) is not None and _tensor(b).dim() == 4]
    three = [b for b in dict.fromkeys(body.entries.values()) if _tensor(b) is not None and _tensor(b).dim() == 3]
    others = [b for b in body.boundary if _tensor(b) is not None and b not in four and b not in three]
    if len(three) != 2:
        what = "no beta" if len(three) == 1 else f"{len(three)} per-token gate tensors"
        return [], (f"not a gated delta rule: the region reads {len(three)} per-token [B, T, H] tensor(s) ({what}); "
                    "GDN reads two, g and beta")
    if len(four) != 3:
        return [], f"not a gated delta rule: the region reads {len(four)} [B, T, H, D] tensors, not q, k and v"
    states = [b for b in others if _tensor(b).dim() == 4]
    stray = [b for b in others if b not in states]
    if stray or len(states) > 1:
        names = ", ".join(f"{b.name} {tuple(_tensor(b).shape)}" for b in stray + states[1:])
        return [], f"the region also reads {names}: none of q, k, v, g, beta, the initial state"
    state = states[0] if states else None
    has_norm = any(n.target == aten.rsqrt.default for n in body.nodes if n.op == "call_function")
    scales = _scales(body) or [1.0]
    out: list[Candidate] = []
    for q, k, v in itertools.permutations(four):
        tq, tk, tv = _tensor(q), _tensor(k), _tensor(v)
        if tuple(tq.shape) != tuple(tk.shape):
            continue
        for g, beta in itertools.permutations(three):
            for scale in scales:
                for flag in (has_norm,):
                    out.append(Candidate(dict(q=q, k=k, v=v, g=g, beta=beta, state=state), flag, scale))
    # Structure first: g feeds the anchor's chain, v is not normalised.
    out.sort(key=lambda c: (not _feeds(c.roles["g"], body.anchor), c.flag != has_norm))
    return out[:32], None


def _feeds(src: torch.fx.Node, target: torch.fx.Node, limit: int = 12) -> bool:
    n = target
    for _ in range(limit):
        ins = [a for a in n.all_input_nodes if _tensor(a) is not None]
        if src in ins:
            return True
        if len(ins) != 1:
            return False
        n = ins[0]
    return False


# -- running the region and the op -------------------------------------------------------

def extract(body: Body, outputs: list[torch.fx.Node]) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = list(body.boundary)
    for b in inputs:
        env[b] = g.placeholder(b.name)
    for n in body.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), g), inputs


def _random_inputs(c: Candidate, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def shape(n: torch.fx.Node) -> list[int]:
        return [hint(s) for s in _tensor(n).shape]

    def rand(n: torch.fx.Node, scale: float = 1.0) -> torch.Tensor:
        t = _tensor(n)
        return (torch.randn(shape(n), generator=gen) * scale).to(device=device, dtype=t.dtype)

    dk = shape(c.roles["q"])[-1]
    # Without the L2 norm, unit-norm keys keep the delta rule contractive
    # (beta·|k|² < 2): random keys of norm sqrt(dk) make both sides blow up.
    qk_scale = 1.0 if c.flag else dk ** -0.5
    out = {
        "q": rand(c.roles["q"], qk_scale),
        "k": rand(c.roles["k"], qk_scale),
        "v": rand(c.roles["v"]),
        # A log decay: -0.5..-0.02 per token.
        "g": (-(torch.rand(shape(c.roles["g"]), generator=gen) * 0.48 + 0.02)).to(
            device=device, dtype=_tensor(c.roles["g"]).dtype),
        "beta": torch.rand(shape(c.roles["beta"]), generator=gen).to(device=device,
                                                                     dtype=_tensor(c.roles["beta"]).dtype),
    }
    if c.roles["state"] is not None:
        out["state"] = rand(c.roles["state"], 0.5)
    return out


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    """The larger of the error's norm and its largest element, each relative to
    the expected values' (norm, largest magnitude).  The norm alone let a region
    whose forward substitution scaled one row's correction by two (an ``add``
    with ``alpha=2``) pass in fp16: 0.05 off on that row's outputs, under the
    tolerance over the whole output.  Roundings of the same fp32 values differ
    by an ulp of each element, under the table's tolerance either way."""
    a, e = a.double(), e.double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    if e.numel() == 0:
        return 0.0
    d = (a - e).abs()
    return max(d.norm().item() / max(e.norm().item(), 1e-30), d.max().item() / max(e.abs().max().item(), 1e-30))


def verify(body: Body, op: Any, cands: list[Candidate], with_state: bool = True) -> tuple[Candidate | None, str]:
    """The first candidate whose op call equals the region on random inputs (its
    output, and its final state ``with_state``), or the closest miss."""
    outputs = [body.o_out] + ([body.state_out] if body.state_out is not None and with_state else [])
    gm, inputs = extract(body, outputs)
    o_val = _tensor(body.o_out)
    best = (float("inf"), "\uffff")  # any message ties below it: a miss with no number still says why
    with concrete():  # see concrete(): never under the Python dispatcher
        gen = torch.Generator().manual_seed(0)
        for c in cands:
            device = _tensor(c.roles["q"]).device
            values = _random_inputs(c, device, gen)
            by_node = {c.roles[r]: values[r] for r in values}
            args = []
            for b in inputs:
                if b in by_node:
                    args.append(by_node[b])
                elif _tensor(b) is None:
                    args.append(hint(_val(b)) if isinstance(_val(b), torch.SymInt) else _val(b))
                else:
                    return None, f"the region also reads {b.name}"
            try:
                expected = gm(*args)
                o, state = op(values["q"], values["k"], values["v"], values["g"], values["beta"],
                              values.get("state"), c.flag, c.scale)
            except Exception as exc:  # noqa: BLE001 - a candidate the op or region cannot run
                best = min(best, (float("inf"), f"{type(exc).__name__}: {str(exc)[:120]}"))
                continue
            if tuple(expected[0].shape) != tuple(o.shape) or expected[0].dtype != o.dtype:
                best = min(best, (float("inf"), f"output is {expected[0].dtype}{tuple(expected[0].shape)}, "
                                                f"the op gives {o.dtype}{tuple(o.shape)}"))
                continue
            err = _rel(o, expected[0])
            if len(expected) > 1:
                if tuple(expected[1].shape) != tuple(state.shape):
                    best = min(best, (float("inf"), f"its state output is {tuple(expected[1].shape)}, "
                                                    f"the op's {tuple(state.shape)}"))
                    continue
                err = max(err, _rel(state, expected[1]))
            tol = REL_TOL.get(o_val.dtype, 1e-4)
            if err <= tol:
                return c, ""
            best = min(best, (err, f"relative error {err:.3g} (tolerance {tol:g})"))
    return None, best[1]


# -- the rule's find ------------------------------------------------------------------------

def find(gm: torch.fx.GraphModule, *, anchor_op: Any, op: Any, form: Callable[[Body], str | None],
         op_name: str) -> Iterator[Region]:
    """Yield one Region per GDN region around ``anchor_op`` nodes whose ``form(body)`` is not None."""
    graph = gm.graph
    pos = _position(graph)
    covered: set[torch.fx.Node] = set()
    anchors = anchor_op if isinstance(anchor_op, tuple) else (anchor_op,)
    for anchor in [n for n in graph.nodes if n.op == "call_function" and n.target in anchors]:
        if anchor in covered:
            continue
        body = slice_body(anchor, pos)
        if body is None:
            continue
        covered.update(body.nodes)
        name = form(body)
        if name is None:
            continue
        # What the region computes (no beta, other shapes, its values against the op's) first, then
        # whether its intermediates are read outside: the first is the reason a user can act on where
        # both hold (a sigmoid decay whose output also feeds a second transpose was refused for that).
        cands, reason = candidates(body)
        if not reason and not cands:
            shapes = ", ".join(f"{tuple(_tensor(b).shape)}" for b in dict.fromkeys(body.entries.values()))
            reason = f"no assignment of q, k, v, g, beta fits the shapes it reads ({shapes})"
        if reason:
            yield Region(name, anchor, reason=reason)
            continue
        # With intermediates read outside, which of them is the final state is
        # not known (training saves many): the output alone is checked, and a
        # region whose output is the op's is refused for the outside reads.
        outside = _outside(body)
        chosen, why = verify(body, op, cands, with_state=outside is None)
        if chosen is None:
            yield Region(name, anchor, reason=f"the region does not compute fusepass::{op_name} "
                                              f"({len(cands)} input assignment(s) tried; closest: {why})")
            continue
        if outside:
            yield Region(name, anchor, reason=outside)
            continue
        yield _region(body, name, chosen, op)


def _outside(body: Body) -> str | None:
    """Checked before any run: an intermediate read outside (training saves them for backward)."""
    members, outs = set(body.nodes), {body.o_out, body.state_out}
    for n in body.nodes:
        if n in outs or _constant(n) or _tensor(n) is None:
            continue
        users = [u for u in n.users if u not in members]
        if users:
            where = "a graph output (in training, saved for backward)" if users[0].op == "output" else users[0].name
            return f"intermediate {n.name} of the region is also used outside it, by {where}"
    return None


def _region(body: Body, name: str, c: Candidate, op: Any) -> Region:
    roles, nodes = dict(c.roles), set(body.nodes)
    # The op repeats grouped heads itself: take q and k from before a
    # repeat_interleave that only the region reads (both or neither).
    unrepeated = [_unrepeat(roles[r]) for r in ("q", "k")]
    if all(chain and len(roles[r].users) == 1 for r, (_, chain) in zip(("q", "k"), unrepeated)):
        for r, (src, chain) in zip(("q", "k"), unrepeated):
            roles[r] = src
            nodes.update(chain)
    pos = {n: i for i, n in enumerate(body.anchor.graph.nodes)}
    outputs = [body.o_out] + ([body.state_out] if body.state_out is not None else [])
    order = ["q", "k", "v", "g", "beta"] + (["state"] if roles["state"] is not None else [])
    replace = functools.partial(_call, op, c.flag, c.scale, roles["state"] is not None, body.state_out is not None)
    return Region(name, body.anchor, sorted(nodes, key=pos.__getitem__), outputs, [roles[r] for r in order],
                  replace, names=[r if r != "state" else "initial_state" for r in order],
                  arguments_checked=True)  # verify() ran these very nodes against the op


def _call(op: Any, flag: bool, scale: float, has_state: bool, want_state: bool, q, k, v, g, beta, *state):
    o, final = op(q, k, v, g, beta, state[0] if has_state else None, flag, scale)
    return (o, final) if want_state else o


def reads_gate(body: Body, node: torch.fx.Node, limit: int = 10) -> bool:
    """Whether ``node`` is computed from a per-token [B, T, H] input alone (the log decay),
    through layout ops and casts: the anchor of a real attempt, not a cumsum of positions."""
    n = node
    for _ in range(limit):
        ins = [a for a in n.all_input_nodes if _tensor(a) is not None]
        if len(ins) != 1:
            return False
        n = ins[0]
        if n in body.entries:
            src = _tensor(body.entries[n])
            return src is not None and src.dim() == 3
    return False


def has(body: Body, *targets: Any) -> bool:
    return any(n.op == "call_function" and n.target in targets for n in body.nodes)


def check(m: Any) -> str | None:
    """Refusals that do not need a run: dtypes and devices the op does not serve."""
    for name in ("q", "k", "v"):
        t = m.val(name)
        if t.dtype not in SUPPORTED:
            return f"{name} is {t.dtype}: the op computes in fp32 and returns q's dtype (fp32/fp16/bf16 only)"
    q = m.val("q")
    if q.device.type not in ("cuda", "cpu"):
        return f"no fusepass kernel for device {q.device.type}"
    return None
