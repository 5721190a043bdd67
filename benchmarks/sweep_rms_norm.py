"""Time RMSNorm / add+RMSNorm launch configurations against the heuristic's pick
and against Inductor, in one process.

    python benchmarks/sweep_rms_norm.py [rms_norm] [add_rms_norm] [--shapes 8192x8192,...] [--no-inductor]

For each benchmark shape: Inductor's kernel for the same plain-torch function
(its autotuned config printed), the heuristic's default, then alternatives:
one-pass with more rows per program, other warp counts, the weight loaded
before the reduction (``w_first``); looped with other grids and chunk widths,
one program per row as Inductor's looped reductions do.  Every config's
output is checked against the fp32 reference before it is timed (CUDA-graph replays, GPU time alone).  Prints a
line per config and, last, a table of the best per shape.  Used to set the
constants in fusepass/kernels/rms_norm.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tabulate import tabulate  # noqa: E402

from fusepass.bench.registry import add_rms_norm as bench_add  # noqa: E402
from fusepass.bench.registry import rms_norm as bench_norm  # noqa: E402
from fusepass.bench.registry.common import compiled  # noqa: E402
from fusepass.bench.registry.rms_norm import EPS, SHAPES  # noqa: E402
from fusepass.kernels.rms_norm import add_rms_norm_fwd, rms_norm_config, rms_norm_fwd  # noqa: E402


def configs(M: int, N: int, n_sm: int):
    yield "default", {}
    yield "default w_first", {"w_first": True}
    if N <= 16384:
        for nw in (4, 8, 16, 32):
            if 4 <= N // (32 * nw) <= 32:
                yield f"row w{nw} w_first", dict(variant="row", num_warps=nw, w_first=True)
        if M > 1:
            for bm, nw in ((2, 8), (2, 16)):
                if bm * N <= 32768:
                    for wf in (False, True):
                        yield f"tile BM{bm} w{nw}{' w_first' if wf else ''}", dict(
                            variant="tile", block_m=bm, num_warps=nw, w_first=wf)
    if N >= 4096 and M > 1:
        # One program per row (P = M: Inductor's looped reductions); the
        # whole row as one chunk is Inductor's persistent reduction, which
        # loads the row twice (the second time from L1/L2) instead of holding
        # it in registers.
        full = triton.next_power_of_2(N)
        for bn, nw in ((full, full // 512), (full, full // 1024), (1024, 4), (2048, 8)):
            if 1 <= nw <= 32 and bn <= full:
                yield f"looped P{M} BN{bn} w{nw}", dict(variant="looped", num_programs=M, block_n=bn, num_warps=nw)
    if N > 16384:
        # Persistent grids: 1 and 2 programs per SM.
        for per_sm, bn, nw in ((1, 16384, 32), (2, 8192, 16), (2, 4096, 8)):
            yield f"looped P{per_sm * n_sm} BN{bn} w{nw}", dict(
                variant="looped", num_programs=per_sm * n_sm, block_n=bn, num_warps=nw)


def inductor_configs(cache_dir: str, seen: set[str]) -> list[str]:
    """The autotuned configs Inductor wrote since the last call."""
    out = []
    for path in sorted(glob.glob(os.path.join(cache_dir, "**", "*.best_config"), recursive=True)):
        if path in seen:
            continue
        seen.add(path)
        try:
            cfg = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        keep = {k: v for k, v in cfg.items() if k in ("XBLOCK", "R0_BLOCK", "RBLOCK", "num_warps", "num_stages")}
        out.append(" ".join(f"{k}={v}" for k, v in keep.items()))
    return out


def main() -> None:
    from fusepass.bench.ops import rel_err
    from fusepass.bench.timing import copy_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("ops", nargs="*", default=["rms_norm"])
    p.add_argument("--shapes", default=None, help="MxN,MxN,... (default: the benchmark shapes)")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--match", default=None, help="time only the configs whose name matches this regex (and the default)")
    args = p.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy {bw:.0f} GB/s", flush=True)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    seen: set[str] = set()
    inductor_configs(cache_dir(), seen)
    rows = []
    for op in args.ops:
        for M, N in shapes:
            x, r = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            nbytes = (2 if op == "rms_norm" else 4) * x.nbytes + w.nbytes

            def pct(us: float) -> float:
                return 100 * nbytes / us / 1e3 / bw

            if op == "rms_norm":
                ind = compiled(bench_norm.hf_rms_norm)
                ind_fn = lambda: ind(x, w)  # noqa: E731
                ref = bench_norm.reference(x, w)
            else:
                ind = compiled(bench_add.hf_add_rms_norm)
                ind_fn = lambda: ind(x, r, w)  # noqa: E731
                ref = bench_add.reference(x, r, w)
            ind_us = float("nan")
            if not args.no_inductor:
                ind_err = rel_err(ind_fn(), ref)
                ind_us = triton.testing.do_bench_cudagraph(ind_fn, rep=50) * 1e3
                tuned = "; ".join(inductor_configs(cache_dir(), seen)) or "-"
                print(f"{op} {M}x{N} inductor: {ind_us:.1f} µs {pct(ind_us):.0f}% err {ind_err:.1e} [{tuned}]",
                      flush=True)

            timings = []
            default = rms_norm_config(M, N, 2, n_sm, residual=op == "add_rms_norm")
            for name, kw in configs(M, N, n_sm):
                if args.match and name != "default" and not re.search(args.match, name):
                    continue
                try:
                    if op == "rms_norm":
                        fn = lambda: rms_norm_fwd(x, w, EPS, 0.0, True, torch.bfloat16, **kw)  # noqa: E731
                    else:
                        fn = lambda: add_rms_norm_fwd(x, r, w, EPS, 0.0, True, torch.bfloat16, **kw)  # noqa: E731
                    # Against the fp32 math, as `fusepass bench` checks, tighter (bf16: 3e-3).
                    err = rel_err(fn(), ref)
                    if not err <= 3e-3:
                        raise AssertionError(f"relative error {err:.1e} against the fp32 reference")
                    us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
                except Exception as exc:  # noqa: BLE001
                    print(f"{op} {M}x{N} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                timings.append((us, name))
                label = name if name != "default" else (
                    f"default ({default.variant} BM{default.BM} BN{default.BN} w{default.num_warps} "
                    f"P{default.num_programs})")
                print(f"{op} {M}x{N} {label}: {us:.1f} µs {pct(us):.0f}%", flush=True)
            if not timings:
                continue
            best_us, best = min(timings)
            default_us = next(us for us, name in timings if name == "default")
            rows.append([op, f"{M}x{N}", f"{ind_us:.1f}", f"{default_us:.1f}", best, f"{best_us:.1f}",
                         f"{pct(best_us):.0f}%", f"{ind_us / best_us:.2f}x"])
    print()
    print(tabulate(rows, headers=["op", "shape", "inductor µs", "default µs", "best config", "best µs",
                                  "best % copy", "best vs inductor"], tablefmt="github"))


if __name__ == "__main__":
    main()
