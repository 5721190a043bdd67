"""A residual add and RMSNorm with the MoE router that reads its output, in one launch.

    add_rms_norm_router(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype,
                        weight, bias?, correction_bias?, kind, top_k, renormalize, n_group, topk_group,
                        scaling, logits_dtype, weights_dtype, eps_tensor?)
        -> topk_weights [T, top_k], topk_ids [T, top_k], logits [T, E], y [..., H], h [..., H]

    y, h = fusepass::add_rms_norm(x, residual, norm_weight, eps, ...)     (y in norm_dtype, h in x's dtype)
    topk_weights, topk_ids, logits = fusepass::moe_router(y viewed [T, H], weight, ...)

In a decoder layer of an MoE model the post-attention norm's output goes to
the router and the experts.  At one token the norm is one program's launch
whose time is latency, and the router's programs each read the whole row
anyway: here each router program computes its tokens' rows of y itself
(``router.Norm``: the sum of squares over the row, then each tile
normalised before its products) and the programs of expert block 0 store y
and h.  y is what ``add_rms_norm``'s kernel computes, roundings included;
the row's sum of squares may be added in another order (an ulp of the norm,
as between any two norm kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import call, eps_args, inline_enabled, on_device, op_eps, register_inline, run_kernel
from fusepass.kernels.moe import _tiles
from fusepass.kernels.moe.router import (
    Norm,
    _check,
    _kernel_ok,
    _reference_out,
    _static,
    _unit_last,
    router_fwd,
    router_traced,
)
from fusepass.kernels.rms_norm import _add_rms_norm_ref_out, _check_residual, _kernel_handles


def _check_all(x, residual, norm_weight, norm_dtype, weight, bias, correction_bias, kind, top_k, n_group, topk_group,
               logits_dtype, weights_dtype, eps, eps_tensor):
    _check_residual(x, residual)
    op_eps(eps, eps_tensor)
    torch._check(x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1],
                 lambda: f"x [..., H] and a router weight [E, H] needed, got {tuple(x.shape)}, {tuple(weight.shape)}")
    torch._check(tuple(norm_weight.shape) == (x.shape[-1],),
                 lambda: f"norm_weight must be [{x.shape[-1]}], got {tuple(norm_weight.shape)}")
    y = x.new_empty(x.shape, dtype=norm_dtype).reshape(-1, x.shape[-1])
    _check(y, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)


def _reference(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight, bias,
               correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype):
    y, h = _add_rms_norm_ref_out(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype)
    tw, tid, logits = _reference_out(y.reshape(-1, x.shape[-1]), weight, bias, correction_bias, kind, top_k,
                                     renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype)
    return tw, tid, logits, y, h


def _fits(x, residual, norm_weight, norm_dtype, weight, kind, n_group) -> bool:
    """Whether the fused launch takes these operands (else the two references)."""
    H = x.shape[-1]
    y = x.new_empty((1, H), dtype=norm_dtype) if H else x
    return (_kernel_handles(x, norm_weight, norm_dtype, residual) and _kernel_ok(y, weight, kind, n_group)
            and norm_weight.device == x.device)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _fused(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight, bias,
           correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype):
    y = _tiles.workspace(x.shape, norm_dtype, x.device)
    h = _tiles.workspace(x.shape, x.dtype, x.device)
    x2, r2 = _rows(x), _rows(residual)
    norm = Norm(r2, norm_weight.contiguous(), eps, weight_offset, cast_before_weight, y.view(x2.shape),
                h.view(x2.shape))
    with on_device(x):
        tw, tid, logits = router_fwd(x2, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group,
                                     scaling, logits_dtype, weights_dtype, norm=norm)
    return tw, tid, logits, y, h


@torch.library.custom_op("fusepass::add_rms_norm_router", mutates_args=())
def add_rms_norm_router(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight_offset: float,
                        cast_before_weight: bool, norm_dtype: torch.dtype, weight: Tensor, bias: Tensor | None,
                        correction_bias: Tensor | None, kind: str, top_k: int, renormalize: bool, n_group: int,
                        topk_group: int, scaling: float, logits_dtype: torch.dtype, weights_dtype: torch.dtype,
                        eps_tensor: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(topk_weights, topk_ids, logits, y, h) (module docstring).  This body
    serves CPU and every non-CUDA device."""
    _check_all(x, residual, norm_weight, norm_dtype, weight, bias, correction_bias, kind, top_k, n_group, topk_group,
               logits_dtype, weights_dtype, eps, eps_tensor)
    return _reference(x, residual, norm_weight, op_eps(eps, eps_tensor), weight_offset, cast_before_weight,
                      norm_dtype, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group,
                      scaling, logits_dtype, weights_dtype)


