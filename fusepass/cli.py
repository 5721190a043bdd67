"""fusepass: a torch.compile backend that fuses LLM subgraphs into Triton kernels.

    fusepass demo [--model qwen3_5_moe] [--quantize int8]
                                                         compile a small model, print the rewrite report,
                                                         check it against eager
    fusepass rules                                       list the rewrite rules
    fusepass tune --model qwen3_5 --quantize int4        measure the quantized linears' kernel plans on this GPU
    fusepass bench [--ops rms_norm,swiglu] [--quick]     check and time each op against eager, Inductor, peers
    fusepass bench e2e [--model llama3-8b] [--phases ...] whole models: prefill, decode, start-up

Each command's --help lists its options.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import time

import torch

from fusepass.formats import FORMATS, GROUP_SIZES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- fusepass demo -------------------------------------------------------------------

_DEMO_HELP = """\
Build a small random-weight transformers model (no download), optionally
quantize its linears with fusepass.quantize, compile it with the fusepass
backend, print the rewrite report, and check its logits against an fp32 copy
of the model run eagerly; then the same for one decode step over a static
cache (its own graph; --no-decode skips it).  Exit status 1 on a mismatch.
On a GPU it then times eager against fusepass (--compare-inductor adds
Inductor, one more compile); on a CPU the ops run their plain-torch
implementations, so nothing is timed there."""


def _time(fn, n: int = 20) -> float:
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") * 1e3
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    a, r = actual.double(), reference.double()
    return ((a - r).norm() / r.norm().clamp_min(1e-30)).item()


def demo(args: argparse.Namespace) -> int:
    import fusepass
    from fusepass import models
    from fusepass.bench.output import Progress
    from fusepass.kernels._common import tolerance

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype]
    timing = device == "cuda" and args.time
    print(f"fusepass demo: {args.model} ({args.size}), {args.dtype} on {device}, torch {torch.__version__}")
    steps = Progress(5 + args.decode + timing * (2 + args.compare_inductor), "fusepass demo")
    steps.step("building the model")
    model = models.build(args.model, dtype=dtype, device=device, size=args.size)
    if args.quantize:
        # Weight-only quantization of every linear but lm_head: the dequant_matmul rules' forms.
        steps.note(str(fusepass.quantize(model, args.quantize, group_size=args.group_size)))
    ids = models.input_ids(model, batch=args.batch, seq=args.seq)

    steps.step("running it eagerly, and an fp32 copy (the reference)")
    with torch.no_grad():
        eager = model(ids).logits
        fp32 = copy.deepcopy(model).float() if dtype != torch.float32 else model
        reference = fp32(ids).logits if dtype != torch.float32 else eager

    steps.step("compiling with fusepass (the first call)")
    fusepass.reset_reports()
    compiled = torch.compile(model, backend="fusepass", mode=args.mode)
    with torch.no_grad():
        t0 = time.perf_counter()
        actual = compiled(ids).logits
        compile_s = time.perf_counter() - t0

    steps.step("checking the logits")
    report = fusepass.last_report()
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json())
    # Half-precision logits of a whole model differ from any reference by the
    # roundings of every layer: fusepass must stay within the dtype's
    # tolerance or twice eager's own distance from the fp32 copy.
    err, eager_err = _rel_err(actual, reference), _rel_err(eager, reference)
    limit = max(tolerance(dtype).rtol, 2 * eager_err)
    ok = err <= limit

    decode = None
    if args.decode:
        steps.step("compiling a decode step over a static cache (one more graph)")
        decode = _decode_step(model, fp32, compiled, ids)
        ok = ok and decode[2] <= max(tolerance(dtype).rtol, 2 * decode[3])

    rows = []
    if timing:
        # Same inputs, one process.  Default mode unless --mode: with
        # reduce-overhead both run from CUDA graphs, as decode is served.
        with torch.no_grad():
            steps.step("timing eager")
            rows.append(["eager", "-", _time(lambda: model(ids))])
            steps.step("timing fusepass")
            rows.append(["fusepass", args.mode or "default", _time(lambda: compiled(ids))])
            if args.compare_inductor:
                steps.step("compiling and timing Inductor")
                inductor = torch.compile(model, mode=args.mode)
                for _ in range(3):
                    inductor(ids)
                rows.insert(1, ["inductor", args.mode or "default", _time(lambda: inductor(ids))])
    steps.step("done")
    steps.close()

    print(f"compiled in {compile_s:.1f} s\n")
    print(report)
    print(f"\nlogits vs an fp32 copy of the model: relative error {err:.2e} (eager {args.dtype} {eager_err:.2e}; "
          f"allowed {limit:.1e}): {'OK' if ok else 'MISMATCH'}")
    norms = models.count_norms(model)
    fused = report.count("rms_norm") + report.count("add_rms_norm") + report.count("rms_norm_gated")
    from fusepass.patterns.rms_norm import HEAD_NORM

    heads = sum(r.startswith(HEAD_NORM) for r in report.reasons("rms_norm"))
    print(f"RMSNorm modules: {norms}, rewritten: {fused}" + (f", left to Inductor (attention heads): {heads}"
                                                           if heads else ""))
    if decode is not None:
        report_d, step_s, err_d, eager_d = decode
        limit_d = max(tolerance(dtype).rtol, 2 * eager_d)
        print(f"\nthe next token, one decode step over a static cache (its own graph, compiled in {step_s:.1f} s):\n")
        print(report_d)
        print(f"\ndecode logits vs the fp32 copy: relative error {err_d:.2e} (eager {args.dtype} {eager_d:.2e}; "
              f"allowed {limit_d:.1e}): {'OK' if err_d <= limit_d else 'MISMATCH'}")
    if rows:
        from tabulate import tabulate

        print(f"\n{args.batch}x{args.seq} tokens, one forward")
        print(tabulate(rows, headers=["forward", "mode", "median µs"], floatfmt=".1f"))
    elif device == "cpu":
        print("\n(CPU: the ops ran their plain-torch implementations, the test path; timings are for a GPU)")
    return 0 if ok else 1


def _decode_step(model, fp32, compiled, ids):
    """(report, compile s, error, eager's error) of the token after ``ids``: each model's own static cache
    filled by its own eager prefill, then one step, the compiled model's against the fp32 copy's."""
    import fusepass
    from transformers import StaticCache

    pos = torch.tensor([ids.shape[1]], device=ids.device)
    step = dict(input_ids=ids[:, -1:].flip(0), cache_position=pos, position_ids=pos.expand(ids.shape[0], 1),
                use_cache=True)
    out = {}
    with torch.no_grad():
        for name, m, fn in (("eager", model, model), ("fp32", fp32, fp32), ("fusepass", model, compiled)):
            cache = StaticCache(config=m.config, max_cache_len=ids.shape[1] + 8)
            m(input_ids=ids, past_key_values=cache, use_cache=True)
            if name == "fusepass":
                fusepass.reset_reports()
                t0 = time.perf_counter()
            out[name] = fn(past_key_values=cache, **step).logits
            if name == "fusepass":
                step_s = time.perf_counter() - t0
    return fusepass.last_report(), step_s, _rel_err(out["fusepass"], out["fp32"]), _rel_err(out["eager"], out["fp32"])


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    from fusepass.models import MODELS

    d = sub.add_parser("demo", help="compile a small model, print the rewrite report, check it against eager",
                       description=_DEMO_HELP)
    d.add_argument("--model", choices=MODELS, default="llama")
    d.add_argument("--size", choices=["tiny", "small", "medium"], default="small")
    d.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    d.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    d.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--seq", type=int, default=16)
    d.add_argument("--quantize", choices=FORMATS, default=None,
                   help="quantize the linear layers first (fusepass.quantize) to show the dequant_matmul rules")
    d.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32, help="int4 group size (default 32)")
    d.add_argument("--json", default=None, help="also write the report as JSON here")
    d.add_argument("--no-decode", dest="decode", action="store_false",
                   help="skip the decode step over a static cache (one more compiled graph)")
    d.add_argument("--no-time", dest="time", action="store_false", help="GPU: skip the timing")
    d.add_argument("--compare-inductor", action="store_true",
                   help="GPU: time Inductor too (one more compile of the model)")
    d.set_defaults(func=demo)


# -- fusepass rules ----------------------------------------------------------------

def list_rules(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    import fusepass

    rows = []
    for rule in fusepass.rules():
        summary = (rule.doc or "").strip().splitlines()[0] if rule.doc else ""
        rows.append([rule.name, rule.priority, ", ".join(f.name for f in rule.forms), summary])
    print(tabulate(rows, headers=["rule", "priority", "forms", "what"]))
    return 0


def _rules_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("rules", help="list the registered rewrite rules",
                       description="List every registered rule (built-in and registered by the user) with its "
                                   "priority, the source forms it matches and what it finds.")
    r.set_defaults(func=list_rules)


# -- fusepass tune -----------------------------------------------------------------

def _tune_parser(sub: argparse._SubParsersAction) -> None:
    from fusepass import tune

    tune.add_arguments(sub.add_parser("tune", help="measure the quantized linears' kernel plans on this GPU",
                                      description=tune.DESCRIPTION))


# -- fusepass bench ----------------------------------------------------------------

def bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="check and time the ops (fusepass bench) or whole models (fusepass bench e2e)",
                       description="Per-op benchmarks over the registry in fusepass.bench.registry (`fusepass bench "
                                   "ops`, the default) or whole models end to end (`fusepass bench e2e`); "
                                   "`fusepass bench plot` redraws a run's plots from its JSON.")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    o = bsub.add_parser("ops", help="per-op benchmarks (the default)",
                        description="Check every provider of every registry case (eager, Inductor, fusepass's op "
                                    "and its compiled form, installed peers) against an fp32 reference, then time "
                                    "the ones that pass in one process; writes table.txt, results.json/.csv and "
                                    "plots.  On a CPU the ops run their plain-torch implementations: a test of "
                                    "that path, not a speed claim.")
    o.add_argument("--ops", default=None, help="comma list of registry entries (default: all)")
    o.add_argument("--quick", action="store_true",
                   help="small shapes; on the CPU paths unless --device cuda (CI runs this)")
    o.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when present, cpu with --quick")
    o.add_argument("--out", default=None,
                   help="folder for table.txt, results.json/.csv and plots (default: a new folder under "
                        "<tmp>/fusepass-bench/)")
    o.add_argument("--providers", default=None, help="comma list: time only these providers")
    o.add_argument("--rep", type=float, default=None, help="ms per timer per provider (default 10; quick 20)")
    o.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new cases after this many seconds (the rest are listed as skipped)")
    o.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs; default 1)")
    o.add_argument("--registry", default=None,
                   help="a folder of registry entries to run instead of the package's own")
    o.set_defaults(func=_bench_ops)
    pl = bsub.add_parser("plot", help="draw a run's plots from its JSON (a run made where matplotlib was missing)",
                         description="Draw the plots of a finished run (fusepass bench or bench e2e) from the "
                                     "results.json / e2e.json in its folder; needs matplotlib.")
    pl.add_argument("--out", required=True, help="the run's folder (results.json and/or e2e.json)")
    pl.set_defaults(func=_bench_plot)
    from fusepass.bench import e2e

    e2e.add_arguments(bsub.add_parser(
        "e2e", help="random-weight transformers models: prefill, generate, CUDA-graph replay, cold and warm start",
        description="Random-weight transformers models from the configs of real checkpoints (nothing downloaded), "
                    "eager, Inductor and fusepass side by side in one process: prefill latency (logits checked "
                    "first), decode tokens/s through generate with CUDA graphs, the decode step replayed from one "
                    "CUDA graph, cold and warm start in fresh processes.  --quick: a tiny Llama on the CPU (the "
                    "ops' test path, not a speed claim)."))


def _bench_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fusepass.bench import output

    written = output.replot(Path(args.out))
    print("wrote " + (", ".join(str(p) for p in written) or "nothing: no results.json or e2e.json there"))
    return 0 if written else 1


def _bench_ops(args: argparse.Namespace) -> int:
    from fusepass.bench import ops, output

    args.out = args.out or output.default_out("ops")
    return ops.main(args)


# -- the command ---------------------------------------------------------------------

SUBCOMMANDS = (_demo_parser, _rules_parser, _tune_parser, bench_parser)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusepass", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from fusepass.models import quiet_imports

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in ("ops", "e2e", "plot", "-h", "--help")):
        argv.insert(1, "ops")  # `fusepass bench --quick` means the per-op benchmarks
    args = parser().parse_args(argv)
    args.command_line = "fusepass " + shlex.join(argv)
    if getattr(args, "dtype", "x") is None and args.command == "demo":
        args.dtype = "bfloat16" if torch.cuda.is_available() and args.device != "cpu" else "float32"
    with quiet_imports():  # transformers' and torchao's start-up noise (see fusepass.models)
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
