"""The residual add and RMSNorm before an MoE router, with the router -> ``fusepass::add_rms_norm_router``.

    y, h = add_rms_norm(x, residual, w_norm)                (fusepass::add_rms_norm)
    topk_weights, topk_ids, logits = moe_router(y viewed [T, H], w_router, ...)   (fusepass::moe_router)
    returns y (the experts' and shared experts' input), h (the next residual) and the router's outputs

Found after the ``add_rms_norm`` and ``moe_router`` rules made their ops of
the model's code: an ``add_rms_norm`` call whose normalised output, flattened
to the router's [T, H] by views only, is the router's x.  One launch instead
of two: at one token the norm is a launch of its own whose time is latency,
ahead of the router's programs, which each read the whole row anyway
(``fusepass.kernels.moe.router_norm``).  Every other reader of y and h keeps
reading them; the op writes both.

Left alone, without a line in the report: a router whose x is not a view of
an ``add_rms_norm`` output (a plain ``rms_norm`` with no residual, a scaled
or sliced y).  Refused with the reason: an argument of the router (its
weight or biases) computed after the norm, where the fused call cannot be
placed.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fusepass.kernels.moe.router_norm import add_rms_norm_router_call
from fusepass.match import same
from fusepass.patterns import moe_router as mr
from fusepass.patterns._linear import is_call as _is, val as _val
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
_NORM = torch.ops.fusepass.add_rms_norm.default
_ROUTER = torch.ops.fusepass.moe_router.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
EPS = 1e-6


# -- the example programs (the model's code before any rule) ------------------------------------


def _norm(x, residual, w_norm):
    """HF Llama / Qwen3-MoE's residual add and RMSNorm."""
    h = x + residual
    hf = h.float()
    y = w_norm * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
    return y, h


def _flat(y):
    return y.reshape(-1, y.shape[-1])


def search_softmax(x, residual, w_norm, weight):
    y, h = _norm(x, residual, w_norm)
    f = _flat(y)
    return (*mr._chosen(*mr.softmax_topk(f, weight), f, weight), y, h)


def search_topk_softmax(x, residual, w_norm, weight, bias):
    y, h = _norm(x, residual, w_norm)
    f = _flat(y)
    return (*mr._chosen(*mr.topk_softmax(f, weight, bias), f, weight, bias), y, h)


def _replace_softmax(x, residual, w_norm, weight):
    w, ids, logits, y, h = add_rms_norm_router_call(x, residual, w_norm, EPS, 0.0, True, x.dtype, weight, None, None,
                                                    "softmax", 2, True, 1, 1, 1.0, x.dtype, x.dtype)
    f = _flat(y)
    return (*mr._chosen(w, ids, logits, f, weight), y, h)


def _replace_topk_softmax(x, residual, w_norm, weight, bias):
    w, ids, logits, y, h = add_rms_norm_router_call(x, residual, w_norm, EPS, 0.0, True, x.dtype, weight, bias, None,
                                                    "topk_softmax", 2, False, 1, 1, 1.0, x.dtype, x.dtype)
    f = _flat(y)
    return (*mr._chosen(w, ids, logits, f, weight, bias), y, h)


def sized_inputs(dtype, shape):
    """x and the residual [*leading, H], H as the router rule draws it (8 to 256), 16 experts."""
    d = mr.sized_inputs(dtype, shape)
    H = d["x"].shape[-1]
    gen = torch.Generator().manual_seed(H + 7)
    lead = [s for s in shape[:-1]]
    x = torch.randn(*lead, H, generator=gen).to(dtype)
    return dict(x=x, residual=torch.randn(*lead, H, generator=gen).to(dtype),
                w_norm=(1 + 0.1 * torch.randn(H, generator=gen)).to(dtype), weight=d["weight"], bias=d["bias"])


def example_inputs(dtype):
    d = sized_inputs(dtype, (5, 32))
    return [d["x"], d["residual"], d["w_norm"], d["weight"]]


def _bias_inputs(dtype):
    return list(sized_inputs(dtype, (5, 32)).values())


# -- the rule's find ------------------------------------------------------------------------------


def _under_views(node):
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        chain.append(node)
        node = node.args[0]
    return node, chain


def _getitem(node) -> tuple[torch.fx.Node, int] | None:
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def _flattens(view: torch.fx.Node, y: torch.fx.Node) -> bool:
    """Whether ``view`` is ``y`` [..., H] as [T, H] (row-major: any chain of views and reshapes is)."""
    v, t = _val(view), _val(y)
    if not isinstance(v, torch.Tensor) or not isinstance(t, torch.Tensor) or v.dim() != 2 or t.dim() < 1:
        return False
    T = 1
    for s in t.shape[:-1]:
        T = T * s
    return same(v.shape[1], t.shape[-1]) and same(v.shape[0], T)


