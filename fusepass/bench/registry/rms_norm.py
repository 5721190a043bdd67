"""RMSNorm: HF Llama's ``LlamaRMSNorm.forward`` against ``fusepass::rms_norm``.

    y = w * (x / sqrt(mean(x², -1) + eps)).to(bf16)      x, w, y bf16

Memory-bound: bytes = x read + w read + y written.  The shapes are hidden
sizes of current LLMs at prefill batch sizes (4096 .. 65536 columns) and the
decode sizes M = 1 and M = 32 at N = 4096, where launch cost dominates.
Inductor's max-autotune compile (coordinate-descent tuning of the reduction's
blocks) is timed at one shape: on the H100 (commit 1e572c0) it was within 2%
of the default compile at 4096x4096 and 8192x8192 and slower at M = 1 (2.8
against 1.7 µs), and each such compile costs seconds of the suite's ten
minutes.

    fusepass bench --ops rms_norm
"""

from __future__ import annotations

import torch

import fusepass.kernels.rms_norm  # noqa: F401  - registers fusepass::rms_norm
from fusepass.bench.registry.common import Case, compiled, inductor_providers, nbytes

EPS = 1e-6
DTYPE = torch.bfloat16
SHAPES = [(4096, 4096), (16384, 4096), (8192, 8192), (4096, 16384), (2048, 65536), (1, 4096), (32, 4096)]
QUICK = [(4096, 4096), (2048, 65536), (1, 4096)]
AUTOTUNE = {(4096, 4096)}
# The CPU runs the ops' plain-torch paths: small shapes keep `--quick` (CI) in seconds.
CPU_SHAPES = [(256, 1024), (1024, 4096), (1, 4096)]
CPU_QUICK = [(1, 1024), (64, 1024)]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, weight as an argument."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    return w * h.to(input_dtype)


def fusepass_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.fusepass.rms_norm(x, w, EPS, 0.0, True, DTYPE)


def liger():
    """Liger-Kernel's RMSNorm (Llama casting: fp32 math, cast before the weight), when installed."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 math, no intermediate rounding."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def shapes(quick: bool, device: str) -> list[tuple[int, int]]:
    if device == "cuda":
        return QUICK if quick else SHAPES
    return CPU_QUICK if quick else CPU_SHAPES


def norm_cases(op: str, eager, fused, reference, residual: bool, quick: bool, device: str, peer=None) -> list[Case]:
    """The cases of ``op`` (rms_norm or add_rms_norm) at every benchmark shape; ``peer``: Liger's, if installed."""
    out = []
    peers = {"liger": peer} if peer is not None and device == "cuda" else {}
    for M, N in shapes(quick, device):
        def make(M=M, N=N):
            x = torch.randn(M, N, device=device, dtype=DTYPE)
            w = (1 + 0.1 * torch.randn(N, device=device)).to(DTYPE)  # a trained norm weight, not ones
            return (x, torch.randn(M, N, device=device, dtype=DTYPE), w) if residual else (x, w)

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
                **inductor_providers(eager, device, autotune=(M, N) in AUTOTUNE),
                "fusepass": fused,
                "fusepass-compiled": compiled(eager, backend="fusepass"),
                **peers,
            },
            bytes_moved=moved,
            notes={"form": "hf", "eps": str(EPS)},
        ))
    return out


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    return norm_cases("rms_norm", hf_rms_norm, fusepass_rms_norm, reference, residual=False, quick=quick,
                      device=device, peer=liger())
