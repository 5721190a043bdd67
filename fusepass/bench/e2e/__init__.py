"""``fusepass bench e2e``: whole models, measured as users run them.

Random-weight ``transformers`` models built from the configs of real
checkpoints (written below; nothing is downloaded), truncated to ``--layers``
decoder layers (``full`` for the whole depth), bf16 on CUDA.  Eager, Inductor
and fusepass side by side in one process, each phase selectable:

- ``prefill``: one forward over a B=1 prompt of T tokens (``use_cache=False``,
  ``logits_to_keep=1`` as ``generate`` asks for), compiled with each backend at
  fixed shapes; median and p20/p80 of timed calls (CUDA events).  The logits
  are checked first against an fp32 copy of the model (eager's own logits when
  none fits): a backend must stay within the dtype's tolerance or twice eager's
  or Inductor's error.
- ``decode``: tokens/s through ``model.generate`` with a static cache and
  ``CompileConfig(backend=..., mode="reduce-overhead", fullgraph=True)`` (CUDA
  graphs), greedy, at each batch size.  Prefill is excluded by difference:
  a generate of N new tokens minus a generate of 1 new token (the first token
  comes from the prefill's logits), both warm, on the same cache object, so
  ``(N - 1) * B`` tokens over the difference; the pairs are timed alternately
  and the quantiles come from the per-pair differences.
- ``replay``: the same decode step (one token per sequence, static cache)
  compiled without CUDA graphs, captured into one CUDA graph by hand and
  replayed K times back to back between two events: the GPU time of a step
  with no launch gaps.  fusepass is told the step is captured
  (``inline_kernels=False``, as it picks itself under
  ``mode="reduce-overhead"``); ``FUSEPASS_INLINE_KERNELS=1`` in the
  environment measures the inlined form.  On the CPU: compiled step called
  back to back.  With ``decode`` in the same run, each decode row also says
  how much of its step lies outside the graph (generate's own work per token).
- ``startup``: compile plus first forward, each in a fresh Python process
  sharing an Inductor (and Triton) cache folder: the first process finds it
  empty (cold), the second warm.  fusepass is not imported beforehand: the
  entry point imports it, as for a user.

Next to every decode and replay row: the weight-read floor, the bytes of every
parameter and buffer (the input embedding excluded: a step reads B rows of it)
over the copy bandwidth measured in the same run, and the row's share of it.
Next to every fusepass row: the rewrite report's totals (hits per rule).

The parts: :mod:`.models` (the configs, building and quantizing), :mod:`.run`
(the state the phases share), :mod:`.phases` (prefill, decode, replay),
:mod:`.startup` (the fresh processes), :mod:`.summary` (comparison, table,
files); this module holds the command.
"""

from __future__ import annotations

import argparse
import time

from ...formats import GROUP_SIZES
from .. import output
from .models import MODELS, QUANTIZE
from .phases import phase_decode, phase_prefill, phase_replay
from .run import DTYPES, PATCH, VARIANT, Run, fusepass_options, split_patches
from .startup import phase_startup
from .summary import finish

PHASES = ("prefill", "decode", "replay", "startup")
BACKENDS = ("eager", "inductor", "fusepass")


