"""The ``fusepass`` command.

    fusepass demo [--model llama] [--dtype float32] [--device cpu|cuda] [--quantize int8|int4|fp8] [--json report.json]
    fusepass rules

``demo`` builds a small random-weight ``transformers`` model, compiles it with
the fusepass backend, prints the rewrite report, and checks the logits
against eager within the dtype table (exit status 1 if they differ).  On a
machine without a GPU it runs the ops' CPU paths.
"""

from __future__ import annotations

import argparse
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
    fused = report.count("rms_norm") + report.count("add_rms_norm")
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


def main(argv: list[str] | None = None) -> int:
    from fusepass.models import MODELS

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
    args = parser.parse_args(argv)
    if getattr(args, "dtype", "x") is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() and args.device != "cpu" else "float32"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
