"""Weight-only quantized linears, bf16 activations: Llama-3-8B's projection
shapes (N x K = 4096x4096, 14336x4096, 4096x14336) from decode to prefill M.

One case per (format, shape, M).  The weight is a random bf16 matrix
quantized once; every provider computes x @ dequant(W)^T from the same
quantized values (bf16 cuBLAS gets the dequantized matrix itself, so it is
the unquantized model's linear at the same numerics), and every one is checked
against the fp32 dequantize-then-matmul reference before it is timed.

    fusepass bench --ops dequant_matmul [--quick]
    python -m fusepass.bench.registry.dequant_matmul --gpu-run [--tune-out plans.json]   # checks, plans, pivot table

Providers: bf16 cuBLAS (``F.linear``), Inductor on the dequant form (default;
``max-autotune-no-cudagraphs`` for int8 at the AUTOTUNE_MS sizes of full runs
only: each compile takes minutes),
torchao int8 weight-only compiled, gemlite A16W8 / A16W4, fusepass's op.
"""

from __future__ import annotations

import importlib.util

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from fusepass.bench.registry.common import Case, compiled, lazy
from fusepass.formats import FORMATS, dequantize
from fusepass.kernels import dequant_matmul as dm  # registers fusepass::dequant_matmul
from fusepass.kernels.dequant_matmul import Problem, plans, tuner
from fusepass.kernels.dequant_matmul.config import valid
from fusepass.kernels._common import TOLERANCES

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
MS = [1, 4, 16, 64, 256, 1024, 4096]
QUICK_MS = [1, 16, 64, 1024]
AUTOTUNE_MS = (1, 16)  # int8, full runs: Inductor max-autotune (minutes per compile; the table has M1)
# What `fusepass bench` runs (the registry suite, which has to fit ten minutes
# of one GPU with the other entries): decode, small-batch and prefill M on the
# square and the wide shape (4096x14336 reads the same bytes as 14336x4096),
# peers where they compete (gemlite and torchao at M <= 64: above it they take
# 2-3x cuBLAS's time and gemlite's autotuning costs 10-15 s per new M), Inductor
# max-autotune at M = 1.  The whole grid (MS x SHAPES, peers at every M) is
# `python -m fusepass.bench.registry.dequant_matmul --time`.  On the H100, the first calls
# of the full grid took 350 s before any timing: gemlite's autotuning 190 s,
# Inductor's compiles 110 s (13-18 s each at M = 1), torchao's 45 s.
SUITE_SHAPES = [(4096, 4096), (14336, 4096)]
SUITE_MS = [1, 16, 64, 1024]
SUITE_PEER_MAX_M = 64
SUITE_AUTOTUNE_MS = (1,)
GROUP = 128


# -- quantized weights -----------------------------------------------------------------


