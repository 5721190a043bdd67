"""What a plan is for and what it says: the ``Problem`` (one product, the key of
its plan) and the ``Config`` (one way to run it), and which configs can run
which problems."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from fusepass.formats import LIBRARY_FORMATS
from fusepass.kernels._common import cdiv, sm_count


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
    ahead: int = 0  # int4 mmt: tiles between a scale's load and its use (0-2; see the kernel)
    xperm: int = 0  # int4 / int8 mmt: x copied into the weight fragments' K order first, then read as stored
    # int4 gemv at M = 1: the zero point off each chunk's sum (gemv._int4_gemv_folded), 0: per value
    fold: int = 1

    def label(self) -> str:
        if self.kind == "cublas":
            return "cublas"
        bm = f"BM{self.BM}-" if self.kind in ("mm", "mmt") else ""
        perm = "-perm" if self.perm else ""
        ahead = f"-a{self.ahead}" if self.kind == "mmt" and self.ahead else ""
        xperm = "-xp" if self.kind == "mmt" and self.xperm else ""
        fold = "-nofold" if self.kind == "gemv" and not self.fold else ""
        return (f"{self.kind}-{bm}BN{self.BN}-BK{self.BK}-S{self.split}-W{self.warps}-st{self.stages}"
                f"{perm}{ahead}{xperm}{fold}")


CUBLAS = Config("cublas")
# M buckets of the plan table: a plan measured at the bucket's M serves every
# M in (bucket / 2, bucket]; above the last one, M itself is the key.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GEMV_MAX_M = 8  # the GEMV's per-row FMA loop is unrolled M times
_GROUP_M = 8
# Formats whose plan depends on the group (block) size: int4's tiles lie inside
# a group; the code books' GEMV loop runs on whole blocks (codebook_chunk); the
# transposed kernel's tiles lie inside a group or cover whole ones (code books, HQQ).
_BLOCKED = ("int4", "nf4", "fp4", "hqq4")


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


def codebook_chunk(G: int) -> int:
    """Bytes of a thread's chunk where the code books run the int4 GEMV loop
    (gemv._dequant_gemv_kernel): 16 (32 values) inside a block of G >= 32, half a
    smaller block; 0 where G is odd or a block of 32 or more is not whole chunks
    (those go value by value)."""
    if G % 2 or (G >= 32 and G % 32):
        return 0
    return 16 if G >= 32 else G // 2


@functools.cache
def gpu_name(device: torch.device) -> str:
    """The CUDA device's name (plans are kept per GPU), or the device type elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@dataclass(frozen=True)
class Problem:
    """One product y [M, N] = x [M, K] @ dequant(W [N, K])^T, as far as its plan
    depends on it: the key of a plan.

    ``M`` is the bucket of the row count (a plan measured at the bucket's M
    serves every M in (bucket / 2, bucket]); ``group`` is int4's group size
    and 0 for the formats with one scale per row; fp16 and bf16 share a plan
    (same bytes, same instructions), fp32 has its own."""

    M: int
    N: int
    K: int
    fmt: str
    group: int
    dtype: torch.dtype
    gpu: str
    sms: int = field(default=1, compare=False)  # multiprocessors: the heuristic sizes K splits by them

    @classmethod
    def of(cls, M: int, N: int, K: int, fmt: str, group_size: int, dtype: torch.dtype,
           device: torch.device | str) -> Problem:
        device = torch.device(device)
        return cls(m_bucket(max(1, M)), N, K, fmt, group_size if fmt in _BLOCKED else 0, dtype, gpu_name(device),
                   sm_count(device))

    @property
    def key(self) -> str:
        prec = "fp32" if self.dtype == torch.float32 else "16bit"
        g = f"g{self.group}" if self.fmt in _BLOCKED else "gc"
        return f"{self.gpu}|{self.fmt}-{g}|{prec}|M{self.M}|N{self.N}|K{self.K}"


def valid(cfg: Config, p: Problem) -> bool:
    """Whether ``cfg`` can run ``p`` (every M of its bucket)."""
    M, fmt, G, dtype = p.M, p.fmt, p.group, p.dtype
    if cfg.kind == "cublas":
        return True
    if cfg.ahead not in (0, 1, 2) or cfg.xperm not in (0, 1) or cfg.fold not in (0, 1):
        return False
    if cfg.kind == "gemv":
        if M > GEMV_MAX_M:
            return False
        if fmt == "int4":  # a thread's chunk of 16 bytes (fewer for G < 32) lies inside one group
            return cfg.BK % G == 0 and (G % 32 == 0 or G in (2, 4, 8, 16))
        if fmt.startswith("gptq4"):  # columns in whole zero-point words; tiles of four-word-row sub-tiles
            return cfg.BN % 8 == 0 and cfg.BK % 32 == 0
        if fmt == "hqq4":  # whole chunks of up to 16 bytes (the group's largest power-of-two divisor)
            return cfg.BK % 16 == 0
        return True
    if cfg.kind == "mmt":  # 16-deep dots of 16-bit operands; int4 tiles within one group
        if dtype == torch.float32 or cfg.BK < 32 or cfg.BM < 16:
            return False
        whole = (G % cfg.BK == 0 or cfg.BK % G == 0) and p.K % cfg.BK == 0  # (no K mask on the words)
        if fmt in ("nf4", "fp4"):  # int4's words: an absmax per 32 codes
            return G % 32 == 0 and whole
        if fmt == "hqq4":  # int8's words, rows paired (N even): a scale and zero point per 16 codes
            return G % 16 == 0 and p.N % 2 == 0 and whole
        return (fmt != "int4" or G % cfg.BK == 0) and fmt not in LIBRARY_FORMATS  # (GPTQ: gemv, mm, dequant)
    # mm: tensor cores need 16-deep dots of 16-bit operands (fp32 runs the
    # "ieee" dot: exact, but no faster than the cuBLAS path, which the plan
    # takes instead), and an int4 tile within one group.
    return dtype != torch.float32 and (fmt != "int4" or (G % cfg.BK == 0 and cfg.BK >= 32))
