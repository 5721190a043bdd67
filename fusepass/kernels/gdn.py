"""Gated DeltaNet (GDN) linear attention: chunked prefill and recurrent decode.

Per batch and value head, with the state S in R^{d_k x d_v} kept in fp32, for
each token t (q scaled by ``scale``, q and k L2-normalised first when
``use_qk_l2norm``):

    S <- exp(g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

Inputs as ``transformers``' ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` receive them: q, k ``[B, T, H_k, d_k]``,
v ``[B, T, H_v, d_v]``, g (log decay) and beta ``[B, T, H_v]``, an optional
initial state ``[B, H_v, d_k, d_v]``.  H_v is a multiple of H_k: value head h
reads key head ``h // (H_v // H_k)`` (``repeat_interleave`` on the head dim).
Outputs: o ``[B, T, H_v, d_v]`` contiguous in q's dtype, and the final state
``[B, H_v, d_k, d_v]`` contiguous in fp32 (always returned; a caller that
does not want it drops it).

``gdn_chunk`` and ``gdn_recurrent`` compute the same function; they differ in
the algorithm their kernels use (chunked for prefill, a token loop for
decode and short T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fusepass.kernels._common import run_kernel

L2NORM_EPS = 1e-6  # transformers' l2norm(x, dim=-1, eps=1e-6), as FLA


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gdn_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float, compute_dtype: torch.dtype = torch.float32
                  ) -> tuple[Tensor, Tensor]:
    """The recurrence token by token in ``compute_dtype`` (fp32; fp64 for references).

    Returns o in q's dtype (``compute_dtype`` when that is fp64) and the final
    state in fp32 (fp64 likewise)."""
    out_dtype = compute_dtype if compute_dtype == torch.float64 else q.dtype
    state_dtype = compute_dtype if compute_dtype == torch.float64 else torch.float32
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    q, k, v, g, beta = (x.transpose(1, 2).to(compute_dtype) for x in (q, k, v, g, beta))
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=1)
        k = k.repeat_interleave(Hv // Hk, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    if initial_state is None:
        S = torch.zeros(B, Hv, Dk, Dv, dtype=compute_dtype, device=v.device)
    else:
        S = initial_state.to(compute_dtype)
    o = torch.empty(B, Hv, T, Dv, dtype=compute_dtype, device=v.device)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        S = S + k_t[..., None] * delta[..., None, :]
        o[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return o.transpose(1, 2).to(out_dtype).contiguous(), S.to(state_dtype).contiguous()


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
# The CUDA implementations are the Triton kernels (issue: GDN kernels); until
# they exist the CUDA path runs the reference too.


@torch.library.custom_op("fusepass::gdn_chunk", mutates_args=())
def gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
              use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Chunked GDN prefill: (o [B, T, H_v, d_v] in q's dtype, final state fp32)."""
    _check(q, k, v, g, beta, initial_state)
    return gdn_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, scale)


@gdn_chunk.register_fake
def _gdn_chunk_fake(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    return _fake(q, k, v, g, beta, initial_state)


@torch.library.custom_op("fusepass::gdn_recurrent", mutates_args=())
def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Recurrent GDN (decode, short T): (o [B, T, H_v, d_v] in q's dtype, final state fp32)."""
    _check(q, k, v, g, beta, initial_state)
    return gdn_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, scale)


@gdn_recurrent.register_fake
def _gdn_recurrent_fake(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    return _fake(q, k, v, g, beta, initial_state)


@gdn_chunk.register_kernel("cuda")
def _gdn_chunk_cuda(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    _check(q, k, v, g, beta, initial_state)
    ref = lambda: gdn_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, scale)  # noqa: E731
    return run_kernel("gdn_chunk", ref, ref)


@gdn_recurrent.register_kernel("cuda")
def _gdn_recurrent_cuda(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    _check(q, k, v, g, beta, initial_state)
    ref = lambda: gdn_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, scale)  # noqa: E731
    return run_kernel("gdn_recurrent", ref, ref)
