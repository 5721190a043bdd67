"""The libraries' layouts (bitsandbytes' NF4 / FP4, HQQ's 4-bit) at a few rows:
the op's heuristic plan against the GEMV and the transposed kernel's tiles,
on cold weights (a ring of copies, as the tuner times them), with the floor.

    python benchmarks/sweep_dequant_library.py [--formats nf4,hqq4] [--ms 4,8,16,32,64,128]
        [--shapes 4096x4096,14336x4096,4096x14336] [--group 64] [--json out.json] [--budget SECONDS]

Prints one line per key: the heuristic's time and config, the fastest config
and its time, each as % of the floor (the codes, absmax or scales and zero
points read once at the copy bandwidth measured at the start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.bench.timing import copy_bandwidth  # noqa: E402
from fusepass.kernels import dequant_matmul as dm  # noqa: E402
from fusepass.kernels.dequant_matmul import launch, plans, tuner  # noqa: E402
from fusepass.kernels.dequant_matmul.config import valid  # noqa: E402
from fusepass.kernels.dequant_matmul.plans import _balanced_split  # noqa: E402
from fusepass.kernels._common import cdiv  # noqa: E402
from fusepass.testing.library_layouts import library_inputs  # noqa: E402


def configs(p: dm.Problem) -> list[dm.Config]:
    """The heuristic's plan, the GEMV's (M <= 8), and the transposed kernel's tiles around the heuristic's."""
    out = [plans.heuristic(p)]
    if p.M <= dm.GEMV_MAX_M:  # the formats' own GEMV loops (the code books: every tile the tuner would time)
        out.append(plans._hqq_gemv(p.M, p.N, p.K, p.sms) if p.fmt == "hqq4"
                   else plans._int4_gemv(p.M, p.N, p.K, p.group, p.sms))
        if p.fmt in ("nf4", "fp4"):
            out += [c for c in tuner.candidates(p) if c.kind == "gemv"]
    bm = min(64 if p.M <= 64 else 128, max(16, 1 << (p.M - 1).bit_length()))
    for bn, warps in ((64, 4), (128, 4), (128, 8)) if p.M > 2 else ():
        for bk in (64, 128):
            base = _balanced_split(cdiv(p.N, bn) * cdiv(p.M, bm), p.K, bk, p.sms)
            for split in sorted({max(1, base // 2), base, min(16, base * 2)}):
                for ahead in (1, 2):
                    for xperm in ((0, 1) if bm >= 32 else (0,)):
                        out.append(dm.Config("mmt", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=3,
                                             ahead=ahead, xperm=xperm))
    return [c for c in dict.fromkeys(out) if valid(c, p)]  # (in order, once each)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nf4,hqq4")
    ap.add_argument("--ms", default="4,8,16,32,64,128", help="at M <= 2 only the GEMV loops")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later keys are skipped")
    args = ap.parse_args(argv)
    t0 = time.time()
    dev = torch.device("cuda")
    gbps = copy_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} copy {gbps:.0f} GB/s")
    rows = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            N, K = map(int, shape.split("x"))
            x, w, s, z, _, G = library_inputs(fmt, 1, N, K, torch.bfloat16, group=args.group)
            w, s = w.to(dev), s.to(dev)
            z = z.to(dev) if z is not None else None
            nbytes = sum(t.numel() * t.element_size() for t in (w, s, z) if t is not None)
            floor = nbytes / gbps / 1e3
            for M in map(int, args.ms.split(",")):
                if time.time() - t0 > args.budget:
                    print(f"# budget spent: {fmt} {shape} M{M} and later skipped")
                    break
                p = dm.Problem.of(M, N, K, fmt, G, torch.bfloat16, dev)
                cands = configs(p)
                xm = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
                ref = dm.dequant_matmul_reference(xm, w, s, z, None, fmt, G)
                out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=dev)
                launch._launch(xm, w, s, z, None, out, fmt, G, cands[0])
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                _, times = tuner.tune(p, w, s, z, cands)
                t = dict(times)
                heur = t.get(cands[0], float("nan"))
                best, best_us = min(times, key=lambda c: c[1])
                row = dict(fmt=fmt, N=N, K=K, M=M, floor_us=floor, heuristic=cands[0].label(), heuristic_us=heur,
                           best=best.label(), best_us=best_us, err=err,
                           times={c.label(): us for c, us in times})
                rows.append(row)
                print(f"{fmt} {N}x{K} M{M}: heuristic {heur:.1f} µs ({100 * floor / heur:.0f}%) {cands[0].label()}"
                      f" | best {best_us:.1f} ({100 * floor / best_us:.0f}%) {best.label()} | {len(times)} configs,"
                      f" rel err {err:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
