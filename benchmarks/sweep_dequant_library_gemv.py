"""HQQ's and GPTQ's GEMV loops (``kernels.dequant_matmul.gemv._hqq_gemv``,
``_gptq_gemv``) over their launch choices, against fusepass's own int4 GEMV on
the same shape: what the heuristic's plans for those layouts (``plans._hqq_gemv``,
``_gptq_gemv``, not measured when written) should be.

    python benchmarks/sweep_dequant_library_gemv.py [--formats hqq4,gptq4,gptq4-act] [--ms 1,4,8]
        [--shapes 4096x4096,14336x4096,4096x14336] [--quick] [--rep 5] [--json out.json]

Per (format, shape, M): each candidate config, checked against the fp32
reference first, then timed as CUDA-graph replays on cold weights (the weight
and copies of it called in turn, ``tuner.cold_copies``: three L2s' worth);
the heuristic's plan is marked ``*``.  ``int4`` is fusepass's int4 group-64
weight of the same shape through its own plan (the target: HQQ group 64 no
slower; GPTQ group 128 as fast).  Random codes: HQQ group 64 with bf16 scale
and zero; GPTQ group 128, ``gptq4`` with g_idx = k // 128 (the word loop),
``gptq4-act`` with an act-order g_idx (the per-code loop).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.bench.timing import time_graph  # noqa: E402
from fusepass.kernels import dequant_matmul as dm  # noqa: E402
from fusepass.kernels._common import cdiv  # noqa: E402
from fusepass.kernels.dequant_matmul import launch, plans, tuner  # noqa: E402
from fusepass.kernels.dequant_matmul.config import Problem, valid  # noqa: E402
from fusepass.testing.library_layouts import library_inputs  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)
GROUPS = {"hqq4": 64, "gptq4": 128, "gptq4-act": 128, "int4": 64}


def weights(fmt: str, N: int, K: int):
    """(weight, scale, zero, g_idx, op format, op group) on the GPU, random codes."""
    if fmt == "int4":
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        s = ((torch.rand(N, K // 64, device="cuda") + 0.5) / (4 * K ** 0.5)).to(torch.bfloat16)
        return w, s, torch.full_like(s, 7.5), None, "int4", 64
    op_fmt = "gptq4" if fmt.startswith("gptq4") else fmt
    _, w, s, z, g, group = library_inputs(op_fmt, 1, N, K, torch.bfloat16, group=GROUPS[fmt],
                                          act_order=fmt == "gptq4-act")
    w, s, z = w.cuda(), s.cuda(), z.cuda()
    return w, s, z, g.cuda() if g is not None else None, op_fmt, group if op_fmt == "hqq4" else 0


def candidates(fmt: str, M: int, N: int, K: int, quick: bool, sms: int) -> list[dm.Config]:
    bm = 1 << max(0, M - 1).bit_length()
    out = []
    if fmt == "hqq4":  # (pairs per program, warps, 16-byte chunks per thread and pair)
        shapes = [(8, 4, 1), (4, 4, 1), (16, 4, 1), (8, 8, 1)] if quick else \
            [(8, 4, 1), (4, 4, 1), (16, 4, 1), (8, 8, 1), (8, 2, 1), (4, 8, 1), (4, 4, 2), (8, 4, 2)]
        for bn, warps, chunks in shapes:
            bn = max(1, bn // bm)
            bk = 512 * warps * chunks
            auto = plans._auto_split(cdiv(N // 2, bn), K, bk, sms)
            for split in sorted({1, auto} if quick else {1, auto, min(16, 2 * auto)}):
                out.append(dm.Config("gemv", BN=bn, BK=bk, split=split, warps=warps))
    elif fmt.startswith("gptq4"):  # (columns per program, tile depth, warps)
        shapes = [(128, 256, 4), (256, 256, 4), (64, 128, 4), (128, 512, 4)] if quick else \
            [(128, 256, 4), (256, 256, 4), (64, 128, 4), (128, 512, 4), (128, 128, 4), (256, 512, 8),
             (64, 256, 2), (512, 256, 4)]
        for bn, bk, warps in shapes:
            if M > 1:
                bk = min(bk, 128)
            auto = plans._auto_split(cdiv(N, bn), K, bk, sms)
            for split in sorted({auto, max(1, auto // 2)} if quick else {auto, max(1, auto // 2), min(16, 2 * auto)}):
                out.append(dm.Config("gemv", BN=bn, BK=bk, split=split, warps=warps))
    return [c for i, c in enumerate(out) if c not in out[:i]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="hqq4,gptq4,gptq4-act")
    p.add_argument("--ms", default="1,4,8")
    p.add_argument("--shapes", default=None, help="NxK list")
    p.add_argument("--quick", action="store_true", help="fewer candidates")
    p.add_argument("--rep", type=float, default=5.0, help="ms of replays per config")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for N, K in shapes:
        own = {}
        for fmt in ["int4", *args.formats.split(",")]:
            w, s, z, g, op_fmt, G = weights(fmt, N, K)
            nbytes = sum(t.numel() * t.element_size() for t in (w, s, z, g) if t is not None)
            ring = [(w, s, z)] + [(w.clone(), s.clone(), z.clone())
                                  for _ in range(tuner.cold_copies(nbytes, w.device) - 1)]
            for M in ms:
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                ref = dm.dequant_matmul_reference(x, w, s, z, None, op_fmt, GROUPS[fmt], g_idx=g)
                prob = Problem.of(M, N, K, op_fmt, G, torch.bfloat16, x.device)
                plan = plans.heuristic(prob)
                cands = [plan] if fmt == "int4" else [plan] + [c for c in candidates(fmt, M, N, K, args.quick, prob.sms)
                                                             if c != plan and valid(c, prob)]
                tuner._precompile(lambda cfg: launch._launch(x, w, s, z, None, out, op_fmt, G, cfg, warmup=True,
                                                             g_idx=g), cands)
                times = []
                for cfg in cands:
                    try:
                        out.fill_(float("nan"))
                        launch._launch(x, w, s, z, None, out, op_fmt, G, cfg, g_idx=g)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        if not err <= 1e-2:
                            print(f"{fmt} {N}x{K} M{M} {cfg.label()}: WRONG (rel err {err:.1e})")
                            continue

                        def calls(cfg=cfg):
                            for wr, sr, zr in ring:
                                launch._launch(x, wr, sr, zr, None, out, op_fmt, G, cfg, g_idx=g)
                        us = time_graph(calls, args.rep).median * 1e3 / len(ring)
                    except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
                        print(f"{fmt} {N}x{K} M{M} {cfg.label()}: {type(exc).__name__}: {exc}".splitlines()[0])
                        continue
                    times.append((us, cfg))
                    rows.append({"fmt": fmt, "N": N, "K": K, "M": M, "config": cfg.label(), "us": us,
                                 "plan": cfg == plan, "bytes": nbytes})
                if not times:
                    continue
                if fmt == "int4":
                    own[M] = times[0][0]
                best = min(times, key=lambda t: t[0])
                plan_us = next((t for t, c in times if c == plan), float("nan"))
                ratio = f", {best[0] / own[M]:.2f}x int4's {own[M]:.1f}" if M in own and fmt != "int4" else ""
                print(f"{fmt:9s} {N}x{K} M{M}: plan {plan.label()} {plan_us:.1f} µs; best {best[1].label()} "
                      f"{best[0]:.1f} µs{ratio}")
                for us, cfg in sorted(times, key=lambda t: t[0]):
                    print(f"    {'*' if cfg == plan else ' '} {us:7.1f}  {cfg.label()}")
            ring = None  # (the copies freed before the next format's)
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
