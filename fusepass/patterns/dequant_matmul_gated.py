"""A quantized MLP's gate and up with their activation -> ``fusepass::dequant_matmul_gated``.

    h = act(x @ dequant(W_gate)^T + b_gate) * (x @ dequant(W_up)^T + b_up)     act: SiLU, GELU, GELU (tanh)

At one to a few tokens an MLP's gate and up projections are GEMVs over the
same x, and the activation between them a launch of its own that reads what
they wrote.  Found after the other rules: two ``fusepass::dequant_matmul``
calls that ``linear_siblings`` made one ``fusepass::dequant_matmul_siblings``
call of (one x, one format, a GEMV plan), whose two outputs go only to one
``fusepass::swiglu`` or ``geglu`` call (which the swiglu / geglu rules made of
the model's activation); replaced by one op whose GEMV applies the
activation, with the model's roundings, before its one store.  The weights
may come in either order (gate is the activation's input).

Left alone, without a line in the report: a pair whose plan on the CUDA
device compiled for is not a GEMV of an even number of rows a program (the
op would run the siblings and the activation kernel one after the other, from
the dispatcher), three siblings (q / k / v), products of different x.
Refused with the reason: gate or up also read outside the activation (both
products must be kept then: the siblings and the activation stay).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from fusepass.formats import dequantize_int4, out_features
from fusepass.kernels.dequant_matmul import dequant_matmul_gated_call
from fusepass.kernels.dequant_matmul.launch import gated_fits
from fusepass.kernels.dequant_matmul.siblings import group_plan
from fusepass.match import same
from fusepass.patterns._linear import is_call as _is, val as _val
from fusepass.patterns.dequant_matmul_int4 import int4_weights, whole_groups
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SIBLINGS = torch.ops.fusepass.dequant_matmul_siblings.default
_SWIGLU = torch.ops.fusepass.swiglu.default
_GEGLU = torch.ops.fusepass.geglu.default
_GELU = {"none": "gelu", "tanh": "gelu_tanh"}  # geglu's approximate -> the op's activation
N_EX, K_EX, G_EX = 24, 64, 32


def _w(packed, scale, zero, x):
    return dequantize_int4(packed, scale, zero, x.dtype)


def search_silu(x, p0, s0, z0, p1, s1, z1):
    return F.silu(x @ _w(p0, s0, z0, x).t()) * (x @ _w(p1, s1, z1, x).t())


def search_gelu(x, p0, s0, z0, p1, s1, z1):
    return F.gelu(x @ _w(p0, s0, z0, x).t()) * (x @ _w(p1, s1, z1, x).t())


def search_gelu_tanh(x, p0, s0, z0, p1, s1, z1):
    return F.gelu(x @ _w(p0, s0, z0, x).t(), approximate="tanh") * (x @ _w(p1, s1, z1, x).t())


def _replace(activation):
    def replace(x, p0, s0, z0, p1, s1, z1):
        group = 2 * p0.shape[1] // s0.shape[1]
        return dequant_matmul_gated_call(x, [p0, p1], [s0.contiguous(), s1.contiguous()],
                                         [z0.contiguous(), z1.contiguous()], [None, None], "int4", group, activation)

    return replace


def example_inputs(dtype):
    return [torch.randn(1, K_EX, dtype=dtype), *int4_weights(dtype, N_EX, K_EX, G_EX),
            *int4_weights(dtype, N_EX, K_EX, G_EX)]


def sized_inputs(dtype, shape):
    """x [*leading, K] with at most four rows (more are a prefill's, which the
    siblings leave to each linear) and K rounded up to a multiple of 32; the
    group the largest of 128 / 64 / 32 that divides K."""
    lead, rows = [], 1
    for d in shape[:-1]:
        d = min(d, 4 // rows) if d else 0
        lead.append(d)
        rows *= max(d, 1)
    k, group = whole_groups(shape[-1] if shape else 1)
    p0, s0, z0 = int4_weights(dtype, N_EX, k, group)
    p1, s1, z1 = int4_weights(dtype, N_EX, k, group)
    return dict(x=torch.randn(*lead, k, dtype=dtype), p0=p0, s0=s0, z0=z0, p1=p1, s1=s1, z1=z1)


# -- the rule's find ------------------------------------------------------------------------


def _activation(node: torch.fx.Node) -> str | None:
    if _is(node, _SWIGLU) and len(node.args) == 2 and not node.kwargs:
        return "silu"
    if _is(node, _GEGLU) and len(node.args) == 3 and not node.kwargs and node.args[2] in _GELU:
        return _GELU[node.args[2]]
    return None


def _under_views(node):
    """(the node under a chain of views of ``node``, the chain: ``node`` first)."""
    chain = []
    while any(_is(node, v) for v in _VIEWS):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _getitem(node) -> tuple[torch.fx.Node, int] | None:
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def _x_for(x: torch.fx.Node, out) -> torch.fx.Node | None:
    """The siblings' x, or the tensor it flattens, whose leading dims are the
    activation's (the op's output keeps x's leading dims); None if neither."""
    for cand in (x, _under_views(x)[0]):
        v = _val(cand)
        if isinstance(v, torch.Tensor) and v.dim() == out.dim() and same(v.shape[-1], _val(x).shape[-1]) \
                and all(same(a, b) for a, b in zip(v.shape[:-1], out.shape[:-1])):
            return cand
    return None


