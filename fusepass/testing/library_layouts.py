"""Random weights in the quantization libraries' stored layouts, for the
kernel tests and the compute-sanitizer sweep (fusepass.formats names them)."""

from __future__ import annotations

import torch


def library_inputs(fmt: str, M: int, N: int, K: int, dtype: torch.dtype, seed: int = 0, group: int | None = None,
                   act_order: bool = True):
    """(x, weight, scale, zero, g_idx, group) in ``fmt``'s stored layout, random codes, on the CPU:
    nf4 / fp4 codes [N, K / 2] with fp32 absmax per 64; hqq4 packed by halves of the
    group rows with float zero points, groups of 32; gptq4 / gptq4_v1 words along K
    with an act-order g_idx (each k's group a permutation's; ``act_order=False``:
    k // group), groups of 32.  ``group`` sets another group size."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    if fmt in ("nf4", "fp4"):
        group = group or 64
        w = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.uint8)
        s = (torch.rand(N, K // group, generator=gen) + 0.5) / (0.5 * K ** 0.5)
        return x, w, s, None, None, group
    if fmt == "hqq4":
        group = group or 32
        w = torch.randint(0, 256, (N * K // group // 2, group), generator=gen, dtype=torch.uint8)
        s = ((torch.rand(N, K // group, generator=gen) + 0.5) / (4 * K ** 0.5)).to(dtype)
        z = (torch.rand(N, K // group, generator=gen) * 15).to(dtype)
        return x, w, s, z, None, group
    group = group or 32
    w = torch.randint(-2**31, 2**31 - 1, (K // 8, N), generator=gen, dtype=torch.int32)
    z = torch.randint(-2**31, 2**31 - 1, (K // group, -(-N // 8)), generator=gen, dtype=torch.int32)
    s = ((torch.rand(K // group, N, generator=gen) + 0.5) / (4 * K ** 0.5)).to(dtype)
    g_idx = (torch.arange(K) // group).to(torch.int32)
    if act_order:
        g_idx[torch.randperm(K, generator=gen)] = g_idx.clone()
    return x, w, s, z, g_idx, group
