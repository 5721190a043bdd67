"""Projections that read one activation, in one launch: ``fusepass::linear_siblings``.

    y_i = x @ W_i^T (+ b_i),   i = 0 .. n - 1,  n <= 4,  every W_i [N_i, K]

At decode sizes (a few rows of x) a linear layer is a matrix-vector product:
its time is its weight's bytes plus a launch's ramp.  Attention's q, k and v
(and the small k / v of grouped-query models, 1-2 MB each in the MoE models
of hidden 2048, which cuBLAS reads in ~5 µs: latency, not bytes) and an MLP's
gate and up all read the same x; one grid whose programs each own a few rows
of one of the weights reads every weight once, through its own pointer (no
concatenated copy), and pays one ramp.

The kernel: program p owns BN rows of the weight whose block range holds p
(the weights' blocks laid end to end), reads them over the whole of K in
BK-wide 16-byte-vector loads with the matching values of x's BM rows,
accumulates products elementwise in fp32 and sums across K once at the end,
then adds the bias in fp32 and rounds once to x's dtype, as cuBLAS's
epilogue does.  Rows past N read row N - 1 and rows of x past M read row
M - 1 (never stored): the loads carry no row mask.  fp64, more than
``MAX_ROWS`` rows of x and groups larger than measured worth it (``takes``)
go to ``torch.mm`` per weight, as the graph had it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.formats import KERNEL_DTYPES
from fusepass.kernels._common import Launch, call, cdiv, flat_rows, inline_enabled, on_device, pdl_begin, pdl_on, \
    register_inline, run_kernel, sm_count

MAX_WEIGHTS = 4
MAX_ROWS = 4  # rows of x the GEMV takes; more are a GEMM (cuBLAS)
# Weight bytes up to which one launch beat cuBLAS's launch per weight (H200,
# bf16, cold, 3e0ea8a): at one row 1.11-2.0x on groups of 20-48 MB, 0.95x on
# Llama-3-8B's gate / up (224 MB, where the ramps are a small share); at four
# rows 1.17-1.34x on q / k / v groups of 20-48 MB but 0.72x on a 48 MB pair
# of one 12288-row and one 64-row weight and 0.56x on the gate / up pair.
MAX_BYTES = {1: 64 << 20}
MAX_BYTES_ROWS = 32 << 20  # two to four rows


def takes(M: int, nbytes: int) -> bool:
    """Whether one launch serves M rows of x against ``nbytes`` of weights (else cuBLAS per weight)."""
    return 0 < M <= MAX_ROWS and nbytes <= MAX_BYTES.get(M, MAX_BYTES_ROWS)


# One weight alone at one row (``linear_one``), 16-bit: the kernel against
# cuBLAS's GEMV (a split-K launch and its reduction), cold, H200, af03263:
# 1.27x at 16 MiB (Qwen3-30B-A3B's o_proj), 1.32x at 22.5 MiB (gpt-oss-20b's),
# 1.12x at 32 MiB (Llama-3-8B's), 0.99x at 112 MiB (its down_proj); at four
# rows 0.76-1.00x, fp32 0.99-1.16x.  In a model: Qwen3-30B-A3B's decode step
# 2 µs a layer faster (b99549f).
MAX_BYTES_ONE = 32 << 20


def takes_one(M: int, nbytes: int) -> bool:
    """Whether one weight of ``nbytes`` alone at M rows of x is measured faster here than through cuBLAS."""
    return M == 1 and nbytes <= MAX_BYTES_ONE


@triton.jit
def _rows(x, w, b, o, N, blk, M, K, stride_xm, stride_wn, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    o_n = blk * BN + tl.arange(0, BN)
    o_m = tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    p_w = w + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_wn + o_k[None, :]  # [BN, BK]
    p_x = x + tl.minimum(o_m, M - 1).to(tl.int64)[:, None] * stride_xm + o_k[None, :]  # [BM, BK]
    acc = tl.zeros([BM, BN, BK], dtype=tl.float32)
    # (The next K tile's loads issued before this tile's products, as the MoE
    # down kernel's look-ahead, beat no tile of the plan's: H200, 6185afa.)
    for k0 in range(0, K, BK):
        if EVEN_K:
            b_w = tl.load(p_w + k0)
            b_x = tl.load(p_x + k0)
        else:
            m_k = k0 + o_k < K
            b_w = tl.load(p_w + k0, mask=m_k[None, :], other=0)
            b_x = tl.load(p_x + k0, mask=m_k[None, :], other=0)
        acc += b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [BM, BN]
    if HAS_BIAS:
        y += tl.load(b + o_n, mask=o_n < N, other=0).to(tl.float32)[None, :]
    m_o = (o_m[:, None] < M) & (o_n[None, :] < N)
    tl.store(o + o_m[:, None] * N + o_n[None, :], y.to(o.dtype.element_ty), mask=m_o)


@triton.jit
def _linear_siblings_kernel(x, w0, w1, w2, w3, b0, b1, b2, b3, o0, o1, o2, o3, N0, N1, N2, N3, E0, E1, E2,
                            M, K, stride_xm, stride_w0, stride_w1, stride_w2, stride_w3,
                            HB0: tl.constexpr, HB1: tl.constexpr, HB2: tl.constexpr, HB3: tl.constexpr,
                            NW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # E0 <= E1 <= E2: where the blocks of weights 0, 1, 2 end.  A slot past NW
    # is compiled out, so its pointers (x, never read or written) do not count
    # as the launch's writes.
    pid = tl.program_id(0)
    if pid < E0:
        _rows(x, w0, b0, o0, N0, pid, M, K, stride_xm, stride_w0, HB0, BM, BN, BK, EVEN_K)
    else:
        if NW > 1:
            if pid < E1:
                _rows(x, w1, b1, o1, N1, pid - E0, M, K, stride_xm, stride_w1, HB1, BM, BN, BK, EVEN_K)
            else:
                if NW > 2:
                    if pid < E2:
                        _rows(x, w2, b2, o2, N2, pid - E1, M, K, stride_xm, stride_w2, HB2, BM, BN, BK, EVEN_K)
                    else:
                        if NW > 3:
                            _rows(x, w3, b3, o3, N3, pid - E2, M, K, stride_xm, stride_w3, HB3, BM, BN, BK,
                                  EVEN_K)


# ------------------------------------------------------------------ launches ----


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(M: int, Ns: list[int], K: int, device: torch.device) -> tuple[int, int, int]:
    """(BN, BK, warps): four rows a program while that still gives every SM two
    programs, else fewer; K in tiles of up to 2048 values a row (16-byte loads
    for each of 128 threads), fewer as x's rows multiply the accumulator."""
    n_sm = sm_count(device) if device.type == "cuda" else 8
    BN = 4
    while BN > 1 and sum(cdiv(n, BN) for n in Ns) < 2 * n_sm:
        BN //= 2
    BK = min(_pow2(K), 8192 // (_pow2(M) * BN))  # the accumulator: up to 64 fp32 a thread
    return BN, max(BK, 16), 4


def siblings_launch(x2: Tensor, weights: list[Tensor], biases: list[Tensor | None], outs: list[Tensor],
                    cfg: tuple[int, ...] | None = None) -> Launch:
    """out_i [M, N_i] = x2 [M, K] @ weights[i]^T (+ biases[i]); x2 and each weight with unit column stride.
    ``cfg``: (BN, BK, warps), the plan's by default."""
    M, K = x2.shape
    Ns = [w.shape[0] for w in weights]
    BN, BK, warps = cfg or plan(M, Ns, K, x2.device)
    ends, e = [], 0
    for n in Ns:
        e += cdiv(n, BN)
        ends.append(e)
    pad = MAX_WEIGHTS - len(weights)
    ws = list(weights) + [x2] * pad
    bs = [b if b is not None else x2 for b in biases] + [x2] * pad
    os_ = list(outs) + [x2] * pad
    ns = Ns + [1] * pad
    es = (ends + [e] * MAX_WEIGHTS)[:3]
    args = dict(x=x2, M=M, K=K, stride_xm=x2.stride(0), NW=len(weights), BM=_pow2(M), BN=BN, BK=BK,
                EVEN_K=K % BK == 0, E0=es[0], E1=es[1], E2=es[2], PDL=pdl_on(x2))
    for i in range(MAX_WEIGHTS):
        args.update({f"w{i}": ws[i], f"b{i}": bs[i], f"o{i}": os_[i], f"N{i}": ns[i],
                     f"stride_w{i}": ws[i].stride(0), f"HB{i}": i < len(biases) and biases[i] is not None})
    return Launch(_linear_siblings_kernel, (e,), args, tuple(f"o{i}" for i in range(len(weights))), warps)


# ------------------------------------------------------------------------ op ----


def _check(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> None:
    torch._check(1 <= len(weights) <= MAX_WEIGHTS, lambda: f"1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    torch._check(len(biases) == len(weights), lambda: "one bias (or None) per weight")
    K = x.shape[-1]
    for i, w in enumerate(weights):
        torch._check(w.dim() == 2 and w.shape[1] == K, lambda: f"weight {i} is {tuple(w.shape)}, not [N, {K}]")
        torch._check(w.dtype == x.dtype, lambda: f"weight {i} is {w.dtype}, x {x.dtype}")
    for i, b in enumerate(biases):
        if b is None:
            continue
        torch._check(b.dim() == 1 and b.shape[0] == weights[i].shape[0] and b.dtype == x.dtype,
                     lambda: f"bias {i} is {b.dtype}{tuple(b.shape)}, not {x.dtype}[{weights[i].shape[0]}]")


def _reference(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    x2 = x.reshape(flat_rows(x, x.shape[-1]), x.shape[-1])  # (K may be 0)
    outs = [torch.mm(x2, w.t()) if b is None else torch.addmm(b, x2, w.t()) for w, b in zip(weights, biases)]
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]


def _operands(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> tuple[Tensor, list[Tensor], list]:
    """x as [M, K] rows, weights and biases at unit stride in their last dim, as the kernel reads them (a
    bias of stride 2 once gave every other value: the kernel reads N packed values)."""
    x2 = x.reshape(flat_rows(x, x.shape[-1]), x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return (x2, [w if w.stride(-1) == 1 else w.contiguous() for w in weights],
            [b if b is None or b.stride(-1) == 1 else b.contiguous() for b in biases])


def linear_siblings_fwd(x: Tensor, weights: list[Tensor], biases: list[Tensor | None],
                        cfg: tuple[int, int, int] | None = None) -> list[Tensor]:
    """The CUDA body (``cfg`` overrides the plan: tests, sweeps)."""
    M = x.numel() // max(x.shape[-1], 1)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    if x.dtype not in KERNEL_DTYPES or x.shape[-1] == 0 or (cfg is None and not takes(M, nbytes)) or M == 0:
        return _reference(x, weights, biases)
    x2, ws, bs = _operands(x, weights, biases)
    outs = [torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device) for w in ws]
    with on_device(x):
        siblings_launch(x2, ws, bs, outs, cfg).run()
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]


@torch.library.custom_op("fusepass::linear_siblings", mutates_args=())
def linear_siblings(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """[x @ w.T (+ b) for each weight]: one launch on CUDA at up to MAX_ROWS rows of x.  This body serves CPU."""
    _check(x, weights, biases)
    return [y.contiguous() for y in _reference(x, weights, biases)]


@linear_siblings.register_fake
def _linear_siblings_fake(x, weights, biases):
    _check(x, weights, biases)
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


@linear_siblings.register_kernel("cuda")
def _linear_siblings_cuda(x, weights, biases):
    _check(x, weights, biases)
    return run_kernel("linear_siblings", lambda: linear_siblings_fwd(x, weights, biases),
                      lambda: [y.contiguous() for y in _reference(x, weights, biases)])


# ------------------------------------------------------- calls in graphs ----


def _traced(x, weights, biases):
    x2, ws, bs = _operands(x, weights, biases)
    M = x2.shape[0]
    outs = [torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device) for w in ws]
    got = siblings_launch(x2, ws, bs, outs).traced()
    return [got[f"o{i}"].view(*x.shape[:-1], w.shape[0]) for i, w in enumerate(ws)]


def _inline_ok(x, weights, biases) -> bool:
    # The launch's BM, BN and grid need M and the N_i as numbers.
    M = x.numel() // x.shape[-1] if isinstance(x.shape[-1], int) and x.shape[-1] else 0
    return (inline_enabled(x) and x.dtype in KERNEL_DTYPES and isinstance(M, int)
            and all(isinstance(s, int) for w in weights for s in (*w.shape, *w.stride()))
            and takes(M, sum(w.numel() * w.element_size() for w in weights)))


register_inline(torch.ops.fusepass.linear_siblings.default, _inline_ok, _traced)


def linear_siblings_call(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]):
    """What the rule puts in a graph: the launch itself when the engine inlines
    kernels for a CUDA graph, else the op."""
    return call(torch.ops.fusepass.linear_siblings.default, x, list(weights), list(biases))
