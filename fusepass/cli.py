"""The ``fusepass`` command.

    fusepass demo [--model llama] [--dtype float32] [--device cpu|cuda] [--quantize int8|int4|fp8] [--json report.json]
    fusepass rules
    fusepass tune --model qwen3_5 --quantize int4 | --shapes 4096x4096 --fmt int8   (plans, on a GPU)
    fusepass bench [--ops rms_norm,swiglu] [--quick] [--out DIR]     per-op benchmarks (from a checkout)
    fusepass bench e2e [--model llama3-8b] [--layers 4] [--phases prefill,decode,replay,startup] [--out DIR]

``demo`` builds a small random-weight ``transformers`` model, compiles it with
the fusepass backend, prints the rewrite report, and checks the logits
against eager within the dtype table (exit status 1 if they differ).  On a
machine without a GPU it runs the ops' CPU paths.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _time(fn, n: int = 20) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") * 1e3
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def demo(args: argparse.Namespace) -> int:
    import fusepass
    from fusepass import models
    from fusepass.kernels._common import tolerance

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype]
    print(f"fusepass demo: {args.model} ({args.size}), {args.dtype} on {device}, torch {torch.__version__}")
    model = models.build(args.model, dtype=dtype, device=device, size=args.size)
    if args.quantize:
        # Weight-only quantization of every linear but lm_head: the dequant_matmul rules' forms.
        print(fusepass.quantize(model, args.quantize, group_size=args.group_size))
    ids = models.input_ids(model, batch=args.batch, seq=args.seq)

    fusepass.reset_reports()
    compiled = torch.compile(model, backend="fusepass", mode=args.mode)
    with torch.no_grad():
        expected = model(ids).logits
        t0 = time.perf_counter()
        actual = compiled(ids).logits
        print(f"compiled in {time.perf_counter() - t0:.1f} s\n")
    report = fusepass.last_report()
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())

    tol = tolerance(dtype)
    err = (actual.double() - expected.double()).abs().max().item()
    ok = torch.allclose(actual, expected, atol=tol.atol, rtol=tol.rtol)
    how = f"tolerance atol {tol.atol}, rtol {tol.rtol}"
    if not ok and dtype != torch.float32:
        # Half-precision logits of a deeper model drift from eager under any
        # compiler; then fusepass must stay within twice Inductor's own drift.
        torch._dynamo.reset()
        with torch.no_grad():
            inductor_err = (torch.compile(model)(ids).logits.double() - expected.double()).abs().max().item()
        ok = err <= 2 * inductor_err
        how = f"Inductor alone differs by {inductor_err:.3g}; allowed twice that"
    print(f"\nlogits vs eager: max abs difference {err:.3g} ({how}): {'OK' if ok else 'MISMATCH'}")
    norms = models.count_norms(model)
    fused = report.count("rms_norm") + report.count("add_rms_norm") + report.count("rms_norm_gated")
    print(f"RMSNorm modules: {norms}, rewritten: {fused}")

    if device == "cuda" and args.time:
        # Every contender in this process, same inputs; reduce-overhead takes
        # the launch cost out (CUDA graphs), which is how decode is served.
        with torch.no_grad():
            rows = [["eager", "-", _time(lambda: model(ids))]]
            for mode in (None, "reduce-overhead"):
                for backend in ("inductor", "fusepass"):
                    torch._dynamo.reset()
                    fn = torch.compile(model, backend=backend, mode=mode)
                    for _ in range(3):
                        fn(ids)
                    rows.append([backend, mode or "default", _time(lambda: fn(ids))])
        from tabulate import tabulate

        print(f"\n{args.batch}x{args.seq} tokens")
        print(tabulate(rows, headers=["forward", "mode", "median µs"], floatfmt=".1f"))
    return 0 if ok else 1


def list_rules(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    import fusepass

    rows = []
    for rule in fusepass.rules():
        summary = (rule.doc or "").strip().splitlines()[0] if rule.doc else ""
        rows.append([rule.name, rule.priority, ", ".join(f.name for f in rule.forms), summary])
    print(tabulate(rows, headers=["rule", "priority", "forms", "what"]))
    return 0


def bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="check and time the ops (fusepass bench) or whole models (fusepass bench e2e)",
                       description="Per-op benchmarks over the registry in benchmarks/ (`fusepass bench ops`, "
                                   "the default) or end-to-end generation (`fusepass bench e2e`).")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    o = bsub.add_parser("ops", help="per-op benchmarks (the default)")
    o.add_argument("--ops", default=None, help="comma list of registry entries (default: all)")
    o.add_argument("--quick", action="store_true",
                   help="small shapes; on the CPU paths unless --device cuda (CI runs this)")
    o.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when present, cpu with --quick")
    o.add_argument("--out", default="bench-out", help="folder for table.txt, results.json/.csv and plots")
    o.add_argument("--providers", default=None, help="comma list: time only these providers")
    o.add_argument("--rep", type=float, default=None, help="ms per timer per provider (default 10; quick 20)")
    o.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new cases after this many seconds (the rest are listed as skipped)")
    o.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs; default 1)")
    o.add_argument("--registry", default=None, help="the benchmarks/ folder (default: the checkout's)")
    o.set_defaults(func=_bench_ops)
    pl = bsub.add_parser("plot", help="draw a run's plots from its JSON (a run made where matplotlib was missing)")
    pl.add_argument("--out", required=True, help="the run's folder (results.json and/or e2e.json)")
    pl.set_defaults(func=_bench_plot)
    from fusepass.bench import e2e

    e2e.add_arguments(bsub.add_parser("e2e", help="random-weight transformers models: prefill, generate, "
                                                   "CUDA-graph replay, cold and warm start"))


def _bench_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fusepass.bench import output

    written = output.replot(Path(args.out))
    print("wrote " + (", ".join(str(p) for p in written) or "nothing: no results.json or e2e.json there"))
    return 0 if written else 1


def _bench_ops(args: argparse.Namespace) -> int:
    from fusepass.bench import ops

    return ops.main(args)


def main(argv: list[str] | None = None) -> int:
    from fusepass.models import MODELS

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in ("ops", "e2e", "plot", "-h", "--help")):
        argv.insert(1, "ops")  # `fusepass bench --quick` means the per-op benchmarks
    parser = argparse.ArgumentParser(prog="fusepass", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compile a small model, print the report, check against eager")
    d.add_argument("--model", choices=MODELS, default="llama")
    d.add_argument("--size", choices=["tiny", "small", "medium"], default="small")
    d.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    d.add_argument("--device", default=None)
    d.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--seq", type=int, default=16)
    d.add_argument("--quantize", choices=["int8", "int4", "fp8"], default=None,
                   help="quantize the linear layers first (fusepass.quantize) to show the dequant_matmul rules")
    d.add_argument("--group-size", type=int, default=32, help="int4 group size (default 32)")
    d.add_argument("--json", default=None, help="also write the report as JSON here")
    d.add_argument("--no-time", dest="time", action="store_false", help="skip the GPU timing")
    d.set_defaults(func=demo)
    r = sub.add_parser("rules", help="list the registered rules")
    r.set_defaults(func=list_rules)
    from fusepass import tune

    tune.add_arguments(sub.add_parser("tune", help="measure the quantized linears' kernel plans on this GPU",
                                      description=tune.__doc__.split("\n\n")[0]))
    bench_parser(sub)
    args = parser.parse_args(argv)
    args.command_line = "fusepass " + shlex.join(argv)
    if getattr(args, "dtype", "x") is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() and args.device != "cpu" else "float32"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
