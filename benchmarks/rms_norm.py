"""RMSNorm: HF Llama's ``LlamaRMSNorm.forward`` against ``fusepass::rms_norm``.

    y = w * (x / sqrt(mean(x², -1) + eps)).to(bf16)      x, w, y bf16

Memory-bound: bytes = x read + w read + y written.  The shapes are hidden
sizes of current LLMs at prefill batch sizes (4096 .. 65536 columns) and the
decode sizes M = 1 and M = 32 at N = 4096, where launch cost dominates.
"""

from __future__ import annotations

import torch

import fusepass.kernels.rms_norm  # noqa: F401  - registers fusepass::rms_norm
from benchmarks.common import Case, compiled, nbytes

EPS = 1e-6
DTYPE = torch.bfloat16
SHAPES = [(4096, 4096), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 65536), (1, 4096), (32, 4096)]
QUICK = [(4096, 4096), (2048, 65536), (1, 4096)]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, weight as an argument."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    return w * h.to(input_dtype)


def fusepass_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.fusepass.rms_norm(x, w, EPS, 0.0, True, DTYPE)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 math, no intermediate rounding."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def norm_cases(op: str, eager, fused, reference, residual: bool, quick: bool) -> list[Case]:
    """The cases of ``op`` (rms_norm or add_rms_norm) at every benchmark shape."""
    out = []
    for M, N in QUICK if quick else SHAPES:
        def make(M=M, N=N):
            x = torch.randn(M, N, device="cuda", dtype=DTYPE)
            w = (1 + 0.1 * torch.randn(N, device="cuda")).to(DTYPE)  # a trained norm weight, not ones
            return (x, torch.randn(M, N, device="cuda", dtype=DTYPE), w) if residual else (x, w)

        x = torch.empty(M, N, dtype=DTYPE, device="meta")
        w = torch.empty(N, dtype=DTYPE, device="meta")
        # x (and r), w read; y (and h) written
        moved = nbytes(x, w) + nbytes(x) + (2 * nbytes(x) if residual else 0)
        out.append(Case(
            op=op,
            shape=f"{M}x{N}" if M > 32 else f"M{M}-N{N}",
            dtype=DTYPE,
            make_inputs=make,
            reference=reference,
            providers={
                "eager": eager,
                "inductor": compiled(eager),
                "fusepass": fused,
                "fusepass-compiled": compiled(eager, backend="fusepass"),
            },
            bytes_moved=moved,
            notes={"form": "hf", "eps": str(EPS)},
        ))
    return out


def cases(quick: bool) -> list[Case]:
    return norm_cases("rms_norm", hf_rms_norm, fusepass_rms_norm, reference, residual=False, quick=quick)
