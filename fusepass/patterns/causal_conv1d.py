"""Causal depthwise conv1d (+ SiLU) -> ``fusepass::causal_conv1d``.

The short convolution in front of a Gated DeltaNet (or Mamba) layer, as
``transformers`` computes it without the ``causal_conv1d`` package::

    y = F.conv1d(x, w.unsqueeze(1), bias, padding=K - 1, groups=C)[..., :T]
    y = silu(y)                                   # or no activation

with x ``[B, C, T]`` and w ``[C, K]``: every channel convolved with its own K
taps over the current and K - 1 previous tokens.  Found in the graph around
``aten.convolution``: a 1-D convolution with one group per channel, stride
and dilation 1, padding K - 1, cut back to T tokens, then SiLU (``silu`` or
its decomposition) or nothing.  The replacement is one launch instead of
the convolution, the slice and the activation.  The op lays its output out
``[B, T, C]``; here it is made contiguous ``[B, C, T]`` again, because views
later in a traced graph were traced for the convolution's layout.  (The
pre-trace path, :mod:`fusepass.pretrace`, routes transformers' functions to
the op before tracing and keeps its layout: the q, k, v views then reach
the GDN kernels without a copy.)
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from fusepass.kernels.causal_conv1d import causal_conv1d, causal_conv1d_update  # noqa: F401 - registers the ops
from fusepass.match import same
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
prims = torch.ops.prims


def search_silu(x, w):
    C, K = w.shape
    return F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=K - 1, groups=C)[..., :x.shape[-1]])


def search_plain(x, w):
    C, K = w.shape
    return F.conv1d(x, w.unsqueeze(1), None, padding=K - 1, groups=C)[..., :x.shape[-1]]


def replace_silu(x, w):
    return torch.ops.fusepass.causal_conv1d(x, w, None, "silu").contiguous()


def replace_plain(x, w):
    return torch.ops.fusepass.causal_conv1d(x, w, None, None).contiguous()


def example_inputs(dtype):
    return sized_inputs(dtype, (2, 12))


def sized_inputs(dtype, shape):
    """(*leading, hidden) as x [B, C, T] and w [C, 4], contiguous (the differential
    generator lays operands out itself; the models' x is the transpose of [B, T, C])."""
    B = 1 + (shape[0] % 2 if len(shape) > 1 else 0)
    C, T = max(2, min(shape[-1], 96) // 2 * 2), 9 + shape[-1] % 5
    return [torch.randn(B, C, T, dtype=dtype), torch.randn(C, 4, dtype=dtype) * 0.5]


# -- the rule's find ------------------------------------------------------------------------


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _only_user(n: torch.fx.Node) -> torch.fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _is(n, target) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target == target


def _silu_after(y: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node] | None:
    """The nodes of silu(y) and its result, in any of the traced spellings
    (``silu``; ``y / (1 + exp(-y))`` or ``y * sigmoid(y)``, in fp32 between casts), or None."""
    u = _only_user(y)
    if _is(u, aten.silu.default):
        return [u], u
    nodes, x = [], y
    if _is(u, prims.convert_element_type.default):
        nodes, x = [u], u
    users = list(x.users)
    if len(users) != 2:
        return None
    neg = next((n for n in users if _is(n, aten.neg.default)), None)
    sig = next((n for n in users if _is(n, aten.sigmoid.default)), None)
    if neg is not None:
        exp = _only_user(neg)
        add = _only_user(exp) if _is(exp, aten.exp.default) else None
        div = _only_user(add) if _is(add, aten.add.Tensor) and add.args[1] == 1 else None
        if not (_is(div, aten.div.Tensor) and div.args[0] is x and div.args[1] is add):
            return None
        nodes += [neg, exp, add, div]
        out = div
    elif sig is not None:
        mul = _only_user(sig)
        if not (_is(mul, aten.mul.Tensor) and set(mul.args) == {x, sig}):
            return None
        nodes += [sig, mul]
        out = mul
    else:
        return None
    back = _only_user(out)
    if _is(back, prims.convert_element_type.default) and back.args[1] == _val(y).dtype:
        nodes.append(back)
        out = back
    return nodes, out


def _refusal(conv: torch.fx.Node) -> str | None:
    x, w, bias, stride, padding, dilation, transposed, out_pad, groups = conv.args[:9]
    xv, wv = _val(x), _val(w)
    if xv is None or wv is None or xv.dim() != 3:
        return ""  # not a 1-D convolution: not an attempt
    C, K = wv.shape[0], wv.shape[-1]
    if transposed or list(stride) != [1] or list(dilation) != [1] or list(out_pad) != [0]:
        return "not a plain convolution (stride, dilation 1, not transposed)"
    if not (same(groups, xv.shape[1]) and same(C, xv.shape[1]) and wv.shape[1] == 1):
        return f"groups {groups} for {xv.shape[1]} channels: not depthwise"
    if list(padding) != [K - 1]:
        return f"padding {list(padding)} with {K} taps: not causal (padding K - 1)"
    if bias is not None:
        return "a bias (transformers' GDN layers have none; the op takes one, this finder does not)"
    if K > 8:
        return f"{K} taps (the kernel holds up to 8)"
    return None


def find(gm: torch.fx.GraphModule):
    for conv in [n for n in gm.graph.nodes if _is(n, aten.convolution.default)]:
        reason = _refusal(conv)
        if reason == "":
            continue
        if reason:
            yield Region("conv1d", conv, reason=reason)
            continue
        x, w = conv.args[0], conv.args[1]
        cut = _only_user(conv)
        if not (_is(cut, aten.slice.Tensor) and cut.args[1] in (2, -1) and cut.args[2] == 0
                and same(cut.args[3], _val(x).shape[2])):
            yield Region("conv1d", conv, reason="not cut back to the input's length ([..., :T])")
            continue
        if len(cut.args) > 4 and cut.args[4] != 1:
            yield Region("conv1d", conv, reason="a strided cut")
            continue
        silu = _silu_after(cut)
        nodes = [conv, cut] + (silu[0] if silu else [])
        out = silu[1] if silu else cut
        if _val(out).dtype != _val(x).dtype:
            yield Region("conv1d", conv, reason=f"output {_val(out).dtype} from {_val(x).dtype} input")
            continue
        form, replace = ("conv1d_silu", replace_silu) if silu else ("conv1d", replace_plain)
        # the taps [C, 1, K] as the op's [C, K]: from before the unsqueeze when it is there
        w2 = w.args[0] if _is(w, aten.unsqueeze.default) and w.args[1] == 1 and len(w.users) == 1 else w
        if w2 is not w:
            nodes.insert(0, w)
            yield Region(form, conv, nodes, [out], [x, w2], replace, names=["x", "w"])
        else:
            yield Region(form, conv, nodes, [out], [x, w], _replace_3d(replace), names=["x", "w"])


def _replace_3d(replace):
    return lambda x, w3: replace(x, w3.squeeze(1))


# -- near-misses ------------------------------------------------------------------------------

def _centered(x, w):  # 'same' padding: reads future tokens
    C, K = w.shape
    return F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=(K - 1) // 2, groups=C)[..., :x.shape[-1]])


def _grouped(x, w):  # two channels per group: not depthwise
    C, K = w.shape
    return F.silu(F.conv1d(x, w.view(C // 2, 2, K), None, padding=K - 1, groups=C // 2)[..., :x.shape[-1]])


def _full_length(x, w):  # no cut: T + K - 1 outputs
    C, K = w.shape
    return F.silu(F.conv1d(x, w.unsqueeze(1), None, padding=K - 1, groups=C))


RULE = Rule(
    name="causal_conv1d",
    forms=[Form("conv1d_silu", search_silu, replace_silu), Form("conv1d", search_plain, replace_plain)],
    example_inputs=example_inputs,
    dtypes=(torch.float32, torch.bfloat16),
    find=find,
    pretraced=(torch.ops.fusepass.causal_conv1d.default, torch.ops.fusepass.causal_conv1d_update.default),
    near_misses=[
        NearMiss("centered padding", _centered, example_inputs, "not causal"),
        NearMiss("two channels per group", _grouped, example_inputs, "not depthwise"),
        NearMiss("not cut back", _full_length, example_inputs, "not cut back"),
    ],
    sized_inputs=sized_inputs,
    doc=__doc__,
)