def _users(node: torch.fx.Node, index: int) -> list[torch.fx.Node]:
    return [u for u in node.users if _getitem(u) == (node, index)]


def find(gm: torch.fx.GraphModule):
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for router in gm.graph.nodes:
        if not _is(router, _ROUTER) or len(router.args) != 12 or router.kwargs:
            continue
        base, _ = _under_views(router.args[0])
        got = _getitem(base)
        if got is None or got[1] != 0 or not _is(got[0], _NORM) or got[0].kwargs or len(got[0].args) not in (7, 8):
            continue
        norm = got[0]
        if not _flattens(router.args[0], base):
            continue
        if any(not _getitem(u) for u in [*norm.users, *router.users]):
            continue
        x, residual, w_norm, eps, offset, cast, out_dtype = norm.args[:7]
        eps_tensor = norm.args[7] if len(norm.args) == 8 else None
        weight, bias, cbias, kind, top_k, renorm, n_group, topk_group, scaling, logits_dtype, weights_dtype = \
            router.args[1:]
        later = [a for a in (weight, bias, cbias) if isinstance(a, torch.fx.Node) and pos[a] > pos[norm]]
        if later:
            yield Region(kind, router, reason=f"the router's {later[0].name} is computed after the norm: the fused "
                         "call cannot be placed before the norm's readers")
            continue
        ys, hs = _users(norm, 0), _users(norm, 1)
        outs = [_users(router, i) for i in range(3)]
        if len(ys) > 1 or len(hs) > 1 or any(len(o) > 1 for o in outs):
            continue  # (a getitem twice: CSE leaves one; not worth a second path)
        nodes = [norm, *ys, *hs, router, *(o[0] for o in outs if o)]
        outputs = [ys[0], hs[0] if hs else None, *(o[0] if o else None for o in outs)]
        args = [x, residual, w_norm, eps_tensor if eps_tensor is not None else eps, weight, bias, cbias]
        names = ["x", "residual", "w_norm", "eps", "weight", "bias", "correction_bias"]
        yield Region(kind, router, nodes, outputs, args,
                     _replacement([o is not None for o in outputs], offset, cast, out_dtype, kind, top_k, renorm,
                                  n_group, topk_group, scaling, logits_dtype, weights_dtype),
                     names=names, arguments_checked=True)


def _replacement(read, offset, cast, out_dtype, kind, top_k, renorm, n_group, topk_group, scaling, logits_dtype,
                 weights_dtype):
    """The fused call, returning (y, h, topk_weights, topk_ids, logits), None where
    ``read`` says the region's output has no node (nobody reads it)."""
    def replace(x, residual, w_norm, eps, weight, bias, correction_bias):
        tw, tid, logits, y, h = add_rms_norm_router_call(x, residual, w_norm, eps, offset, cast, out_dtype, weight,
                                                         bias, correction_bias, kind, top_k, renorm, n_group,
                                                         topk_group, scaling, logits_dtype, weights_dtype)
        return tuple(t if r else None for t, r in zip((y, h, tw, tid, logits), read))

    return replace


# -- near-misses ------------------------------------------------------------------------------------


def _nm_no_residual(x, residual, w_norm, weight):  # a plain RMSNorm before the router: nothing to fold
    xf = x.float()
    y = w_norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    f = _flat(y)
    return (*mr._chosen(*mr.softmax_topk(f, weight), f, weight), residual)


def _nm_scaled(x, residual, w_norm, weight):  # the router reads 2 y, not y
    y, h = _norm(x, residual, w_norm)
    f = _flat(y * 2)
    return (*mr._chosen(*mr.softmax_topk(f, weight), f, weight), y, h)


RULE = Rule(
    name="add_rms_norm_router",
    forms=[Form("softmax", search_softmax, _replace_softmax),
           Form("topk_softmax", search_topk_softmax, _replace_topk_softmax, example_inputs=_bias_inputs)],
    example_inputs=example_inputs,
    dtypes=(torch.float32, torch.bfloat16),
    find=find,
    priority=-5,  # after add_rms_norm (10) and moe_router (30) made their ops
    sized_inputs=sized_inputs,
    builds_on=("add_rms_norm", "moe_router"),
    near_misses=[
        NearMiss("plain rms_norm", _nm_no_residual, example_inputs, ""),
        NearMiss("router of 2 y", _nm_scaled, example_inputs, ""),
    ],
    canonical=mr.canonical,
    doc=__doc__,
)
