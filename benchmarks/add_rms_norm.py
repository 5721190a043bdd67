"""Residual add + RMSNorm: ``h = x + r; (LlamaRMSNorm(h), h)`` against
``fusepass::add_rms_norm``.

    h = x + r                                            bf16
    y = w * (h / sqrt(mean(h², -1) + eps)).to(bf16)

Memory-bound: bytes = x, r, w read + y, h written.  Same shapes as
``rms_norm``.
"""

from __future__ import annotations

import torch

import fusepass.kernels.rms_norm  # noqa: F401  - registers fusepass::add_rms_norm
from benchmarks.common import Case, compiled, nbytes

EPS = 1e-6
DTYPE = torch.bfloat16
SHAPES = [(4096, 4096), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 65536), (1, 4096), (32, 4096)]
QUICK = [(4096, 4096), (2048, 65536), (1, 4096)]


def hf_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add, then transformers' LlamaRMSNorm.forward."""
    h = x + r
    input_dtype = h.dtype
    n = h.to(torch.float32)
    variance = n.pow(2).mean(-1, keepdim=True)
    n = n * torch.rsqrt(variance + EPS)
    return w * n.to(input_dtype), h


def fusepass_add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.fusepass.add_rms_norm(x, r, w, EPS, 0.0, True, DTYPE)


def reference(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 math from the same inputs, no intermediate rounding."""
    hf = x.float() + r.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.float(), hf


def _inputs(M: int, N: int):
    def make():
        x = torch.randn(M, N, device="cuda", dtype=DTYPE)
        r = torch.randn(M, N, device="cuda", dtype=DTYPE)
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(DTYPE)  # a trained norm weight, not ones
        return x, r, w

    return make


def cases(quick: bool) -> list[Case]:
    out = []
    for M, N in QUICK if quick else SHAPES:
        x = torch.empty(M, N, dtype=DTYPE, device="meta")
        w = torch.empty(N, dtype=DTYPE, device="meta")
        out.append(Case(
            op="add_rms_norm",
            shape=f"{M}x{N}" if M > 32 else f"M{M}-N{N}",
            dtype=DTYPE,
            make_inputs=_inputs(M, N),
            reference=reference,
            providers={
                "eager": hf_add_rms_norm,
                "inductor": compiled(hf_add_rms_norm),
                "fusepass": fusepass_add_rms_norm,
                "fusepass-compiled": compiled(hf_add_rms_norm, backend="fusepass"),
            },
            bytes_moved=nbytes(x, x, w) + nbytes(x, x),  # x, r, w read; y, h written
            notes={"form": "hf", "eps": str(EPS)},
        ))
    return out
