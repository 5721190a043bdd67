"""A launch configuration (``Config``), the M buckets, and which configs can run a problem."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusepass.kernels._common import cdiv


@dataclass(frozen=True)
class Config:
    """One way to run the product.  kind: "gemv", "mm", "mmt" (the product
    transposed, the weight as the dot's A operand) or "cublas"."""

    kind: str
    BN: int = 0
    BK: int = 0
    BM: int = 0  # mm only; gemv takes BM = next power of two >= M
    split: int = 1  # K slices wanted (the launcher rounds to whole BK tiles)
    warps: int = 4
    stages: int = 1
    perm: int = 0  # int4 mm: one dot over a permuted K order instead of two over split x

    def label(self) -> str:
        if self.kind == "cublas":
            return "cublas"
        bm = f"BM{self.BM}-" if self.kind in ("mm", "mmt") else ""
        perm = "-perm" if self.perm else ""
        return f"{self.kind}-{bm}BN{self.BN}-BK{self.BK}-S{self.split}-W{self.warps}-st{self.stages}{perm}"


CUBLAS = Config("cublas")
# M buckets of the plan table: a plan measured at the bucket's M serves every
# M in (bucket / 2, bucket]; above the last one, M itself is the key.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_GEMV_MAX_M = 8  # the GEMV's per-row FMA loop is unrolled M times
_GROUP_M = 8


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def m_bucket(M: int) -> int:
    for b in BUCKETS:
        if M <= b:
            return b
    return M


def _k_split(K: int, BK: int, split: int) -> tuple[int, int, bool]:
    """(K per slice, slices, whether every slice is whole BK tiles ending at K)."""
    k_split = cdiv(cdiv(K, max(1, split)), BK) * BK
    n = cdiv(K, k_split)
    return k_split, n, k_split * n == K


def _valid(cfg: Config, M: int, K: int, fmt: str, G: int, dtype: torch.dtype) -> bool:
    if cfg.kind == "cublas":
        return True
    if cfg.kind == "gemv":
        return M <= _GEMV_MAX_M and (fmt != "int4" or cfg.BK % G == 0)
    if cfg.kind == "mmt":  # 16-deep dots of 16-bit operands; int4 tiles within one group
        return dtype != torch.float32 and cfg.BK >= 32 and cfg.BM >= 16 and (fmt != "int4" or G % cfg.BK == 0)
    # mm: tensor cores need 16-deep dots of 16-bit operands (fp32 runs the
    # "ieee" dot: exact, but no faster than the cuBLAS path, which the plan
    # takes instead), and an int4 tile within one group.
    return dtype != torch.float32 and (fmt != "int4" or (G % cfg.BK == 0 and cfg.BK >= 32))