def _not_one_gemv(sib: torch.fx.Node) -> bool:
    """On a CUDA device with the rows and sizes known, whether the pair's plan is
    not a GEMV the gated kernel takes (the op would then run the siblings and
    the activation kernel one after the other)."""
    x, ws, ss, _, _, fmt, group = sib.args[:7]
    xv = _val(x)
    if xv.device.type != "cuda" or not all(isinstance(s, int) for s in xv.shape) or not xv.shape[-1]:
        return False
    K = xv.shape[-1]
    N = out_features(_val(ws[0]), fmt, _val(ss[0]))
    if not isinstance(N, int):
        return False
    cfg = group_plan(xv.numel() // K, [N, N], K, fmt, group, xv.dtype, xv.device)
    return cfg is None or not gated_fits(cfg, fmt)


def find(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        activation = _activation(node)
        if activation is None:
            continue
        (g, g_views), (u, u_views) = _under_views(node.args[0]), _under_views(node.args[1])
        got_g, got_u = _getitem(g), _getitem(u)
        if got_g is None or got_u is None or got_g[0] is not got_u[0]:
            continue
        sib = got_g[0]
        if not _is(sib, _SIBLINGS) or len(sib.args) not in (7, 8) or sib.kwargs or len(sib.args[1]) != 2 \
                or {got_g[1], got_u[1]} != {0, 1}:
            continue
        x, ws, ss, zs, bs, fmt, group = sib.args[:7]
        nested = list(sib.args[7]) if len(sib.args) == 8 else []  # (double quantization: three a weight)
        form = f"{fmt}_{activation}"
        chain = [g, *reversed(g_views), node], [u, *reversed(u_views), node]
        if set(sib.users) != {g, u} or any(list(a.users) != [b] for c in chain for a, b in zip(c, c[1:])):
            yield Region(form, node, reason="gate or up also read outside the activation: the two products "
                         "are kept (siblings and the activation stay)")
            continue
        out = _val(node)
        x_in = _x_for(x, out) if isinstance(out, torch.Tensor) else None
        if x_in is None or _not_one_gemv(sib):
            continue
        order = (got_g[1], got_u[1])
        args = [x_in] + [t for i in order for t in (ws[i], ss[i], zs[i], bs[i])]
        names = ["x", "w0", "s0", "z0", "b0", "w1", "s1", "z1", "b1"]
        if nested:
            args += [t for i in order for t in nested[3 * i:3 * i + 3]]
            names += [f"{a}{i}" for i in range(2) for a in ("nested", "code", "offset")]
        yield Region(form, node, [sib, g, u, *g_views, *u_views, node], [node], args,
                     _replacement(fmt, group, activation), names=names, arguments_checked=True)


def _replacement(fmt: str, group: int, activation: str):
    def replace(x, w0, s0, z0, b0, w1, s1, z1, b1, *nested):
        return dequant_matmul_gated_call(x, [w0, w1], [s0, s1], [z0, z1], [b0, b1], fmt, group, activation,
                                         list(nested))

    return replace


# -- near-misses ------------------------------------------------------------------------------

def _nm_gate_also_read(x, p0, s0, z0, p1, s1, z1):
    g = x @ _w(p0, s0, z0, x).t()
    return F.silu(g) * (x @ _w(p1, s1, z1, x).t()), g.sum()


def _nm_two_x(x, p0, s0, z0, p1, s1, z1):  # up reads another x: no siblings, no pair
    return F.silu(x @ _w(p0, s0, z0, x).t()) * ((x * 2) @ _w(p1, s1, z1, x).t())


def _nm_relu(x, p0, s0, z0, p1, s1, z1):  # no gated activation kernel: the siblings stay
    return F.relu(x @ _w(p0, s0, z0, x).t()) * (x @ _w(p1, s1, z1, x).t())


RULE = Rule(
    name="dequant_matmul_gated",
    forms=[Form("int4_silu", search_silu, _replace("silu")), Form("int4_gelu", search_gelu, _replace("gelu")),
           Form("int4_gelu_tanh", search_gelu_tanh, _replace("gelu_tanh"))],
    example_inputs=example_inputs,
    find=find,
    priority=-12,  # after linear_siblings (-10) made the pair one call, and after the activation rules
    sized_inputs=sized_inputs,
    packed_args=("p0", "p1"),
    builds_on=("dequant_matmul_int4", "swiglu", "geglu", "linear_siblings"),
    near_misses=[
        NearMiss("gate also read", _nm_gate_also_read, example_inputs, "also read outside the activation"),
        NearMiss("up of another x", _nm_two_x, example_inputs, ""),
        NearMiss("relu gate", _nm_relu, example_inputs, ""),
    ],
    doc=__doc__,
)
