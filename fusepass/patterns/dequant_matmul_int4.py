"""Weight-only int4 linear, group-wise -> ``fusepass::dequant_matmul`` (fmt "int4").

    q[n, 2i] = packed[n, i] & 0xF,  q[n, 2i+1] = packed[n, i] >> 4     packed uint8 [N, K // 2]
    W[n, k]  = (q[n, k] - zero[n, k // G]) * scale[n, k // G]          asymmetric
    W[n, k]  = (q[n, k] - 8) * scale[n, k // G]                        symmetric
    y = x @ W.T (+ bias)

The unpack interleaves the nibbles back (``torch.stack([lo, hi], -1)``: a cat
of two unsqueezes after tracing), views the [N, K] codes as [N, K // G, G]
groups, applies zero and scale per group and views back to [N, K]; the group
size G is read from the matched view, so one pattern serves every G.
Forms: ``asymmetric`` / ``symmetric``, each as ``mm`` and (``F.linear`` with a
bias) ``addmm``; leading dims and operand order as in
:mod:`fusepass.patterns.dequant_matmul`.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from fusepass.formats import GROUP_SIZES
from fusepass.formats import dequantize_int4 as dequantize
from fusepass.formats import unpack_int4 as unpack
from fusepass.match import MatchInfo, same, shape_str
from fusepass.patterns import dequant_matmul as dm
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten
N_EX, K_EX, G_EX = 24, 64, 32


def _forms():
    def asym(x, packed, scale, zero):
        return x @ dequantize(packed, scale, zero, x.dtype).t()

    def asym_bias(x, packed, scale, zero, bias):
        return F.linear(x, dequantize(packed, scale, zero, x.dtype), bias)

    def sym(x, packed, scale):
        return x @ dequantize(packed, scale, None, x.dtype).t()

    def sym_bias(x, packed, scale, bias):
        return F.linear(x, dequantize(packed, scale, None, x.dtype), bias)

    def call(x, packed, scale, zero=None, bias=None):
        group = 2 * packed.shape[1] // scale.shape[1]
        return dm._op()(x, packed, scale.contiguous(), None if zero is None else zero.contiguous(),
                        None if bias is None else bias.reshape(-1).contiguous(), "int4", group)

    return [
        Form("asymmetric", asym, lambda x, packed, scale, zero: call(x, packed, scale, zero)),
        Form("asymmetric_bias", asym_bias, lambda x, packed, scale, zero, bias: call(x, packed, scale, zero, bias)),
        # The symmetric forms take (x, packed, scale[, bias]): their own inputs.
        Form("symmetric", sym, lambda x, packed, scale: call(x, packed, scale), example_inputs=lambda dt: _sym(dt)),
        Form("symmetric_bias", sym_bias, lambda x, packed, scale, bias: call(x, packed, scale, None, bias),
             example_inputs=lambda dt: _sym(dt)),
        # 3-D x that does not flatten without a copy: bmm (see dequant_matmul).
        Form("asymmetric_bmm", asym, lambda x, packed, scale, zero: call(x, packed, scale, zero),
             example_inputs=lambda dt: _bmm(example_inputs(dt))),
        Form("symmetric_bmm", sym, lambda x, packed, scale: call(x, packed, scale),
             example_inputs=lambda dt: _bmm(_sym(dt))),
    ]


def _bmm(inputs):
    x, *rest = inputs
    return [x.reshape(2, 2, -1).transpose(0, 1), *rest]


def int4_weights(dtype, n, k, group, gen=None):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    # Codes minus zero have rms ~6: dequantized rows of norm O(1) (see dm.channel_scale).
    scale = ((0.5 + torch.rand(n, k // group, generator=gen)) / (6 * k ** 0.5)).to(dtype)
    zero = torch.randint(0, 16, (n, k // group), generator=gen).to(dtype)
    return packed, scale, zero


def example_inputs(dtype):
    packed, scale, zero = int4_weights(dtype, N_EX, K_EX, G_EX)
    return [torch.randn(4, K_EX, dtype=dtype), packed, scale, zero, torch.randn(N_EX, dtype=dtype)]


def _sym(dtype):
    x, packed, scale, _, bias = example_inputs(dtype)
    return [x, packed, scale, bias]


def whole_groups(k: int) -> tuple[int, int]:
    """(K rounded up to a multiple of 32, as int4 needs whole groups; the group,
    the largest of 128 / 64 / 32 that divides it): the sized inputs of the
    rules whose forms hold int4 linears."""
    k = max(32, -(-k // 32) * 32)
    return k, next(g for g in (128, 64, 32) if k % g == 0)


def sized_inputs(dtype, shape):
    """x of ``shape`` with K rounded up to a multiple of 32 (int4 needs whole groups);
    the group the largest of 128/64/32 that divides K."""
    k, group = whole_groups(shape[-1] if shape else 1)
    packed, scale, zero = int4_weights(dtype, N_EX, k, group)
    return dict(x=torch.randn(*shape[:-1], k, dtype=dtype), packed=packed, scale=scale, zero=zero,
                bias=torch.randn(N_EX, dtype=dtype))


def _group_view(m: MatchInfo) -> torch.Tensor | None:
    """The [N, K // G, G] view of the codes (the 3-D reshape of the match)."""
    for n in m.nodes:
        v = n.meta.get("val")
        if n.target == aten.reshape.default and isinstance(v, torch.Tensor) and v.dim() == 3:
            return v
    return None


def check(m: MatchInfo) -> str | None:
    x, packed, scale = m.val("x"), m.val("packed"), m.val("scale")
    zero = m.val("zero") if "zero" in m.inputs else None
    bias = m.val("bias") if "bias" in m.inputs else None
    if packed.dtype != torch.uint8:
        return (f"packed weight dtype {packed.dtype} is not uint8 "
                f"({'>> 4 sign-extends an int8' if packed.dtype == torch.int8 else 'not two nibbles per byte'})")
    reason = dm.check_activation(x) or dm.check_weight(packed, "packed weight")
    if reason:
        return reason
    n, k = packed.shape[0], 2 * packed.shape[1]
    groups = _group_view(m)
    if groups is None:
        return "no [N, K // G, G] group view in the match"
    if not (same(groups.shape[0], n) and same(groups.shape[1] * groups.shape[2], k)):
        return f"the group view {shape_str(groups)} does not split the [{n}, {k}] codes into row groups"
    g = groups.shape[2]
    for t, what in ((scale, "scale"), (zero, "zero")):
        if t is None:
            continue
        if t.dim() != 2 or not (same(t.shape[0], n) and same(t.shape[1], groups.shape[1])):
            return f"{what} shape {shape_str(t)} is not (N, K // G) = ({n}, {groups.shape[1]})"
        if not t.dtype.is_floating_point:
            return f"{what} dtype {t.dtype} is not a float"
    if not any(same(g, s) for s in GROUP_SIZES):
        return f"group size {g} (K = {k}) is not one the kernel has ({', '.join(map(str, GROUP_SIZES))})"
    reason = dm.check_vector(bias, n, "bias") or dm.check_output(m, x, n)
    if reason:
        return reason
    if not same(x.shape[-1], k):
        return f"activation has {x.shape[-1]} features, the weight {k}"
    return dm.plan(m, x, n, k, "int4", g)


def explain(node: torch.fx.Node) -> str | None:
    return dm.explain_for(node, packed=True)


# -- near-misses ------------------------------------------------------------------------

def _nm_scale_per_channel(x, packed, scale, zero):
    # A [N, 1] scale broadcasts over every group: per channel, not per group.
    n = packed.shape[0]
    q = unpack(packed).to(x.dtype).reshape(n, 2, -1)
    return x @ ((q - zero[:, :2, None]) * scale[:, :1, None]).reshape(n, -1).t()


def _nm_group_16(x, packed, scale, zero):
    n = packed.shape[0]
    q = unpack(packed).to(x.dtype).reshape(n, -1, 16)
    s = scale.repeat_interleave(2, dim=1)
    return x @ ((q - 8) * s[..., None]).reshape(n, -1).t()


def _nm_int8_packed(x, packed, scale, zero):
    return x @ dequantize(packed.view(torch.int8), scale, zero, x.dtype).t()


def _nm_dequant_reused(x, packed, scale, zero):
    w = dequantize(packed, scale, zero, x.dtype)
    return x @ w.t(), w.amax()


def _nm_fp64(x, packed, scale, zero):
    return x @ dequantize(packed, scale, zero, x.dtype).t()


def _inputs(dtype):
    return example_inputs(dtype)[:4]


RULE = Rule(
    name="dequant_matmul_int4",
    forms=_forms(),
    example_inputs=example_inputs,
    sized_inputs=sized_inputs,
    check=check,
    anchor=(aten.mm.default, aten.addmm.default),
    explain=explain,
    commutative_root=True,
    any_reshape=True,
    near_misses=[
        NearMiss("scale per channel", _nm_scale_per_channel, _inputs, "scale shape (24, 1) is not (N, K // G)"),
        NearMiss("group of 16", _nm_group_16, _inputs, "group size 16"),
        NearMiss("int8 packed weight", _nm_int8_packed, _inputs, "sign-extends"),
        NearMiss("dequantized weight reused", _nm_dequant_reused, _inputs, "also used outside"),
        NearMiss("fp64 activations", _nm_fp64, lambda dt: _inputs(torch.float64), "float64 has no kernel"),
    ],
    doc=__doc__,
)
