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


def int32_words(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [R, 8 * C] (0..15) -> the int32 words [R, C] a checkpoint stores, code j of
    each eight at bits 4j (two's complement)."""
    r, c = codes.shape
    parts = codes.to(torch.int64).reshape(r, c // 8, 8) << (4 * torch.arange(8, device=codes.device))
    words = parts.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def grouped_int4(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """Round-to-nearest 4-bit codes of w [N, K] over the columns of each group (g_idx [K], every group
    ``K / groups`` columns): scales fp16 [groups, N], zero points int64 [groups, N] (8 when
    ``sym``), codes int64 [K, N]."""
    n, k = w.shape
    cols = w.float()[:, torch.argsort(g_idx, stable=True)].reshape(n, groups, k // groups)
    if sym:
        scale = cols.abs().amax(-1).t() / 7.5
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = cols.amin(-1).t(), cols.amax(-1).t()
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half()
    q = torch.round(w.float().t() / scale.float()[g_idx] + zero[g_idx]).clamp(0, 15).to(torch.int64)
    return scale, zero.to(torch.int64), q


def gptq_tensors(w: torch.Tensor, group: int, act_order: bool = False, sym: bool = False, v1: bool = True,
                 seed: int = 0, wrap: bool = False):
    """GPTQ's stored layout of w [N, K] (N a multiple of 8), from the format's description:
    (state dict tensors, the fp32 weight [N, K] they stand for).  qweight int32 [K / 8, N],
    eight codes along K a word; qzeros int32 [K / G, N / 8], eight along N (v1, the older
    format: stored minus one, so a zero point of 0 wraps to 15 and reads back as 16); fp16
    scales [K / G, N]; g_idx [K] (act_order, GPTQ's desc_act: each column's group follows a
    random order of K).  ``wrap`` (the loader's tests): three rows of the first group get a zero
    point of 0, which v1 stores as 15 (read back as 16): the format's own semantics; their codes
    stay those of the true zero point, so those rows stand far from w."""
    n, k = w.shape
    dev = w.device
    g_idx = torch.arange(k, device=dev) // group
    if act_order:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)).to(dev)
        g_idx = torch.empty(k, dtype=torch.int64, device=dev)
        g_idx[order] = torch.arange(k, device=dev) // group
    scale, zero, q = grouped_int4(w, g_idx, k // group, sym)
    if wrap and not sym:
        zero[0, :3] = 0
    stored = (zero - 1) & 0xF if v1 else zero
    z = (stored + 1) if v1 else stored
    ref = (q - z[g_idx]).float() * scale.float()[g_idx]  # [K, N]
    return {"qweight": int32_words(q.t()).t().contiguous(), "qzeros": int32_words(stored), "scales": scale,
            "g_idx": g_idx.to(torch.int32)}, ref.t()


def _hqq_encoded(v):
    """A meta entry as HQQ's safetensors encoding stores it."""
    if isinstance(v, str):
        return torch.tensor([ord(c) for c in v], dtype=torch.uint8)
    if isinstance(v, bool):
        return torch.tensor(int(v), dtype=torch.uint8)
    if isinstance(v, tuple):
        return torch.tensor(v)
    return torch.tensor(v, dtype=torch.int32)


def hqq_tensors(w: torch.Tensor, group: int, encoded: bool = False, **meta):
    """HQQ's 4-bit layout of w [N, K] (axis 1, 4bit_u8, from the format's description):
    (HQQLinear's state dict entries, the fp32 weight they stand for).  W [N, K] as R = N K / G
    rows of G, each row's scale and (unrounded) zero in w's dtype; rows r < R / 2 in W_q's
    high nibbles, r + R / 2 in the low; ``encoded``: the meta entries as HQQ's safetensors
    encoding stores them; ``meta`` overrides entries (the loader's refusals)."""
    n, k = w.shape
    rows = w.reshape(-1, group).float()
    lo, hi = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-4)
    zero = -lo / scale  # HQQ keeps the zero point a float
    q = torch.round(rows / scale + zero).clamp(0, 15).to(torch.uint8)
    half = q.shape[0] // 2
    scale, zero = scale.to(w.dtype), zero.to(w.dtype)
    ref = ((q.float() - zero.float()) * scale.float()).reshape(n, k)
    entries = dict(nbits=4, group_size=group, axis=1, packing="4bit_u8", shape=(n, k), view_as_float=False,
                   quant_scale=False, quant_zero=False)
    entries.update(meta)
    if encoded:
        entries = {key: _hqq_encoded(v) for key, v in entries.items()}
    elif isinstance(entries["shape"], tuple):
        entries["shape"] = torch.Size(entries["shape"])
    return {"W_q": (q[:half] << 4) | q[half:], "scale": scale, "zero": zero, **entries}, ref
