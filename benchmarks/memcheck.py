"""Every fusepass op's CUDA path at real and edge sizes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python benchmarks/memcheck.py [--ops gdn,moe,library] [--quick] [--isolate]

Groups: norms, dequant_matmul (int8 / int4 / fp8), library (nf4, fp4, gptq4
with an act-order g_idx and, at GEMV sizes, g_idx = k // G too, gptq4_v1,
hqq4), gdn, conv, linear (linear_siblings, the quantized siblings and gated), attention (decode_attention), moe (router and experts
at Qwen3-30B-A3B's, gpt-oss-20b's and DeepSeek-V3's sizes, quantized expert
stacks) and all_reduce (``all_reduce_rms_norm`` on a one-rank process group:
NCCL for the CUDA tensors, gloo for the CPU copies).  Besides each op's own
plan, the launch paths the op picks only at other sizes or GPUs (GDN's
variants, every MoE experts plan, the router's tile shapes, every
dequant_matmul path on the library layouts) are each called once directly.
The moe group builds its experts with tests/test_moe_kernels.py's builder
(so it needs pytest importable).

Without the caching allocator every tensor is its own allocation, so a read
or write past its end lands outside any allocation and memcheck reports it
(inside the allocator's slabs it would land in another tensor and pass).
Each case runs the op once on random inputs with poisoned outputs and checks
the result against the op's own plain-torch body on the CPU (fp32), so the
sweep also fails on wrong values.  ``--peers`` also runs the
flash-linear-attention kernels on the same GDN inputs (the sequence in which
a fault was once seen: fusepass's recurrent kernel, FLA's, then
transformers' fp64 loop).

A kernel that raises falls back to the plain-torch body inside the op
(``run_kernel``): the sweep reports such a case as FALLBACK, not ok.  A fault
(an illegal address) leaves the process's CUDA context unusable, so every
later case would fail too: the sweep stops there and names the case.
``--isolate`` runs each group in a child process instead and, after a fault,
a new child from the case after it, so one fault hides nothing (memcheck
follows child processes by default: run it on the parent as above).

Exit status: 0 when every case ran and matched; 1 otherwise (memcheck's own
``--error-exitcode`` reports a fault).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import fusepass  # noqa: F401  - registers the ops
from fusepass.kernels._common import clear_kernel_fallbacks, kernel_fallbacks

ops = torch.ops.fusepass
DEVICE = "cuda"
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the tests' input builders (tests/ is imported as a namespace package)
    sys.path.insert(0, str(ROOT))


class ContextLost(Exception):
    """A case left the CUDA context unusable (a fault): every later case in this process would fail."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    n = b.norm().item()
    return (a - b).norm().item() / (n if n > 0 else 1.0)


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(t) for t in x)
    return x


def _outputs(x) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]


def _case(name: str, op, args: tuple, tol: float, compare=None) -> tuple[str, str, float]:
    """Run ``op`` on CUDA ``args`` and on their CPU copies; return (name, verdict, error).
    ``compare(got, want, cpu_args) -> error`` replaces the largest relative error
    over the outputs (got on the CPU)."""
    t0 = time.perf_counter()
    clear_kernel_fallbacks()
    try:
        got = op(*args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        # A kernel that raised has been replaced by the op's torch body: right
        # values, but the kernel did not run under the sanitizer.
        fell = kernel_fallbacks()
        cpu_args = _cpu(args)
        want = op(*cpu_args)
        if compare is not None:
            err = compare(_cpu(got), want, cpu_args)
        else:
            err = max((_rel(g, w) for g, w in zip(_outputs(got), _outputs(want))), default=0.0)
        verdict = "ok" if err <= tol else f"MISMATCH {err:.3g} > {tol:g}"
        if fell:
            verdict = "FALLBACK " + "; ".join(f"{k}: {v}" for k, v in fell.items())[:120]
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        verdict, err = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", float("nan")
        traceback.print_exc()
    print(f"{name:60s} {verdict:40s} {time.perf_counter() - t0:6.1f} s", flush=True)
    return name, verdict, err


def _context_alive() -> bool:
    if DEVICE != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - the sticky error of a fault
        return False


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def norm_cases(quick: bool):
    sizes = [(1, 4096), (7, 4097), (3, 1), (0, 64), (2, 65536), (4096, 4096)] if not quick else [(7, 4097), (2, 65536)]
    for M, N in sizes:
        for dt in (torch.bfloat16, torch.float32):
            x, r, w, z = _randn(M, N, dtype=dt), _randn(M, N, dtype=dt), _randn(N, dtype=dt), _randn(M, N, dtype=dt)
            tol = 2e-2 if dt != torch.float32 else 1e-4
            yield f"rms_norm M{M} N{N} {dt}", ops.rms_norm, (x, w, 1e-6, 0.0, False, dt), tol
            yield f"add_rms_norm M{M} N{N} {dt}", ops.add_rms_norm, (x, r, w, 1e-6, 1.0, True, dt), tol
            yield f"rms_norm_gated M{M} N{N} {dt}", ops.rms_norm_gated, (x, z, w, 1e-6, True, "silu"), tol
            yield f"swiglu M{M} N{N} {dt}", ops.swiglu, (x, z), tol
            yield f"geglu M{M} N{N} {dt}", ops.geglu, (x, z, "tanh"), tol


def dequant_cases(quick: bool):
    from fusepass.kernels.dequant_matmul import Config
    from fusepass.quantize import Fp8Linear, Int4Linear, Int8Linear

    def quantized(N, K, fmt, group):
        lin = torch.nn.Linear(K, N, bias=False, device=DEVICE, dtype=torch.bfloat16)
        m = {"int8": Int8Linear, "fp8": Fp8Linear}[fmt](lin) if fmt != "int4" else Int4Linear(lin, group)
        return m.weight, m.scale, getattr(m, "zero", None)

    shapes = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (96, 160), (33, 256)]
    Ms = (1, 2, 4, 8, 16, 64, 256, 1024) if not quick else (1, 16, 256)
    for N, K in shapes[:3] if quick else shapes:
        for fmt, group in (("int8", 0), ("int4", 128), ("int4", 32), ("fp8", 0)):
            if fmt == "int4" and K % group:
                continue
            q, s, z = quantized(N, K, fmt, group)
            for M in Ms:
                if M * N * K > 1024 * 4096 * 14336:
                    continue
                x = _randn(M, K)
                b = _randn(N) if M == 4 else None
                yield (f"dequant_matmul {fmt} g{group} M{M} N{N} K{K}", ops.dequant_matmul,
                       (x, q, s, z, b, fmt, group), 2e-2)
            if fmt == "int4" and group == 128 and K % 2048 == 0:
                # the one-row GEMV's folded sums overflowing (sum (128 + q) x): the slice re-done per code
                x = _randn(1, K)
                x[0, 40:72] = 3e35
                cfg = Config("gemv", BN=8, BK=2048, warps=2, split=2)
                yield (f"dequant_matmul int4 g128 {cfg.label()} M1 N{N} K{K} folded overflow", _dequant_config(cfg),
                       (x, q, s, z, None, fmt, group), 2e-2)
            if fmt == "int4" and group == 128 and (N, K) == (1024, 4096):
                # the heuristic's four rows a program over the whole of K (folded; the H200 plan runs it per code)
                cfg = Config("gemv", BN=4, BK=4096, warps=4, split=1)
                yield (f"dequant_matmul int4 g128 {cfg.label()} M1 N{N} K{K}", _dequant_config(cfg),
                       (_randn(1, K), q, s, z, None, fmt, group), 2e-2)
            if (fmt == "int4" and group == 128) or fmt == "int8":
                # int4's scales loaded ahead, x copied into the tile's K order (plans take both at some shapes)
                for M, split, ahead, xperm in ((16, 2, 1, 0), (16, 1, 2, 0), (64, 4, 2, 0), (64, 2, 2, 1), (16, 4, 1, 1)):
                    if fmt == "int8" and not xperm:
                        continue
                    cfg = Config("mmt", BM=M, BN=64, BK=128, split=split, stages=3, ahead=ahead if fmt == "int4" else 0,
                                 xperm=xperm)
                    yield (f"dequant_matmul {fmt} {cfg.label()} M{M} N{N} K{K}", _dequant_config(cfg),
                           (_randn(M, K), q, s, z, None, fmt, group), 2e-2)


