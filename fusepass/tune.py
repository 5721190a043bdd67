"""``fusepass tune``: measure the quantized linears' plans on this GPU.

    fusepass tune --model qwen3_5 --quantize int4 [--size small] [--batch 2 --seq 16] [--decode-batch 1,2]
    fusepass tune --shapes 4096x4096,14336x4096 --fmt int8 --m 1,16,256
    fusepass tune ... --list            the problems and the plan each gets now, nothing timed
    fusepass tune --step llama3-8b --layers 8 --quantize int4 --group-size 128 [--decode-batch 1]

Every problem (format, group, M bucket, N, K, activation dtype) is timed on
the current GPU -- a few Triton compiles and timings each, seconds -- and the
fastest plan goes to the user cache (``~/.cache/fusepass/dequant_matmul.json``,
or ``FUSEPASS_DEQUANT_MATMUL_CACHE``), where compiles look it up.  Without a
tuned plan a compile takes the plan shipped for the GPU, else a heuristic:
nothing is ever measured while compiling.  From a model: the shapes of the
linear layers ``fusepass.quantize`` converts, at the prefill's M (batch x
seq) and each decode batch.  ``--step``: the plans a model's decode step
uses, chosen by timing the step itself (``fusepass.bench.e2e.tune_step``:
alone, a plan can rank otherwise than in the model).
"""

from __future__ import annotations

