"""HQQ's 4-bit linear on its plain-PyTorch backend -> ``fusepass::dequant_matmul`` (fmt "hqq4").

    Q[r, j]      = W_q[r, j] >> 4            r < R / 2          W_q uint8 [R / 2, G], R = N K / G
    Q[r, j]      = W_q[r - R / 2, j] & 15    r >= R / 2         (first half of the rows high nibbles)
    W            = ((Q - zero) * scale).reshape(N, K)           zero, scale [R, 1]: one per group row
    y = x @ W.T (+ bias)

as ``HQQLinear`` (``axis=1``, groups of G along K, ``HQQBackend.PYTORCH``)
traces: an empty [R, G] buffer in the compute dtype filled by two
``slice_scatter`` of the unpacked halves (``(W_q & 0xF0) >> 4`` and
``W_q & 0x0F``), ``sub`` of the float zero point, ``mul`` of the scale, a
reshape to [N, K], then the matmul; the bias is added after, beside the op.
The group rows r = n K / G + k // G make the [R, 1] scale and zero the
op's [N, K / G] as they are (a view).  The op reads the packed bytes where
they lie (fusepass.formats: hqq4): nothing is repacked.  HQQ's zero points
are floats, subtracted in fp32 by the op; HQQ rounds (Q - zero) and the
product to the compute dtype: the table's one-rounding difference.

The buffer's size and the slice bounds are constants of each layer's
shape, so the rule finds the structure (``find``) rather than one traced
pattern.  Refused with the reason: ``axis=0`` (scale and zero [1, ...]:
groups along N), scale or zero not in x's dtype, halves that are not the
buffer's two halves, K not whole groups, anything but 4 bits.
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.match import same, shape_str
from fusepass.patterns import dequant_matmul as dm
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
N_EX, K_EX, G_EX = 24, 128, 64
_END = 2**63 - 1


def _dequantize(w_q, scale, zero, n, k, dtype):
    step = w_q.shape[0]
    tmp = torch.empty([2 * step, w_q.shape[1]], dtype=dtype, device=w_q.device)
    tmp[:step] = (w_q & 0b11110000) >> 4
    tmp[step:] = w_q & 0b00001111
    return ((tmp - zero) * scale).reshape(n, k)


def search(x, w_q, scale, zero):
    return torch.matmul(x, _dequantize(w_q, scale, zero, w_q.shape[0] * 2 * w_q.shape[1] // x.shape[-1],
                                       x.shape[-1], x.dtype).t())


def search_bias(x, w_q, scale, zero, bias):
    out = search(x, w_q, scale, zero)
    out += bias
    return out


def _replace(x, w_q, scale, zero):
    g = w_q.shape[1]
    k = x.shape[-1]
    n = 2 * w_q.shape[0] * g // k
    return dm._op()(x, w_q, scale.reshape(n, k // g), zero.reshape(n, k // g), None, "hqq4", g)


def hqq_weights(n, k, group, dtype, gen=None):
    """Random HQQ tensors: W_q [n k / group / 2, group], scale and zero [n k / group, 1] (float zeros)."""
    rows = n * k // group
    w_q = torch.randint(0, 256, (rows // 2, group), generator=gen, dtype=torch.uint8)
    scale = ((0.5 + torch.rand(rows, 1, generator=gen)) / (4 * k ** 0.5)).to(dtype)
    zero = (torch.rand(rows, 1, generator=gen) * 15).to(dtype)
    return w_q, scale, zero


def example_inputs(dtype):
    return [torch.randn(4, K_EX, dtype=dtype), *hqq_weights(N_EX, K_EX, G_EX, dtype), torch.randn(N_EX, dtype=dtype)]


def sized_inputs(dtype, shape):
    """x of ``shape`` with K rounded up to a multiple of 64 (whole groups)."""
    k = max(64, -(-(shape[-1] if shape else 1) // 64) * 64)
    return dict(x=torch.randn(*shape[:-1], k, dtype=dtype), **dict(zip(("w_q", "scale", "zero"),
                hqq_weights(N_EX, k, 64, dtype))), bias=torch.randn(N_EX, dtype=dtype))


# -- find: mm(x, permute(reshape(mul(sub(halves, zero), scale)))) ---------------------------

def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is(n, target) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target == target


def _half(scatter, buffer_of):
    """(source of a slice_scatter, its start, its end, the buffer it writes into)."""
    if not _is(scatter, aten.slice_scatter.default):
        return None
    base, src = scatter.args[0], scatter.args[1]
    dim, start, end = (list(scatter.args[2:]) + [0, None, None])[:3]
    if dim != 0:
        return None
    if _is(src, aten.copy.default):
        src = src.args[1]
    return src, start, end, base


def _unpacked(node, w_q_out: list):
    """Whether ``src`` is (W_q & 0xF0) >> 4 (high) or W_q & 0x0F (low), and of which W_q."""
    if _is(node, aten.__rshift__.Scalar) and node.args[1] == 4 and _is(node.args[0], aten.bitwise_and.Scalar) \
            and node.args[0].args[1] == 0xF0:
        w_q_out.append(node.args[0].args[0])
        return "high"
    if _is(node, aten.bitwise_and.Scalar) and node.args[1] == 0x0F:
        w_q_out.append(node.args[0])
        return "low"
    return None


def _match(mm: torch.fx.Node):
    """(region nodes, x, W_q, scale, zero, reason) for an HQQ dequant feeding ``mm``; None: not one."""
    x, wt = mm.args[0], mm.args[1]
    if not (_is(wt, aten.permute.default) and list(wt.args[1]) == [1, 0]):
        return None
    rs = wt.args[0]
    # (no reshape where the grouped matrix already is [N, K]: one group per row)
    mul = rs.args[0] if _is(rs, aten.reshape.default) else rs
    if not _is(mul, aten.mul.Tensor):
        return None
    for sub, scale in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        if _is(sub, aten.sub.Tensor):
            break
    else:
        return None
    outer, zero = sub.args[0], sub.args[1]
    second = _half(outer, None)
    if second is None:
        return None
    src2, start2, end2, inner = second
    first = _half(inner, None)
    if first is None:
        return None
    src1, start1, end1, empty = first
    sources: list = []
    halves = {_unpacked(src1, sources): (start1, end1), _unpacked(src2, sources): (start2, end2)}
    if set(halves) != {"high", "low"} or len(sources) != 2 or sources[0] is not sources[1]:
        return None
    w_q = sources[0]
    nodes = [mm, wt] + ([rs] if rs is not mul else []) + [mul, sub, outer, inner]
    for s in (outer, inner):
        if _is(s.args[1], aten.copy.default):
            nodes.append(s.args[1])
            if _is(s.args[1].args[0], aten.slice.Tensor):
                nodes.append(s.args[1].args[0])
    nodes += [n for n in (src1, src2) if n not in nodes]
    nodes += [n.args[0] for n in (src1, src2) if _is(n, aten.__rshift__.Scalar)]
    if _is(empty, aten.empty.memory_format):
        nodes.append(empty)
    step = _val(w_q).shape[0] if isinstance(_val(w_q), torch.Tensor) else None
    reason = None
    if not (halves["high"][0] in (0, None) and same(halves["high"][1], step) and same(halves["low"][0], step)
            and (halves["low"][1] in (None, _END) or same(halves["low"][1], 2 * step))):
        reason = f"the unpacked halves fill rows {halves}, not [0, {step}) high and [{step}, end) low"
    return nodes, x, w_q, scale, zero, reason


def _refusal(x, w_q, scale, zero, out) -> str | None:
    xv, wv, sv, zv = (_val(a) for a in (x, w_q, scale, zero))
    reason = dm.check_activation(xv)
    if reason:
        return reason
    if wv.dtype != torch.uint8 or wv.dim() != 2 or not dm.rows_contiguous(wv):
        return f"W_q {wv.dtype}{shape_str(wv)} is not contiguous uint8 [R / 2, G] (4-bit HQQ)"
    rows, g = 2 * wv.shape[0], wv.shape[1]
    for t, what in ((sv, "scale"), (zv, "zero")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not same(t.shape[0], rows) or not same(t.shape[1], 1):
            return (f"{what} {shape_str(t)} is not one value per group row ({rows}, 1): HQQ's axis=0 "
                    "(groups along N) or another layout fusepass has no kernel for")
        if t.dtype != xv.dtype:
            return f"{what} is {t.dtype}, the activation {xv.dtype}"
    k = xv.shape[-1]
    ov = _val(out)
    n = ov.shape[-1]
    if not same(n * k, rows * g) or not same(k % g, 0):
        return f"[N, K] = [{n}, {k}] is not whole groups of {g} over {rows} group rows"
    return None


def find(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        if not _is(node, aten.mm.default):
            continue
        found = _match(node)
        if found is None:
            continue
        nodes, x, w_q, scale, zero, reason = found
        reason = (reason or _refusal(x, w_q, scale, zero, node)
                  or dm.check_library_device(_val(x), "hqq4", _val(node).shape[-1]))
        if reason:
            yield Region("hqq", node, reason=reason)
            continue
        yield Region("hqq", node, nodes, [node], [x, w_q, scale, zero], _replace,
                     names=["x", "w_q", "scale", "zero"])


def check(m) -> str | None:
    return dm.check_output(m, m.val("x"), m.output_val.shape[-1])


# -- near-misses ------------------------------------------------------------------------------

def _nm_swapped_halves(x, w_q, scale, zero):
    step = w_q.shape[0]
    tmp = torch.empty([2 * step, w_q.shape[1]], dtype=x.dtype, device=w_q.device)
    tmp[:step] = w_q & 0b00001111  # the low nibbles first: not HQQ's order
    tmp[step:] = (w_q & 0b11110000) >> 4
    n = 2 * step * w_q.shape[1] // x.shape[-1]
    return torch.matmul(x, ((tmp - zero) * scale).reshape(n, x.shape[-1]).t())


def _nm_axis0(x, w_q, scale, zero):
    # groups along N (HQQ's axis=0): one scale per column of the grouped matrix
    step = w_q.shape[0]
    tmp = torch.empty([2 * step, w_q.shape[1]], dtype=x.dtype, device=w_q.device)
    tmp[:step] = (w_q & 0b11110000) >> 4
    tmp[step:] = w_q & 0b00001111
    n = 2 * step * w_q.shape[1] // x.shape[-1]
    g = w_q.shape[1]
    z, s = (t.reshape(-1)[:1].expand(g).reshape(1, g) for t in (zero, scale))
    return torch.matmul(x, ((tmp - z) * s).reshape(n, x.shape[-1]).t())


def _inputs(dtype):
    return example_inputs(dtype)[:4]


RULE = Rule(
    name="dequant_matmul_hqq",
    forms=[Form("hqq", search, _replace), Form("hqq_bias", search_bias, lambda x, w_q, s, z, b: _replace(x, w_q, s, z) + b)],
    example_inputs=example_inputs,
    sized_inputs=sized_inputs,
    find=find,
    check=check,
    near_misses=[
        NearMiss("halves swapped", _nm_swapped_halves, _inputs, "not [0,"),
        NearMiss("groups along N (axis=0)", _nm_axis0, _inputs, "axis=0"),
    ],
    doc=__doc__,
)
