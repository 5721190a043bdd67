"""Gated RMSNorm after a Gated DeltaNet layer: transformers' ``Qwen3_5RMSNormGated.forward``
against ``fusepass::rms_norm_gated``, Qwen3.5-9B shapes.

    y = (w * (x / sqrt(mean(x², -1) + eps)).to(bf16)) * silu(z.float())  -> bf16

x is the GDN output and z the gate projection, both [tokens x 32 value
heads, 128] bf16 (``reshape(-1, head_v_dim)`` of contiguous tensors);
w is [128].  Memory-bound: bytes = x and z read + w read + y written.
Tokens 1 (decode, M = 32), 64, 4096 and 16384 (prefill).

    fusepass bench --ops rms_norm_gated
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusepass.kernels.rms_norm_gated  # noqa: F401  - registers fusepass::rms_norm_gated
from fusepass.bench.registry.common import Case, compiled, nbytes

EPS = 1e-6
DTYPE = torch.bfloat16
HEADS, HEAD_DIM = 32, 128  # Qwen3.5-9B: linear_num_value_heads, linear_value_head_dim
TOKENS = [1, 64, 4096, 16384]
QUICK = [1, 4096]


def hf_rms_norm_gated(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3_5RMSNormGated.forward, weight as an argument."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    h = w * h.to(input_dtype)
    h = h * F.silu(z.to(torch.float32))
    return h.to(input_dtype)


def fusepass_rms_norm_gated(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.fusepass.rms_norm_gated(x, z, w, EPS, True, "silu")


def reference(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 math, no intermediate rounding."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float() * F.silu(z.float())


def _fla():
    """flash-linear-attention's fused gated norm (one fp32 rounding), where installed."""
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except ImportError:
        return None
    return lambda x, z, w: rms_norm_gated(x, z, w, None, "swish", eps=EPS)


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    out = []
    fla = _fla()
    # bf16 on the CPU: 4096 tokens took 0.27 s a call there.
    quick_tokens = [1, 64] if device == "cpu" else QUICK
    for tokens in quick_tokens if quick else TOKENS:
        M, N = tokens * HEADS, HEAD_DIM

        def make(M=M, N=N):
            x = torch.randn(M, N, device=device, dtype=DTYPE)
            z = torch.randn(M, N, device=device, dtype=DTYPE)
            w = (1 + 0.1 * torch.randn(N, device=device)).to(DTYPE)  # a trained norm weight, not ones
            return x, z, w

        x = torch.empty(M, N, dtype=DTYPE, device="meta")
        w = torch.empty(N, dtype=DTYPE, device="meta")
        providers = {
            "eager": hf_rms_norm_gated,
            "inductor": compiled(hf_rms_norm_gated),
            "fusepass": fusepass_rms_norm_gated,
            "fusepass-compiled": compiled(hf_rms_norm_gated, backend="fusepass"),
        }
        if fla is not None:
            providers["fla"] = fla
        out.append(Case(
            op="rms_norm_gated",
            shape=f"T{tokens}-H{HEADS}-D{N}",
            dtype=DTYPE,
            make_inputs=make,
            reference=reference,
            providers=providers,
            bytes_moved=nbytes(x, x, w) + nbytes(x),  # x, z, w read; y written
            notes={"form": "hf", "activation": "silu", "eps": str(EPS), "M": str(M)},
        ))
    return out
