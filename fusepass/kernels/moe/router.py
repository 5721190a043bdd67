"""The router of a sparse MoE block: logits, scores, top-k, renormalisation and
scaling in one op.

    moe_router(x [T, H], weight [E, H], bias [E]?, correction_bias [E]?, kind,
               top_k, renormalize, n_group, topk_group, scaling,
               logits_dtype, weights_dtype)
        -> topk_weights [T, top_k] (weights_dtype),
           topk_ids     [T, top_k] (int64),
           logits       [T, E]     (logits_dtype)

    logits = (x @ weight^T + bias), accumulated in fp32, rounded to logits_dtype
    s      = logits in fp32

    kind "softmax"       p = softmax(s);  ids = top-k of p;  w = p[ids]
                         renormalize: w /= sum(w)
                         (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, OLMoE: weights in
                         x's dtype; Mixtral: renormalised, weights left in fp32)
    kind "topk_softmax"  ids = top-k of s;  w = softmax(s[ids])
                         (gpt-oss, with its router bias)
    kind "sigmoid"       p = sigmoid(s);  c = p + correction_bias;
                         with n_group > 1, only the topk_group groups of
                         E / n_group experts with the largest sum of their two
                         largest c compete;  ids = top-k of c;  w = p[ids]
                         renormalize: w /= sum(w) + 1e-20
                         (DeepSeek-V3 and its family: logits in fp32)
    then  w *= scaling;  topk_weights = w rounded to weights_dtype

Every step after the logits runs in fp32, as the models do (their softmax
takes ``dtype=torch.float`` or a ``.float()`` input; gpt-oss's softmax of
bf16 values computes in fp32 and rounds once, which is this).

Ties: the top-k here (selection and order) puts the lower expert index first
among equal scores, in the reference and in the kernel.  torch.topk does not
promise an order among ties: on CPU it picks among them arbitrarily
(``std::nth_element``), on CUDA its selection keeps the lowest indices.  Ties
are not rare: bf16 logits have 8 significant bits, and with 128 experts two of
them near the k-th place are equal in a few percent of tokens; an equal score
at the k-th place decides which expert runs, so a comparison against eager
that must be exact on the ids sees such tokens differ (with the same weight).
DeepSeek-V3 calls ``topk(sorted=False)``, whose order is unspecified: any
order of the same ids is its answer; this op returns them in descending order.

The ``sigmoid`` kind's group scores and group choice follow DeepSeek-V3's
code: the sum of each group's two largest choice scores, the ``topk_group``
largest groups, the others masked with -inf before the final top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import run_kernel

ROUTER_KINDS = ("softmax", "topk_softmax", "sigmoid")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# DeepSeek-V3's guard against a zero sum of sigmoid scores.
SIGMOID_RENORM_EPS = 1e-20


# --------------------------------------------------------------- reference ----


def topk_lowest_first(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest along the last dim, descending, ties in ascending index order."""
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def moe_router_reference(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str,
                         top_k: int, renormalize: bool, n_group: int, topk_group: int, scaling: float,
                         logits_dtype: torch.dtype, weights_dtype: torch.dtype,
                         compute_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """The op's semantics in plain torch.  ``compute_dtype`` (fp32, or fp64 for
    tests) is where everything between the roundings the models make runs."""
    cd = compute_dtype
    E = weight.shape[0]
    logits = x.to(cd) @ weight.to(cd).t()
    if bias is not None:
        logits = logits + bias.to(cd)
    logits = logits.to(logits_dtype)
    s = logits.to(cd)
    if kind == "softmax":
        w, ids = topk_lowest_first(torch.softmax(s, dim=-1), top_k)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    elif kind == "topk_softmax":
        w, ids = topk_lowest_first(s, top_k)
        w = torch.softmax(w, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        p = torch.sigmoid(s)
        choice = p if correction_bias is None else p + correction_bias.to(cd)
        if n_group > 1:
            T, size = choice.shape[0], E // n_group
            group_scores = topk_lowest_first(choice.view(T, n_group, size), 2)[0].sum(dim=-1)
            group_ids = topk_lowest_first(group_scores, topk_group)[1]
            keep = torch.zeros(T, n_group, dtype=torch.bool, device=x.device).scatter_(1, group_ids, True)
            choice = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
        ids = topk_lowest_first(choice, top_k)[1]
        w = p.gather(1, ids)
        if renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + SIGMOID_RENORM_EPS)
    w = w * scaling
    return w.to(weights_dtype), ids, logits


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str, top_k: int,
           n_group: int, topk_group: int, logits_dtype: torch.dtype, weights_dtype: torch.dtype) -> None:
    torch._check(kind in ROUTER_KINDS, lambda: f"kind must be one of {ROUTER_KINDS}, got {kind!r}")
    torch._check(x.dim() == 2, lambda: f"x must be [T, H], got {tuple(x.shape)}")
    torch._check(weight.dim() == 2 and weight.shape[1] == x.shape[1],
                 lambda: f"weight must be [E, {x.shape[1]}], got {tuple(weight.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("correction_bias", correction_bias)):
        torch._check(t is None or t.dtype in _FLOATS, lambda: f"{name} must be floating point, got {t.dtype}")
    torch._check(logits_dtype in _FLOATS and weights_dtype in _FLOATS,
                 lambda: f"logits_dtype and weights_dtype must be floating point, got {logits_dtype}, {weights_dtype}")
    E = weight.shape[0]
    torch._check(1 <= top_k <= E, lambda: f"top_k = {top_k} outside [1, {E} experts]")
    torch._check(bias is None or tuple(bias.shape) == (E,), lambda: f"bias must be [{E}], got {tuple(bias.shape)}")
    torch._check(correction_bias is None or kind == "sigmoid",
                 lambda: f"a correction bias belongs to the sigmoid router, not {kind!r}")
    torch._check(correction_bias is None or tuple(correction_bias.shape) == (E,),
                 lambda: f"correction_bias must be [{E}], got {tuple(correction_bias.shape)}")
    torch._check(n_group == 1 or kind == "sigmoid", lambda: f"group-limited top-k belongs to the sigmoid router, not {kind!r}")
    torch._check(n_group >= 1 and E % n_group == 0, lambda: f"{E} experts do not split into {n_group} groups")
    torch._check(n_group == 1 or E // n_group >= 2, lambda: "groups need two experts or more (their score is a top-2 sum)")
    torch._check(1 <= topk_group <= n_group, lambda: f"topk_group = {topk_group} outside [1, {n_group}]")
    torch._check(top_k <= topk_group * (E // n_group),
                 lambda: f"top_k = {top_k} exceeds the {topk_group * (E // n_group)} experts of the chosen groups")


# ----------------------------------------------------------------------- op ----


def _reference_out(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                   logits_dtype, weights_dtype):
    cd = torch.float64 if torch.float64 in (x.dtype, weight.dtype, logits_dtype) else torch.float32
    w, ids, logits = moe_router_reference(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group,
                                          topk_group, scaling, logits_dtype, weights_dtype, cd)
    return w.contiguous(), ids.contiguous(), logits.contiguous()


@torch.library.custom_op("fusepass::moe_router", mutates_args=())
def moe_router(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str, top_k: int,
               renormalize: bool, n_group: int, topk_group: int, scaling: float, logits_dtype: torch.dtype,
               weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(topk_weights, topk_ids, logits) of an MoE router (module docstring).  This body serves CPU and every non-CUDA device."""
    _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    return _reference_out(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                          logits_dtype, weights_dtype)


@moe_router.register_fake
def _moe_router_fake(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                     logits_dtype, weights_dtype):
    _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    T, E = x.shape[0], weight.shape[0]
    return (x.new_empty((T, top_k), dtype=weights_dtype), x.new_empty((T, top_k), dtype=torch.int64),
            x.new_empty((T, E), dtype=logits_dtype))


@moe_router.register_kernel("cuda")
def _moe_router_cuda(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                     logits_dtype, weights_dtype):
    _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    args = (x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype,
            weights_dtype)
    return run_kernel("moe_router", lambda: _reference_out(*args), lambda: _reference_out(*args))