def _dequant_config(cfg):
    """The dequant_matmul launcher with ``cfg`` on CUDA tensors, the op's CPU body on CPU copies."""
    def run(x, q, s, z, b, fmt, group):
        if x.is_cuda:
            from fusepass.kernels.dequant_matmul import launch
            out = torch.full((x.shape[0], q.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
            launch._launch(x, q, s, z, b, out, fmt, group, cfg)
            return out
        return ops.dequant_matmul(x, q, s, z, b, fmt, group)
    return run


def _gdn_inputs(B, T, Hk, Hv, dk, dv, state=True, strided=True):
    mixed = _randn(B, T, 2 * Hk * dk + Hv * dv)
    q, k, v = torch.split(mixed, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q, k, v = q.view(B, T, Hk, dk), k.view(B, T, Hk, dk), v.view(B, T, Hv, dv)
    g = F.logsigmoid(torch.randn(B, T, Hv, device=DEVICE) + 3)
    beta = torch.rand(B, T, Hv, device=DEVICE).to(torch.bfloat16)
    s0 = torch.randn(B, Hv, dk, dv, device=DEVICE) * 0.1 if state else None
    return q, k, v, g, beta, s0


def _gdn_launch(**options):
    """gdn_chunk_fwd with launch ``options`` on CUDA tensors, the op's CPU body on CPU copies."""
    def run(q, k, v, g, beta, s0, l2, scale):
        if q.is_cuda:
            from fusepass.kernels.gdn import gdn_chunk_fwd
            return gdn_chunk_fwd(q, k, v, g, beta, s0, l2, scale, **options)
        return ops.gdn_chunk(q, k, v, g, beta, s0, l2, scale)
    return run


# Every launch path of the chunked op (the op itself runs the default one).
GDN_PATHS = {"split": dict(fuse_output=False), "split-inverse-fp32": dict(fuse_output=False, inverse_fp32=True),
             "fused": dict(fuse_output=True), "fused-tiles": dict(fuse_output=True, scan_row_factors=False),
             "split-tiles": dict(fuse_output=False, output_row_factors=False),
             "fused-bv128": dict(fuse_output=True, block_v=128),
             "split-s1": dict(fuse_output=False, num_stages=1)}


def gdn_cases(quick: bool):
    chunk = [  # (B, T, Hk, Hv, dk, dv)
        (1, 8192, 32, 32, 128, 128), (2, 3000, 16, 32, 128, 128), (1, 65, 4, 4, 64, 64),
        (3, 1, 2, 4, 128, 128), (1, 17, 2, 2, 96, 192), (1, 130, 2, 2, 256, 256), (4, 63, 2, 2, 64, 128),
    ]
    rec = [(1, 1, 32, 32, 128, 128), (128, 1, 32, 32, 128, 128), (256, 1, 16, 32, 128, 128),
           (5, 3, 2, 2, 96, 192), (2, 8, 4, 8, 256, 256)]
    if quick:
        chunk, rec = chunk[1:4], rec[1:3]
    for B, T, Hk, Hv, dk, dv in chunk:
        for l2 in (True, False):
            q, k, v, g, beta, s0 = _gdn_inputs(B, T, Hk, Hv, dk, dv, state=l2)
            if not l2:  # the recurrence is stable for unit keys: give them normalised
                q, k = F.normalize(q.float(), dim=-1).to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype)
            a = (q, k, v, g, beta, s0)
            yield f"gdn_chunk B{B} T{T} Hk{Hk} Hv{Hv} dk{dk} dv{dv} l2={l2}", ops.gdn_chunk, (*a, l2, dk ** -0.5), 2e-2
    # Launched directly: d_k a power of two, as the op launches them (d_k 96 goes to its
    # plain-torch path; the cases above still pass it through the op).
    # T 1030: one stage at 32 value columns faulted from T 1024 (H200, see gdn.launch._MIN_TILE).
    edge = [(1, 65, 4, 4, 64, 64), (2, 17, 1, 2, 64, 192), (3, 200, 2, 4, 128, 128), (1, 1030, 2, 2, 128, 128)]
    for (B, T, Hk, Hv, dk, dv), (path, options) in itertools.product(edge[:1] if quick else edge, GDN_PATHS.items()):
        a = _gdn_inputs(B, T, Hk, Hv, dk, dv, state=B != 2)
        yield (f"gdn_chunk[{path}] B{B} T{T} Hk{Hk} Hv{Hv} dk{dk} dv{dv}", _gdn_launch(**options),
               (*a, True, dk ** -0.5), 2e-2)
    for B, T, Hk, Hv, dk, dv in rec:
        a = _gdn_inputs(B, T, Hk, Hv, dk, dv)
        yield f"gdn_recurrent B{B} T{T} Hk{Hk} Hv{Hv} dk{dk} dv{dv}", ops.gdn_recurrent, (*a, True, dk ** -0.5), 2e-2


def conv_cases(quick: bool):
    """The GDN layer's short convolution: prefill and the in-place state update."""
    prefill = [(1, 8192, 2048), (2, 4097, 33), (3, 130, 1)] if not quick else [(2, 4097, 33), (3, 130, 1)]
    for B, C, T in prefill:
        x = _randn(B, T, C).transpose(1, 2)  # the model's layout: the transpose of [B, T, C]
        w, b = _randn(C, 4), _randn(C)
        yield f"causal_conv1d B{B} C{C} T{T}", ops.causal_conv1d, (x, w, b, "silu"), 2e-2
    for B, C, L, S in [(32, 8192, 1, 4), (3, 130, 3, 3)] if not quick else [(3, 130, 3, 3)]:
        x = _randn(B, L, C).transpose(1, 2)
        w, state = _randn(C, 4), _randn(B, C, S)
        yield (f"causal_conv1d_update B{B} C{C} L{L} S{S}", ops.causal_conv1d_update,
               (x, state, w, None, "silu"), 2e-2)


def _library_inputs(fmt, M, N, K, dtype, seed=0, **kw):
    """(x, weight, scale, zero, g_idx, group) in ``fmt``'s stored layout with random codes, on DEVICE."""
    from fusepass.testing.library_layouts import library_inputs

    return tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                 for t in library_inputs(fmt, M, N, K, dtype, seed, **kw))


def _library_path(cfg, N):
    """dequant_matmul's product with the explicit config ``cfg`` on CUDA tensors, the op's body on CPU copies."""
    def run(x, w, s, z, b, fmt, group, g):
        if x.is_cuda:
            from fusepass.kernels.dequant_matmul.launch import _launch
            out = torch.full((x.shape[0], N), float("nan"), dtype=x.dtype, device=x.device)
            _launch(x, w, s, z, b, out, fmt, group if fmt in ("nf4", "fp4", "hqq4") else 0, cfg, g_idx=g)
            return out
        return ops.dequant_matmul(x, w, s, z, b, fmt, group, g)
    return run


LIBRARY_FORMATS = ("nf4", "fp4", "gptq4", "gptq4_v1", "hqq4")


def library_cases(quick: bool):
    """The libraries' 4-bit layouts (bitsandbytes, GPTQ, HQQ) through the op at Llama's
    shapes and at N, K that are not whole blocks (K a multiple of 64 and of 8 * 32:
    what the layouts' groups need), then each product path once at a real size."""
    from fusepass.kernels import dequant_matmul as dm
    from fusepass.kernels.dequant_matmul.config import Problem, m_bucket, valid

    shapes = [(4096, 4096), (14336, 4096), (40, 192), (33, 320)]  # (N, K)
    Ms = (1, 3, 16, 77)
    if quick:
        shapes, Ms = [(4096, 4096), (40, 192)], (1, 16)
    for (N, K), fmt in itertools.product(shapes, LIBRARY_FORMATS):
        for M in Ms:
            x, w, s, z, g, group = _library_inputs(fmt, M, N, K, torch.bfloat16, seed=M)
            b = _randn(N) if M == 3 else None
            yield (f"dequant_matmul {fmt} g{group} M{M} N{N} K{K}", ops.dequant_matmul,
                   (x, w, s, z, b, fmt, group, g), 2e-2)
            if fmt.startswith("gptq4") and M < 16:  # g_idx = k // G: the GEMV's other loop (one group per word)
                x, w, s, z, g, group = _library_inputs(fmt, M, N, K, torch.bfloat16, seed=M, act_order=False)
                yield (f"dequant_matmul {fmt} g{group} grouped M{M} N{N} K{K}", ops.dequant_matmul,
                       (x, w, s, z, b, fmt, group, g), 2e-2)
    # The op's plan takes one path per (M, N, K): each of the others once (the
    # real-size configs of tests/test_dequant_matmul_kernels.py's GPU test).
    paths = {"gemv": dm.Config("gemv", BN=8, BK=256, split=1), "gemv-splitk": dm.Config("gemv", BN=16, BK=256, split=4),
             "mm": dm.Config("mm", BM=16, BN=64, BK=32, split=1, stages=3),
             "mm-splitk": dm.Config("mm", BM=64, BN=128, BK=32, split=2), "cublas": dm.CUBLAS,
             # the code books' and HQQ's words on the transposed kernel (the plans' from three rows)
             "mmt-ahead": dm.Config("mmt", BM=16, BN=128, BK=64, split=3, stages=3, ahead=1),
             "mmt-xperm": dm.Config("mmt", BM=64, BN=64, BK=64, split=2, stages=3, ahead=2, xperm=1)}
    N, K = (4096, 4096) if not quick else (40, 192)
    for (path, cfg), fmt in itertools.product(paths.items(), LIBRARY_FORMATS if not quick else ("gptq4", "hqq4", "nf4")):
        M = 1 if cfg.kind == "gemv" else 77
        x, w, s, z, g, group = _library_inputs(fmt, M, N, K, torch.bfloat16, seed=M)
        G = group if fmt in ("nf4", "fp4", "hqq4") else 0
        if not valid(cfg, Problem(m_bucket(M), N, K, fmt, G, torch.bfloat16, "memcheck", 132)):
            continue
        yield (f"dequant_matmul[{path}] {fmt} M{M} N{N} K{K}", _library_path(cfg, N),
               (x, w, s, z, None, fmt, group, g), 2e-2)


# --------------------------------------------------------------------- moe ----

# name -> (E, H, kind, top_k, renormalize, n_group, topk_group, scaling, bias, correction bias, x / logits /
#          weights / router weight dtype)
ROUTERS = {
    "qwen3-30b-a3b": (128, 2048, "softmax", 8, True, 1, 1, 1.0, False, False, "bf16", "bf16", "bf16", "bf16"),
    "olmoe": (64, 2048, "softmax", 8, False, 1, 1, 1.0, False, False, "bf16", "bf16", "bf16", "bf16"),
    "gpt-oss-20b": (32, 2880, "topk_softmax", 4, False, 1, 1, 1.0, True, False, "bf16", "bf16", "bf16", "bf16"),
    "deepseek-v3": (256, 7168, "sigmoid", 8, True, 8, 4, 2.5, False, True, "bf16", "fp32", "fp32", "fp32"),
    "odd-E60-H301": (60, 301, "softmax", 4, True, 1, 1, 1.0, False, False, "fp16", "fp16", "fp32", "fp16"),
    "odd-E12-sigmoid-scaled": (12, 77, "sigmoid", 3, False, 1, 1, 1.5, False, True, "bf16", "bf16", "bf16", "bf16"),
}
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _router_inputs(name, T, expanded=False):
    E, H, kind, k, renorm, ng, tg, sc, bias, cb, xdt, ldt, wdt, rdt = ROUTERS[name]
    x = _randn(T, H, dtype=_DT[xdt])
    w = (torch.randn(E, H, device=DEVICE) * 3 * H ** -0.5).to(_DT[rdt])  # logits of std ~3: a spread softmax
    b = c = None
    if bias:  # expanded: one value at stride 0 over the experts
        b = _randn(1, dtype=_DT[xdt]).expand(E) if expanded else _randn(E, dtype=_DT[xdt])
    if cb:
        c = (torch.randn(1, device=DEVICE) * 0.1).expand(E) if expanded else torch.randn(E, device=DEVICE) * 0.1
    return (x, w, b, c, kind, k, renorm, ng, tg, sc, _DT[ldt], _DT[wdt])


def _router_compare(got, want, cpu_args):
    """Logits against the CPU body's; ids and weights against the selection made from the
    kernel's own logits (a logit an ulp apart at the k-th place picks another expert,
    which is no fault).  The error: the largest of the logits' and weights' relative
    errors and the fraction of tokens whose ids differ."""
    from fusepass.kernels.moe import router as rt

    w, ids, logits = got
    _, _, _, c, kind, k, renorm, ng, tg, sc, _, wdt = cpu_args
    ref_w, ref_ids = rt.router_select_reference(logits, c, kind, k, renorm, ng, tg, sc, wdt)
    same = (ids == ref_ids).all(dim=-1)
    differ = (~same).float().mean().item() if ids.shape[0] else 0.0
    return max(_rel(logits, want[2]), _rel(w[same], ref_w[same]), differ)


def _router_path(cfg):
    """The router kernel with tiles ``cfg`` on CUDA tensors, the op's body on CPU copies."""
    def run(*args):
        if args[0].is_cuda:
            from fusepass.kernels.moe import router as rt
            return rt.router_fwd(*args, cfg=cfg)
        return ops.moe_router(*args)
    return run


def _router_paths(E):
    """Split over experts (a counter per token block; FMAs, tl.dot) and all experts per
    program (FMAs, tl.dot): the op takes split FMAs for T <= 8 and whole tl.dot above."""
    from fusepass.kernels.moe import router as rt
    from fusepass.kernels.moe._tiles import cdiv_pow2

    BEA = cdiv_pow2(E)
    return {"split-fma": rt.RouterConfig(BT=4, BE=8, BK=64, dot=False),
            "split-fma-pdl": rt.RouterConfig(BT=4, BE=8, BK=64, dot=False, pdl=True, release=True),
            "split-dot": rt.RouterConfig(BT=16, BE=16, BK=64, dot=True),
            "whole-fma": rt.RouterConfig(BT=4, BE=BEA, BK=max(16, 4096 // (4 * BEA)), dot=False),
            "whole-dot": rt.RouterConfig(BT=16, BE=BEA, BK=64, dot=True, warps=8 if BEA >= 256 else 4)}


# name -> (E, k, H, I, activation, gate layout, transposed, bias, alpha, limit)
EXPERTS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", "halves", False, False, 0.0, 0.0),
    "gpt-oss-20b": (32, 4, 2880, 2880, "gpt_oss", "interleaved", True, True, 1.702, 7.0),
    "odd-E13-H301-I97": (13, 3, 301, 97, "silu", "halves", False, True, 0.0, 0.0),
    "odd-gpt-oss-E5-H37-I19": (5, 2, 37, 19, "gpt_oss", "interleaved", True, True, 1.702, 7.0),
}
# Quantized stacks at Qwen3-30B-A3B's dims: fmt, group, asymmetric
EXPERT_QUANT = (("int4", 128, True), ("int4", 32, False), ("int8", 0, False), ("fp8", 0, False))


def _experts_plan(plan):
    """moe_experts through ``plan``'s launches on CUDA tensors, the op's body on CPU copies."""
    def run(*args):
        if args[0].is_cuda:
            from fusepass.kernels.moe import experts as ex
            return ex.experts_fwd(*args, plan=plan)
        return ops.moe_experts(*args)
    return run


def _experts_decode(**cfg):
    """moe_experts through the decode launches with the heuristic's tiles changed by ``cfg``
    (e.g. pdl=True) on CUDA tensors, the op's body on CPU copies."""
    def run(*args):
        if args[0].is_cuda:
            import dataclasses

            from fusepass.kernels._common import sm_count
            from fusepass.kernels.moe import decode
            from fusepass.kernels.moe import experts as ex
            x, ids, w1 = args[0], args[1], args[3]
            trans, fmt, group = args[13], args[14], args[15]
            I = w1.shape[2 if trans else 1] // 2
            base = decode.decode_heuristic(x.shape[0], ids.shape[1], x.shape[1], I, trans, sm_count(x.device),
                                           group if fmt == "int4" else 0,
                                           dot=decode.dot_down_fits(x.dtype, args[4].dtype, fmt, trans),
                                           plain16=fmt == "none" and w1.element_size() == 2)
            return ex.experts_fwd(*args, plan="decode", cfg=dataclasses.replace(base, **cfg))
        return ops.moe_experts(*args)
    return run


def _poison_moe_workspaces():
    """NaN (or a huge index) in every MoE output and workspace, as the kernel tests do: an
    element a kernel forgets to write shows.  Returns the undo."""
    from fusepass.kernels.moe import _tiles

    real = _tiles.workspace

    def poisoned(shape, dtype, device):
        return real(shape, dtype, device).fill_(float("nan") if dtype.is_floating_point else 2**30)

    _tiles.workspace = poisoned
    return lambda: setattr(_tiles, "workspace", real)


def moe_cases(quick: bool):
    """moe_router at the models' sizes and tile paths; moe_experts per model and token
    count (the op's own plan), quantized stacks, and each plan forced once."""
    try:
        from tests.test_moe_kernels import _experts_inputs  # the kernel tests' builder (random ids, quantizers)
    except ImportError as exc:
        raise ImportError(f"the moe group builds its inputs with tests/test_moe_kernels.py: {exc}") from exc
    undo = _poison_moe_workspaces()
    try:
        yield from _moe_router_cases(quick)
        yield from _moe_experts_cases(quick, _experts_inputs)
    finally:
        undo()


def _moe_router_cases(quick: bool):
    Ts = (1, 3, 64, 4096, 0) if not quick else (1, 64, 0)
    for name in ROUTERS if not quick else ("qwen3-30b-a3b", "deepseek-v3", "odd-E60-H301"):
        for T in Ts:
            yield f"moe_router {name} T{T}", ops.moe_router, _router_inputs(name, T), 2e-2, _router_compare
        if ROUTERS[name][8] or ROUTERS[name][9]:  # a bias: also one of stride 0
            yield (f"moe_router {name} T3 expanded bias", ops.moe_router, _router_inputs(name, 3, expanded=True),
                   2e-2, _router_compare)
    for name in ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3", "odd-E12-sigmoid-scaled"):
        for (path, cfg), T in itertools.product(_router_paths(ROUTERS[name][0]).items(), (3, 64)):
            if quick and (T == 3 or name == "gpt-oss-20b"):
                continue
            yield (f"moe_router[{path}] {name} T{T}", _router_path(cfg), _router_inputs(name, T), 2e-2,
                   _router_compare)


def _moe_experts_cases(quick: bool, build):
    Ts = (1, 2, 8, 64, 512, 0) if not quick else (1, 64)
    for name, (E, k, H, I, act, layout, trans, bias, alpha, limit) in EXPERTS.items():
        if quick and name == "gpt-oss-20b":  # 2.6 G weights to draw on the CPU: not in a quick sweep
            continue
        Ts_m = Ts if not name.startswith("odd") else (1, 7, 77)
        # One weight stack per model at the largest T; smaller T take the first rows.
        x, ids, tw, *weights = (None if t is None else t.to(DEVICE)
                                for t in build(max(Ts_m), E, H, I, k, torch.bfloat16, trans=trans, bias=bias))
        tail = (act, layout, trans, "none", 0, alpha, limit)
        for T in Ts_m:
            yield f"moe_experts {name} T{T}", ops.moe_experts, (x[:T], ids[:T], tw[:T], *weights, *tail), 2e-2
        for T in (1, 4) if not name.startswith("odd") else (1, 7):  # both decode launches with and without PDL
            for pdl in (False, True):
                yield (f"moe_experts[decode pdl={pdl}] {name} T{T}", _experts_decode(pdl=pdl),
                       (x[:T], ids[:T], tw[:T], *weights, *tail), 2e-2)
            # The next K tile loaded ahead (its last look-ahead past K, masked off).
            yield (f"moe_experts[decode ahead] {name} T{T}",
                   _experts_decode(ahead=True, ahead2=True, whole2=False, BK=16 if name.startswith("odd") else 512,
                                   defer=False, BK2=16 if name.startswith("odd") else 64, defer2=True, dot2=False),
                   (x[:T], ids[:T], tw[:T], *weights, *tail), 2e-2)
            # The down kernel's K split (the partial sums' workspace, the counters, the
            # last program's finish); the odd shapes' BK2 16 makes I 97 / 19 split too.
            KP = 1 << (k - 1).bit_length()
            BN2 = 64 if trans else 16
            BK2 = 16 if name.startswith("odd") else max(8, 8192 // (KP * BN2))
            for split in (2, 8):
                yield (f"moe_experts[decode split2={split}] {name} T{T}",
                       _experts_decode(split2=split, BN2=BN2, BK2=BK2, defer2=False),
                       (x[:T], ids[:T], tw[:T], *weights, *tail), 2e-2)
            if trans:  # the down kernel on the tensor cores (cp.async stages), whole and split
                for split in (1, 8):
                    yield (f"moe_experts[decode dot2 split2={split}] {name} T{T}",
                           _experts_decode(dot2=True, split2=split, BN2=64, BK2=64 if not name.startswith("odd") else 16,
                                           defer2=False, stages2=3), (x[:T], ids[:T], tw[:T], *weights, *tail), 2e-2)
        # Every plan once (the op takes grouped_mm only from T * k = 16384 up, on
        # sm90); torch._grouped_mm needs 16-byte aligned rows: H, I multiples of 8.
        plans = ("decode", "sorted") + (("grouped_mm",) if H % 8 == 0 and I % 8 == 0 else ())
        T = 64 if not name.startswith("odd") else 7
        for plan in plans if not quick or name.startswith("odd") else ():
            yield (f"moe_experts[{plan}] {name} T{T}", _experts_plan(plan), (x[:T], ids[:T], tw[:T], *weights, *tail),
                   2e-2)
        del x, ids, tw, weights
    E, k, H, I = EXPERTS["qwen3-30b-a3b"][:4]
    for fmt, group, asym in EXPERT_QUANT if not quick else EXPERT_QUANT[:1]:
        x, ids, tw, *weights = (None if t is None else t.to(DEVICE)
                                for t in build(64, E, H, I, k, torch.bfloat16, fmt=fmt, group=group, asym=asym))
        tail = ("silu", "halves", False, fmt, group, 0.0, 0.0)
        label = f"{fmt}{f' g{group}' if group else ''}{' asym' if asym else ''}"
        for T in (1, 64) if not quick else (1,):
            yield (f"moe_experts qwen3-30b-a3b {label} T{T}", ops.moe_experts,
                   (x[:T], ids[:T], tw[:T], *weights, *tail), 2e-2)
        for pdl in (False, True):
            yield (f"moe_experts[decode pdl={pdl}] qwen3-30b-a3b {label} T1", _experts_decode(pdl=pdl),
                   (x[:1], ids[:1], tw[:1], *weights, *tail), 2e-2)
        yield (f"moe_experts[decode ahead] qwen3-30b-a3b {label} T1",
               _experts_decode(ahead=True, ahead2=True, whole2=False), (x[:1], ids[:1], tw[:1], *weights, *tail), 2e-2)
        # down's K split in whole tiles (int4: chunk tiles; 768 over 3 x 256 and 2 x 384)
        for split in (2, 3):
            yield (f"moe_experts[decode split2={split}] qwen3-30b-a3b {label} T1", _experts_decode(split2=split),
                   (x[:1], ids[:1], tw[:1], *weights, *tail), 2e-2)
        for plan in ("decode", "sorted") if not quick else ("sorted",):  # grouped_mm: plain weights only
            yield (f"moe_experts[{plan}] qwen3-30b-a3b {label} T8", _experts_plan(plan),
                   (x[:8], ids[:8], tw[:8], *weights, *tail), 2e-2)
        del x, ids, tw, weights


# -------------------------------------------------------------- all_reduce ----


def _process_group() -> str:
    """The default process group, one rank: NCCL for CUDA tensors and gloo for the CPU
    copies the op's own body reduces (gloo alone under --cpu-smoke); a file store,
    no network."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="memcheck-pg-")) / "store"
        backend = "cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo"
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return dist.group.WORLD.group_name


def all_reduce_cases(quick: bool):
    """all_reduce_rms_norm: on one rank the collective is the identity, and the norm
    kernel (add_rms_norm's, or rms_norm's without a residual) runs on its buffer."""
    group = _process_group()
    sizes = [(1, 4096), (7, 4096), (4096, 4096), (1, 8192), (7, 8192), (4096, 8192), (3, 4097), (0, 64)]
    for M, N in sizes if not quick else [(7, 4096), (3, 4097)]:
        for residual in (True, False):
            x, w = _randn(M, N), _randn(N)
            r = _randn(M, N) if residual else None
            yield (f"all_reduce_rms_norm M{M} N{N} residual={residual}", ops.all_reduce_rms_norm,
                   (x, r, w, 1e-6, 0.0, True, torch.bfloat16, group), 2e-2)


def peer_sequence() -> list[tuple[str, str, float]]:
    """fusepass's recurrent kernel, FLA's, then transformers' fp64 loop on the same decode inputs."""
    out = []
    B, Hk, Hv, d = 128, 32, 32, 128
    q, k, v, g, beta, s0 = _gdn_inputs(B, 1, Hk, Hv, d, d)
    o1, s1 = ops.gdn_recurrent(q, k, v, g, beta, s0, True, d ** -0.5)
    torch.cuda.synchronize()
    out.append(("peer sequence: fusepass recurrent B128", "ok", 0.0))
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        print("flash-linear-attention not installed: peer sequence stops here")
        return out
    o2, s2 = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=d ** -0.5, initial_state=s0,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    out.append(("peer sequence: FLA fused recurrent B128", "ok" if _rel(o2, o1) < 2e-2 else "MISMATCH", _rel(o2, o1)))
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    fn = getattr(m.torch_recurrent_gated_delta_rule, "__wrapped__", m.torch_recurrent_gated_delta_rule)
    o3, s3 = fn(q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=s0.double(),
                output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    out.append(("peer sequence: transformers fp64 loop B128", "ok" if _rel(o1, o3) < 2e-2 else "MISMATCH",
                _rel(o1, o3)))
    for name, verdict, err in out:
        print(f"{name:60s} {verdict:40s} err {err:.3g}", flush=True)
    return out


def _siblings_config(cfg):
    """linear_siblings' launch with the explicit (BN, BK, warps) on CUDA tensors, the op's CPU body on CPU copies."""
    def run(x, ws, bs):
        if x.is_cuda:
            from fusepass.kernels.linear_siblings import linear_siblings_fwd
            return linear_siblings_fwd(x, ws, bs, cfg)
        return ops.linear_siblings(x, ws, bs)
    return run


def linear_cases(quick: bool):
    """Projections of one x in one launch: models' q / k / v and gate / up, odd N and K
    (K not a whole tile: masked loads), strided weights, biases, 1-4 rows, each
    rows-a-program the plan can pick, and more rows than the GEMV takes (cuBLAS)."""
    groups = [(2048, [4096, 512, 512]), (4096, [14336, 14336]), (37, [9, 1, 3, 33]), (4097, [5, 1000]),
              (4096, [2880]), (2049, [1])]  # (one weight alone: linear_one's)
    if quick:
        groups = groups[::2]
    for (K, Ns), M in itertools.product(groups, (1, 3, 4, 6)):
        ws = [_randn(n, K + 3)[:, :K] if i == 1 else _randn(n, K) for i, n in enumerate(Ns)]
        bs = [_randn(n) if i % 2 == 0 else None for i, n in enumerate(Ns)]
        yield f"linear_siblings M{M} K{K} N{Ns}", ops.linear_siblings, (_randn(M, K), ws, bs), 2e-2
    for BN, BK, warps in [(1, 512, 4), (2, 2048, 8), (8, 256, 4)]:
        K, Ns = 4097, [7, 300]
        yield (f"linear_siblings BN{BN} BK{BK} W{warps} M2 K{K} N{Ns}", _siblings_config((BN, BK, warps)),
               (_randn(2, K), [_randn(n, K) for n in Ns], [None, _randn(300)]), 2e-2)
    # quantized: Llama-3-8B's q / k / v and odd rows, one format and group a call
    from fusepass.quantize import quantize_rows

    qgroups = [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]), (320, [33, 5])]
    for (K, Ns), fmt, M in itertools.product(qgroups[1:] if quick else qgroups, ("int4", "int8", "fp8"), (1, 3)):
        layers = [quantize_rows(torch.randn(n, K, device=DEVICE) * 0.02, fmt, 64) for n in Ns]
        ws = [q for q, _, _ in layers]
        ss = [s.to(torch.bfloat16) if fmt == "int4" else s for _, s, _ in layers]
        zs = [z.to(torch.bfloat16) if z is not None else None for _, _, z in layers]
        bs = [_randn(Ns[0])] + [None] * (len(Ns) - 1)
        yield (f"dequant_matmul_siblings {fmt} M{M} K{K} N{Ns}", ops.dequant_matmul_siblings,
               (_randn(M, K), ws, ss, zs, bs, fmt, 64 if fmt == "int4" else 0, []), 2e-2)
    # gate and up with their activation in one launch (dequant_matmul_gated): two weights of one shape,
    # both biased or neither, odd N (a program's half-tile past N), one to three rows
    ggroups = [(4096, 14336), (320, 33)] if quick else [(4096, 14336), (3584, 18944), (320, 33), (1024, 7)]
    for (K, N), fmt, M in itertools.product(ggroups, ("int4", "int8", "fp8"), (1, 3)):
        layers = [quantize_rows(torch.randn(N, K, device=DEVICE) * 0.02, fmt, 64) for _ in range(2)]
        ws = [q for q, _, _ in layers]
        ss = [s.to(torch.bfloat16) if fmt == "int4" else s for _, s, _ in layers]
        zs = [z.to(torch.bfloat16) if z is not None else None for _, _, z in layers]
        bs = [_randn(N), _randn(N)] if M == 3 else [None, None]
        act = ("silu", "gelu", "gelu_tanh")[(K + M) % 3]
        yield (f"dequant_matmul_gated {fmt} {act} M{M} K{K} N{N}", ops.dequant_matmul_gated,
               (_randn(M, K), ws, ss, zs, bs, fmt, 64 if fmt == "int4" else 0, act, []), 2e-2)
    # bitsandbytes' code books (blocks of 64, fp32 absmax; "dq": double quantization's bytes and
    # tables, read in the grids) through both grids: Llama-3-8B's q / k / v and gate / up, odd rows (a
    # tile past N), K of a masked last tile
    from fusepass.testing.library_layouts import library_inputs

    bgroups = [(4096, [4096, 1024, 1024]), (4096, [14336, 14336]), (192, [33, 5, 33])]
    for (K, Ns), fmt, M in itertools.product(bgroups[1:] if quick else bgroups, ("nf4", "fp4", "nf4-dq"), (1, 3)):
        book = fmt[:3]
        got = [library_inputs(book, M, n, K, torch.bfloat16, seed=i) for i, n in enumerate(Ns)]
        x = got[0][0].to(DEVICE)
        ws, ss = [g[1].to(DEVICE) for g in got], [g[2].to(DEVICE) for g in got]
        nested = []
        if fmt.endswith("dq"):
            dq = [_double_quantized(n, K) for n in Ns]
            ss, nested = [a for a, _ in dq], [t for _, q in dq for t in q]
        bs = [_randn(Ns[0])] + [None] * (len(Ns) - 1)
        yield (f"dequant_matmul_siblings {fmt} M{M} K{K} N{Ns}", ops.dequant_matmul_siblings,
               (x, ws, ss, [None] * len(Ns), bs, book, 64, nested), 2e-2)
        if Ns[0] == Ns[-1]:
            yield (f"dequant_matmul_gated {fmt} silu M{M} K{K} N{Ns[0]}", ops.dequant_matmul_gated,
                   (x, [ws[0], ws[-1]], [ss[0], ss[-1]], [None, None], [bs[0], _randn(Ns[0])], book, 64, "silu",
                    nested[:3] + nested[-3:]), 2e-2)
        if fmt.endswith("dq"):
            yield (f"dequant_matmul {fmt} M{M} K{K} N{Ns[-1]}", ops.dequant_matmul,
                   (x, ws[-1], ss[-1], None, None, book, 64, None, None, *nested[-3:]), 2e-2)
            if M == 3:  # sixteen rows: the tensor-core plan, the absmax expanded in its own launch first
                yield (f"dequant_matmul {fmt} M16 K{K} N{Ns[-1]}", ops.dequant_matmul,
                       (_randn(16, K), ws[-1], ss[-1], None, None, book, 64, None, None, *nested[-3:]), 2e-2)


def _double_quantized(n, k):
    """A random absmax of an [n, k] code-book weight (blocks of 64) as bitsandbytes' double
    quantization stores it: bytes [n, k / 64], nested absmax per 256 blocks, code, offset."""
    blocks = n * k // 64
    a8 = torch.randint(0, 256, (n, k // 64), dtype=torch.uint8, device=DEVICE)
    code = torch.sort(torch.rand(256, device=DEVICE) * 2 - 1)[0]
    return a8, [torch.rand(-(-blocks // 256), device=DEVICE) * 0.1 + 0.01, code,
                torch.rand(1, device=DEVICE) * 0.01]


def attention_cases(quick: bool):
    """decode_attention: models' head shapes over static caches (one split and many, blocks the mask
    hides skipped), odd L, D and D_v (masked lanes), speculative rows, a per-head float mask,
    multi-head, strided q (a transposed view) and a cache slice, batch 8, and each block / split /
    warps the plan can pick; decode_attention_write's in-kernel cache write."""
    from fusepass.kernels.decode_attention import decode_attention_fwd

    shapes = [(1, 32, 8, 1, 4096, 128, 128), (1, 32, 4, 1, 256, 128, 128), (1, 16, 2, 1, 1000, 256, 256),
              (8, 64, 8, 1, 777, 64, 64), (2, 12, 3, 3, 91, 80, 48), (1, 8, 8, 2, 33, 32, 32), (3, 6, 1, 1, 5, 16, 16)]
    if quick:
        shapes = shapes[1::2]
    for B, H, HKV, T, L, D, DV in shapes:
        q = _randn(B, T, H, D).transpose(1, 2)  # (as a model's q reaches attention)
        k = _randn(B, HKV, L + 5, D)[:, :, :L]  # (a slice of a longer cache)
        v = _randn(B, HKV, L, DV)
        n = torch.randint(1, L + 1, (B,), device=DEVICE)
        mask = (torch.arange(L, device=DEVICE)[None, :] < n[:, None])[:, None, None, :].expand(B, 1, T, L)
        yield f"decode_attention B{B} H{H}/{HKV} T{T} L{L} D{D}/{DV} bool", ops.decode_attention, \
            (q, k, v, mask, D ** -0.5), 2e-2
        fmask = torch.where(torch.rand(B, H, T, L, device=DEVICE) < 0.7, 0.0, float("-inf")).to(torch.bfloat16)
        fmask[..., 0] = 0
        yield f"decode_attention B{B} H{H}/{HKV} T{T} L{L} D{D}/{DV} float per head", ops.decode_attention, \
            (q, k, v, fmask, 0.1), 2e-2
    # The op with the step's cache write: the slot in the first / a middle / the last split, negative,
    # value columns in blocks; the caches afterwards checked against the snapshots written on the CPU.
    from fusepass.kernels.decode_attention import decode_attention_write_fwd

    for B, H, HKV, L, D, cfg, slot in [(1, 32, 4, 256, 128, None, 130), (1, 32, 8, 4096, 128, None, 2049),
                                       (8, 64, 8, 777, 64, None, 776), (2, 32, 8, 1500, 128, (64, 5, 4, 4), -1),
                                       (1, 16, 2, 1000, 256, None, 0), (3, 12, 3, 91, 80, (16, 3, 4), 45)]:
        q = _randn(B, 1, H, D).transpose(1, 2)
        k = _randn(B, HKV, L + 5, D)[:, :, :L]
        v = _randn(B, HKV, L, D)
        kn, vn = _randn(B, 1, HKV, D).transpose(1, 2), _randn(B, HKV, 1, D)
        mask = (torch.arange(L, device=DEVICE) <= slot % L)[None, None, None, :]
        want_k, want_v = k.cpu().clone(), v.cpu().clone()
        want_k[:, :, slot], want_v[:, :, slot] = kn.cpu()[:, :, 0], vn.cpu()[:, :, 0]

        def compare(got, want, cpu_args, k=k, v=v, want_k=want_k, want_v=want_v):
            return max(_rel(got, want), _rel(k.cpu(), want_k), _rel(v.cpu(), want_v))

        yield (f"decode_attention_write cfg {cfg} B{B} H{H}/{HKV} L{L} D{D} slot {slot}",
               lambda *a, c=cfg: decode_attention_write_fwd(*a, cfg=c) if a[0].is_cuda else
               ops.decode_attention_write(*a),
               (q, k, v, kn, vn, torch.tensor([slot], device=DEVICE), mask, D ** -0.5), 2e-2, compare)
    for cfg in [(16, 1, 4), (32, 7, 8), (128, 3, 4), (64, 64, 4), (128, 1, 4, 2), (64, 5, 4, 4)]:
        q, k, v = _randn(2, 32, 1, 128), _randn(2, 8, 1500, 128), _randn(2, 8, 1500, 128)
        mask = (torch.arange(1500, device=DEVICE) < 1300)[None, None, None, :]
        yield (f"decode_attention cfg {cfg} B2 H32/8 L1500",
               lambda *a, c=cfg: decode_attention_fwd(*a, cfg=c) if a[0].is_cuda else ops.decode_attention(*a),
               (q, k, v, mask, 0.09), 2e-2)


GROUPS = {"norms": norm_cases, "dequant_matmul": dequant_cases, "library": library_cases, "gdn": gdn_cases,
          "conv": conv_cases, "moe": moe_cases, "all_reduce": all_reduce_cases, "linear": linear_cases,
          "attention": attention_cases}


def run_group(group: str, quick: bool, start: int = 0, record=None, match: str = "") -> list[tuple[str, str, float]]:
    """The group's cases from index ``start`` (earlier ones are built, not run: the
    inputs come from one seeded stream) whose names contain ``match`` (or one of
    its comma-separated parts).  ``record`` gets a line as each case starts and
    ends, so a parent can name the case a dead child was running.
    Raises ContextLost after a case that faulted."""
    torch.manual_seed(0)  # per group: a child running one group draws what a whole sweep draws
    results = []
    for i, c in enumerate(GROUPS[group](quick)):
        if i < start or (match and not any(m in c[0] for m in match.split(","))):
            continue
        if record:
            record(dict(group=group, i=i, name=c[0]))
        name, verdict, err = _case(*c)
        results.append((name, verdict, err))
        if record:
            record(dict(group=group, i=i, name=name, verdict=verdict, err=err))
        if verdict != "ok" and not _context_alive():
            raise ContextLost(f"group {group}, case {i} ({name})")
    return results


def run_isolated(group: str, args) -> list[tuple[str, str, float]]:
    """``group`` in child processes: one, and after a fault a new one from the next case.
    ``group`` "" runs only the peer sequence."""
    results, start = [], 0
    while True:
        fd, path = tempfile.mkstemp(prefix="memcheck-", suffix=".jsonl")
        os.close(fd)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--ops", group, "--start", str(start), "--record", path]
        cmd += ["--quick"] * args.quick + ["--cpu-smoke"] * args.cpu_smoke + ["--peers"] * (not group)
        cmd += ["--match", args.match] if args.match else []
        rc = subprocess.run(cmd).returncode
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        os.unlink(path)
        results += [(r["name"], r["verdict"], r["err"]) for r in lines if "verdict" in r]
        if rc in (0, 1):  # the child ran to its end
            return results
        last = lines[-1] if lines else None
        if last is None or last.get("i") is None:
            results.append((f"[{group or 'peers'}] from case {start}", f"FAULT: child exited {rc} outside a case",
                            float("nan")))
            return results
        if "verdict" not in last:  # died inside the case (a signal, an abort)
            results.append((last["name"], f"FAULT: child exited {rc}", float("nan")))
        print(f"*** group {group}: the child exited {rc} at or after case {last['i']} ({last['name']}); "
              f"going on from case {last['i'] + 1} in a new process", flush=True)
        start = last["i"] + 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(GROUPS), help=f"groups to run: {', '.join(GROUPS)}")
    p.add_argument("--quick", action="store_true", help="a few cases per group")
    p.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on CPU tensors (no kernels)")
    p.add_argument("--peers", action="store_true", help="also the GDN decode sequence with FLA and transformers")
    p.add_argument("--isolate", action="store_true",
                   help="each group in its own process; after a fault, the rest of the group in a new one")
    p.add_argument("--match", default="",
                   help="only the cases whose names contain this, or one of a comma list (e.g. 'split2', 'nf4,fp4')")
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)  # a child's first case
    p.add_argument("--record", help=argparse.SUPPRESS)  # a child's JSON-lines record of its cases
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = "cpu" if args.cpu_smoke else "cuda"
    groups = [g for g in args.ops.split(",") if g]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        p.error(f"unknown groups {unknown}; known: {', '.join(GROUPS)}")
    record = None
    if args.record:
        def record(line, path=args.record):
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
    results = []
    try:
        for group in groups:
            if args.isolate:
                results += run_isolated(group, args)
            else:
                results += run_group(group, args.quick, args.start, record, args.match)
        if args.peers:
            results += run_isolated("", args) if args.isolate else peer_sequence()
    except ContextLost as exc:
        print(f"*** CUDA context lost after {exc}: no later case can run in this process "
              "(--isolate goes on in a new one)", flush=True)
        results.append((str(exc), "FAULT: CUDA context lost, later cases not run", float("nan")))
        if args.record:
            return 3  # the parent starts a new child after the recorded case
    if args.record and args.peers and not groups:
        for name, verdict, err in results:
            record(dict(group="peers", i=None, name=name, verdict=verdict, err=err))
    bad = [r for r in results if r[1] != "ok"]
    print(f"\n{len(results)} cases, {len(bad)} not ok")
    for name, verdict, _ in bad:
        print(f"  {name}: {verdict}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
