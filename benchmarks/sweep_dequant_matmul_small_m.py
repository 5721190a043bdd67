"""int4 at M = 16-64: the op's transposed kernel (``mmt``) over its launch choices.

At M = 16-64 the op's int4 ``mm`` kernel (x as the dot's A operand, the
weight tile unpacked into two half-depth B operands) ran 1.4-2.4x gemlite
A16W4's time on the H100.  This script found the replacement, now the op's
``mmt`` path: the product transposed, out^T = W x^T, the unpacked tile the
dot's A operand with the two nibbles of each byte joined back into K order in
registers (one dot per tile).  A variant with two half-depth dots instead of
the join ran 1.1-1.4x slower than the joined one at every shape (commit
d5c4001; figures in BENCHMARKS.md) and was dropped.  The script times
``mmt`` over tile and split choices against the op's current plan, bf16
cuBLAS and gemlite A16W4, each checked against the fp32 reference first.

    python benchmarks/sweep_dequant_matmul_small_m.py [--ms 16,64] [--rep 25]
    TRITON_INTERPRET=1 python benchmarks/sweep_dequant_matmul_small_m.py --cpu-smoke

Prints one line per (M, shape): the best time of each provider with its
config, and its ratio to gemlite A16W4 where gemlite is importable.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dequant_matmul import _gemlite, quantize  # noqa: E402
from fusepass.kernels import dequant_matmul as dm  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)
GROUP = 128


def configs(M: int, N: int, smoke: bool) -> list[dm.Config]:
    bm = min(64, max(16, triton.next_power_of_2(M)))
    if smoke:
        return [dm.Config("mmt", BM=bm, BN=64, BK=64, split=split, stages=2) for split in (1, 2)]
    return [dm.Config("mmt", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=3)
            for bn in (64, 128) for bk in (64, 128) for warps in (4, 8)
            for split in ((1, 2, 4, 8) if N <= 4096 else (1, 2, 4))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="16,64")
    p.add_argument("--rep", type=int, default=25)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    shapes = ((96, 512),) if smoke else SHAPES
    ms = (16, 13) if smoke else tuple(int(v) for v in args.ms.split(","))
    if not smoke:
        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    lines = []
    for N, K in shapes:
        qw = quantize(torch.randn(N, K, device=device) * 0.02, "int4", GROUP)
        q, s, z = qw["weight"], qw["scale"], qw["zero"]
        gem = None if smoke else _gemlite(qw, "int4", device)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            ref = dm.dequant_matmul_reference(x, q, s, z, None, "int4", GROUP).float()
            best: dict[str, tuple[float, str]] = {}

            def bench(provider, label, fn):
                try:
                    y = fn()
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    if not err <= 1e-2:  # bf16 output: a few ulps in norm
                        print(f"    M{M} N{N} K{K} {provider} {label}: error {err:.1e}")
                        return
                    us = 0.0 if smoke else triton.testing.do_bench_cudagraph(fn, rep=args.rep) * 1e3
                except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported
                    print(f"    M{M} N{N} K{K} {provider} {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
                    return
                if provider not in best or us < best[provider][0]:
                    best[provider] = (us, label)

            if not smoke:
                wd = dm.dequantize(q, s, z, "int4", GROUP, torch.bfloat16)
                bench("cublas-bf16", "", lambda: x @ wd.t())
                bench("fusepass-plan", dm.dequant_matmul_plan(M, N, K, "int4", GROUP, torch.bfloat16, x.device),
                      lambda: torch.ops.fusepass.dequant_matmul(x, q, s, z, None, "int4", GROUP))
                if gem is not None:
                    bench("gemlite-a16w4", "", lambda: gem(x))
            for cfg in configs(M, N, smoke):
                out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
                bench("mmt", cfg.label(), lambda out=out, cfg=cfg: (
                    dm._launch(x, q, s, z, None, out, "int4", GROUP, cfg), out)[1])
            base = best.get("gemlite-a16w4", (None,))[0]
            cells = [f"{k} {us:.1f}" + (f" ({us / base:.2f}x gemlite)" if base else "") + (f" [{lab}]" if lab else "")
                     for k, (us, lab) in sorted(best.items(), key=lambda kv: kv[1][0])]
            line = f"M{M} N{N} K{K} [{time.time() - t0:.0f} s]: " + "; ".join(cells)
            print(line, flush=True)
            lines.append(line)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
