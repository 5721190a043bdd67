"""The MoE decode path's launch options timed against each other on the GPU:
programmatic dependent launch (router -> gate_up -> down: ``RouterConfig.pdl``
and ``release``, ``DecodeConfig.pdl``).

Each variant is checked against the fp32 reference and against the default
launch bit for bit, then timed as CUDA-graph replays: the router and the
experts together (the block's op pair) and the experts alone; floor = the
active experts' and the router's bytes at the copy rate of the run.

    python benchmarks/moe_decode_launches.py [--ts 1,4] [--models ...] [--int4] [--profile] [--rounds 5]

With ``--rounds N`` every variant is timed N times, the variants taking turns
(a drift of the machine then reaches all of them alike), and the table gives
the median with the range: single timings of one variant moved by 1-2 µs
between runs of the same tree (H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import triton.testing
from tabulate import tabulate

from fusepass.bench.registry import moe as M
from fusepass.kernels._common import sm_count
from fusepass.kernels.moe import decode, experts as ex, router as rt

VARIANTS = {  # name: (router launched with PDL, router releases at its start, experts' two launches with PDL)
    "none": (False, False, False),
    "experts": (False, False, True),
    "release+experts": (False, True, True),
    "all": (True, True, True),
}


def chain(blk: M.Block, x, quant, rcfg, dcfg):
    w, ids, _ = rt.router_fwd(*blk.router_args(x), cfg=rcfg)
    return experts(blk, x, ids, w, quant, dcfg)


def experts(blk: M.Block, x, ids, w, quant, dcfg):
    m = blk.m
    w1, w2, b1, b2 = blk.expert_weights()
    if quant is None:
        return ex.experts_fwd(x, ids, w, w1, w2, b1, b2, None, None, None, None, *blk.op_tail(), "none", 0,
                              m["alpha"], m["limit"], plan="decode", cfg=dcfg)
    q1, s1, z1, q2, s2, z2 = quant
    return ex.experts_fwd(x, ids, w, q1, q2, b1, b2, s1, z1, s2, z2, m["act"], m["layout"], False, "int4",
                          blk.group, m["alpha"], m["limit"], plan="decode", cfg=dcfg)


def kernel_times(fn, reps: int = 50) -> dict[str, float]:
    """Mean µs per launch of each kernel in ``fn`` replayed from a CUDA graph (profiler)."""
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
            out[ev.key[:40]] = ev.device_time_total / reps if hasattr(ev, "device_time_total") else \
                ev.cuda_time_total / reps
    return out


def _spread(ts: list[float]) -> str:
    """The median, and the range where there are several timings."""
    med = statistics.median(ts)
    return f"{med:.1f}" if len(ts) == 1 else f"{med:.1f} ({min(ts):.1f}-{max(ts):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--ts", default="1")
    p.add_argument("--int4", action="store_true", help="also the int4 experts (g128)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rep", type=float, default=30.0)
    p.add_argument("--profile", action="store_true", help="per-kernel times of the none and all variants")
    p.add_argument("--rounds", type=int, default=1, help="timings per variant, the variants taking turns")
    a = p.parse_args()
    bw = M.copy_bandwidth("cuda", False)
    rows, prof_rows = [], []
    for name in a.models.split(","):
        blk = M.Block(name, "cuda")
        m = blk.m
        for quant_name in ("bf16", "int4") if a.int4 and not m["transposed"] else ("bf16",):
            quant = blk.quantized() if quant_name == "int4" else None
            for T in (int(t) for t in a.ts.split(",")):
                x = torch.randn(T, m["H"], device="cuda", dtype=torch.bfloat16)
                w, ids, _ = M.ops.moe_router(*blk.router_args(x))
                ref = blk.reference(x, ids, w, quant)
                floor = blk.floor_bytes(ids, quant) / bw / 1e3
                base_r = rt.router_heuristic(T, m["E"], m["H"])
                base_d = decode.decode_heuristic(T, m["k"], m["H"], m["I"], m["transposed"], sm_count(x.device),
                                                 blk.group if quant is not None else 0,
                                                 dot=quant is None and m["transposed"], plain16=quant is None)
                base_out = None
                cases = []
                for v in a.variants.split(","):
                    rp, rr, dp = VARIANTS[v]
                    rcfg = dataclasses.replace(base_r, pdl=rp, release=rr)
                    dcfg = dataclasses.replace(base_d, pdl=dp)
                    out = chain(blk, x, quant, rcfg, dcfg)
                    torch.cuda.synchronize()
                    if base_out is None:
                        base_out = out.clone()
                    cases.append((v, rcfg, dcfg, torch.equal(out, base_out), M.rel(out, ref)))
                t_all = {v: [] for v, *_ in cases}
                t_ex = {v: [] for v, *_ in cases}
                for _ in range(a.rounds):
                    for v, rcfg, dcfg, _same, _err in cases:
                        t_all[v].append(triton.testing.do_bench_cudagraph(
                            lambda: chain(blk, x, quant, rcfg, dcfg), rep=a.rep) * 1e3)
                        t_ex[v].append(triton.testing.do_bench_cudagraph(
                            lambda: experts(blk, x, ids, w, quant, dcfg), rep=a.rep) * 1e3)
                for v, rcfg, dcfg, same, err in cases:
                    med = statistics.median(t_all[v])
                    rows.append([name, quant_name, T, v, _spread(t_all[v]), _spread(t_ex[v]), f"{floor:.1f}",
                                 f"{med / floor:.2f}", f"{err:.1e}", "yes" if same else "NO"])
                    print(rows[-1], flush=True)
                    if a.profile and v in ("none", "all"):
                        kt = kernel_times(lambda: chain(blk, x, quant, rcfg, dcfg))
                        for k_name, us in kt.items():
                            prof_rows.append([name, quant_name, T, v, k_name, f"{us:.2f}"])
        blk = None  # its weights freed before the next model
        torch.cuda.empty_cache()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"copy {bw:.0f} GB/s")
    if prof_rows:
        print(tabulate(prof_rows, headers=["block", "experts", "T", "variant", "kernel", "µs (profiler)"]))
    print(tabulate(rows, headers=["block", "experts", "T", "variant", "router+experts µs", "experts µs", "floor µs",
                                  "x floor", "rel err", "= default"]))


if __name__ == "__main__":
    main()
