"""Projections of one activation at decode sizes: one launch against cuBLAS's one per weight.

    python benchmarks/linear_siblings.py [--ms 1,4] [--shapes all] [--configs] [--rep 100] [--formats bf16,fp32,int4,int8]

For each group of weights (a model's q / k / v, an MLP's gate / up), bf16
(or fp16, fp32), cold (a ring of weight copies larger than three L2s, each call on the next
copy): cuBLAS (``x @ w.t()`` per weight, what Inductor's graph runs), the
op with its plan, and with ``--configs`` every (rows a program, K tile,
warps) the launch takes.  Each output is checked against the fp32 product
first, its buffer poisoned with NaN; CUDA-graph time of the whole ring
divided by its length.  "floor": the weights' bytes at the copy bandwidth
measured in the same run (read + write counted: a read-only stream can pass
100%).  Quantized formats (``fusepass.quantize``'s int4 g128, int8, per
channel): ``dequant_matmul`` weight by weight, each its own plan, against
``dequant_matmul_siblings``.  The table comes last.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
from tabulate import tabulate

import fusepass  # noqa: F401 - registers the ops
from fusepass.bench.timing import copy_bandwidth, environment
from fusepass.kernels.linear_siblings import MAX_ROWS, plan, siblings_launch
from fusepass.quantize import quantize_rows

SHAPES = {  # name: (K, [N_i])
    "qwen3-30b-a3b q/k/v": (2048, [4096, 512, 512]),
    "gpt-oss-20b q/k/v": (2880, [4096, 512, 512]),
    "qwen3.5-moe gdn in_proj": (2048, [12288, 64]),
    "llama3-8b q/k/v": (4096, [4096, 1024, 1024]),
    "llama3-8b gate/up": (4096, [14336, 14336]),
    # one weight (the rule groups two or more; is one worth a launch of its own?)
    "qwen3-30b-a3b o_proj": (4096, [2048]),
    "gpt-oss-20b o_proj": (4096, [2880]),
    "llama3-8b o_proj": (4096, [4096]),
    "llama3-8b down_proj": (14336, [4096]),
    "qwen3.5-moe shared_expert_gate": (2048, [1]),
}
PLAIN = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _configs(M: int):
    for BN, BK, warps in itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (4, 8)):
        if M * BN * BK <= 16384 and BN * BK >= 32 * warps * 8:  # <= 128 fp32 a thread; 16 bytes a thread a row
            yield BN, BK, warps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="1,4")
    p.add_argument("--shapes", default="all")
    p.add_argument("--configs", action="store_true", help="time every launch config too")
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--formats", default="bf16")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    env = environment(dev)
    bw = copy_bandwidth(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    rows = []
    formats = args.formats.split(",")
    for fmt in (f for f in formats if f not in PLAIN):
        for name in names:
            rows += _quantized(name, fmt, args, dev, bw, l2)
    for dtype_name, name in itertools.product([f for f in formats if f in PLAIN], names):
        dtype = PLAIN[dtype_name]
        K, Ns = SHAPES[name]
        nbytes = dtype.itemsize * K * sum(Ns)
        copies = max(2, min(64, math.ceil(3 * l2 / nbytes)))
        torch.manual_seed(0)
        ring = [[torch.randn(n, K, device=dev, dtype=dtype) * 0.02 for n in Ns] for _ in range(copies)]
        floor = nbytes / (bw * 1e9) * 1e6
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dtype)
            ref = [x.double() @ w.double().t() for w in ring[0]]

            def timed(label, call):
                outs = call(0)
                err = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(outs, ref))
                if not err <= 1e-2:
                    print(f"  {name} M{M} {label}: error {err:.2e}", flush=True)
                    return None

                def ring_call():
                    for i in range(copies):
                        call(i)
                us = triton.testing.do_bench_cudagraph(ring_call, rep=args.rep) * 1e3 / copies
                return us, err

            got = {}
            got["cuBLAS, one mm a weight"] = timed("cublas", lambda i: [x @ w.t() for w in ring[i]])
            BN, BK, warps = plan(M, Ns, K, dev)
            got[f"op (plan BN{BN} BK{BK} W{warps})"] = timed(
                "op", lambda i: torch.ops.fusepass.linear_siblings(x, ring[i], [None] * len(Ns)))
            if args.configs and M <= MAX_ROWS:
                for cfg in _configs(M):
                    def launch(i, cfg=cfg):
                        outs = [torch.full((M, n), float("nan"), device=dev, dtype=dtype) for n in Ns]
                        siblings_launch(x, ring[i], [None] * len(Ns), outs, cfg).run()
                        return outs
                    try:
                        label = f"BN{cfg[0]} BK{cfg[1]} W{cfg[2]}"
                        got[label] = timed(str(cfg), launch)
                    except Exception as exc:  # noqa: BLE001 - a config that cannot run is reported
                        print(f"  {name} M{M} {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            base = got["cuBLAS, one mm a weight"]
            best = min((v[0], k) for k, v in got.items() if v is not None and not k.startswith("cuBLAS"))
            for label, v in got.items():
                if v is None or not (label.startswith(("cuBLAS", "op")) or label == best[1]):
                    continue
                rows.append([f"{name} {dtype_name}", M, f"{nbytes / 2**20:.1f}", f"{floor:.2f}", label, f"{v[0]:.2f}",
                             f"{100 * floor / v[0]:.0f}%", f"{base[0] / v[0]:.2f}x" if base else "-", f"{v[1]:.1e}"])
            print(f"  {name} {dtype_name} M{M}: cuBLAS {base[0] if base else float('nan'):.2f} µs, best {best[1]} {best[0]:.2f}",
                  flush=True)
    print(f"\n{env.get('device', '')}, torch {torch.__version__}, Triton {triton.__version__}, "
          f"commit {env.get('commit', '')}, copy {bw:.0f} GB/s, cold weights, CUDA-graph µs a call\n")
    print(tabulate(rows, headers=["weights", "M", "MiB", "floor µs", "path", "µs", "% floor", "vs cuBLAS",
                                  "rel err"]))


def _quantized(name: str, fmt: str, args, dev, bw: float, l2: int) -> list:
    K, Ns = SHAPES[name]
    G = 128 if fmt == "int4" else 0
    torch.manual_seed(0)
    layers = []
    for n in Ns:
        q, s, z = quantize_rows(torch.randn(n, K, device=dev) * 0.02, fmt, 128)
        layers.append((q, s.to(torch.bfloat16) if fmt == "int4" else s,
                       z.to(torch.bfloat16) if z is not None else None))
    nbytes = sum(t.numel() * t.element_size() for layer in layers for t in layer if t is not None)
    copies = max(2, min(64, math.ceil(3 * l2 / nbytes)))
    ring = [layers] + [[tuple(t.clone() if t is not None else None for t in layer) for layer in layers]
                       for _ in range(copies - 1)]
    floor = nbytes / (bw * 1e9) * 1e6
    out = []
    for M in (int(m) for m in args.ms.split(",")):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ref = [torch.ops.fusepass.dequant_matmul(x, q, s, z, None, fmt, G).float() for q, s, z in layers]
        got = {}
        for label, call in [
            (f"{fmt}: dequant_matmul a weight", lambda i: [torch.ops.fusepass.dequant_matmul(x, q, s, z, None, fmt, G)
                                                          for q, s, z in ring[i]]),
            (f"{fmt}: dequant_matmul_siblings", lambda i: torch.ops.fusepass.dequant_matmul_siblings(
                x, [t[0] for t in ring[i]], [t[1] for t in ring[i]], [t[2] for t in ring[i]], [None] * len(Ns),
                fmt, G, [])),
        ]:
            outs = call(0)
            err = max(((o.float() - r).norm() / r.norm()).item() for o, r in zip(outs, ref))
            if not err <= 1e-2:
                print(f"  {name} {fmt} M{M} {label}: error {err:.2e}", flush=True)
                continue

            def ring_call(call=call):
                for i in range(copies):
                    call(i)
            got[label] = (triton.testing.do_bench_cudagraph(ring_call, rep=args.rep) * 1e3 / copies, err)
        base = next(iter(got.values()), None)
        for label, (us, err) in got.items():
            out.append([name, M, f"{nbytes / 2**20:.1f}", f"{floor:.2f}", label, f"{us:.2f}",
                        f"{100 * floor / us:.0f}%", f"{base[0] / us:.2f}x", f"{err:.1e}"])
        print(f"  {name} {fmt} M{M}: " + ", ".join(f"{k} {v[0]:.2f}" for k, v in got.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