@add_rms_norm_router.register_fake
def _fake(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight, bias,
          correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype,
          eps_tensor=None):
    _check_all(x, residual, norm_weight, norm_dtype, weight, bias, correction_bias, kind, top_k, n_group, topk_group,
               logits_dtype, weights_dtype, eps, eps_tensor)
    T = x.numel() // x.shape[-1] if x.shape[-1] else x[..., 0].numel()
    E = weight.shape[0]
    return (x.new_empty((T, top_k), dtype=weights_dtype), x.new_empty((T, top_k), dtype=torch.int64),
            x.new_empty((T, E), dtype=logits_dtype), x.new_empty(x.shape, dtype=norm_dtype), x.new_empty(x.shape))


@add_rms_norm_router.register_kernel("cuda")
def _cuda(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight, bias, correction_bias,
          kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype, eps_tensor=None):
    _check_all(x, residual, norm_weight, norm_dtype, weight, bias, correction_bias, kind, top_k, n_group, topk_group,
               logits_dtype, weights_dtype, eps, eps_tensor)
    args = (x, residual, norm_weight, op_eps(eps, eps_tensor), weight_offset, cast_before_weight, norm_dtype, weight,
            bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype,
            weights_dtype)
    if not _fits(x, residual, norm_weight, norm_dtype, weight, kind, n_group):  # fp64, > 1024 experts
        return _reference(*args)
    return run_kernel("add_rms_norm_router", lambda: _fused(*args), lambda: _reference(*args))


# -- the inlined form (a CUDA graph's launches in Inductor's code) --------------------------------


def _inline_ok(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight, bias,
               correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype,
               eps_tensor=None) -> bool:
    # Static sizes (the launch's tiles depend on T), a number for eps, at least one token.
    try:
        _check_all(x, residual, norm_weight, norm_dtype, weight, bias, correction_bias, kind, top_k, n_group,
                   topk_group, logits_dtype, weights_dtype, eps, eps_tensor)
    except RuntimeError:  # the op's call raises the error itself
        return False
    return (inline_enabled(x) and eps_tensor is None and _static(*x.shape, *weight.shape, *weight.stride())
            and x.numel() > 0 and _fits(x, residual, norm_weight, norm_dtype, weight, kind, n_group))


def _traced(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight, bias,
            correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype,
            eps_tensor=None):
    x2, r2 = _rows(x), _rows(residual)
    y = torch.empty(x2.shape, dtype=norm_dtype, device=x.device)
    h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    norm = Norm(r2, norm_weight.contiguous(), eps, weight_offset, cast_before_weight, y, h)
    tw, tid, logits, y, h = router_traced(x2, weight, _unit_last(bias), _unit_last(correction_bias), kind, top_k,
                                          renormalize, n_group, topk_group, scaling, logits_dtype, weights_dtype,
                                          norm)
    return tw, tid, logits, y.view(x.shape), h.view(x.shape)


register_inline(torch.ops.fusepass.add_rms_norm_router.default, _inline_ok, _traced)


def add_rms_norm_router_call(x, residual, norm_weight, eps, weight_offset, cast_before_weight, norm_dtype, weight,
                             bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                             logits_dtype, weights_dtype):
    """What a rule puts in a graph (the op, or its launch inlined); ``eps`` a
    number or a 0-dim tensor."""
    eps, eps_tensor = eps_args(eps)
    return call(torch.ops.fusepass.add_rms_norm_router.default, x, residual, norm_weight, eps, weight_offset,
                cast_before_weight, norm_dtype, weight, bias, correction_bias, kind, top_k, renormalize, n_group,
                topk_group, scaling, logits_dtype, weights_dtype, eps_tensor)
