"""Check and time every registered op against eager, Inductor and peers.

    python benchmarks/run.py                 # all ops, all shapes
    python benchmarks/run.py --ops rms_norm --quick --json out.json

Every provider is first checked against the case's fp32 reference on fresh
random inputs (relative error norm and the dtype table); then all providers of
a case are timed in the same process with ``triton.testing.do_bench`` (median
and p20/p80, plain launches) and under a CUDA graph
(``do_bench_cudagraph``: GPU time alone).  The table that ends the output
gives GB/s from the graph time and its share of the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tabulate import tabulate  # noqa: E402

OPS = ["rms_norm", "add_rms_norm", "rms_norm_gated", "swiglu", "geglu", "dequant_matmul"]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    import triton.testing

    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def rel_err(out, ref) -> float:
    worst = 0.0
    for o, r in zip(_flat(out), _flat(ref)):
        o64, r64 = o.double(), r.double()
        if not torch.isfinite(o64).all():
            return float("inf")
        worst = max(worst, ((o64 - r64).norm() / r64.norm().clamp_min(1e-30)).item())
    return worst


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - not a checkout (the device copy)
        return os.environ.get("FUSEPASS_COMMIT", "unknown")


def main(argv: list[str] | None = None) -> int:
    import triton
    import triton.testing

    p = argparse.ArgumentParser()
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    args = p.parse_args(argv)

    import fusepass  # noqa: F401  - registers the ops

    torch.manual_seed(0)
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    env = {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "commit": commit()}
    print(f"# {dev}  torch {torch.__version__}  triton {triton.__version__}  commit {env['commit']}")
    print(f"# measured copy bandwidth: {bw:.0f} GB/s (bytes read + written)")

    rows, failures = [], []
    for op in args.ops.split(","):
        module = importlib.import_module(op)
        for case in module.cases(args.quick):
            inputs = case.make_inputs()
            ref = case.reference(*inputs)
            for name, fn in case.providers.items():
                row = {"op": case.op, "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""),
                       "provider": name, **env}
                try:
                    out = fn(*inputs)
                    torch.cuda.synchronize()
                    err = rel_err(out, ref)
                    # Plain launches (what a caller without CUDA graphs sees,
                    # CPU overhead included) and replays of a CUDA graph (the
                    # GPU time alone; GB/s are computed from these).
                    ms = triton.testing.do_bench(lambda: fn(*inputs), rep=args.rep, quantiles=[0.5, 0.2, 0.8])
                    graph_ms = triton.testing.do_bench_cudagraph(lambda: fn(*inputs), rep=args.rep)
                except Exception as exc:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
                    row.update(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:120])
                    rows.append(row)
                    failures.append(row)
                    continue
                # bf16 inputs against an fp32 reference: a few ulps of bf16 in norm.
                limit = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[case.dtype]
                row.update(
                    rel_err=err, ok=err <= limit,
                    median_us=ms[0] * 1e3, p20_us=ms[1] * 1e3, p80_us=ms[2] * 1e3,
                    graph_us=None if graph_ms is None else graph_ms * 1e3,
                    gbps=case.bytes_moved / graph_ms / 1e6,
                    pct_copy=100 * case.bytes_moved / graph_ms / 1e6 / bw,
                    copy_gbps=bw,
                )
                if not row["ok"] and name in ("fusepass", "fusepass-compiled"):
                    failures.append(row)
                rows.append(row)

    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    table = [
        [r["op"], r["shape"], r["provider"],
         f"{r['median_us']:.1f}" if "median_us" in r else "-",
         f"{r['graph_us']:.1f}" if r.get("graph_us") else "-",
         f"{r['gbps']:.0f}" if "gbps" in r else "-",
         f"{r['pct_copy']:.0f}%" if "pct_copy" in r else "-",
         f"{r['rel_err']:.1e}" if "rel_err" in r else r.get("error", "")]
        for r in rows
    ]
    print(tabulate(table, headers=["op", "shape", "provider", "median µs", "graph µs", "GB/s (graph)", "% copy",
                                   "rel err"]))
    if failures:
        print(f"FAILED: {len(failures)} provider checks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