def quantize(w: torch.Tensor, fmt: str, group: int = GROUP) -> dict:
    """Round-to-nearest quantization of a [N, K] weight into the op's layouts (plus what peers need)."""
    w = w.float()
    N, K = w.shape
    if fmt == "int8":
        s = (w.abs().amax(1) / 127).clamp_min(1e-8)
        q = (w / s[:, None]).round().clamp(-128, 127).to(torch.int8)
        return dict(weight=q, scale=s.to(torch.bfloat16), zero=None, group=0)
    if fmt == "fp8":
        s = (w.abs().amax(1) / 448).clamp_min(1e-8)
        q = (w / s[:, None]).to(torch.float8_e4m3fn)
        return dict(weight=q, scale=s.to(torch.bfloat16), zero=None, group=0)
    g = w.view(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-8)
    z = (-lo / s).round().clamp(0, 15)
    q = (g / s[..., None] + z[..., None]).round().clamp(0, 15).to(torch.uint8).view(N, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return dict(weight=packed.contiguous(), scale=s.to(torch.bfloat16), zero=z.to(torch.bfloat16), group=group,
                unpacked=q)


def weight_bytes(qw: dict) -> int:
    return sum(t.numel() * t.element_size() for t in (qw["weight"], qw["scale"], qw["zero"]) if t is not None)


# -- providers ------------------------------------------------------------------------


def _dequant_form(fmt: str, group: int):
    """What quantized model code writes (the rules' search forms), bf16 activations."""
    if fmt == "int4":
        def fn(x, q, s, z):
            N = q.shape[0]
            w = torch.stack([q & 0xF, q >> 4], dim=-1).view(N, -1, group).to(x.dtype)
            w = ((w - z[..., None]) * s[..., None]).view(N, -1)
            return x @ w.t()
    else:
        def fn(x, q, s, z):
            return x @ (q.to(x.dtype) * s[:, None]).t()
    return fn


def _torchao_int8(w_bf16: torch.Tensor):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception:  # noqa: BLE001 - optional peer
        return None
    lin = torch.nn.Linear(w_bf16.shape[1], w_bf16.shape[0], bias=False, device=w_bf16.device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w_bf16)
    # quantize_ also sets Inductor's config process-wide (its recommended
    # settings: coordinate-descent tuning among them).  Left on, every later
    # case's "inductor" row was compiled with them (the H100 runs at 9fab920
    # and 5aa3999, where those compiles took up to 50 and 119 s).  They are
    # kept to torchao's own compile.
    before = torch._inductor.config.get_config_copy()
    precision = torch.get_float32_matmul_precision()
    try:
        quantize_(lin, Int8WeightOnlyConfig())
    except Exception as exc:  # noqa: BLE001
        print(f"# torchao unavailable: {type(exc).__name__}: {exc}")
        return None
    finally:
        after = torch._inductor.config.get_config_copy()
        torchao_config = {k: v for k, v in after.items() if before.get(k) != v}
        torch._inductor.config.load_config(before)
        torch.set_float32_matmul_precision(precision)

    def fwd(x):
        return lin(x)
    # A function of its own per case: Linear.forward's code object is shared by
    # every module, and Dynamo stops compiling one code object after 8 shapes.
    fn = compiled(fwd)

    def call(x):  # compiled (on its first call) under torchao's settings
        with torch._inductor.config.patch(torchao_config):
            return fn(x)
    return call


def _gemlite(qw: dict, fmt: str, device):
    try:
        from gemlite.helper import A16W4_HQQ_INT, A16W8_INT8
    except Exception:  # noqa: BLE001 - optional peer
        return None
    try:
        if fmt == "int8":
            return A16W8_INT8(device=device, dtype=torch.bfloat16).from_weights(
                qw["weight"], bias=None, scales=qw["scale"].view(-1, 1))
        if fmt == "int4":
            return A16W4_HQQ_INT(device=device, dtype=torch.bfloat16).from_weights(
                qw["unpacked"], qw["scale"], qw["zero"], bias=None)
    except Exception as exc:  # noqa: BLE001
        print(f"# gemlite {fmt} unavailable: {type(exc).__name__}: {exc}")
    return None


def _case(fmt: str, N: int, K: int, M: int, quick: bool, device: str, suite: bool = False) -> Case:
    # One quantized weight per (format, shape), shared by every M: peers that
    # repack (gemlite, torchao) do it once here, not per timing.
    qw, w_deq = _weights(fmt, N, K, device)

    def make_inputs():
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        return (x,)

    def reference(x):
        return dm.dequant_matmul_reference(x, qw["weight"], qw["scale"], qw["zero"], None, fmt, qw["group"])

    form = _dequant_form(fmt, qw["group"])
    q, s, z = qw["weight"], qw["scale"], qw["zero"]
    providers = {}
    if fmt == "int8":  # the same bf16 product for every format: timed once
        # cuBLAS on a GPU; on the CPU the same F.linear is ATen's CPU matmul.
        providers["cublas-bf16" if device == "cuda" else "aten-bf16"] = lambda x: F.linear(x, w_deq)
    if fmt == "int8" or not quick:
        providers["inductor"] = _bind(lazy(lambda: compiled(form)), q, s, z)
    if not quick and fmt == "int8" and M in (SUITE_AUTOTUNE_MS if suite else AUTOTUNE_MS):
        providers["inductor-max-autotune"] = _bind(
            lazy(lambda: compiled(form, mode="max-autotune-no-cudagraphs")), q, s, z)
    # Peers: CUDA only (gemlite has no CPU path; torchao's CPU int8 is another
    # kernel than the one the GPU rows compare with), and only when installed.
    peers = device != "cpu" and not (suite and M > SUITE_PEER_MAX_M)
    # torchao compiled takes 9.5 ms at M = 256 and 37-530 ms per call above (H100): its
    # timings there cost the suite minutes and say nothing M = 256 does not.
    if peers and fmt == "int8" and M <= 256 and importlib.util.find_spec("torchao") is not None:
        providers["torchao-int8"] = _lazy_module(lambda: _torchao_int8(w_deq))
    if peers and fmt in ("int8", "int4") and importlib.util.find_spec("gemlite") is not None:
        providers[f"gemlite-{fmt}"] = _lazy_module(lambda: _gemlite(qw, fmt, device))
    providers[f"fusepass-{fmt}"] = lambda x: torch.ops.fusepass.dequant_matmul(x, q, s, z, None, fmt, qw["group"])
    return Case(
        op="dequant_matmul", shape=f"{fmt}-M{M}-N{N}-K{K}", dtype=torch.bfloat16, make_inputs=make_inputs,
        reference=reference, providers=providers, bytes_moved=weight_bytes(qw),
        notes={"fmt": fmt, "M": str(M), "N": str(N), "K": str(K), "bf16_bytes": str(2 * N * K)},
    )


@functools.cache
def _weights(fmt: str, N: int, K: int, device: str):
    gen = torch.Generator(device=device).manual_seed(N * 7 + K)
    w = torch.randn(N, K, device=device, generator=gen) * 0.02
    qw = quantize(w, fmt)
    w_deq = dequantize(qw["weight"], qw["scale"], qw["zero"], fmt, qw["group"], torch.bfloat16)
    return qw, w_deq


def _bind(fn, *extra):
    return lambda x: fn(x, *extra)


def _lazy_module(make):
    box = []

    def fn(x):
        if not box:
            box.append(make())
        if box[0] is None:
            raise RuntimeError("provider not installed")
        return box[0](x)
    return fn


# The CPU's --quick run (CI) checks and times every provider's path on one
# small shape: the real sizes took minutes per format on 2 CPU cores.
CPU_QUICK_SHAPES = [(256, 512)]
CPU_QUICK_MS = [1, 16]


def cases(quick: bool = False, device: str = "cuda", grid: bool = False) -> list[Case]:
    """The registry's cases (``fusepass bench``: the SUITE_* trim above), or with ``grid`` every
    shape and M with peers at every M (this script's ``--time``)."""
    if quick and device == "cpu":
        shapes, ms = CPU_QUICK_SHAPES, CPU_QUICK_MS
    elif grid:
        shapes, ms = SHAPES, QUICK_MS if quick else MS
    else:
        shapes, ms = SUITE_SHAPES, SUITE_MS
    suite = not grid and not quick
    return [_case(fmt, N, K, M, quick, device, suite) for fmt in FORMATS for N, K in shapes for M in ms]


# -- the GPU run: checks at real sizes, plans, timings ------------------------------


def check_paths(log) -> int:
    """Every path (GEMV / split-K, tensor cores / split-K, dequant + cuBLAS) of every format
    against the fp32 reference at real sizes, bf16 / fp16 / fp32, with bias and 3-D x."""
    failures = 0
    N, K = 4096, 4096
    paths = {
        "gemv": dm.Config("gemv", BN=8, BK=512, split=1),
        "gemv-split4": dm.Config("gemv", BN=16, BK=512, split=4, warps=8),
        "mm": dm.Config("mm", BM=16, BN=64, BK=64, split=1, stages=3),
        "mm-split3": dm.Config("mm", BM=64, BN=128, BK=64, split=3, stages=3),
        "mm-perm": dm.Config("mm", BM=16, BN=64, BK=64, split=2, stages=3, perm=1),
        "gemv-narrow": dm.Config("gemv", BN=2, BK=512, split=1),
        "mmt": dm.Config("mmt", BM=16, BN=64, BK=64, split=1, stages=3),
        "mmt-split4": dm.Config("mmt", BM=64, BN=128, BK=128, split=4, stages=3),
        "mmt-split3-bk256": dm.Config("mmt", BM=32, BN=64, BK=256, split=3, stages=3),  # int8 / fp8: K masked
        "mmt-bm128": dm.Config("mmt", BM=128, BN=128, BK=64, split=2, warps=8, stages=3),
        "cublas": dm.CUBLAS,
    }
    for fmt in ("int8", "int4", "int4-sym-g32", "fp8"):
        base = fmt.split("-")[0]
        qw, _ = _weights(base, N, K, "cuda")
        if fmt == "int4-sym-g32":
            w = torch.randn(N, K, device="cuda") * 0.02
            qw = quantize(w, "int4", 32)
            qw["zero"] = None  # symmetric form: offset 8
        for name, cfg in paths.items():
            for M, dtype, bias, three_d in ((1, torch.bfloat16, True, False), (5, torch.float16, False, True),
                                            (77, torch.bfloat16, True, True), (300, torch.float16, True, False),
                                            (3, torch.float32, True, False), (40, torch.float32, False, False)):
                if not valid(cfg, Problem(dm.m_bucket(M), N, K, base, qw["group"] if base == "int4" else 0,
                                          dtype, "")):
                    continue
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                if three_d:
                    x = x.view(1, M, K)
                b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
                r = dm.dequant_matmul_reference(x, qw["weight"], qw["scale"], qw["zero"], b, base, qw["group"])
                try:
                    y = dm.dequant_matmul_fwd(x, qw["weight"], qw["scale"], qw["zero"], b, base, qw["group"],
                                              config=cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                    failures += 1
                    log(f"check {fmt} {name} M{M} {dtype}: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                tol = TOLERANCES[dtype]
                ok = torch.allclose(y.float(), r.float(), atol=tol.atol, rtol=tol.rtol) and bool(torch.isfinite(y).all())
                err = ((y.double() - r.double()).norm() / r.double().norm()).item()
                if not ok:
                    failures += 1
                log(f"check {fmt:13s} {name:12s} M{M:<4d} {str(dtype)[6:]:8s} bias={int(bias)} 3d={int(three_d)} "
                    f"rel_err={err:.1e} max_abs={(y.float() - r.float()).abs().max().item():.2e} {'ok' if ok else 'FAIL'}")
    return failures


def tune_all(ms, log, deadline: float, formats=FORMATS, shapes=SHAPES) -> dict:
    """Plans for the benchmark shapes (the shipped table), most important M first, until ``deadline``."""
    table = {}
    order = sorted(ms, key=lambda m: (m not in (1, 16, 64), m))
    for M in order:
        for fmt in formats:
            for N, K in shapes:
                if time.time() > deadline:
                    log(f"tune: out of time before {fmt} M{M} N{N} K{K}")
                    return table
                qw, _ = _weights(fmt, N, K, "cuda")
                t0 = time.time()
                problem = Problem.of(M, N, K, fmt, qw["group"], torch.bfloat16, "cuda")
                best, times = tuner.tune(problem, qw["weight"], qw["scale"], qw["zero"])
                us = dict(times)[best]
                table[problem.key] = {**dataclasses.asdict(best), "us": round(us, 2)}
                plans.save(problem, best, us)
                ranked = sorted(times, key=lambda t: t[1])
                log(f"tune {fmt} M{M} N{N} K{K}: " + "  ".join(f"{c.label()} {t:.1f}" for c, t in ranked[:6])
                    + f"  ({len(times)} cands, {time.time() - t0:.1f} s)")
    return table


def time_cases(selected, log, rep: int, deadline: float) -> list[dict]:
    import triton.testing

    rows = []
    for case in selected:
        if time.time() > deadline:
            log(f"time: out of time at {case.shape}")
            break
        torch.manual_seed(0)
        (x,) = case.make_inputs()
        ref = case.reference(x)
        for name, fn in case.providers.items():
            row = {"case": case.shape, "provider": name, **case.notes}
            try:
                out = fn(x)
                torch.cuda.synchronize()
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                row["rel_err"] = err
                if not err <= 1e-2:  # bf16 output against fp32: a few bf16 ulps in norm
                    row["error"] = f"rel err {err:.1e}"
                    rows.append(row)
                    continue
                row["us"] = triton.testing.do_bench_cudagraph(lambda: fn(x), rep=rep) * 1e3
            except Exception as exc:  # noqa: BLE001 - a provider that cannot run is reported
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:100]
            rows.append(row)
            log(json.dumps(row))
    return rows


def pivot(rows, bw: float) -> str:
    from tabulate import tabulate

    cols = ["cublas-bf16", "inductor", "inductor-max-autotune", "torchao-int8", "gemlite-int8", "fusepass-int8",
            "gemlite-int4", "fusepass-int4", "fusepass-fp8"]
    by = {}
    for r in rows:
        key = (int(r["N"]), int(r["K"]), int(r["M"]))
        name = r["provider"]
        if name in ("inductor", "inductor-max-autotune"):
            name = name if r["fmt"] == "int8" else f"{name}@{r['fmt']}"
        by.setdefault(key, {})[name] = r.get("us", r.get("error", "-"))
        if name.startswith("fusepass") and "us" in r:
            wb = {"int8": 1.0, "fp8": 1.0, "int4": 0.5 + 4 / GROUP}[r["fmt"]] * int(r["N"]) * int(r["K"])
            by[key][f"GB/s {r['fmt']}"] = wb / r["us"] / 1e3
    present = [c for c in cols if any(c in v for v in by.values())]
    table = []
    for (N, K, M), v in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        line = [f"M{M} N{N} K{K}"]
        for c in present:
            val = v.get(c, "-")
            line.append(f"{val:.1f}" if isinstance(val, float) else str(val)[:14])
        def ratio(a, b):
            return f"{v[a] / v[b]:.2f}" if isinstance(v.get(a), float) and isinstance(v.get(b), float) else "-"
        line += [ratio("fusepass-int8", "gemlite-int8"), ratio("fusepass-int4", "gemlite-int4"),
                 ratio("fusepass-int8", "cublas-bf16"), ratio("fusepass-int8", "inductor"),
                 f"{v['GB/s int8']:.0f}" if "GB/s int8" in v else "-", f"{v['GB/s int4']:.0f}" if "GB/s int4" in v else "-"]
        table.append(line)
    headers = ["shape (µs, CUDA graph)"] + present + ["i8/gl8", "i4/gl4", "i8/cub", "i8/ind", "GB/s i8", "GB/s i4"]
    return f"copy bandwidth {bw:.0f} GB/s (read + write)\n" + tabulate(table, headers=headers)


def main(argv=None) -> int:
    import triton

    from fusepass.bench.timing import commit, copy_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("--gpu-run", action="store_true")
    p.add_argument("--check", action="store_true", help="check every path at real sizes")
    p.add_argument("--tune", action="store_true", help="measure the plans of the benchmark shapes")
    p.add_argument("--time", action="store_true", help="time the providers")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ms", default=None)
    p.add_argument("--formats", default=",".join(FORMATS), help="formats to tune and time (comma list)")
    p.add_argument("--shapes", default=None,
                   help="NxK list to tune (default the benchmark shapes; Llama-3-8B's k/v projection is 1024x4096)")
    p.add_argument("--providers", default=None, help="comma list of provider names (exact, e.g. inductor without "
                   "inductor-max-autotune) or name prefixes (gemlite: both formats)")
    p.add_argument("--budget", type=float, default=380, help="seconds before stages stop")
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / "dequant_matmul_log.txt", "a")

    def log(msg):
        logf.write(msg + "\n")
        logf.flush()
        print(msg, flush=True)

    torch.manual_seed(0)
    bw = copy_bandwidth("cuda")
    head = (f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
            f"commit {commit()}  copy {bw:.0f} GB/s")
    log(head)
    ms = [int(m) for m in args.ms.split(",")] if args.ms else (QUICK_MS if args.quick else MS)
    summary = [head]
    if args.check:
        t0 = time.time()
        fails = check_paths(log)
        summary.append(f"checks: {fails} failing ({time.time() - t0:.0f} s)")
    if args.tune:
        t0 = time.time()
        shapes = ([tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")] if args.shapes
                  else SHAPES)
        table = tune_all(ms, log, t_start + args.budget * 0.75, args.formats.split(","), shapes)
        # the shipped file for this GPU: fusepass/kernels/dequant_matmul/plans/<gpu>.json (merge it there)
        shipped = out_dir / plans.shipped_path(torch.cuda.get_device_name()).name
        shipped.write_text(json.dumps({"plans": table}, indent=0, sort_keys=True))
        summary.append(f"tuned {len(table)} keys ({time.time() - t0:.0f} s)")
    rows = []
    if args.time:
        formats = args.formats.split(",")
        selected = [c for c in cases(args.quick, grid=True) if int(c.notes["M"]) in ms and c.notes["fmt"] in formats]
        selected.sort(key=lambda c: ms.index(int(c.notes["M"])))  # the first M given first: a deadline cuts the last
        if args.providers:
            prefixes = args.providers.split(",")
            for c in selected:
                names = set(c.providers)
                c.providers = {k: v for k, v in c.providers.items()
                               if any(k == pr if pr in names else k.startswith(pr) for pr in prefixes)}
        rows = time_cases(selected, log, args.rep, t_start + args.budget)
        (out_dir / "dequant_matmul_rows.json").write_text(json.dumps(rows, indent=1))
    summary.append(f"total {time.time() - t_start:.0f} s")
    if rows:
        summary.append(pivot(rows, bw))
    log("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
