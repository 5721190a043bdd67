"""Launches: one builder per kernel, and ``_launch``, which runs a ``Config``.

The builders return :class:`~fusepass.kernels._common.Launch` objects naming
every kernel argument; the op's CUDA body runs them (``_launch``), a graph
gets them traced (``op.dequant_matmul_traced``).  Only the buffers differ
between the two: eager launches take their split-K counters from the
process-wide regions of :mod:`.counters`, a graph allocates zeroed ones of
its own.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._guards import detect_fake_mode

from fusepass.formats import CODEBOOKS, LIBRARY_FORMATS, codebook, out_features
from fusepass.kernels._common import Launch, cdiv, emulate_rounding, interpreting, pdl_on
from fusepass.kernels.dequant_matmul.config import _GROUP_M, Config, _k_split, _pow2, codebook_chunk
from fusepass.kernels.dequant_matmul.counters import _split_counters
from fusepass.kernels.dequant_matmul.dequant import _dequant_kernel, _nested_absmax_kernel
from fusepass.kernels.dequant_matmul.gemv import (
    _dequant_gemv_gated_kernel,
    _dequant_gemv_kernel,
    _dequant_gemv_siblings_kernel,
)
from fusepass.kernels.dequant_matmul.tensor_core import _dequant_mm_kernel, _dequant_mmt_kernel
from fusepass.kernels.dequant_matmul.tiles import _splitk_reduce_kernel

_REDUCE_BLOCK = 1024


def _fold(cfg: Config, x: Tensor) -> int:
    """Whether the int4 GEMV takes the zero point off each chunk's sum
    (gemv._int4_gemv_folded): for 16-bit x only.  The folded sum
    s (sum (128 + q) x - (128 + z) sum x) is exact in its products only where x
    has at most 16 significant bits; an fp32 x's products (128 + q) x are
    rounded at ~136 |x| each, and the cancellation against (128 + z) sum x
    keeps those roundings: ~2**-24 * 136 * sum |x| of a chunk against the
    dequantised matmul's ~2**-24 * sum |(q - z) x|.  fp32, N 24, K 32, x all
    0.7104, s 0.598: 2.2e-4 off the fp64 product (|y| 1.85 there, 27 at most)
    where eager's fp32 matmul is 3.1e-6 off; per value (_nibble_gemv) the
    kernel is within eager's rounding (a long differential run, seed
    1949640409)."""
    return cfg.fold if x.dtype != torch.float32 else 0


def _workspace(split: int, M: int, N: int, like: Tensor) -> Tensor:
    return torch.empty((split, M, N), dtype=torch.float32, device=like.device)


def _pairs(x: Tensor) -> Tensor:
    """x [M, K] (K even, unit column stride) as [M, K / 2] words, each two adjacent
    values: int32 for 16-bit x, int64 for fp32.  A row stride or offset that is
    odd in elements cannot be viewed so and is copied."""
    if x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.int64 if x.dtype == torch.float32 else torch.int32)


def _x_fragment_order(x: Tensor, fmt: str) -> Tensor:
    """x [M, K] copied with K in the order the ``mmt`` tile of int32 words holds
    it (see tensor_core._dequant_mmt_kernel): int4, column 32j + 16h + 8u + 2t
    + e holds K index 32j + 8t + 4h + 2u + e (K a multiple of 32); int8, column
    16j + 8h + 2t + e holds 16j + 4t + 2h + e (K a multiple of 16).  The
    kernel then reads x's rows as stored instead of gathering pairs.  In a
    graph (the inlined launches) the copy is a node Inductor compiles with the
    rest (it may fuse it into x's producer; not measured)."""
    M, K = x.shape
    if fmt == "int4":
        return x.reshape(M, K // 32, 4, 2, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(M, K)
    return x.reshape(M, K // 16, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(M, K)


def _words(w: Tensor) -> Tensor:
    """A weight of bytes (int4 / nf4 / fp4 packed uint8 [N, K / 2], int8 [N, K]) as int32 words
    of four bytes; a row stride or offset that is not whole words is copied first."""
    if w.stride(0) % 4 or w.storage_offset() % 4:
        w = w.clone(memory_format=torch.contiguous_format)  # (a new storage: contiguous() keeps the offset)
    return w.view(torch.int32)


def _table(fmt: str, device: torch.device) -> Tensor:
    """A code-book format's 16 values on ``device`` (the kernels read it from L1):
    one real tensor per device, made once; while a graph is traced with fake
    tensors, a fresh one of that trace's mode (the graph holds it as a
    constant; a cached one would belong to the first trace's mode, and the
    next trace fails with "Mixing fake modes")."""
    if detect_fake_mode() is not None:
        return codebook(fmt, device)
    return _real_table(fmt, device)


@functools.cache
def _real_table(fmt: str, device: torch.device) -> Tensor:
    return codebook(fmt, device)


@functools.cache
def _gptq_shifts(device: torch.device) -> Tensor:
    return torch.arange(0, 32, 4, dtype=torch.int32, device=device)


def _library_operands(w: Tensor, scale: Tensor, zero: Tensor | None, g_idx: Tensor | None, shifts: Tensor | None,
                      fmt: str):
    """(zero, g_idx, shifts) pointers of a library layout: the code book in zero's
    place for nf4 / fp4; gptq4's packed zeros, its g_idx as int32 and the bit
    offsets of the codes in a word (GPTQ's 0, 4, ..., 28 unless given)."""
    if fmt in CODEBOOKS:
        return _table(fmt, w.device), scale, scale
    if fmt == "hqq4":
        return zero, scale, scale
    g_idx = (g_idx if g_idx.dtype == torch.int32 else g_idx.to(torch.int32)).contiguous()
    shifts = _gptq_shifts(w.device) if shifts is None else shifts.reshape(-1).contiguous()
    return zero, g_idx, shifts


def _groups(fmt: str, scale: Tensor) -> int:
    """GPTQ's group count (its g_idx indexes the scale rows as torch does, a negative index from the end);
    1 for the other formats, whose kernels do not read g_idx."""
    return scale.shape[0] if fmt.startswith("gptq4") else 1


def hqq_pairs(fmt: str, N: int) -> bool:
    """Whether the GEMV reads an HQQ weight as pairs of rows (n, n + N / 2), whose
    codes share bytes (gemv._hqq_gemv): for even N; odd N goes value by value."""
    return fmt == "hqq4" and N % 2 == 0


def own_loop(fmt: str, N: int, G: int, cfg: Config) -> bool:
    """Whether a library layout's GEMV runs its own loop (gemv._hqq_gemv,
    the int4 loop for the code books; GPTQ's always does) rather than value by value."""
    if fmt in CODEBOOKS:
        vb = codebook_chunk(G)
        return vb > 0 and cfg.BK % (2 * vb) == 0
    return hqq_pairs(fmt, N)


def gemv_asm(fmt: str, G: int, N: int, cfg: Config) -> bool:
    """Whether a GEMV on the GPU converts codes with inline PTX (tiles._nibbles_128,
    _word_128, _codebook_pair).  _nibbles_128 converts the bytes of a thread four at a time: int4
    needs 4-byte chunks within a group (G >= 8); HQQ's pairs and the code books,
    whole chunks of a multiple of 4 bytes and a tile deep enough that each thread
    holds a whole chunk (fewer, and Triton gives a thread single bytes).  GPTQ's
    words convert one at a time."""
    if fmt == "int4":
        return G >= 8
    if hqq_pairs(fmt, N):
        return G % 16 == 0 and cfg.BK >= 512 * cfg.warps
    if fmt in CODEBOOKS:
        vb = codebook_chunk(G)
        return own_loop(fmt, N, G, cfg) and vb % 4 == 0 and cfg.BK >= 2 * vb * 32 * cfg.warps
    return fmt.startswith("gptq4")


def splits(cfg: Config, K: int) -> int:
    """K slices the product runs in (1: whole K)."""
    return _k_split(K, cfg.BK, cfg.split)[1]


def tiles(cfg: Config, M: int, N: int) -> int:
    """Output tiles of the product: split-K counters needed, one per tile."""
    return cdiv(N, cfg.BN) * (1 if cfg.kind == "gemv" else cdiv(M, cfg.BM))


def nested_fits(cfg: Config, fmt: str, N: int, G: int) -> bool:
    """Whether ``cfg`` reads a code book's double-quantized absmax as stored (its
    byte, nested absmax, code and offset): the GEMV's int4 loop does
    (tiles._block_scales); other plans take the fp32 absmax, expanded first."""
    return fmt in CODEBOOKS and cfg.kind == "gemv" and own_loop(fmt, N, G, cfg)


def _nested_args(nested: list[Tensor] | None, names: tuple[str, str, str], dummy: Tensor) -> dict:
    """The kernel's pointers to a double quantization's (nested absmax, code, offset), or stand-ins."""
    return dict(zip(names, nested if nested is not None else (dummy,) * 3))


def product_launch(x: Tensor, w: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, out: Tensor,
                   fmt: str, G: int, cfg: Config, part: Tensor | None = None, ctr: Tensor | None = None,
                   g_idx: Tensor | None = None, shifts: Tensor | None = None,
                   nested: list[Tensor] | None = None) -> Launch:
    """The fused product (``cfg.kind`` "gemv", "mm" or "mmt"): out [M, N] = x [M, K] @ dequant(w)^T + bias.

    Operands as the op checked them: x and w with unit column stride (fp8
    weights viewed as bytes: a masked load's fill value cannot be cast to
    fp8), scale / zero / bias contiguous.  A split K writes its slices into
    ``part`` [split, M, N] fp32; with counters ``ctr`` (``tiles``, zeroed) the
    tile's last program sums them, else :func:`reduce_launch` must run next.
    Unused pointers are given ``scale``: never read, and never a tensor the
    launch writes (a graph's functional launch must not see its output twice).
    ``nested``: a code book's double quantization (scale its bytes), where
    ``nested_fits``.
    """
    M, K = x.shape
    N = out_features(w, fmt, scale)
    if nested is not None and not nested_fits(cfg, fmt, N, G):
        raise ValueError(f"config {cfg.label()} reads no double-quantized absmax: expand it first")
    k_split, split, even = _k_split(K, cfg.BK, cfg.split)
    dummy = scale
    lib = fmt in LIBRARY_FORMATS
    if lib:
        zero, g_idx, shifts = _library_operands(w, scale, zero, g_idx, shifts, fmt)
    args = dict(w=w, scale=scale, zero=zero if zero is not None else dummy, bias=bias if bias is not None else dummy,
                out=out, part=part if split > 1 else dummy, ctr=ctr if ctr is not None else dummy,
                g_idx=g_idx if g_idx is not None else dummy, shifts=shifts if shifts is not None else dummy,
                M=M, N=N, K=K, K_SPLIT=k_split, stride_xm=x.stride(0), stride_wn=w.stride(0),
                stride_sn=scale.stride(0) if fmt == "int4" or lib else 1,
                FMT=fmt, G=max(G, 1), HAS_ZERO=zero is not None and not lib, HAS_BIAS=bias is not None,
                PARTIAL=split > 1, SUM_HERE=ctr is not None, EVEN_K=even, LIB=lib, BN=cfg.BN, BK=cfg.BK)
    outputs = ("out",) + (("part",) if split > 1 else ()) + (("ctr",) if ctr is not None else ())
    dot_f32 = x.dtype == torch.float32 or not x.is_cuda
    ng = _groups(fmt, scale)
    if cfg.kind == "gemv":
        # int4, GPTQ and the code books' loop read x as value pairs.  HQQ's pairs
        # of rows read the bytes flat, n K + k (a strided W_q, which the rule
        # refuses, is copied).
        loop = own_loop(fmt, N, G, cfg)
        if loop and fmt == "hqq4" and not w.is_contiguous():
            w = w.contiguous()
            args.update(w=w, stride_wn=w.stride(0))
        xp = _pairs(x) if fmt == "int4" or fmt.startswith("gptq4") or fmt in CODEBOOKS else x
        asm = x.is_cuda and not interpreting() and gemv_asm(fmt, G, N, cfg)
        pdl = pdl_on(x)
        return Launch(_dequant_gemv_kernel, (cdiv(N // 2 if fmt == "hqq4" and loop else N, cfg.BN), split),
                      {**args, "x": x, "x2": xp, "stride_x2m": xp.stride(0), "NG": ng, "BM": _pow2(M), "ASM": asm,
                       "LOOP": loop, "FOLD": _fold(cfg, x), "PDL": pdl, "NESTED": nested is not None,
                       **_nested_args(nested, ("nest", "code2", "offset"), dummy)}, outputs, cfg.warps, cfg.stages)
    if cfg.kind == "mmt":
        # int4, the code books and HQQ always, int8 in whole tiles: the weight read
        # as int32 words (see the kernel); the code books' words hold codes in
        # int4's order, HQQ's bytes (as a [N / 2, K] matrix) values in int8's
        nibbles = fmt == "int4" or fmt in CODEBOOKS
        words = nibbles or fmt == "hqq4" or (fmt == "int8" and even and K % 4 == 0)
        if words:
            wv = _words(w.contiguous().view(N // 2, K) if fmt == "hqq4" else w)
            args.update(w=wv, stride_wn=wv.stride(0))
        xperm = bool(cfg.xperm) and words and K % (32 if nibbles else 16) == 0
        xk = _x_fragment_order(x, "int4" if nibbles else fmt) if xperm else x
        return Launch(_dequant_mmt_kernel, (cdiv(N, cfg.BN), cdiv(M, cfg.BM), split),
                      {**args, "x": xk, "stride_xm": xk.stride(0), "BM": cfg.BM, "DOT_F32": dot_f32,
                       "ASM": x.is_cuda and not interpreting(), "WORDS": words, "AHEAD": cfg.ahead,
                       "XPERM": xperm}, outputs, cfg.warps, cfg.stages)
    if cfg.kind == "mm":
        return Launch(_dequant_mm_kernel, (cdiv(M, cfg.BM) * cdiv(N, cfg.BN), split),
                      {**args, "x": x, "NG": ng, "BM": cfg.BM, "GROUP_M": _GROUP_M, "DOT_F32": dot_f32,
                       "PERM": bool(cfg.perm) and fmt == "int4"}, outputs, cfg.warps, cfg.stages)
    raise ValueError(f"no fused kernel for config kind {cfg.kind!r}")


# fusepass's own formats and bitsandbytes' code books (their whole blocks in the int4 loop)
SIBLING_FORMATS = ("int4", "int8", "fp8", *CODEBOOKS)
MAX_SIBLINGS = 3


def sibling_fits(cfg: Config, fmt: str, G: int) -> bool:
    """Whether one GEMV grid over a group's weights runs the plan ``cfg``: a GEMV,
    and for a code book one whose K tile holds whole chunks (``own_loop``: the
    grid has no value-by-value path for the library layouts)."""
    return cfg.kind == "gemv" and (fmt not in CODEBOOKS or own_loop(fmt, 0, G, cfg))


def _group_operands(x: Tensor, zeros: list[Tensor | None], fmt: str):
    """(x as the kernel reads it, the zero pointers, HAS_ZERO, LOOP) of a group:
    int4 and the code books read x as value pairs; a code book's table stands
    in zero's place (``_library_operands``) and runs the int4 loop."""
    book = fmt in CODEBOOKS
    xp = _pairs(x) if fmt == "int4" or book else x
    if book:
        return xp, [_table(fmt, x.device)] * len(zeros), False, True
    return xp, zeros, zeros[0] is not None, False


def siblings_launch(x: Tensor, ws: list[Tensor], scales: list[Tensor], zeros: list[Tensor | None],
                    biases: list[Tensor | None], outs: list[Tensor], fmt: str, G: int, cfg: Config,
                    nested: list[list[Tensor]] | None = None) -> Launch:
    """outs[i] [M, N_i] = x [M, K] @ dequant(ws[i])^T (+ biases[i]) in one GEMV grid
    (``cfg``: a "gemv" config, run over the whole of K); operands as for
    :func:`product_launch`, one format and group size, zero points on all or
    none, ``nested`` (each weight's double quantization) on all or none."""
    M, K = x.shape
    Ns = [out_features(w, fmt, s) for w, s in zip(ws, scales)]
    ends, e = [], 0
    for n in Ns:
        e += cdiv(n, cfg.BN)
        ends.append(e)
    ws = [w.view(torch.uint8) if fmt == "fp8" else w for w in ws]
    xp, zeros, has_zero, loop = _group_operands(x, zeros, fmt)
    even = K % cfg.BK == 0
    args = dict(x=x, x2=xp, M=M, K=K, stride_xm=x.stride(0), stride_x2m=xp.stride(0), FMT=fmt, G=max(G, 1),
                HAS_ZERO=has_zero, NW=len(ws), EVEN_K=even, LOOP=loop,
                ASM=x.is_cuda and not interpreting() and gemv_asm(fmt, G, Ns[0], cfg), BM=_pow2(M), BN=cfg.BN,
                BK=cfg.BK, FOLD=_fold(cfg, x), E0=ends[0], E1=(ends + [e])[1], PDL=pdl_on(x),
                NESTED=nested is not None)
    for i in range(MAX_SIBLINGS):
        j = min(i, len(ws) - 1)  # a slot past the weights: weight 0's tensors, never touched
        s = scales[j]
        args.update({f"w{i}": ws[j] if i < len(ws) else scales[0], f"s{i}": s if i < len(ws) else scales[0],
                     f"z{i}": zeros[j] if i < len(ws) and zeros[j] is not None else scales[0],
                     f"b{i}": biases[j] if i < len(ws) and biases[j] is not None else scales[0],
                     f"o{i}": outs[i] if i < len(ws) else scales[0], f"N{i}": Ns[j] if i < len(ws) else 1,
                     f"stride_w{i}": ws[j].stride(0), f"stride_s{i}": s.stride(0) if fmt == "int4" or loop else 1,
                     f"HB{i}": i < len(ws) and biases[i] is not None,
                     **_nested_args(nested[j] if nested is not None else None, (f"q{i}", f"c{i}", f"f{i}"),
                                    scales[0])})
    return Launch(_dequant_gemv_siblings_kernel, (e,), args, tuple(f"o{i}" for i in range(len(ws))), cfg.warps,
                  cfg.stages)


def gated_fits(cfg: Config, fmt: str) -> bool:
    """Whether ``gated_launch`` takes the siblings' plan ``cfg``: a GEMV of an even
    number of rows a program (half of them from each weight)."""
    return fmt in SIBLING_FORMATS and cfg.kind == "gemv" and cfg.BN >= 2 and cfg.BN % 2 == 0


def gated_launch(x: Tensor, ws: list[Tensor], scales: list[Tensor], zeros: list[Tensor | None],
                 biases: list[Tensor | None], out: Tensor, fmt: str, G: int, cfg: Config, activation: str,
                 nested: list[list[Tensor]] | None = None) -> Launch:
    """out [M, N] = act(x @ dequant(ws[0])^T + b0) * (x @ dequant(ws[1])^T + b1) in
    one GEMV grid (``cfg``: the plan of the two weights as siblings, ``gated_fits``);
    operands as for :func:`siblings_launch`, the two weights of one shape and
    layout (strides), ``activation`` one of "silu", "gelu", "gelu_tanh"."""
    M, K = x.shape
    N = out.shape[1]
    ws = [w.view(torch.uint8) if fmt == "fp8" else w for w in ws]
    xp, zeros, has_zero, loop = _group_operands(x, zeros, fmt)
    z0, z1 = zeros if zeros[0] is not None else (scales[0], scales[0])
    b0, b1 = biases if biases[0] is not None else (scales[0], scales[0])
    args = dict(x=x, x2=xp, w0=ws[0], w1=ws[1], s0=scales[0], s1=scales[1], z0=z0, z1=z1, b0=b0, b1=b1, out=out,
                M=M, N=N, K=K, stride_xm=x.stride(0), stride_x2m=xp.stride(0), stride_wn=ws[0].stride(0),
                stride_sn=scales[0].stride(0) if fmt == "int4" or loop else 1, stride_om=out.stride(0), FMT=fmt,
                G=max(G, 1), HAS_ZERO=has_zero, HAS_BIAS=biases[0] is not None, EVEN_K=K % cfg.BK == 0, LOOP=loop,
                ASM=x.is_cuda and not interpreting() and gemv_asm(fmt, G, 2 * N, cfg), BM=_pow2(M), BN=cfg.BN,
                BK=cfg.BK, FOLD=_fold(cfg, x), ACT=activation, EMU=emulate_rounding(out.dtype), PDL=pdl_on(x),
                NESTED=nested is not None)
    for i in range(2):
        args.update(_nested_args(nested[i] if nested is not None else None, (f"q{i}", f"c{i}", f"f{i}"), scales[0]))
    return Launch(_dequant_gemv_gated_kernel, (cdiv(N, cfg.BN // 2),), args, ("out",), cfg.warps, cfg.stages)


def nested_absmax_launch(a8: Tensor, nested: list[Tensor], out: Tensor) -> Launch:
    """out (fp32, a8's shape) = a code book's absmax from double quantization's
    bytes ``a8`` and (nested absmax, code, offset), all contiguous."""
    n = a8.numel()
    args = dict(a8=a8, nest=nested[0], code=nested[1], offset=nested[2], out=out, n=n, BLOCK=1024)
    return Launch(_nested_absmax_kernel, (cdiv(n, 1024),), args, ("out",), 4)


def reduce_launch(part: Tensor, bias: Tensor | None, out: Tensor) -> Launch:
    """out [M, N] = the sum of the slices part [split, M, N] (+ bias): split K without counters."""
    split, M, N = part.shape
    args = dict(part=part, bias=bias if bias is not None else part, out=out, M=M, N=N, SPLIT=split,
                HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK)
    return Launch(_splitk_reduce_kernel, (cdiv(M * N, _REDUCE_BLOCK),), args, ("out",), 4)


def dequant_launch(w: Tensor, scale: Tensor, zero: Tensor | None, out: Tensor, fmt: str, G: int,
                   g_idx: Tensor | None = None, shifts: Tensor | None = None) -> Launch:
    """out [N, K] = dequant(w) in out's dtype: the cuBLAS path's first pass (``torch.mm`` follows)."""
    N, K = out.shape
    bn, bk = (32, min(G, 256)) if fmt == "int4" else (16, 256)
    lib = fmt in LIBRARY_FORMATS
    if lib:
        zero, g_idx, shifts = _library_operands(w, scale, zero, g_idx, shifts, fmt)
    args = dict(w=w, scale=scale, zero=zero if zero is not None else scale, g_idx=g_idx if g_idx is not None else scale,
                shifts=shifts if shifts is not None else scale,
                out=out, N=N, K=K, NG=_groups(fmt, scale), stride_wn=w.stride(0),
                stride_sn=scale.stride(0), FMT=fmt, G=max(G, 1),
                HAS_ZERO=zero is not None and not lib, LIB=lib, BN=bn, BK=bk)
    return Launch(_dequant_kernel, (cdiv(N, bn), cdiv(K, bk)), args, ("out",), 4)


def _run(launch: Launch, warmup: bool) -> None:
    if warmup:  # compile only (the tuner compiles its candidates in parallel first)
        launch.warmup()
    else:
        launch.run()


def _launch(x: Tensor, w: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, out: Tensor,
            fmt: str, G: int, cfg: Config, warmup: bool = False, sum_here: bool = True,
            g_idx: Tensor | None = None, shifts: Tensor | None = None, nested: list[Tensor] | None = None) -> None:
    """out[M, N] = x[M, K] @ dequant(w)^T + bias with ``cfg``, now; operands as for
    :func:`product_launch`.  A split K is summed by the tile's last program
    where counters can be had and ``sum_here`` (the default), else by a second
    kernel."""
    M, K = x.shape
    N = out_features(w, fmt, scale)
    if fmt == "fp8":
        w = w.view(torch.uint8)
    if cfg.kind == "cublas":
        wd = torch.empty((N, K), dtype=x.dtype, device=x.device)
        _run(dequant_launch(w, scale, zero, wd, fmt, G, g_idx, shifts), warmup)
        if warmup:
            return
        if bias is None:
            torch.mm(x, wd.t(), out=out)
        else:
            torch.addmm(bias.to(x.dtype), x, wd.t(), out=out)
        return
    split = splits(cfg, K)
    part = _workspace(split, M, N, x) if split > 1 else None
    ctr = None
    if split > 1 and sum_here:  # (a compile-only warmup needs only the pointer's type)
        ctr = torch.empty(0, dtype=torch.int32, device=x.device) if warmup else _split_counters(x.device,
                                                                                                  tiles(cfg, M, N))
    _run(product_launch(x, w, scale, zero, bias, out, fmt, G, cfg, part, ctr, g_idx, shifts, nested), warmup)
    if split > 1 and ctr is None:
        _run(reduce_launch(part, bias, out), warmup)
