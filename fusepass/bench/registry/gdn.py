"""Gated DeltaNet: chunked prefill and one-token decode, bf16, the shapes of issue 8.

Providers: transformers' pure-torch loops (``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule``, called directly so that the hub wrapper
does not route them to FLA) eagerly and under Inductor, FLA 0.6
(``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``) where it
is installed, and the fusepass ops.  q, k and v are [B, T, H, D] views of one
fused projection, as the models produce them; the initial state is fp32.

    fusepass bench --ops gdn                            # the registry run (the SUITE shapes below)
    python -m fusepass.bench.registry.gdn --inductor B8-T512-H32-D128,decode  # check, time, sweep; Inductor where named
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from fusepass.bench.registry.common import Case, compiled, nbytes
from fusepass.kernels import gdn  # registers fusepass::gdn_chunk / gdn_recurrent

# (id, B, T, H_k, H_v, d_k, d_v)
PREFILL = [
    ("B1-T4096-H16-D128", 1, 4096, 16, 16, 128, 128),
    ("B8-T512-H32-D128", 8, 512, 32, 32, 128, 128),
    ("B1-T16384-H32-D128", 1, 16384, 32, 32, 128, 128),
    ("B4-T4096-Hk16-Hv32-D128", 4, 4096, 16, 32, 128, 128),
    ("B1-T4096-H30-dk96-dv192", 1, 4096, 30, 30, 96, 192),
]
DECODE = [
    ("decode-B1-H32-D128", 1, 1, 32, 32, 128, 128),
    ("decode-B64-H32-D128", 64, 1, 32, 32, 128, 128),
]
QUICK = {"B8-T512-H32-D128", "decode-B64-H32-D128"}
# The registry suite (`fusepass bench`) has to fit ten minutes of one GPU with
# the other entries.  On the H100 (commit 1e572c0) its first calls were the
# cost: Inductor's compile of HF's chunk loop, unrolled, 85 s at B1-T4096-H16
# (64 chunks; 37 s at B8-T512, 8 chunks), and FLA's autotuning, 60-65 s for
# every new head count and head dims (H16, then H32: it keys on H, HV, K, V).
# So the suite keeps one head configuration (H32 D128, Qwen3.5-9B's value
# heads) at a batched and a long prompt and the two decode sizes, with
# Inductor on the batched prompt and on decode B1.  The script (`python -m
# fusepass.bench.registry.gdn`) times every shape.
SUITE = {"B8-T512-H32-D128", "B1-T16384-H32-D128", "decode-B1-H32-D128", "decode-B64-H32-D128"}
INDUCTOR = {"B8-T512-H32-D128", "decode-B1-H32-D128"}


def _hf():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return None, None
    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731
    return unwrap(m.torch_chunk_gated_delta_rule), unwrap(m.torch_recurrent_gated_delta_rule)


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None, None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def make_inputs(B, T, Hk, Hv, dk, dv, device="cuda", state=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16
    mixed = torch.randn(B, T, 2 * Hk * dk + Hv * dv, device=device, generator=gen).to(dt)
    q, k, v = torch.split(mixed, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k, v = q.view(B, T, Hk, dk), k.view(B, T, Hk, dk), v.view(B, T, Hv, dv)
    g = F.logsigmoid(torch.randn(B, T, Hv, device=device, generator=gen) + 3)  # fp32, as the models
    beta = torch.randn(B, T, Hv, device=device, generator=gen).sigmoid().to(dt)
    s0 = torch.randn(B, Hv, dk, dv, device=device, generator=gen) * 0.1 if state else None
    return q, k, v, g, beta, s0


def providers(decode: bool, inductor: bool = True) -> dict:
    hf_chunk, hf_rec = _hf()
    fla_chunk, fla_rec = _fla()
    out = {}
    hf = hf_rec if decode else hf_chunk
    if hf is not None:
        def hf_call(q, k, v, g, beta, s0, fn=hf):
            return fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        out["hf-eager"] = hf_call
        if inductor:
            out["hf-inductor"] = compiled(hf_call)
    fla = fla_rec if decode else fla_chunk
    if fla is not None:
        def fla_call(q, k, v, g, beta, s0, fn=fla):
            return fn(q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=s0,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        out["fla"] = fla_call
    op = torch.ops.fusepass.gdn_recurrent if decode else torch.ops.fusepass.gdn_chunk
    out["fusepass"] = lambda q, k, v, g, beta, s0: op(q, k, v, g, beta, s0, True, q.shape[-1] ** -0.5)
    return out


def reference(q, k, v, g, beta, s0):
    """The token recurrence in fp64 (o, state)."""
    return gdn.gdn_reference(q, k, v, g, beta, s0, True, q.shape[-1] ** -0.5, compute_dtype=torch.float64)


def _case(spec, device, inductor=True) -> Case:
    name, B, T, Hk, Hv, dk, dv = spec
    decode = name.startswith("decode")
    meta = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    moved = nbytes(meta(B, T, 2 * Hk * dk + Hv * dv), meta(B, T, Hv, dv))  # q, k, v read; o written
    notes = {}
    if decode:
        state_bytes = 2 * nbytes(meta(B, Hv, dk, dv, dt=torch.float32))  # read and written once
        moved += state_bytes
        notes["state_bytes"] = str(state_bytes)
    return Case(
        op="gdn", shape=name, dtype=torch.bfloat16,
        make_inputs=lambda: make_inputs(B, T, Hk, Hv, dk, dv, device, state=decode),
        reference=reference, providers=providers(decode, inductor), bytes_moved=moved, notes=notes,
    )


# The CPU's --quick run (CI): HF's chunk loop compiled by Inductor at B8
# T512 took minutes on 2 CPU cores; two chunks and a decode step check every
# provider's path.
CPU_QUICK = [("B1-T130-H2-D32", 1, 130, 2, 2, 32, 32), ("decode-B2-H2-D32", 2, 1, 2, 2, 32, 32)]


def cases(quick: bool = False, device: str = "cuda", grid: bool = False) -> list[Case]:
    """The registry's cases (SUITE, or QUICK), or with ``grid`` every shape (the script)."""
    if quick and device == "cpu":
        return [_case(s, device) for s in CPU_QUICK]
    wanted = QUICK if quick else None if grid else SUITE
    return [_case(s, device, inductor=quick or s[0] in INDUCTOR)
            for s in PREFILL + DECODE if wanted is None or s[0] in wanted]