def main(args: argparse.Namespace) -> int:
    args.out = args.out or output.default_out("e2e")
    args.model_given = args.model is not None
    args.model = args.model or "llama3-8b"
    if args.quick:
        args.prefill = args.prefill or "32"
        args.batch = args.batch or "1"
        args.prompt = args.prompt or 16
        args.new_tokens = args.new_tokens or 8
        args.repeat = args.repeat or 1
    args.prefill = args.prefill or "512,2048,8192"
    args.batch = args.batch or "1,32"
    args.prompt = args.prompt or 128
    args.new_tokens = args.new_tokens or 128
    args.repeat = args.repeat or 3
    phases = [p.strip() for p in args.phases.split(",")]
    backends = [b.strip() for b in args.backends.split(",")]
    try:
        bases = [split_patches(b)[0] for b in backends]
    except ValueError as exc:
        raise SystemExit(f"fusepass bench e2e: {exc}") from None
    unknown = [p for p in phases if p not in PHASES] + [
        b for b, base in zip(backends, bases)
        if (base not in BACKENDS and not base.startswith(VARIANT)) or (base == "eager" and b != base)]
    if unknown:
        raise SystemExit(f"fusepass bench e2e: unknown phase(s)/backend(s) {unknown}; phases {PHASES}, "
                         f"backends {BACKENDS} or {VARIANT}RULE[+RULE...]")
    variants = [b for b in backends if b.startswith(VARIANT)]
    if "startup" in phases and any(PATCH in b for b in backends):
        raise SystemExit("fusepass bench e2e: the startup phase times plain backends only, without @KEY=VALUE")
    if variants:
        from fusepass.rule import rules

        known = {r.name for r in rules()}
        bad = [r for b in variants for r in fusepass_options(b)["disable_rules"] if r not in known] or \
            [b for b in variants if fusepass_options(b) == {"disable_rules": []}]
        if bad:
            raise SystemExit(f"fusepass bench e2e: {bad}: name the rules to leave out, of {sorted(known)}, "
                             "or 'inline'")
        if "startup" in phases:
            raise SystemExit(f"fusepass bench e2e: the startup phase times plain backends only, not {variants}")
    if args.quantize in ("int8", "int4"):
        import fusepass

        if not hasattr(fusepass, "quantize"):
            raise SystemExit("fusepass bench e2e: --quantize needs fusepass.quantize, which this version lacks")

    run = Run(args)
    print(f"# fusepass bench e2e on {run.env['device']}: torch {run.env['torch']}, transformers "
          f"{run.env['transformers']}, commit {run.env['commit']}")
    print(f"# {run.model_name}, {run.layers} layer(s), {run.dtype}, {run.device}; copy bandwidth "
          f"{run.copy_gbps:.0f} GB/s; phases {','.join(phases)}", flush=True)
    print(f"# {args.command_line}", flush=True)
    if not run.cuda:
        print(f"# {output.CPU_NOTE}", flush=True)
    for phase in phases:
        t0 = time.perf_counter()
        {"prefill": phase_prefill, "decode": phase_decode, "replay": phase_replay, "startup": phase_startup}[phase](run)
        run.say(f"phase {phase} done in {time.perf_counter() - t0:.1f} s")
    return finish(run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=list(MODELS), default=None,
                   help="default llama3-8b (tiny-llama with --quick)")
    p.add_argument("--layers", default="4", help="decoder layers (default 4), or 'full' for the whole depth")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma list (default: eager,inductor,fusepass); fusepass-no:RULE[+RULE...]: "
                        "fusepass without those rules ('inline': the ops called through the dispatcher, "
                        "not launched from Inductor's code); NAME@KEY=VALUE[@KEY=VALUE]: that backend with "
                        "Inductor config patches (fusepass@combo_kernels=1)")
    p.add_argument("--quick", action="store_true", help="the tiny model on the CPU, a few shapes (CI)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="weight-only quantization: int8/int4 through fusepass.quantize, torchao-int8 through "
                        "torchao's Int8WeightOnlyConfig, bnb-nf4/bnb-fp4 as bitsandbytes' Linear4bit (blocks "
                        "of 64, no double quantization; bnb-nf4-dq with it), gptq/gptq-act-order/hqq: each "
                        "linear written in GPTQ's or HQQ's layout (--group-size) and loaded through "
                        "fusepass.load_quantized; "
                        "lm_head stays bf16 in all")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128, help="int4 group size (default 128)")
    p.add_argument("--prefill", default=None, help="prompt lengths for the prefill phase (default 512,2048,8192)")
    p.add_argument("--batch", default=None, help="batch sizes for decode and replay (default 1,32)")
    p.add_argument("--prompt", type=int, default=None, help="prompt length for decode/replay/startup (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per decode run (default 128)")
    p.add_argument("--replays", type=int, default=200, help="CUDA-graph replays per timing (replay phase)")
    p.add_argument("--repeat", type=int, default=None, help="cold/warm start pairs per backend (default 3)")
    p.add_argument("--child-timeout", type=float, default=600.0, help="seconds allowed for one startup process")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new measurement after this many seconds (the rest are listed as skipped)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: also profile each prefill call and decode step (plain launches): kernels, time per "
                        "kind of kernel, the top kernels; written as profile_*.txt beside the table")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs; default 1)")
    p.add_argument("--hide", default=None,
                   help="comma list of installed packages this run must not import, e.g. fla: with "
                        "flash-linear-attention importable transformers runs Gated DeltaNet on its kernels, "
                        "hidden it runs its own PyTorch code (what fusepass rewrites)")
    p.add_argument("--out", default=None, help="folder for e2e_table.txt, e2e.json/.csv and the plot (default: a new "
                                               "folder under <tmp>/fusepass-bench/)")
    p.set_defaults(func=main)
