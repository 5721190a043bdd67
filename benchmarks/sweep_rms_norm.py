"""Time RMSNorm / add+RMSNorm launch configurations against the heuristic's pick.

    python benchmarks/sweep_rms_norm.py

For each benchmark shape: the default config, then the alternatives (one-pass
with more rows per program or other warp counts; looped with other grid sizes
and chunk widths).  Prints one line per config: µs, % of copy bandwidth,
and the best per shape last.  Used to set the constants in
fusepass/kernels/rms_norm.py.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fusepass.kernels.rms_norm import add_rms_norm_fwd, rms_norm_config, rms_norm_fwd  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (4096, 16384), (2048, 65536)]


def configs(M: int, N: int, n_sm: int):
    yield "default", {}
    if N <= 16384:
        for bm, nw in itertools.product((1, 2, 4), (4, 8, 16)):
            if bm * N <= 32768 and bm * N // (32 * nw) >= 4:
                yield f"tile BM{bm} w{nw}", dict(variant="tile", block_m=bm, num_warps=nw)
    if N >= 4096:
        # Persistent (a few programs per SM, striding over rows) and one
        # program per row (P = M: what Inductor's looped reductions do).
        for grid, bn, nw in itertools.product((2 * n_sm, 4 * n_sm, M), (1024, 2048, 4096, 8192), (4, 8, 16)):
            if bn < N and 4 <= bn // (32 * nw) <= 16:
                yield f"looped P{min(M, grid)} BN{bn} w{nw}", dict(
                    variant="looped", num_programs=min(M, grid), block_n=bn, num_warps=nw)


def main() -> None:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    from run import copy_bandwidth

    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy {bw:.0f} GB/s")
    for op in sys.argv[1:] or ("rms_norm",):
        for M, N in SHAPES:
            x, r = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            nbytes = (2 if op == "rms_norm" else 4) * x.nbytes + w.nbytes
            ref = rms_norm_fwd(x, w, 1e-6, 0.0, True, torch.bfloat16) if op == "rms_norm" else \
                add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, torch.bfloat16)[0]
            timings = []
            default = rms_norm_config(M, N, 2, n_sm)
            for name, kw in configs(M, N, n_sm):
                try:
                    if op == "rms_norm":
                        fn = lambda: rms_norm_fwd(x, w, 1e-6, 0.0, True, torch.bfloat16, **kw)  # noqa: E731
                    else:
                        fn = lambda: add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, torch.bfloat16, **kw)  # noqa: E731
                    out = fn()
                    out = out if op == "rms_norm" else out[0]
                    # Another chunk width sums in another order: equal to a rounding.
                    torch.testing.assert_close(out, ref, atol=1.6e-2, rtol=1.6e-2)
                    us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
                except Exception as exc:  # noqa: BLE001
                    print(f"{op} {M}x{N} {name}: {type(exc).__name__}")
                    continue
                pct = 100 * nbytes / us / 1e3 / bw
                timings.append((us, name, pct))
                if name == "default":
                    print(f"{op} {M}x{N} default ({default.variant} BM{default.BM} BN{default.BN} "
                          f"w{default.num_warps} P{default.num_programs}): {us:.1f} µs {pct:.0f}%")
            for us, name, pct in sorted(timings)[:3]:
                print(f"{op} {M}x{N} TOP {name}: {us:.1f} µs {pct:.0f}%")


if __name__ == "__main__":
    main()
