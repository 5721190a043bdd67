"""Every fusepass op's CUDA path at real and edge sizes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python benchmarks/memcheck.py [--ops gdn_chunk,dequant_matmul] [--quick]

Without the caching allocator every tensor is its own allocation, so a read
or write past its end lands outside any allocation and memcheck reports it
(inside the allocator's slabs it would land in another tensor and pass).
Each case runs the op once on random inputs with poisoned outputs and checks
the result against the op's own plain-torch body on the CPU (fp32), so the
sweep also fails on wrong values.  ``--peers`` also runs the
flash-linear-attention kernels on the same GDN inputs (the sequence in which
a fault was once seen: fusepass's recurrent kernel, FLA's, then
transformers' fp64 loop).

Exit status: 0 when every case ran and matched; 1 otherwise (memcheck's own
``--error-exitcode`` reports a fault).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import fusepass  # noqa: F401  - registers the ops

ops = torch.ops.fusepass
DEVICE = "cuda"


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


def _case(name: str, op, args: tuple, tol: float) -> tuple[str, str, float]:
    """Run ``op`` on CUDA ``args`` and on their CPU copies; return (name, verdict, error)."""
    t0 = time.perf_counter()
    try:
        got = op(*args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        want = op(*_cpu(args))
        err = max((_rel(g, w) for g, w in zip(_outputs(got), _outputs(want))), default=0.0)
        verdict = "ok" if err <= tol else f"MISMATCH {err:.3g} > {tol:g}"
    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
        verdict, err = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", float("nan")
        traceback.print_exc()
    print(f"{name:60s} {verdict:40s} {time.perf_counter() - t0:6.1f} s", flush=True)
    return name, verdict, err


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
    for B, T, Hk, Hv, dk, dv in rec:
        a = _gdn_inputs(B, T, Hk, Hv, dk, dv)
        yield f"gdn_recurrent B{B} T{T} Hk{Hk} Hv{Hv} dk{dk} dv{dv}", ops.gdn_recurrent, (*a, True, dk ** -0.5), 2e-2


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


GROUPS = {"norms": norm_cases, "dequant_matmul": dequant_cases, "gdn": gdn_cases}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(GROUPS), help=f"groups to run: {', '.join(GROUPS)}")
    p.add_argument("--quick", action="store_true", help="a few cases per group")
    p.add_argument("--cpu-smoke", action="store_true", help="run the script's logic on CPU tensors (no kernels)")
    p.add_argument("--peers", action="store_true", help="also the GDN decode sequence with FLA and transformers")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = "cpu" if args.cpu_smoke else "cuda"
    torch.manual_seed(0)
    results = []
    for group in args.ops.split(","):
        results += [_case(*c) for c in GROUPS[group](args.quick)]
    if args.peers:
        results += peer_sequence()
    bad = [r for r in results if r[1] != "ok"]
    print(f"\n{len(results)} cases, {len(bad)} not ok")
    for name, verdict, _ in bad:
        print(f"  {name}: {verdict}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
