"""Static look at the chunked GDN launches on a machine without a GPU: each
launch the op would make, compiled for sm_90 (Triton's own ptxas), with its
registers, spills and the instructions of its loops.

    python benchmarks/sass_gdn.py --shape 1,16384,32,32,128,128 [--set fuse_output=False --set block_v=64] [--dump]

The launch choices (``--set``) are :func:`fusepass.kernels.gdn.chunk_launches`'
keywords; the SM count is the H100's / H200's 132.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402

import sass_dequant_matmul as sass  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,1024,32,32,128,128", help="B,T,H_k,H_v,d_k,d_v (T: launches do not "
                   "depend on it beyond its chunk count)")
    p.add_argument("--set", action="append", default=[], help="a chunk_launches keyword, NAME=VALUE")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--l2norm", action="store_true")
    p.add_argument("--dump", action="store_true")
    args = p.parse_args(argv)
    driver.set_active(sass._Sm90())
    from fusepass.kernels.gdn import launch

    launch.sm_count = lambda device: 132
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, T, Hk, Hv, dk, dv = (int(x) for x in args.shape.split(","))
    q, k = torch.randn(B, T, Hk, dk).to(dt), torch.randn(B, T, Hk, dk).to(dt)
    v = torch.randn(B, T, Hv, dv).to(dt)
    g, beta, s0 = -torch.rand(B, T, Hv), torch.rand(B, T, Hv).to(dt), torch.randn(B, Hv, dk, dv)
    out, hT = torch.empty(B, T, Hv, dv, dtype=dt), torch.empty(B, Hv, dk, dv)
    options = {name: ast.literal_eval(value) for name, value in (item.split("=", 1) for item in args.set)}
    for lch in launch.chunk_launches(q, k, v, g, beta, s0, out, hT, args.l2norm, dk ** -0.5, **options):
        compiled = lch.kernel.warmup(**lch.args, grid=lch.grid, **lch._meta())
        print(f"== warps {lch.num_warps} stages {lch.num_stages} BV {lch.args.get('BV')} grid {lch.grid}")
        print(sass.report(compiled, None, args.dump, 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
