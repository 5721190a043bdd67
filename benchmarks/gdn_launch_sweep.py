"""The chunked GDN op's launch choices, each launch timed on its own (CUDA-graph
µs): where the pipeline's time goes, and which warps / stages / value-column
blocks / inverse precision and method each kernel runs fastest with.

    python benchmarks/gdn_launch_sweep.py --shape 1,16384,32,32,128,128 --layout contig-norm

Each variant is checked against the default launch's output first (max
relative difference printed); timings of a launch alone re-run it on the
scratch the full pipeline left (the state pass then reads its own v', which
changes values, not the work).
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

from fusepass.bench.registry.gdn import layout_inputs
from fusepass.kernels._common import on_device
from fusepass.kernels.gdn import chunk_launches

VARIANTS = {
    "split": dict(fuse_output=False),
    "split-s2": dict(fuse_output=False, num_stages=2),
    "split-s4": dict(fuse_output=False, num_stages=4),
    "split-w2": dict(fuse_output=False, num_warps=2),
    "split-w8": dict(fuse_output=False, num_warps=8),
    "split-bv64": dict(fuse_output=False, block_v=64),
    "split-bv128": dict(fuse_output=False, block_v=128),
    "split-inverse-fp32": dict(fuse_output=False, inverse_fp32=True),
    "split-inverse-ieee": dict(fuse_output=False, inverse_precision="ieee"),
    "split-inverse-w2": dict(fuse_output=False, inverse_warps=2),
    "split-inverse-w4": dict(fuse_output=False, inverse_warps=4),
    "split-wu-w8": dict(fuse_output=False, wu_warps=8),
    "fused": dict(fuse_output=True),
    "fused-s2": dict(fuse_output=True, num_stages=2),
    "fused-tiles": dict(fuse_output=True, scan_row_factors=False),
    "split-tiles": dict(fuse_output=False, output_row_factors=False),
    "fused-w8": dict(fuse_output=True, num_warps=8),
}


def _name(kernel) -> str:
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    return name.replace("_gdn_", "").replace("_kernel", "")


def main(argv=None) -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,16384,32,32,128,128", help="B,T,H_k,H_v,d_k,d_v")
    p.add_argument("--layout", default="contig-norm", choices=("contig-norm", "strided-l2"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rep", type=int, default=30)
    args = p.parse_args(argv)
    B, T, Hk, Hv, dk, dv = (int(x) for x in args.shape.split(","))
    (q, k, v, g, beta, s0), l2 = layout_inputs(B, T, Hk, Hv, dk, dv, args.layout)
    scale = dk ** -0.5

    def bench(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3

    def pipeline(options):
        out = torch.empty((B, T, Hv, dv), dtype=q.dtype, device=q.device)
        hT = torch.empty((B, Hv, dk, dv), dtype=torch.float32, device=q.device)
        return chunk_launches(q, k, v, g, beta, s0, out, hT, l2, scale, **options), out, hT

    rows = []
    ref = None
    for name in args.variants.split(","):
        try:
            launches, out, hT = pipeline(VARIANTS[name])
            with on_device(q):
                for launch in launches:
                    launch.run()
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.float().clone()
                diff = ((out.float() - ref).norm() / ref.norm()).item()
                total = bench(lambda: [launch.run() for launch in launches])
                each = [bench(launch.run) for launch in launches]
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
            rows.append([name, f"error {type(exc).__name__}: {str(exc)[:60]}"])
            continue
        parts = " + ".join(f"{_name(launch.kernel)} {t:.0f}"
                           for launch, t in zip(launches, each))
        rows.append([name, f"{total:.1f}", parts, f"{diff:.1e}"])
        print(rows[-1], flush=True)
    print(f"# {torch.cuda.get_device_name()} B{B} T{T} Hk{Hk} Hv{Hv} dk{dk} dv{dv} {args.layout}")
    print(tabulate(rows, headers=["variant", "total µs", "per launch µs (alone)", "vs first"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
