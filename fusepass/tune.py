"""``fusepass tune``: measure the quantized linears' plans on this GPU.

    fusepass tune --model qwen3_5 --quantize int4 [--size small] [--batch 2 --seq 16] [--decode-batch 1,2]
    fusepass tune --shapes 4096x4096,14336x4096 --fmt int8 --m 1,16,256
    fusepass tune ... --list            the problems and the plan each gets now, nothing timed

Every problem (format, group, M bucket, N, K, activation dtype) is timed on
the current GPU -- a few Triton compiles and timings each, seconds -- and the
fastest plan goes to the user cache (``~/.cache/fusepass/dequant_matmul.json``,
or ``FUSEPASS_DEQUANT_MATMUL_CACHE``), where compiles look it up.  Without a
tuned plan a compile takes the plan shipped for the GPU, else a heuristic:
nothing is ever measured while compiling.  From a model: the shapes of the
linear layers ``fusepass.quantize`` converts, at the prefill's M (batch x
seq) and each decode batch.
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
problems and the plan each gets now, timing nothing (it runs on a CPU too)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fusepass.formats import FORMATS, GROUP_SIZES
    from fusepass.models import MODELS

    p.add_argument("--model", choices=MODELS, default=None, help="tune the shapes of this random-weight model")
    p.add_argument("--size", choices=["tiny", "small", "medium"], default="small")
    p.add_argument("--quantize", "--fmt", dest="fmt", choices=FORMATS, default="int8", help="weight format")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32, help="int4 group size (default 32)")
    p.add_argument("--batch", type=int, default=2, help="prefill batch (with --model)")
    p.add_argument("--seq", type=int, default=16, help="prefill tokens per sequence (with --model)")
    p.add_argument("--decode-batch", default=None, help="comma list of decode batches (default: --batch)")
    p.add_argument("--shapes", default=None, help="comma list of NxK weight shapes (instead of --model)")
    p.add_argument("--m", default="1,16,256", help="comma list of row counts for --shapes")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="activation dtype")
    p.add_argument("--list", action="store_true", help="print the problems and their current plans; time nothing")
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
    from fusepass.kernels.dequant_matmul import Problem

    if args.shapes:
        shapes = [tuple(_ints(nk.replace("x", ","))) for nk in args.shapes.split(",") if nk.strip()]
        ms = _ints(args.m)
    elif args.model:
        shapes = model_shapes(args.model, args.size, args.fmt, args.group_size)
        ms = [args.batch * args.seq, *_ints(args.decode_batch or str(args.batch))]
    else:
        raise SystemExit("fusepass tune: give --model or --shapes")
    group = args.group_size if args.fmt == "int4" else 0
    found = {Problem.of(m, n, k, args.fmt, group, _DTYPES[args.dtype], device) for n, k in shapes for m in ms}
    return sorted(found, key=lambda p: (p.N, p.K, p.M))


def main(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from fusepass.kernels.dequant_matmul import plans, tune_and_save

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