import argparse
import time

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DESCRIPTION = """\
Time the quantized linears' kernel plans on this GPU, for the linear layers of
a random-weight model (--model) or for given weight shapes (--shapes), and
keep the fastest plan of each problem in the user cache
(~/.cache/fusepass/dequant_matmul.json, or FUSEPASS_DEQUANT_MATMUL_CACHE),
where compiles look it up; without one a compile takes the plan shipped for
the GPU, else a heuristic, and never times anything.  --list prints the
problems and the plan each gets now, timing nothing (it runs on a CPU too).
--step MODEL times a whole decode step instead (one of `fusepass bench e2e`'s
models, random weights, quantized with --quantize): each plan the step uses is
tried with every candidate inside the step, the fastest kept (GPU only)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fusepass.formats import FORMATS, GROUP_SIZES
    from fusepass.models import MODELS

    p.add_argument("--model", choices=MODELS, default=None, help="tune the shapes of this random-weight model")
    p.add_argument("--size", choices=["tiny", "small", "medium"], default="small")
    from fusepass.bench.e2e.models import QUANTIZE

    p.add_argument("--quantize", "--fmt", dest="fmt", choices=list(dict.fromkeys(FORMATS + QUANTIZE)), default="int8",
                   help=f"weight format ({', '.join(FORMATS)}; with --step also {', '.join(QUANTIZE[2:])}, "
                        "as fusepass bench e2e quantizes)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="int4 group size (default 32; 128 with --step, as fusepass bench e2e)")
    p.add_argument("--batch", type=int, default=2, help="prefill batch (with --model)")
    p.add_argument("--seq", type=int, default=16, help="prefill tokens per sequence (with --model)")
    p.add_argument("--decode-batch", default=None, help="comma list of decode batches (default: --batch)")
    p.add_argument("--shapes", default=None, help="comma list of NxK weight shapes (instead of --model)")
    p.add_argument("--m", default="1,16,256", help="comma list of row counts for --shapes")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="activation dtype")
    p.add_argument("--list", action="store_true", help="print the problems and their current plans; time nothing")
    from fusepass.bench.e2e.models import MODELS as STEP_MODELS

    p.add_argument("--step", choices=sorted(STEP_MODELS), default=None,
                   help="tune the plans of this model's decode step by timing the step (GPU)")
    p.add_argument("--layers", default="4", help="with --step: decoder layers (or 'full'; default 4)")
    p.add_argument("--prompt", type=int, default=128, help="with --step: tokens in the cache before the step")
    p.add_argument("--replays", type=int, default=50, help="with --step: CUDA-graph replays per timing")
    p.add_argument("--min-gain", type=float, default=0.005,
                   help="with --step: keep another plan only where the step is this much faster (default 0.5%%)")
    p.add_argument("--budget", type=float, default=None, help="with --step: seconds before no new plan is timed")
    p.add_argument("--without", default="", metavar="RULE[,RULE]",
                   help="with --step: compile the step without these rules (plans for that variant)")
    p.set_defaults(func=main)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def model_shapes(name: str, size: str, fmt: str, group_size: int) -> list[tuple[int, int]]:
    """(N, K) of every linear layer ``fusepass.quantize`` converts in the model."""
    import fusepass
    from fusepass import models

    model = models.build(name, dtype=torch.float32, device="cpu", size=size)
    fusepass.quantize(model, fmt, group_size=group_size)
    layers = (fusepass.quantize.Int8Linear, fusepass.quantize.Int4Linear, fusepass.quantize.Fp8Linear)
    return sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, layers)})


def problems(args: argparse.Namespace, device: torch.device):
    from fusepass.formats import FORMATS
    from fusepass.kernels.dequant_matmul import Problem

    if args.fmt not in FORMATS:
        raise SystemExit(f"fusepass tune: --quantize {args.fmt} is for --step (a library's layers in a model)")
    if args.shapes:
        shapes = [tuple(_ints(nk.replace("x", ","))) for nk in args.shapes.split(",") if nk.strip()]
        ms = _ints(args.m)
    elif args.model:
        shapes = model_shapes(args.model, args.size, args.fmt, args.group_size or 32)
        ms = [args.batch * args.seq, *_ints(args.decode_batch or str(args.batch))]
    else:
        raise SystemExit("fusepass tune: give --model or --shapes")
    group = (args.group_size or 32) if args.fmt == "int4" else 0
    found = {Problem.of(m, n, k, args.fmt, group, _DTYPES[args.dtype], device) for n, k in shapes for m in ms}
    return sorted(found, key=lambda p: (p.N, p.K, p.M))


def main(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from fusepass.kernels.dequant_matmul import plans, tune_and_save

    if args.step:
        return _main_step(args)

    if not args.list and not torch.cuda.is_available():
        print("fusepass tune: timing needs a CUDA GPU (use --list to see the problems and their plans)")
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    todo = problems(args, device)
    print(f"fusepass tune: {len(todo)} problems on {todo[0].gpu if todo else device}"
          + ("" if args.list else f"; plans go to {plans.cache_path() or 'memory only'}"))
    rows = []
    for p in todo:
        entry = plans.measured(p)
        before = plans.lookup(p)
        row = [p.fmt + (f"-g{p.group}" if p.group else ""), p.M, p.N, p.K,
               before.label() + ("" if entry else " (heuristic)"), entry.get("us", "") if entry else ""]
        if not args.list:
            t0 = time.perf_counter()
            best, us = tune_and_save(p)
            row += [best.label(), f"{us:.1f}", f"{time.perf_counter() - t0:.1f}"]
            print(tabulate([row], tablefmt="plain"), flush=True)  # progress: seconds per problem
        rows.append(row)
    headers = ["format", "M", "N", "K", "plan before", "µs"] + ([] if args.list else ["plan now", "µs", "s"])
    print()
    print(tabulate(rows, headers=headers))
    return 0


def _main_step(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from fusepass.bench.e2e.tune_step import tune_step
    from fusepass.kernels.dequant_matmul import plans

    if args.list or not torch.cuda.is_available():
        print("fusepass tune --step: times a decode step on a CUDA GPU (its plans are looked up as it runs)")
        return 2
    rows = []
    for batch in _ints(args.decode_batch or "1"):
        choices, before, after = tune_step(args.step, args.layers, args.fmt, args.group_size or 128, batch,
                                           args.prompt, args.replays, args.min_gain, args.budget,
                                           without=[r for r in args.without.split(",") if r])
        for c in choices:
            p = c.key
            rows.append([p.fmt + (f"-g{p.group}" if p.group else ""), batch, p.N, p.K, c.before.label(),
                         f"{c.us_before:.1f}", c.after.label() if c.after != c.before else "(kept)",
                         f"{c.us_after:.1f}"])
        print(f"{args.step} batch {batch}: the step {before:.1f} µs with the plans it found, {after:.1f} with "
              f"the plans kept ({before / after:.3f}x), timed again one after the other", flush=True)
    print()
    print(tabulate(rows, headers=["format", "batch", "N", "K", "plan before", "step µs", "plan now", "step µs"]))
    print(f"kept plans: {plans.cache_path() or 'memory only'}")
    return 0

