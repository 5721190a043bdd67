"""Quantized linears at small M: the op's kernels over their launch choices,
with the weight hot in L2 and cold.

At M = 16-64 the op's int4 ``mm`` kernel (x as the dot's A operand, the
weight tile unpacked into two half-depth B operands) ran 1.4-2.4x gemlite
A16W4's time on the H100.  This script found the replacement, now the op's
``mmt`` path: the product transposed, out^T = W x^T, the dequantised tile the
dot's A operand (int4: the two nibbles of each byte joined back into K order
in registers, one dot per tile).  It times ``mmt`` over tile and split choices
for int4, int8 and fp8 against the op's current plan, bf16 cuBLAS and gemlite
(A16W8, A16W4), each checked against the fp32 reference first; at M <= 8 it
times the op's own GEMV candidates instead.

Two timings per entry, both CUDA-graph replays.  *hot*: one weight, called
again and again, so a weight that fits the L2 (50 MB on an H100: every int4
and int8 shape here, and bf16 4096x4096) is read from it after the first
replay.  *cold*: a ring of copies of the weight larger than three L2s, called
in turn, as a model's layers are (each call reads its weight from HBM); the
time is per call.

    python benchmarks/sweep_dequant_matmul_small_m.py [--formats int4,int8,fp8] [--ms 1,16,64] [--rep 10]
        [--shapes 4096x4096,14336x4096] [--no-cold] [--json out.json] [--plans plans.json] [--both-sums]
        [--budget SECONDS]
    TRITON_INTERPRET=1 python benchmarks/sweep_dequant_matmul_small_m.py --cpu-smoke

Prints one line per (format, M, shape): each provider's best hot and cold
time with its config, and the ratio to gemlite where gemlite is importable;
then a table of the cold times against the floor (every byte of the
quantized weight, scales and zero points read once at the copy bandwidth
measured at the start): the fastest config, the op's plan and the heuristic
(the plan of a shape outside the plan table), each as % of the floor.
``--plans`` writes each key's fastest config on cold weights in the op's
plan-file format; the shipped plans of M = 1-256 on the Llama-3-8B shapes
came from this (runs at 1cf3eea, 1f50f70 and a2e7909; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.bench.registry.dequant_matmul import _gemlite, quantize  # noqa: E402
from fusepass.formats import dequantize  # noqa: E402
from fusepass.kernels import dequant_matmul as dm  # noqa: E402
from fusepass.kernels.dequant_matmul import launch, plans as dm_plans, tuner  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K)
GROUP = 128
MAX_COPIES = 48  # of the cold ring (dm.cold_copies: three L2s' worth)


def configs(fmt: str, M: int, N: int, K: int, smoke: bool, quick: bool = False, wide: bool = False,
            xperm: bool = False, fold_ab: bool = False, splits: tuple[int, ...] = ()) -> list[dm.Config]:
    if M <= 8:
        cands = tuner.candidates(dm.Problem.of(M, N, K, fmt, GROUP, torch.bfloat16, "cpu" if smoke else "cuda"))
        cands = [c for c in cands if c.kind == "gemv"][:2] if smoke else cands
        if splits:  # each GEMV tile also with K in these many slices (whole tiles a slice)
            more = [dataclasses.replace(c, split=s) for c in cands if c.kind == "gemv" and c.split == 1
                    for s in splits if 1 < s <= K // c.BK]
            cands = cands + [c for c in more if c not in cands]
        if fold_ab and M == 1 and fmt == "int4":  # each GEMV also with the zero point taken off per value
            cands = cands + [dataclasses.replace(c, fold=0) for c in cands if c.kind == "gemv"]
        return cands
    bm = min(128 if M > 64 else 64, max(16, triton.next_power_of_2(M)))
    if smoke:
        return [dm.Config("mmt", BM=bm, BN=64, BK=64, split=split, stages=2) for split in (1, 2)]
    if M > 64:  # M = 128-256: one or two row blocks of 128, eight warps for the larger tiles
        bks = (64, 128)
        return [dm.Config("mmt", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=3)
                for bn in (64, 128) for bk in bks for split in (1, 2, 4) for warps in (4, 8)]
    bks = (64, 128) if fmt == "int4" else (128, 256)
    if wide:  # every split, int4's scales loaded 0-2 tiles ahead (wider tiles and 5-8 stages were not
        # faster: H200, int4 M 16 / 64 on 4096x14336 and 14336x4096, 5e215f8)
        xps = (0, 1) if fmt in ("int4", "int8") and xperm else (0,)
        return [dm.Config("mmt", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=3, ahead=ahead, xperm=xp)
                for bn, warps in ((64, 4), (128, 4), (128, 8)) for bk in bks[-1:]
                for split in (1, 2, 4, 8, 16) for ahead in ((0, 1, 2) if fmt == "int4" else (0,))
                for xp in xps if not xp or fmt == "int8" or (split > 1 and ahead > 0)]
    if quick:  # the tiles the heuristic chooses among
        return [dm.Config("mmt", BM=bm, BN=bn, BK=128, split=split, warps=4, stages=3)
                for bn in (64, 128) for split in (1, 2, 4, 8)]
    return [dm.Config("mmt", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=3)
            for bn, warps in ((64, 4), (128, 4), (128, 8)) for bk in bks for split in (1, 2, 4, 8, 16)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="int4,int8,fp8")
    p.add_argument("--ms", default="16,64")
    p.add_argument("--shapes", default=None, help="NxK,... (default: the three Llama-3-8B shapes)")
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--budget", type=float, default=1e9, help="seconds; later entries are skipped")
    p.add_argument("--json", default=None, help="write every timing here")
    p.add_argument("--plans", default=None, help="write the fastest config of each key on cold weights here, "
                   "in the op's plan-file format (to merge into fusepass/kernels/dequant_matmul/plans/<gpu>.json)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--quick", action="store_true", help="at M > 8, only the tiles the heuristic chooses among")
    p.add_argument("--no-hot", action="store_true", help="time cold weights only")
    p.add_argument("--xperm", action="store_true", help="with --wide: int4 (splits 2-16, scales ahead) and int8 also "
                   "with x copied into the tile's K order first")
    p.add_argument("--wide", action="store_true", help="at M > 8, every split of 64- and 128-row tiles, int4 scales loaded 0-2 tiles ahead")
    p.add_argument("--fold-ab", action="store_true", help="int4 at M = 1: each GEMV config also with fold=0 "
                   "(the zero point subtracted per value instead of off each chunk's sum)")
    p.add_argument("--splits", default="", help="at M <= 8: each GEMV candidate also split over K into these "
                   "many slices (comma list; splits of whole tiles only)")
    p.add_argument("--both-sums", action="store_true", help="also time each split-K config with its slices summed "
                   "by a second kernel (provider <kind>-2k) instead of by each tile's last program")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    if smoke:
        shapes = ((96, 512),)
    elif args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    else:
        shapes = SHAPES
    ms = (1, 16, 13) if smoke else tuple(int(v) for v in args.ms.split(","))
    cold = not (args.no_cold or smoke)
    copy_gbps = None
    if not smoke:
        from fusepass.bench.timing import copy_bandwidth

        copy_gbps = copy_bandwidth("cuda")
        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
              f"copy {copy_gbps:.0f} GB/s (read + write)", flush=True)
    floor_rows = []
    t0 = time.time()
    lines, rows = [], []
    plans: dict[str, dict] = {}
    for fmt in args.formats.split(","):
        G = GROUP if fmt == "int4" else 0
        for N, K in shapes:
            if time.time() - t0 > args.budget:
                print(f"# budget spent: {fmt} N{N} K{K} and later skipped", flush=True)
                break
            qw = quantize(torch.randn(N, K, device=device) * 0.02, fmt, GROUP)
            q, s, z = qw["weight"], qw["scale"], qw["zero"]
            ring = tuner._cold_ring(q, s, z, MAX_COPIES) if cold else [(q, s, z)]
            n_q = len(ring)
            wd = None if smoke else dequantize(q, s, z, fmt, G, torch.bfloat16)
            n_b = dm.cold_copies(wd.numel() * 2, wd.device, MAX_COPIES) if cold else 1
            ring_bf16 = [wd] + [wd.clone() for _ in range(n_b - 1)] if wd is not None else []
            gem = None if smoke or fmt == "fp8" else _gemlite(qw, fmt, device)
            gems = ([gem] + [_gemlite(qw, fmt, device) for _ in range(n_q - 1)]) if gem is not None and cold else [gem]
            for M in ms:
                x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
                ref = dm.dequant_matmul_reference(x, q, s, z, None, fmt, G).float()
                best: dict[str, dict[str, tuple[float, str]]] = {"hot": {}, "cold": {}}
                win: list = []  # (cold µs, config) of the fastest of the op's configs

                def bench(provider, label, call, n_ring, cfg=None):
                    """call(i): the provider on copy i of the weight; cfg: the op's config it runs."""
                    try:
                        y = call(0)
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        if not err <= 1e-2:  # bf16 output: a few ulps in norm
                            print(f"    {fmt} M{M} N{N} K{K} {provider} {label}: error {err:.1e}")
                            return
                        times = {}
                        if not smoke and not args.no_hot:
                            times["hot"] = triton.testing.do_bench_cudagraph(lambda: call(0), rep=args.rep) * 1e3
                        if cold:  # (--no-hot once skipped this too: rows without a time)
                            def ring_call():
                                for i in range(n_ring):
                                    call(i)
                            times["cold"] = triton.testing.do_bench_cudagraph(ring_call, rep=args.rep) * 1e3 / n_ring
                    except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported
                        print(f"    {fmt} M{M} N{N} K{K} {provider} {label}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:90]}")
                        return
                    rows.append(dict(fmt=fmt, M=M, N=N, K=K, provider=provider, config=label, **times))
                    if cfg is not None and "cold" in times and (not win or times["cold"] < win[0]):
                        win[:] = [times["cold"], cfg]
                    for mode, us in times.items():
                        if provider not in best[mode] or us < best[mode][provider][0]:
                            best[mode][provider] = (us, label)

                heur = dm_plans.heuristic(dm.Problem.of(M, N, K, fmt, G, torch.bfloat16, device))
                cands = configs(fmt, M, N, K, smoke, args.quick, args.wide, args.xperm, args.fold_ab,
                                tuple(int(v) for v in args.splits.split(",") if v))
                if heur.kind != "cublas" and heur not in cands:
                    cands = [heur, *cands]
                if not smoke:
                    # compile every candidate on a thread pool first (Triton's C++ passes and ptxas in parallel)
                    out0 = torch.empty((M, N), device=device, dtype=torch.bfloat16)
                    tuner._precompile(lambda cfg: launch._launch(x, q, s, z, None, out0, fmt, G, cfg, warmup=True),
                                      cands)
                    bench("cublas-bf16", "", lambda i: x @ ring_bf16[i].t(), n_b)
                    plan = dm.dequant_matmul_plan(M, N, K, fmt, GROUP, torch.bfloat16, x.device)
                    cfg = dm.lookup(dm.Problem.of(M, N, K, fmt, G, torch.bfloat16, x.device))
                    bench("fusepass-plan", f"{plan} {cfg.label()}",
                          lambda i: torch.ops.fusepass.dequant_matmul(x, *ring[i], None, fmt, GROUP), n_q, cfg)
                    if gem is not None:
                        bench(f"gemlite-{fmt}", "", lambda i: gems[i](x), len(gems))
                for cfg in cands:
                    outs = [torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16) for _ in range(2)]
                    for sum_here in (True, False) if args.both_sums and cfg.split > 1 else (True,):
                        def run(i, cfg=cfg, outs=outs, sum_here=sum_here):
                            out = outs[i % 2]
                            launch._launch(x, *ring[i], None, out, fmt, G, cfg, sum_here=sum_here)
                            return out

                        if sum_here:
                            bench(cfg.kind, cfg.label(), run, n_q, cfg)
                            if cfg == heur:
                                bench("heuristic", cfg.label(), run, n_q)
                        else:  # the split summed by a second kernel, as before the in-kernel sum
                            bench(cfg.kind + "-2k", cfg.label() + "-2k", run, n_q)
                if win:
                    key = dm.Problem.of(M, N, K, fmt, G, torch.bfloat16, device).key
                    plans[key] = {**dataclasses.asdict(win[1]), "us": round(win[0], 2)}
                if copy_gbps and best["cold"]:
                    nbytes = sum(t.numel() * t.element_size() for t in (q, s, z) if t is not None)
                    floor_us = nbytes / copy_gbps / 1e3
                    best_cold = best["cold"]
                    fast = min((v for k, v in best_cold.items() if k in ("gemv", "mmt", "mm")), default=(None, ""))
                    row = dict(fmt=fmt, M=M, shape=f"{N}x{K}", floor=floor_us, best=fast[0], best_cfg=fast[1],
                               plan=best_cold.get("fusepass-plan", (None,))[0],
                               heuristic=best_cold.get("heuristic", (None,))[0], heuristic_cfg=heur.label(),
                               gemlite=best_cold.get(f"gemlite-{fmt}", (None,))[0],
                               cublas=best_cold.get("cublas-bf16", (None,))[0])
                    floor_rows.append(row)
                if smoke:
                    checked = sum(r["fmt"] == fmt and r["M"] == M and r["N"] == N for r in rows)
                    print(f"{fmt} M{M} N{N} K{K}: {checked} configs match the reference", flush=True)
                for mode in ("hot", "cold"):
                    if not best[mode]:
                        continue
                    base = best[mode].get(f"gemlite-{fmt}", (None,))[0]
                    cells = [f"{k} {us:.1f}" + (f" ({us / base:.2f}x gemlite)" if base else "")
                             + (f" [{lab}]" if lab else "")
                             for k, (us, lab) in sorted(best[mode].items(), key=lambda kv: kv[1][0])]
                    line = f"{fmt} M{M} N{N} K{K} {mode} [{time.time() - t0:.0f} s]: " + "; ".join(cells)
                    print(line, flush=True)
                    lines.append(line)
            del ring, ring_bf16, gems, gem
            if not smoke:
                torch.cuda.empty_cache()
    print("\n".join(lines))
    if floor_rows:
        def pct(us, floor):
            return f"{100 * floor / us:.0f}%" if us else "-"

        print(f"\n# cold µs and % of the floor (copy {copy_gbps:.0f} GB/s); best = fastest config swept")
        print("| fmt | M | N x K | floor | best | % | plan | % | heuristic | % | gemlite | cuBLAS bf16 | best config |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in floor_rows:
            f = r["floor"]
            print(f"| {r['fmt']} | {r['M']} | {r['shape']} | {f:.1f} | {r['best'] or 0:.1f} | {pct(r['best'], f)} | "
                  f"{r['plan'] or 0:.1f} | {pct(r['plan'], f)} | {r['heuristic'] or 0:.1f} | {pct(r['heuristic'], f)} | "
                  f"{'%.1f' % r['gemlite'] if r['gemlite'] else '-'} | {r['cublas'] or 0:.1f} | {r['best_cfg']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbps": copy_gbps, "rows": rows, "floor": floor_rows}, indent=0))
    if args.plans:
        Path(args.plans).write_text(json.dumps({"plans": dict(sorted(plans.items()))}, indent=0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
