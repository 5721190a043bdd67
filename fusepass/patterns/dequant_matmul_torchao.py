"""torchao's int8 weight-only linear (``Int8WeightOnlyConfig``) -> ``fusepass::dequant_matmul``.

    y = (x @ q.T.to(x.dtype)) * scale.to(x.dtype).reshape(N)   q int8 [N, K], scale fp32 [N, 1]  (Int8Tensor)
    y = (x @ q.T.to(x.dtype)) * scale                           scale [N] in x's dtype   (AffineQuantizedTensor)

as the two tensor subclasses trace: torchao 0.18's ``Int8Tensor`` (form
``int8_weight_only``) and the ``AffineQuantizedTensor`` that 0.17 and earlier
build, whose scale is kept in the model's dtype, so no convert or reshape
appears (form ``int8_weight_only_aqt``).  In both the activation is
flattened to 2-D, ``mm(x, convert(permute(q)))``, the product scaled, then
unflattened; a bias is added after, beside the op.  The transpose comes
before the convert here (after it in hand-written code), and where the scale
is converted to the activation's dtype first the op is given that rounded
scale, so it agrees with torchao's own rounding.  Checks as in
:mod:`fusepass.patterns.dequant_matmul`.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from fusepass.formats import CHANNEL_FORMATS
from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.match import MatchInfo
from fusepass.patterns import dequant_matmul as dm
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten
prims = torch.ops.prims
N_EX, K_EX = 24, 40


def search(x, weight, scale):
    return (x @ weight.t().to(x.dtype)) * scale.to(x.dtype).reshape(-1)


def replace(x, weight, scale):
    return dm._call(x, weight, scale.to(x.dtype))


def search_aqt(x, weight, scale_n):  # its own name: sized_inputs gives it a [N] scale in x's dtype
    return (x @ weight.t().to(x.dtype)) * scale_n


def replace_aqt(x, weight, scale_n):
    return dm._call(x, weight, scale_n)


def example_inputs_aqt(dtype):
    x, w, _ = example_inputs(dtype)
    return [x, w, dm.channel_scale(N_EX, K_EX, dtype)]


def example_inputs(dtype):
    return [torch.randn(4, K_EX, dtype=dtype), torch.randint(-127, 128, (N_EX, K_EX), dtype=torch.int8),
            dm.channel_scale(N_EX, K_EX)[:, None]]


def sized_inputs(dtype, shape):
    # x 2-D, as torchao flattens it before its mm: a strided 3-D x would reach the
    # graph as a bmm, which torchao never produces and this rule does not anchor on.
    K = max(shape[-1] if shape else 1, 2)  # see dequant_matmul.sized_inputs
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    scale = dm.channel_scale(N_EX, K)
    return dict(x=torch.randn((rows, K), dtype=dtype), weight=torch.randint(-127, 128, (N_EX, K), dtype=torch.int8),
                scale=scale[:, None], scale_n=scale.to(dtype))


def check(m: MatchInfo) -> str | None:
    aqt = m.form == "int8_weight_only_aqt"
    x, w, scale = m.val("x"), m.val("weight"), m.val("scale_n" if aqt else "scale")
    if w.dtype not in CHANNEL_FORMATS:
        return f"weight dtype {w.dtype} is not a format fusepass knows (int8, float8_e4m3fn per channel)"
    n, k = w.shape[0], w.shape[-1]
    reason = dm.check_activation(x) or dm.check_weight(w)
    if reason:
        return reason
    if scale.numel() != n or not scale.dtype.is_floating_point or (aqt and scale.dim() != 1):
        return f"scale {scale.dtype}{dm.shape_str(scale)} is not one float per output channel ({n})"
    reason = dm.check_output(m, x, n)
    if reason:
        return reason
    return dm.plan(m, x, n, k, CHANNEL_FORMATS[w.dtype], k)


def explain(node: torch.fx.Node) -> str | None:
    """Only the torchao-shaped weight operand, ``convert(permute(q))``; the rest is dequant_matmul's."""
    i_x, i_w = (1, 2) if node.target == aten.addmm.default else (0, 1)
    w = node.args[i_w] if len(node.args) > i_w else None
    if not (isinstance(w, torch.fx.Node) and w.target == prims.convert_element_type.default
            and isinstance(w.args[0], torch.fx.Node) and w.args[0].target == aten.permute.default):
        return None
    q = w.args[0].args[0]
    qv = q.meta.get("val") if isinstance(q, torch.fx.Node) else None
    if not isinstance(qv, torch.Tensor) or qv.dtype not in CHANNEL_FORMATS:
        return None
    x = node.args[i_x].meta.get("val")
    if isinstance(x, torch.Tensor) and x.dtype not in SUPPORTED:
        return f"activation dtype {x.dtype} has no kernel (fp32/fp16/bf16 only)"
    if len(w.users) > 1 or len(w.args[0].users) > 1:
        return f"the dequantized weight ({w.name}) is also used outside the matmul"
    return "a matmul on torchao's int8 weight without its per-channel scale multiply after it"


def _nm_no_scale(x, w, s):
    return x @ w.t().to(x.dtype), s


def _nm_fp64(x, w, s):
    return search(x, w, s)


RULE = Rule(
    name="dequant_matmul_torchao",
    forms=[Form("int8_weight_only", search, replace),
           Form("int8_weight_only_aqt", search_aqt, replace_aqt, example_inputs_aqt)],
    example_inputs=example_inputs,
    sized_inputs=sized_inputs,
    check=check,
    anchor=(aten.mm.default, aten.addmm.default),
    explain=explain,
    commutative_root=True,
    any_reshape=True,
    near_misses=[
        NearMiss("no scale", _nm_no_scale, example_inputs, "without its per-channel scale"),
        NearMiss("fp64 activations", _nm_fp64, lambda dt: example_inputs(torch.float64), "float64 has no kernel"),
    ],
    doc=__doc__,
)
