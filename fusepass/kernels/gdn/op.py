"""The ops ``fusepass::gdn_chunk`` and ``fusepass::gdn_recurrent``: fake, CUDA
(Triton) and CPU (plain torch) implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import run_kernel
from fusepass.kernels.gdn.launch import RECURRENT_MAX_T, gdn_chunk_fwd, gdn_recurrent_fwd, kernel_supported
from fusepass.kernels.gdn.reference import _compute_dtype, _fp32_state, gdn_chunk_torch, gdn_reference


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: f"q, k, v must be [B, T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    torch._check(tuple(k.shape) == tuple(q.shape), lambda: f"k {tuple(k.shape)} is not q's shape {tuple(q.shape)}")
    torch._check(v.shape[0] == B and v.shape[1] == T, lambda: f"v {tuple(v.shape)} does not match q {tuple(q.shape)}")
    torch._check(Hv % Hk == 0, lambda: f"{Hv} value heads are not a multiple of {Hk} key heads")
    torch._check(tuple(g.shape) == (B, T, Hv), lambda: f"g is {tuple(g.shape)}, not {(B, T, Hv)}")
    torch._check(tuple(beta.shape) == (B, T, Hv), lambda: f"beta is {tuple(beta.shape)}, not {(B, T, Hv)}")
    if initial_state is not None:
        torch._check(tuple(initial_state.shape) == (B, Hv, Dk, Dv),
                     lambda: f"initial_state is {tuple(initial_state.shape)}, not {(B, Hv, Dk, Dv)}")


def _fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
          ) -> tuple[Tensor, Tensor]:
    _check(q, k, v, g, beta, initial_state)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out = v.new_empty((B, T, Hv, Dv), dtype=q.dtype)
    state = v.new_empty((B, Hv, Dk, Dv), dtype=torch.float32)
    return out, state


# ----------------------------------------------------------------------- ops ----


@torch.library.custom_op("fusepass::gdn_chunk", mutates_args=())
def gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
              use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Chunked GDN prefill: (o [B, T, H_v, d_v] in q's dtype, final state fp32).

    This body (CPU and every non-CUDA device) runs the chunked algorithm in
    plain torch, 64 tokens per step instead of one."""
    _check(q, k, v, g, beta, initial_state)
    return _fp32_state(gdn_chunk_torch(q, k, v, g, beta, initial_state, use_qk_l2norm, scale))


@gdn_chunk.register_fake
def _gdn_chunk_fake(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    return _fake(q, k, v, g, beta, initial_state)


@torch.library.custom_op("fusepass::gdn_recurrent", mutates_args=())
def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Recurrent GDN (decode, short T): (o [B, T, H_v, d_v] in q's dtype, final state fp32)."""
    _check(q, k, v, g, beta, initial_state)
    return _fp32_state(gdn_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, scale, _compute_dtype(q)))


@gdn_recurrent.register_fake
def _gdn_recurrent_fake(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    return _fake(q, k, v, g, beta, initial_state)


@gdn_chunk.register_kernel("cuda")
def _gdn_chunk_cuda(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    _check(q, k, v, g, beta, initial_state)
    args = (q, k, v, g, beta, initial_state, use_qk_l2norm, scale)
    fallback = lambda: _fp32_state(gdn_chunk_torch(*args))  # noqa: E731
    if not kernel_supported(q, k, v, g, beta, initial_state):
        return fallback()  # fp64, mixed q/k/v dtypes, d_k > 256
    launch = gdn_recurrent_fwd if q.shape[1] <= RECURRENT_MAX_T else gdn_chunk_fwd
    return run_kernel("gdn_chunk", lambda: launch(*args), fallback)


@gdn_recurrent.register_kernel("cuda")
def _gdn_recurrent_cuda(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    _check(q, k, v, g, beta, initial_state)
    args = (q, k, v, g, beta, initial_state, use_qk_l2norm, scale)
    fallback = lambda: _fp32_state(gdn_reference(*args, _compute_dtype(q)))  # noqa: E731
    if not kernel_supported(q, k, v, g, beta, initial_state):
        return fallback()
    return run_kernel("gdn_recurrent", lambda: gdn_recurrent_fwd(*args), fallback)
