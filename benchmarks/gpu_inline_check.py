"""fusepass against Inductor on the demo models, default mode and CUDA graphs.

    python benchmarks/gpu_inline_check.py --out DIR [--models llama,qwen3_5] [--quantize int8,int4]
    python benchmarks/gpu_inline_check.py --cpu-smoke --out DIR      (tiny model, CPU, interpreter: runs the script)

For each demo model (``fusepass demo``'s random-weight ``small`` models,
bf16, linear layers quantized by ``fusepass.quantize``) and each shape (a
2x16-token prefill, a 2x1-token step without cache), the model is compiled
with ``backend="inductor"`` and ``backend="fusepass"``, in default mode and
with ``mode="reduce-overhead"`` (CUDA graphs), every compile with
``dynamic=False``.  Each compiled forward's logits are checked against eager
(within the dtype table, or within twice Inductor's own drift for bf16, as
``fusepass demo`` does).  Then the forwards are timed back to back (20 calls
between two events, median of rounds that alternate the contenders, host
time included: default mode pays each launch on the host) and the table
gives Inductor's time over fusepass's (>= 1.0: fusepass as fast or faster).

For each fusepass graph the post-pass graph is dumped and counted: fusepass
kernels launched from Inductor's code (inlined) against ``fusepass::`` op
calls left to the dispatcher, with any note of a compile that fell back to
``inline_kernels=False``.

Prints one line per result as it comes, then the table; writes
``results.json`` and ``table.txt`` under ``--out``.  ``--budget`` seconds
(default 540) stops starting new models; the rest are listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import fusepass  # noqa: E402
from fusepass import models  # noqa: E402
from fusepass.kernels._common import tolerance  # noqa: E402

MODES = (None, "reduce-overhead")
BACKENDS = ("inductor", "fusepass")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_calls(fn, calls: int) -> float:
    """ms per call over ``calls`` back-to-back calls (GPU events on CUDA, else the host clock)."""
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def _profile_kernels(fn, calls: int) -> list[dict]:
    """GPU kernels of ``calls`` back-to-back calls under torch.profiler: per kernel name, launches and µs per
    call, longest first (what a forward spends where; CUDA-graph replays are listed kernel by kernel)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    rows = [{"name": e.key, "per_call": e.count / calls, "us_per_call": e.self_device_time_total / calls}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def _count_graph_ops(folder: str) -> dict:
    """Inlined fusepass kernel launches and dispatcher ``fusepass::`` calls in the dumped post-pass graphs."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    inlined: dict[str, int] = {}
    dispatched: dict[str, int] = {}
    graphs = 0
    for path in sorted(Path(folder).glob("*.after.txt")):
        graphs += 1
        text = path.read_text()
        for op in re.findall(r"target=torch\.ops\.fusepass\.(\w+)\.", text):
            dispatched[op] = dispatched.get(op, 0) + 1
        for idx in re.findall(r"triton_kernel_wrapper_functional\]\(args = \(\), kwargs = \{kernel_idx: (\d+)", text):
            kernel = kernel_side_table.get_kernel(int(idx))
            fn = getattr(kernel, "fn", kernel)
            if not getattr(fn, "__module__", "").startswith("fusepass"):
                continue
            name = getattr(fn, "__name__", str(fn))
            inlined[name] = inlined.get(name, 0) + 1
    return {"graphs": graphs, "inlined_launches": inlined, "dispatcher_calls": dispatched}


def run_model(name: str, quant: str, args, log) -> list[dict]:
    device = "cpu" if args.cpu_smoke else "cuda"
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    model = models.build(name, dtype=dtype, device=device, size=args.size).eval()
    fusepass.quantize(model, quant, group_size=args.group_size)
    shapes = {"prefill": models.input_ids(model, batch=args.batch, seq=args.seq).to(device),
              "step": models.input_ids(model, batch=args.batch, seq=1, seed=2).to(device)}
    rows = []
    with torch.no_grad():
        expected = {s: model(ids, use_cache=False).logits.float() for s, ids in shapes.items()}
        modes = [None if m == "default" else m for m in args.modes.split(",")]
        for mode in (modes if not args.cpu_smoke else (None,)):
            contenders = {}
            for backend in BACKENDS:
                torch._dynamo.reset()
                fusepass.reset_reports()
                dump = tempfile.mkdtemp(prefix=f"{name}-{quant}-{backend}-")
                # torch.compile takes a mode or options, not both: fusepass's come from the environment.
                os.environ["FUSEPASS_DUMP_GRAPHS"] = dump
                fn = torch.compile(model, backend=backend, mode=mode, dynamic=False)
                t0 = time.perf_counter()
                errs = {}
                for s, ids in shapes.items():
                    for _ in range(3):  # compile, then CUDA graphs' warm-up and record
                        out = fn(ids, use_cache=False).logits.float()
                    errs[s] = (out - expected[s]).abs().max().item()
                compile_s = time.perf_counter() - t0
                info = {"compile_s": round(compile_s, 1), "max_abs_err": errs}
                if backend == "fusepass":
                    info.update(_count_graph_ops(dump))
                    report = fusepass.last_report()
                    info["notes"] = [n for g in getattr(report, "graphs", []) for n in getattr(g, "notes", [])
                                     if "inline" in n or "dispatcher" in n]
                    info["hits"] = len([h for g in getattr(report, "graphs", []) for h in g.hits])
                contenders[backend] = (fn, info)
                log(f"{name} {quant} {mode or 'default'} {backend}: compiled+warm {compile_s:.1f} s, "
                    f"max |logits - eager| {errs}" + (f", inlined {info.get('inlined_launches')}, dispatcher "
                                                     f"{info.get('dispatcher_calls')} {info.get('notes') or ''}"
                                                     if backend == "fusepass" else ""))
            tol = tolerance(dtype)
            for s, ids in shapes.items():
                times: dict[str, list[float]] = {b: [] for b in BACKENDS}
                for _ in range(args.rounds):  # paired: each round times every contender in turn
                    for backend, (fn, _) in contenders.items():
                        times[backend].append(_time_calls(lambda fn=fn, ids=ids: fn(ids, use_cache=False),
                                                          args.calls))
                med = {b: statistics.median(v) for b, v in times.items()}
                ind_err = contenders["inductor"][1]["max_abs_err"][s]
                fp_err = contenders["fusepass"][1]["max_abs_err"][s]
                ok = fp_err <= max(tol.atol + tol.rtol * expected[s].abs().max().item(), 2 * ind_err)
                fp = contenders["fusepass"][1]
                row = {"model": name, "quant": quant, "mode": mode or "default", "shape": s,
                       "tokens": f"{ids.shape[0]}x{ids.shape[1]}", "inductor_ms": round(med["inductor"], 4),
                       "fusepass_ms": round(med["fusepass"], 4),
                       "inductor_over_fusepass": round(med["inductor"] / med["fusepass"], 3),
                       "err_fusepass": fp_err, "err_inductor": ind_err, "logits_ok": ok,
                       "inlined": sum(fp.get("inlined_launches", {}).values()),
                       "dispatcher": sum(fp.get("dispatcher_calls", {}).values()),
                       "compile_s": {b: c[1]["compile_s"] for b, c in contenders.items()},
                       "detail": fp}
                rows.append(row)
                log(f"  {s} {row['tokens']}: inductor {med['inductor']:.3f} ms, fusepass {med['fusepass']:.3f} ms, "
                    f"ratio {row['inductor_over_fusepass']:.2f}, logits {'OK' if ok else 'MISMATCH'}")
                if args.profile and torch.cuda.is_available():
                    for backend, (fn, _) in contenders.items():
                        kernels = _profile_kernels(lambda fn=fn, ids=ids: fn(ids, use_cache=False), args.calls)
                        row.setdefault("kernels", {})[backend] = kernels
                        log(f"  {s} {backend}: {len(kernels)} kernel names, "
                            f"{sum(k['per_call'] for k in kernels):.0f} launches and "
                            f"{sum(k['us_per_call'] for k in kernels):.1f} µs of kernel time per forward")
                        for k in kernels[:args.profile]:
                            log(f"    {k['us_per_call']:7.2f} µs  x{k['per_call']:<4g} {k['name'][:110]}")
            del contenders
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-inline-out")
    p.add_argument("--models", default="llama,qwen3_5")
    p.add_argument("--quantize", default="int8,int4")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--size", default=None, help="model size (default: small; tiny with --cpu-smoke)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--budget", type=float, default=540, help="seconds after which no new model starts")
    p.add_argument("--modes", default="default,reduce-overhead", help="default and/or reduce-overhead")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="also list each contender's GPU kernels per forward (torch.profiler), the K longest in the log")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (interpreter): the script runs")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.size = args.size or "tiny"
        args.rounds, args.calls = min(args.rounds, 2), min(args.calls, 2)
        args.seq = min(args.seq, 4)
    else:
        args.size = args.size or "small"
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --cpu-smoke)")
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    log(f"{env}")
    rows, skipped = [], []
    for name in args.models.split(","):
        for quant in args.quantize.split(","):
            if time.perf_counter() - t_start > args.budget:
                skipped.append(f"{name} {quant}")
                continue
            try:
                rows += run_model(name, quant, args, log)
            except Exception as exc:  # noqa: BLE001 - one model's failure is a result, not the end
                log(f"{name} {quant}: FAILED {type(exc).__name__}: {exc}")
                rows.append({"model": name, "quant": quant, "error": f"{type(exc).__name__}: {exc}"})
    from tabulate import tabulate

    table = tabulate([[r["model"], r["quant"], r.get("mode", ""), r.get("tokens", ""), r.get("inductor_ms", ""),
                       r.get("fusepass_ms", ""), r.get("inductor_over_fusepass", r.get("error", "")),
                       r.get("inlined", ""), r.get("dispatcher", ""),
                       "" if "logits_ok" not in r else ("OK" if r["logits_ok"] else "MISMATCH")] for r in rows],
                     headers=["model", "quant", "mode", "tokens", "inductor ms", "fusepass ms", "inductor/fusepass",
                              "inlined launches", "dispatcher calls", "logits"], floatfmt=".3f")
    text = f"{env}\n{table}\n" + (f"skipped (budget): {', '.join(skipped)}\n" if skipped else "")
    (out / "table.txt").write_text(text)
    (out / "results.json").write_text(json.dumps({"env": env, "rows": rows, "skipped": skipped}, indent=1,
                                                 default=str))
    print("\n" + text)
    bad = [r for r in rows if "error" in r or not r.get("logits_ok", True)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