# -- the script: checks, timings, a sweep of the state pass's launch choices ----------------------

def _rel(out, ref) -> float:
    worst = 0.0
    for o, r in zip(out, ref):
        if o is None:
            continue
        o, r = o.double(), r.double()
        if not torch.isfinite(o).all():
            return float("inf")
        worst = max(worst, ((o - r).norm() / r.norm()).item())
    return worst


def _time(fn, args, graph=True):
    import triton.testing

    ms = triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=100, return_mode="median")
    gms = None
    if graph:
        try:
            gms = triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=100, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a provider that cannot be captured is reported
            print(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:80]})")
    return ms * 1e3, None if gms is None else gms * 1e3


def _breakdown(fn, args, reps: int = 5) -> str:
    """GPU time per kernel of one call (torch.profiler), longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(*args)
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.key and not evt.key.startswith(("ProfilerStep", "cuda")):
            times[evt.key] = t / reps
    top = sorted(times.items(), key=lambda kv: -kv[1])[:8]
    return ", ".join(f"{k[:40]} {v:.0f}" for k, v in top)


# -- the chunk kernel's launch choices against FLA, two input layouts ----------------------------

# The shapes of the chunk kernel's acceptance table (B, T, H_k, H_v, d_k, d_v).
ISSUE_SHAPES = [
    ("B1-T8192-H32-D128", 1, 8192, 32, 32, 128, 128),
    ("B1-T16384-H32-D128", 1, 16384, 32, 32, 128, 128),
    ("B2-T3000-H32-D128", 2, 3000, 32, 32, 128, 128),
    ("B16-T1024-H32-D128", 16, 1024, 32, 32, 128, 128),
    ("B8-T512-H32-D128", 8, 512, 32, 32, 128, 128),
    ("B4-T4096-Hk16-Hv32-D128", 4, 4096, 16, 32, 128, 128),
    ("B1-T4096-H16-D64", 1, 4096, 16, 16, 64, 64),
    ("B1-T32768-H16-D128", 1, 32768, 16, 16, 128, 128),
    ("B2-T8192-H64-D128", 2, 8192, 64, 64, 128, 128),
    ("B1-T4096-H16-D256", 1, 4096, 16, 16, 256, 256),
    ("B1-T4096-H30-dk96-dv192", 1, 4096, 30, 30, 96, 192),
]
# "strided-l2": q, k, v views of one projection, the L2 norm in the kernel (a
# model's call); "contig-norm": contiguous q, k, v already normalised (the
# layout FLA is fastest on: it copies strided inputs and runs its norm as
# separate launches).
LAYOUTS = ("strided-l2", "contig-norm")
# Launch choices of gdn_chunk_fwd: each named set against the default.
VARIANTS = {
    "split": dict(fuse_output=False),
    "fused": dict(fuse_output=True),
    "fused-tiles": dict(fuse_output=True, scan_row_factors=False),
    "split-tiles": dict(fuse_output=False, output_row_factors=False),
    "split-s1": dict(fuse_output=False, num_stages=1),
    "split-inverse-fp32": dict(fuse_output=False, inverse_fp32=True),
    "fused-bv128": dict(fuse_output=True, block_v=128),
}


def layout_inputs(B, T, Hk, Hv, dk, dv, layout, device="cuda", seed=0):
    """The issue's inputs: q, k, v bf16 (strided views, or contiguous and
    normalised), g fp32, beta bf16, an fp32 initial state."""
    q, k, v, g, beta, s0 = make_inputs(B, T, Hk, Hv, dk, dv, device=device, state=True, seed=seed)
    l2 = layout == "strided-l2"
    if not l2:
        q, k = (F.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))
        v = v.contiguous()
    return (q, k, v, g, beta, s0), l2


def variants_main(args) -> int:
    import triton
    from tabulate import tabulate

    cpu = args.cpu_smoke
    device = "cpu" if cpu else "cuda"
    specs = [("B1-T130-Hk1-Hv2-D32", 1, 130, 1, 2, 32, 32), ("B2-T64-H2-dk16-dv24", 2, 64, 2, 2, 16, 24)] if cpu \
        else [s for s in ISSUE_SHAPES if args.shapes == "all" or s[0] in args.shapes.split(",")]
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    sweep_at = set(args.sweep_shapes.split(",")) if args.sweep_shapes else {s[0] for s in specs}
    fla_chunk = _fla()[0]
    sha = os.environ.get("FUSEPASS_COMMIT") or "?"
    gpu = torch.cuda.get_device_name() if not cpu else "cpu"
    env = f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  commit {sha}"
    print(f"# {env}", flush=True)
    rows, records = [], []

    def timed(fn, inputs):
        if cpu:
            fn(*inputs)
            return float("nan")
        import triton.testing
        return triton.testing.do_bench_cudagraph(lambda: fn(*inputs), rep=args.rep, return_mode="median") * 1e3

    for name, B, T, Hk, Hv, dk, dv in specs:
        for layout in args.layouts.split(","):
            inputs, l2 = layout_inputs(B, T, Hk, Hv, dk, dv, layout, device)
            scale = dk ** -0.5
            t0 = time.time()
            ref = gdn.gdn_chunk_torch(*(None if x is None else x.double() for x in inputs), l2, scale)
            print(f"{name} {layout}: fp64 reference {time.time() - t0:.1f} s", flush=True)
            contenders = {}
            if fla_chunk is not None:
                contenders["fla"] = lambda q, k, v, g, b, s0: fla_chunk(
                    q, k, v, g=g, beta=b, scale=scale, initial_state=s0, output_final_state=True,
                    use_qk_l2norm_in_kernel=l2)
            contenders["fusepass"] = lambda q, k, v, g, b, s0: torch.ops.fusepass.gdn_chunk(
                q, k, v, g, b, s0, l2, scale)
            if name in sweep_at and (layout == "strided-l2" or args.sweep_all_layouts):
                for vname in names:
                    contenders[vname] = lambda q, k, v, g, b, s0, c=VARIANTS[vname]: gdn.gdn_chunk_fwd(
                        q, k, v, g, b, s0, l2, scale, **c)
            times = {}
            for cname, fn in contenders.items():
                t0 = time.time()
                try:
                    out = fn(*inputs)
                    err = _rel(out, ref)
                    ms = timed(fn, inputs)
                except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
                    print(f"  {cname}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    rows.append([name, layout, cname, "-", "-", f"error {type(exc).__name__}"])
                    continue
                times[cname] = ms
                ratio = ms / times["fla"] if "fla" in times and cname != "fla" else float("nan")
                print(f"  {cname:22s} {ms:8.1f} µs  x{ratio:.3f} FLA  err {err:.2e}  ({time.time() - t0:.1f} s)",
                      flush=True)
                rows.append([name, layout, cname, f"{ms:.1f}", f"{ratio:.3f}", f"{err:.2e}"])
                records.append(dict(shape=name, layout=layout, provider=cname, us=ms, vs_fla=ratio, rel_err=err))
            if args.breakdown_at and not cpu and name in args.breakdown_at.split(","):
                for cname in ("fla", "fusepass", "split", "fused"):
                    if cname in contenders:
                        print(f"    {cname} kernels (µs): {_breakdown(contenders[cname], inputs)}", flush=True)
            del inputs, ref
            if not cpu:
                torch.cuda.empty_cache()
    text = f"# {env}\n" + tabulate(rows, headers=["shape", "layout", "provider", "graph µs", "/ FLA",
                                                   "rel err vs fp64"]) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gdn_variants.txt").write_text(text)
    (Path(args.out) / "gdn_variants.json").write_text(json.dumps({"env": env, "rows": records}))
    print(text)
    return 0


def main(argv=None) -> int:
    import triton
    from tabulate import tabulate

    from fusepass.bench.timing import commit, copy_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("--inductor", default="all", help="comma-separated case ids (or 'decode') to compile with Inductor")
    p.add_argument("--eager", default="all", help="case ids timed with the eager HF loop")
    p.add_argument("--shapes", default="all")
    p.add_argument("--sweep", default="", help="case ids (or 'all', 'decode') to sweep launch choices at")
    p.add_argument("--breakdown", action="store_true", help="GPU time per kernel (torch.profiler)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--variants", default="", help="'all' or names of VARIANTS: the chunk kernel's launch "
                   "choices against FLA on ISSUE_SHAPES (--shapes, --layouts, --sweep-shapes)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--sweep-shapes", default="", help="shapes at which the variants run (default: all)")
    p.add_argument("--breakdown-at", default="", help="shapes at which --variants profiles each kernel")
    p.add_argument("--sweep-all-layouts", action="store_true")
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph's rep (ms)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the interpreter (with --variants)")
    args = p.parse_args(argv)
    if args.variants:
        return variants_main(args)
    sel = lambda spec, opt: opt == "all" or spec[0] in opt.split(",") or (  # noqa: E731
        "decode" in opt.split(",") and spec[0].startswith("decode"))

    torch.manual_seed(0)
    bw = copy_bandwidth("cuda")
    sha = os.environ.get("FUSEPASS_COMMIT") or commit()
    env = f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  commit {sha}"
    print(f"# {env}\n# copy bandwidth {bw:.0f} GB/s", flush=True)
    rows, sweep_rows = [], []
    for spec in PREFILL + DECODE:
        if not sel(spec, args.shapes):
            continue
        case = _case(spec, "cuda", inductor=sel(spec, args.inductor))
        if not sel(spec, args.eager):
            case.providers.pop("hf-eager", None)
        inputs = case.make_inputs()
        t0 = time.time()
        ref = case.reference(*inputs)
        print(f"{case.shape}: reference {time.time() - t0:.1f} s", flush=True)
        floor = None
        if "state_bytes" in case.notes:
            floor = int(case.notes["state_bytes"]) / bw / 1e3  # µs
        for name, fn in case.providers.items():
            t0 = time.time()
            try:
                out = fn(*inputs)
                torch.cuda.synchronize()
                err = _rel(out, ref)
                first = time.time() - t0
                med, graph = _time(fn, inputs)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                rows.append([case.shape, name, "-", "-", "-", f"error {type(exc).__name__}"])
                continue
            print(f"  {name}: err {err:.2e} median {med:.1f} µs graph {graph} first call {first:.1f} s", flush=True)
            if args.breakdown and name in ("fla", "fusepass"):
                try:
                    print(f"    kernels (µs): {_breakdown(fn, inputs)}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"    no breakdown: {type(exc).__name__}: {str(exc)[:100]}")
            rows.append([case.shape, name, f"{med:.1f}", "-" if graph is None else f"{graph:.1f}",
                         "-" if floor is None or graph is None else f"{graph / floor:.2f}", f"{err:.2e}"])
        if floor is not None:
            rows.append([case.shape, "floor: state r+w at copy bw", "-", f"{floor:.1f}", "1.00", "-"])
        if args.sweep and sel(spec, args.sweep):
            decode = spec[0].startswith("decode")
            if decode:
                configs = [dict(block_v=bv, num_warps=nw) for bv in (32, 64, 128) for nw in (4, 8)]
                launch = gdn.gdn_recurrent_fwd
            else:
                configs = [dict(inverse_fp32=True), dict(block_v=64), dict(num_stages=4)]
                launch = gdn.gdn_chunk_fwd
            for cfg in configs:
                fn = lambda q, k, v, g, b, s0, cfg=cfg: launch(q, k, v, g, b, s0, True, q.shape[-1] ** -0.5, **cfg)
                try:
                    err = _rel(fn(*inputs), ref)
                    med, graph = _time(fn, inputs)
                except Exception as exc:  # noqa: BLE001
                    sweep_rows.append([case.shape, str(cfg), "-", "-", f"error {type(exc).__name__}: {str(exc)[:60]}"])
                    continue
                sweep_rows.append([case.shape, str(cfg), f"{med:.1f}", f"{graph:.1f}", f"{err:.2e}"])
                print("  sweep", *sweep_rows[-1][1:], flush=True)
        del inputs, ref
        torch.cuda.empty_cache()

    headers = ["shape", "provider", "median µs (launches)", "graph µs", "graph / floor", "rel err vs fp64"]
    text = f"# {env}\n# copy bandwidth {bw:.0f} GB/s\n"
    if sweep_rows:
        text += tabulate(sweep_rows, headers=["shape", "config", "median µs", "graph µs", "rel err"]) + "\n\n"
    text += tabulate(rows, headers=headers) + "\n"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gdn_bench.txt").write_text(text)
    (Path(args.out) / "gdn_bench.json").write_text(json.dumps({"env": env, "rows": rows, "sweep": sweep_rows}))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
