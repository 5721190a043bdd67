"""The GDN recurrence in plain torch: the token loop (the reference) and the
chunked algorithm of the kernels (the CPU body of ``gdn_chunk``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

L2NORM_EPS = 1e-6  # transformers' l2norm(x, dim=-1, eps=1e-6), as FLA
CHUNK = 64  # tokens per chunk of the chunked form (BT in the kernels)


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
        S = initial_state.to(compute_dtype, copy=True)  # T = 0 returns it: never the caller's tensor
    o = torch.empty(B, Hv, T, Dv, dtype=compute_dtype, device=v.device)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        S = S + k_t[..., None] * delta[..., None, :]
        o[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return o.transpose(1, 2).to(out_dtype).contiguous(), S.to(state_dtype).contiguous()


def _compute_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _fp32_state(result: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The ops' final state is fp32 for every input dtype (fp64 inputs compute in fp64)."""
    o, S = result
    return o, S if S.dtype == torch.float32 else S.float()


def _unit_lower_inverse(A: Tensor, block: int = 16) -> Tensor:
    """(I + A)^-1 for strictly lower A [..., C, C], C a multiple of ``block``,
    as the inverse kernel computes it: diagonal blocks by forward substitution,
    then T_ij = -T_ii sum_{j <= m < i} A_im T_mj."""
    C = A.shape[-1]
    n = C // block
    blocks = [[A[..., i * block:(i + 1) * block, j * block:(j + 1) * block] for j in range(n)] for i in range(n)]
    Tb = [[None] * n for _ in range(n)]
    eye = torch.eye(block, dtype=A.dtype, device=A.device)
    for i in range(n):
        X = -blocks[i][i].clone()
        for r in range(2, block):
            X[..., r, :] = X[..., r, :] + (X[..., r, :, None] * X).sum(-2)
        Tb[i][i] = X + eye
    for i in range(1, n):
        for j in range(i - 1, -1, -1):
            acc = sum(blocks[i][m] @ Tb[m][j] for m in range(j, i))
            Tb[i][j] = -(Tb[i][i] @ acc)
    zero = torch.zeros_like(Tb[0][0])
    return torch.cat([torch.cat([Tb[i][j] if j <= i else zero for j in range(n)], -1) for i in range(n)], -2)


def gdn_chunk_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                    use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """The chunked algorithm of the kernels in plain torch (fp32; fp64 for fp64
    inputs): the CPU body of ``gdn_chunk``, and a check of the chunked form
    against the token recurrence."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = q.dtype
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    C = CHUNK
    NT = -(-T // C)
    S = (torch.zeros(B, HV, DK, DV, dtype=cd, device=v.device) if initial_state is None
         else initial_state.to(cd).clone())
    if B == 0 or T == 0 or HV == 0:
        return v.new_empty((B, T, HV, DV), dtype=out_dtype), S.contiguous()
    q, k, v, g, beta = (x.transpose(1, 2).to(cd) for x in (q, k, v, g, beta))
    if HV != HK:
        q, k = q.repeat_interleave(HV // HK, dim=1), k.repeat_interleave(HV // HK, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    pad = NT * C - T
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(B, HV, NT, C, -1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).reshape(B, HV, NT, C) for x in (g, beta))
    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp only of Gamma_i - Gamma_j for i >= j: the mask goes on the exponent
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = ((k @ k.transpose(-1, -2)) * beta[..., :, None] * D).tril(-1)
    Tm = _unit_lower_inverse(A)
    w = Tm @ (k * (beta * G.exp())[..., None])
    u = Tm @ (v * beta[..., None])
    o = torch.empty(B, HV, NT, C, DV, dtype=cd, device=q.device)
    for c in range(NT):
        vn = u[:, :, c] - w[:, :, c] @ S
        o[:, :, c] = (q[:, :, c] * G[:, :, c, :, None].exp()) @ S + ((q[:, :, c] @ k[:, :, c].transpose(-1, -2))
                                                                    * D[:, :, c]) @ vn
        Gl = G[:, :, c, -1]
        S = S * Gl.exp()[..., None, None] + (k[:, :, c] * (Gl[..., None] - G[:, :, c]).exp()[..., None]
                                             ).transpose(-1, -2) @ vn
    o = o.reshape(B, HV, NT * C, DV)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype).contiguous(), S.contiguous()
