"""Residual add + RMSNorm: ``h = x + r; (LlamaRMSNorm(h), h)`` against
``fusepass::add_rms_norm``.

    h = x + r                                            bf16
    y = w * (h / sqrt(mean(h², -1) + eps)).to(bf16)

Memory-bound: bytes = x, r, w read + y, h written.  Same shapes as
``rms_norm``.

    fusepass bench --ops add_rms_norm
"""

from __future__ import annotations

import torch

import fusepass.kernels.rms_norm  # noqa: F401  - registers fusepass::add_rms_norm
from fusepass.bench.registry.common import Case
from fusepass.bench.registry.rms_norm import DTYPE, EPS, norm_cases


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


def liger():
    """Liger-Kernel's fused residual add + RMSNorm (returns the norm, then the sum), when installed."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None
    return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)


def reference(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 math from the same inputs, no intermediate rounding."""
    hf = x.float() + r.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.float(), hf


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    return norm_cases("add_rms_norm", hf_add_rms_norm, fusepass_add_rms_norm, reference, residual=True,
                      quick=quick, device=device, peer=liger())
