"""Why large M runs dequantise + cuBLAS: fused int8 tensor-core kernels against it.

At M >= 1024 the product is compute-bound and ``dequant_matmul`` writes the
dequantised weight and calls cuBLAS (its ``cublas`` plan).  This script times
the fused alternatives on Llama-3-8B's shapes, each checked against the fp32
reference first:

- ``mm``: the op's own tensor-core kernel (x as the dot's A operand, the
  weight tile dequantised into B);
- ``swap``: the product transposed, out^T = W @ x^T, so that the int8 tile is
  the dot's A operand, converted in registers, and x^T is B from shared memory;
- ``tma``: ``swap`` persistent, both operands through tensor descriptors (TMA);
- ``triton-bf16``: ``swap`` on the bf16 weight: what Triton's dot reaches with
  no dequantisation at all, the ceiling of the fused kernels here.

    python benchmarks/sweep_dequant_matmul_large_m.py [--ms 1024,4096]

Prints one line per (shape, M): each provider's best config as a ratio of
bf16 cuBLAS's time.  Needs a GPU with TMA (Hopper or later) for ``tma``.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

from fusepass.kernels import dequant_matmul as dm
from fusepass.kernels.dequant_matmul import launch

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
CONFIGS = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3))  # BN BM BK warps stages


@triton.jit
def _tile(t, N, M, BN: tl.constexpr, BM: tl.constexpr, GROUP_N: tl.constexpr):
    # Programs in groups of GROUP_N weight row blocks, sharing x tiles in L2.
    n_n = tl.cdiv(N, BN)
    width = GROUP_N * tl.cdiv(M, BM)
    first_n = (t // width) * GROUP_N
    size_n = tl.minimum(n_n - first_n, GROUP_N)
    return first_n + (t % width) % size_n, (t % width) // size_n


@triton.jit
def _swap_kernel(x, w, scale, out, M, N, K, stride_xm, stride_wn,
                 BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr, SCALED: tl.constexpr):
    i_n, i_m = _tile(tl.program_id(0), N, M, BN, BM, GROUP_N)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    m_m = o_m < M
    p_w = w + o_n.to(tl.int64)[:, None] * stride_wn + o_k[None, :]
    p_x = x + o_m.to(tl.int64)[None, :] * stride_xm + o_k[:, None]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for _ in range(0, K, BK):  # K a multiple of BK here
        b_w = tl.load(p_w, mask=m_n[:, None], other=0)
        b_xt = tl.load(p_x, mask=m_m[None, :], other=0)
        acc = tl.dot(b_w.to(b_xt.dtype), b_xt, acc)
        p_w += BK
        p_x += BK
    if SCALED:
        acc *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
    tl.store(out + o_m.to(tl.int64)[None, :] * N + o_n[:, None], acc.to(out.dtype.element_ty),
             mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _swap_tma_kernel(x, w, scale, out, M, N, K, stride_xm, stride_wn,
                     BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr,
                     NUM_SMS: tl.constexpr, STAGES: tl.constexpr):
    d_w = tl.make_tensor_descriptor(w, shape=[N, K], strides=[stride_wn, 1], block_shape=[BN, BK])
    d_x = tl.make_tensor_descriptor(x, shape=[M, K], strides=[stride_xm, 1], block_shape=[BM, BK])
    tiles = tl.cdiv(N, BN) * tl.cdiv(M, BM)
    for t in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
        i_n, i_m = _tile(t, N, M, BN, BM, GROUP_N)
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            b_w = d_w.load([i_n * BN, k])
            b_x = d_x.load([i_m * BM, k])
            acc = tl.dot(b_w.to(b_x.dtype), b_x.T, acc)
        o_n = i_n * BN + tl.arange(0, BN)
        o_m = i_m * BM + tl.arange(0, BM)
        m_n = o_n < N
        acc *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
        tl.store(out + o_m.to(tl.int64)[None, :] * N + o_n[:, None], acc.to(out.dtype.element_ty),
                 mask=m_n[:, None] & (o_m < M)[None, :])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1024,4096")
    p.add_argument("--rep", type=int, default=20)
    args = p.parse_args(argv)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    for N, K in SHAPES:
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
        s = (torch.rand(N, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
        wd = (q.float() * s.float()[:, None]).to(torch.bfloat16)
        for M in (int(v) for v in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ (q.float() * s.float()[:, None]).t()
            best: dict[str, tuple[float, str]] = {}

            def bench(provider, label, fn):
                try:
                    err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                    if not err <= 2e-2:
                        print(f"    {provider} {label}: error {err:.1e}")
                        return
                    us = triton.testing.do_bench_cudagraph(fn, rep=args.rep) * 1e3
                except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported
                    print(f"    {provider} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                    return
                if provider not in best or us < best[provider][0]:
                    best[provider] = (us, label)

            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            bench("cublas-bf16", "", lambda: x @ wd.t())
            bench("dequant+cublas", "", lambda: (launch._launch(x, q, s, None, None, out, "int8", 0, dm.CUBLAS), out)[1])
            bench("mm", "BM128-BN256-BK64", lambda: (launch._launch(
                x, q, s, None, None, out, "int8", 0, dm.Config("mm", BM=128, BN=256, BK=64, warps=8, stages=3)), out)[1])
            for bn, bm, bk, warps, stages in CONFIGS:
                label = f"{bn}x{bm}x{bk}-w{warps}-s{stages}"
                grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
                for provider, weight, scaled in (("swap", q, True), ("triton-bf16", wd, False)):
                    bench(provider, label, lambda weight=weight, scaled=scaled, bn=bn, bm=bm, bk=bk, w_=warps, st=stages: (
                        _swap_kernel[grid](x, weight, s, out, M, N, K, x.stride(0), weight.stride(0), BN=bn, BM=bm,
                                           BK=bk, GROUP_N=8, SCALED=scaled, num_warps=w_, num_stages=st), out)[1])
                bench("tma", label, lambda bn=bn, bm=bm, bk=bk, w_=warps, st=stages: (
                    _swap_tma_kernel[(n_sm,)](x, q, s, out, M, N, K, x.stride(0), q.stride(0), BN=bn, BM=bm, BK=bk,
                                              GROUP_N=8, NUM_SMS=n_sm, STAGES=st, num_warps=w_), out)[1])
            cub = best["cublas-bf16"][0]
            cells = [f"{k} {us:.1f} us ({us / cub:.2f}x{', ' + label if label else ''})" for k, (us, label) in best.items()]
            print(f"M{M} N{N} K{K} [{time.time() - t0:.0f} s]: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
