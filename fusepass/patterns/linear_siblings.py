"""Linear layers that read one activation at decode sizes -> ``fusepass::linear_siblings``.

    q = x @ Wq^T,  k = x @ Wk^T,  v = x @ Wv^T     (each + b where the layer has a bias)

Attention's q, k and v projections, an MLP's gate and up, a Gated DeltaNet
layer's two input projections: two to four matrix products of the same x.
At one to four rows of x each is a matrix-vector product whose time is its
weight's bytes plus a launch's ramp, and the small ones (the k / v of a
grouped-query model) are all ramp.  Found in the post-grad graph as
``mm(x, B)`` / ``addmm(bias, x, B)`` nodes with the same x (any B whose
transpose is the weight; a 1-D bias; one x: one node, the same view of one
tensor, or one gather of its features by one index tensor, as GPTQ act-order
layers of one input gather it), after every other rule has taken the
matmuls it fuses (a dequantising linear, an MoE router); replaced by one op
that reads every weight once in one launch (four weights at most a call).
The quantized linears those rules found become ``fusepass::dequant_matmul``
calls first; two or three of them on one x, one format (int4 / int8 / fp8,
and bitsandbytes' NF4 / FP4 code books) and group size, become one
``fusepass::dequant_matmul_siblings`` call (the GEMV over all their rows
where the group's plan is the GEMV).

Left alone, without a line in the report: where the rows of x and the
weights' bytes are known when compiling and one launch was measured no
faster than cuBLAS's one per weight (``kernels.linear_siblings.takes``: more
than four rows, as in a prefill; more than 64 MB of weights at one row, as
an 8B model's gate and up; more than 32 MB at two to four rows; a symbolic
row count goes to the op, which decides per call), a group of quantized
calls whose plan on the CUDA device compiled for is not the GEMV (the op
would run them one by one, from the dispatcher), a product whose weight or
bias is computed from another product of the group (one launch cannot hold
both; one computed later from what came before, as a bitsandbytes absmax
with double quantization is next to its own call, joins).  Refused with the
reason: fp64 and other dtypes without a kernel, a weight in another dtype or
on another device than x.
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.formats import KERNEL_DTYPES, dequantize_int4, out_features
from fusepass.kernels.dequant_matmul import dequant_matmul_siblings_call
from fusepass.kernels.dequant_matmul.config import GEMV_MAX_M
from fusepass.kernels.dequant_matmul.launch import MAX_SIBLINGS, SIBLING_FORMATS
from fusepass.kernels.dequant_matmul.siblings import group_plan
from fusepass.kernels.linear_siblings import MAX_WEIGHTS, linear_siblings_call, takes
from fusepass.patterns._linear import is_call as _is, product as _product, val as _val
from fusepass.patterns import dequant_matmul_bnb as bnb
from fusepass.patterns.dequant_matmul_int4 import int4_weights, whole_groups
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
_FORMS = {2: "two", 3: "three", 4: "four"}


def search_two(x, w0, w1):
    return x @ w0.t(), x @ w1.t()


def search_three(x, w0, w1, w2, b0, b1, b2):
    return (torch.nn.functional.linear(x, w0, b0), torch.nn.functional.linear(x, w1, b1),
            torch.nn.functional.linear(x, w2, b2))


def search_gathered(x, perm, w0, w1):
    # x's features gathered before each product by one index tensor (GPTQ's act-order
    # layers of one input, as fusepass.load_quantized makes them)
    return x.index_select(-1, perm) @ w0.t(), x.index_select(-1, perm) @ w1.t()


def search_int4_two(xq, p0, s0, z0, p1, s1, z1):
    # two int4 linears of fusepass.quantize's form: the dequant rule makes each a
    # dequant_matmul call, then this rule one dequant_matmul_siblings call
    return (xq @ dequantize_int4(p0, s0, z0, xq.dtype).t(), xq @ dequantize_int4(p1, s1, z1, xq.dtype).t())


def replace_int4_two(xq, p0, s0, z0, p1, s1, z1):
    group = 2 * p0.shape[1] // s0.shape[1]
    return tuple(dequant_matmul_siblings_call(xq, [p0, p1], [s0.contiguous(), s1.contiguous()],
                                              [z0.contiguous(), z1.contiguous()], [None, None], "int4", group))


def search_nf4_two(xb, q0, a0, q1, a1):
    # two bitsandbytes NF4 linears (blocks of 64): dequant_matmul_bnb makes each a
    # dequant_matmul call, then this rule one dequant_matmul_siblings call
    return bnb.search(xb, q0, a0), bnb.search(xb, q1, a1)


def replace_nf4_two(xb, q0, a0, q1, a1):
    n, k = bnb.N_EX, bnb.K_EX
    ws = [q.view(torch.uint8).reshape(n, k // 2) for q in (q0, q1)]
    return tuple(dequant_matmul_siblings_call(xb, ws, [a.reshape(n, k // 64) for a in (a0, a1)], [None, None],
                                              [None, None], "nf4", 64))


def search_nf4_nested_two(xb, q0, n0, d0, c0, o0, q1, n1, d1, c1, o1):
    # the same with double quantization (n: nested absmax, d: the absmax's bytes, c: their code, o: offset)
    return bnb.search_nested(xb, q0, n0, d0, c0, o0), bnb.search_nested(xb, q1, n1, d1, c1, o1)


def replace_nf4_nested_two(xb, q0, n0, d0, c0, o0, q1, n1, d1, c1, o1):
    n, k = bnb.N_EX, bnb.K_EX
    ws = [q.view(torch.uint8).reshape(n, k // 2) for q in (q0, q1)]
    nested = bnb.stored_absmax(n0, c0, o0) + bnb.stored_absmax(n1, c1, o1)
    return tuple(dequant_matmul_siblings_call(xb, ws, [d.reshape(n, k // 64) for d in (d0, d1)], [None, None],
                                              [None, None], "nf4", 64, nested))


def replace_two(x, w0, w1):
    return tuple(linear_siblings_call(x, [w0, w1], [None, None]))


def replace_three(x, w0, w1, w2, b0, b1, b2):
    return tuple(linear_siblings_call(x, [w0, w1, w2], [b0, b1, b2]))


def replace_gathered(x, perm, w0, w1):
    return tuple(linear_siblings_call(x.index_select(-1, perm), [w0, w1], [None, None]))


def example_inputs(dtype):
    K = 24
    return [torch.randn(1, K, dtype=dtype), torch.randn(16, K, dtype=dtype), torch.randn(4, K, dtype=dtype),
            torch.randn(4, K, dtype=dtype), torch.randn(16, dtype=dtype), torch.randn(4, dtype=dtype),
            torch.randn(4, dtype=dtype)]


def int4_inputs(dtype):
    return [torch.randn(1, 64, dtype=dtype), *int4_weights(dtype, 24, 64, 32), *int4_weights(dtype, 8, 64, 32)]


def nf4_inputs(dtype):
    (q0, (a0,)), (q1, (a1,)) = bnb._quantized(dtype), bnb._quantized(dtype)
    return [torch.randn(1, bnb.K_EX, dtype=dtype), q0, a0, q1, a1]


def nf4_nested_inputs(dtype):
    (q0, s0), (q1, s1) = bnb._quantized(dtype, nested=True), bnb._quantized(dtype, nested=True)
    return [torch.randn(1, bnb.K_EX, dtype=dtype), q0, *s0, q1, *s1]


def gathered_inputs(dtype):
    x, w0, w1 = example_inputs(dtype)[:3]
    return [x, torch.randperm(x.shape[-1]), w0, w1]


def sized_inputs(dtype, shape):
    """(*leading, hidden) as x [*leading, hidden] with at most four rows (more
    are a prefill's GEMM, which the rule leaves to cuBLAS), and the weights of
    the example inputs over ``hidden``."""
    lead, rows = [], 1
    for d in shape[:-1]:
        d = min(d, 4 // rows) if d else 0
        lead.append(d)
        rows *= max(d, 1)
    x, w0, w1, w2, b0, b1, b2 = example_inputs(dtype)
    K = shape[-1]
    kq, group = whole_groups(K)
    p0, s0, z0 = int4_weights(dtype, 24, kq, group)
    p1, s1, z1 = int4_weights(dtype, 8, kq, group)
    _, q0, a0, q1, a1 = nf4_inputs(dtype)  # (the bitsandbytes forms' shapes are fixed: K_EX features)
    _, _, n0, d0, c0, o0, _, n1, d1, c1, o1 = nf4_nested_inputs(dtype)
    return dict(xb=torch.randn(*lead, bnb.K_EX, dtype=dtype), q0=q0, a0=a0, q1=q1, a1=a1, n0=n0, d0=d0, c0=c0,
                o0=o0, n1=n1, d1=d1, c1=c1, o1=o1,
                x=torch.randn(*lead, K, dtype=dtype), w0=torch.randn(w0.shape[0], K, dtype=dtype),
                w1=torch.randn(w1.shape[0], K, dtype=dtype), w2=torch.randn(w2.shape[0], K, dtype=dtype),
                b0=b0, b1=b1, b2=b2, perm=torch.randperm(K), xq=torch.randn(*lead, kq, dtype=dtype),
                p0=p0, s0=s0, z0=z0, p1=p1, s1=s1, z1=z1)


# -- the rule's find ------------------------------------------------------------------------


def _cublas_known(group) -> bool:
    """Rows and bytes known when compiling, and cuBLAS's launch per weight measured no slower there."""
    M = _val(group[0][1]).shape[0]
    sizes = [_val(m[2]).numel() * _val(m[2]).element_size() for m in group]
    # (no rows: the op returns empty outputs, no launch)
    return isinstance(M, int) and M != 0 and all(isinstance(s, int) for s in sizes) and not takes(M, sum(sizes))


def _joinable(members, node_of, operands_of, pos, products):
    """The members none of whose weights and biases is computed from a member's
    product, or any product a group may take (``products``): joining one would
    make a cycle.  One computed after the group's
    first product from what came before (an operand a rule computes next to
    its own call, such as a scale's conversion) joins: the engine's
    topological sort after the rewrites moves it up to the one call."""
    first = pos[node_of(members[0])]
    calls = {node_of(m) for m in members} | products
    return [m for m in members if all(_independent(a, calls, first, pos) for a in operands_of(m) if a is not None)]


def _independent(a, calls, first: int, pos, limit: int = 64) -> bool:
    """Whether ``a`` is computed without any node of ``calls``: what it reads from
    position ``first`` on, traced back through pure, deterministic nodes (at
    most ``limit`` of them; more, an impure or a seeded one: no)."""
    seen: set = set()
    todo = [a]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or pos.get(n, first) < first:
            continue
        if n in calls or n.op != "call_function" or n.is_impure() or len(seen) >= limit \
                or torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return False
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return True


def _key(x: torch.fx.Node):
    # The same view of one tensor taken twice (two F.linear calls on a 3-D x) is one
    # x; so is one gather of x's features taken twice with one index tensor
    # (GPTQ's act-order layers of one input, fusepass.load_quantized sharing their
    # permutation).
    if _is(x, aten.view.default) or _is(x, aten.reshape.default) or _is(x, aten._unsafe_view.default):
        return ("view", _key(x.args[0]), str(tuple(x.args[1])))
    if _is(x, aten.index_select.default) and len(x.args) == 3 and not x.kwargs:
        return ("index_select", _key(x.args[0]), x.args[1], x.args[2])
    if _is(x, aten.index.Tensor) and len(x.args) == 2 and not x.kwargs:  # (index_select, decomposed)
        return ("index", _key(x.args[0]), tuple(x.args[1]))
    return x


def find(gm: torch.fx.GraphModule):
    # Every product either finder may group: a weight computed from any of them
    # stays apart (from another group's, two groups could each wait on the other).
    products = {n for n in gm.graph.nodes if _product(n) is not None or _is(n, _DEQUANT)}
    yield from _find_products(gm, products)
    yield from _find_quantized(gm, products)


def _find_products(gm: torch.fx.GraphModule, products: set):
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict = {}
    for node in gm.graph.nodes:
        got = _product(node)
        if got is not None:
            groups.setdefault(_key(got[0]), []).append((node, *got))
    for members in groups.values():
        if len(members) < 2:
            continue
        members = _joinable(members, lambda m: m[0], lambda m: (m[2], m[3]), pos, products)
        for i in range(0, len(members), MAX_WEIGHTS):
            group = members[i:i + MAX_WEIGHTS]
            if len(group) < 2 or _cublas_known(group):
                continue
            yield _region(group)


def _region(group) -> Region:
    anchor, x = group[0][0], group[0][1]
    n = len(group)
    xv = _val(x)
    reason = None
    if xv.dtype not in KERNEL_DTYPES:
        reason = f"{n} products of one x in {xv.dtype}: no kernel (fp32/fp16/bf16)"
    elif any(_val(m[2]).dtype != xv.dtype or _val(m[2]).device != xv.device for m in group):
        reason = "a weight in another dtype or on another device than x"
    elif xv.device.type not in ("cuda", "cpu"):
        reason = f"no fusepass kernel on {xv.device}"
    if reason:
        return Region(_FORMS[n], anchor, reason=reason)
    has_bias = [m[3] is not None for m in group]
    args = [x] + [m[2] for m in group] + [m[3] for m in group if m[3] is not None]
    names = ["x"] + [f"w{i}" for i in range(n)] + [f"b{i}" for i in range(n) if has_bias[i]]
    return Region(_FORMS[n], anchor, [m[0] for m in group], [m[0] for m in group], args, _replacement(has_bias),
                  names=names)


def _replacement(has_bias: list[bool]):
    n = len(has_bias)

    def replace(x, *rest):
        ws, extra = [b.t() for b in rest[:n]], iter(rest[n:])
        return tuple(linear_siblings_call(x, ws, [next(extra) if h else None for h in has_bias]))

    return replace


# -- quantized linears: the dequant_matmul calls other rules put in the graph ------------------

_DEQUANT = torch.ops.fusepass.dequant_matmul.default


def _find_quantized(gm: torch.fx.GraphModule, products: set):
    """Groups of ``fusepass::dequant_matmul`` calls on one x, one format (int4,
    int8, fp8), one group size, zero points on all or none, at a row count
    the GEMV serves (or symbolic): ``fusepass::dequant_matmul_siblings``."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict = {}
    for node in gm.graph.nodes:
        if not _is(node, _DEQUANT) or node.kwargs or len(node.args) not in (7, 12) \
                or any(a is not None for a in node.args[7:9]):
            continue
        x, w, scale, zero, bias, fmt, group = node.args[:7]
        xv = _val(x)
        if fmt not in SIBLING_FORMATS or not isinstance(xv, torch.Tensor) or xv.dtype not in KERNEL_DTYPES:
            continue
        rows = xv.numel() // xv.shape[-1] if isinstance(xv.shape[-1], int) and xv.shape[-1] else 0
        if isinstance(rows, int) and not 0 < rows <= GEMV_MAX_M:
            continue
        # (12 arguments: a code book's double quantization, its three tensors last)
        groups.setdefault((_key(x), fmt, group, zero is None, len(node.args)), []).append(node)
    for members in groups.values():
        members = _joinable(members, lambda m: m, lambda m: [*m.args[1:5], *m.args[9:]], pos, products)
        for i in range(0, len(members), MAX_SIBLINGS):
            group = members[i:i + MAX_SIBLINGS]
            if len(group) < 2:
                continue
            fmt, gs = group[0].args[5], group[0].args[6]
            if _another_plan(group, fmt, gs):
                continue
            nested = len(group[0].args) == 12
            args = [group[0].args[0]] + [a for m in group for a in m.args[1:5]]
            names = ["x"] + [f"{a}{i}" for i in range(len(group)) for a in ("w", "s", "z", "b")]
            if nested:
                args += [a for m in group for a in m.args[9:]]
                names += [f"{a}{i}" for i in range(len(group)) for a in ("nested", "code", "offset")]
            form = f"{fmt} {'nested ' if nested else ''}{_FORMS[len(group)]}"
            yield Region(form, group[0], list(group), list(group), args,
                         _quantized_replacement(len(group), fmt, gs), names=names, arguments_checked=True)


def _another_plan(group, fmt: str, group_size: int) -> bool:
    """On a CUDA device with the rows and sizes known, whether the group's plan
    is not the GEMV: the op would then run each weight through its own plan,
    as the calls do now, but as a call Inductor cannot inline."""
    xv = _val(group[0].args[0])
    if xv.device.type != "cuda" or not all(isinstance(s, int) for s in xv.shape) or not xv.shape[-1]:
        return False
    K = xv.shape[-1]
    Ns = [out_features(_val(m.args[1]), fmt, _val(m.args[2])) for m in group]
    if not all(isinstance(n, int) for n in Ns):
        return False
    return group_plan(xv.numel() // K, Ns, K, fmt, group_size, xv.dtype, xv.device) is None


def _quantized_replacement(n: int, fmt: str, group_size: int):
    def replace(x, *rest):
        ws, ss, zs, bs = (list(rest[i:4 * n:4]) for i in range(4))
        return tuple(dequant_matmul_siblings_call(x, ws, ss, zs, bs, fmt, group_size, list(rest[4 * n:])))

    return replace


# -- near-misses ------------------------------------------------------------------------------

def _pair_inputs(dtype):
    return example_inputs(dtype)[:3]


def _prefill_rows(x, w0, w1):  # sixteen rows: a GEMM, cuBLAS's
    return torch.cat([x] * 16) @ w0.t(), torch.cat([x] * 16) @ w1.t()


def _chained(x, w0, w1):  # the second weight made from the first product: one launch cannot hold both
    y0 = x @ w0.t()
    return y0, x @ (w1 + y0.sum()).t()


RULE = Rule(
    name="linear_siblings",
    forms=[Form("two", search_two, replace_two), Form("three", search_three, replace_three),
           Form("gathered", search_gathered, replace_gathered, example_inputs=gathered_inputs),
           Form("int4 two", search_int4_two, replace_int4_two, example_inputs=int4_inputs),
           Form("nf4 two", search_nf4_two, replace_nf4_two, example_inputs=nf4_inputs),
           Form("nf4 nested two", search_nf4_nested_two, replace_nf4_nested_two,
                example_inputs=nf4_nested_inputs)],
    example_inputs=example_inputs,
    find=find,
    priority=-10,  # last: every rule that fuses a matmul (dequantising linears, routers) takes it first
    sized_inputs=sized_inputs,
    packed_args=("p0", "p1", "a0", "a1", "n0", "n1", "d0", "d1", "c0", "c1", "o0", "o1"),
    builds_on=("dequant_matmul_int4", "dequant_matmul_bnb"),  # (the int4 and nf4 forms: the calls it groups)
    near_misses=[
        NearMiss("rows of a prefill", _prefill_rows, _pair_inputs, ""),
        NearMiss("weight from the other product", _chained, _pair_inputs, ""),
    ],
    doc=__doc__,
)
