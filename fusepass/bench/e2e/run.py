"""What one ``fusepass bench e2e`` invocation shares between its phases: the
:class:`Run` (options, model, rows, timers) and the backend helpers."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from .. import output
from ..timing import Timing, copy_bandwidth, environment, profile_kernels, render_profile, time_cpu, time_events
from .models import MODELS, _layers, build, quantize, weight_bytes

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def rewrites(report: Any) -> str:
    """The report's totals: hits per rule, graphs (from cache), refusals, and the
    graphs compiled again another way after a failed compile (what ran is then
    not the default: the row must say so)."""
    cached = sum(1 for g in report.graphs if g.cache == "hit")
    again = sum(1 for g in report.graphs if any("compiled again" in n for n in g.notes))
    text = _hit_totals([(h.rule, h.where) for h in report.hits])
    return (f"{text} ({len(report.graphs)} graph(s){f', {cached} from cache' if cached else ''}"
            f"{f', {len(report.refusals)} refused' if report.refusals else ''}"
            f"{f', {again} compiled again after a failure (see the log)' if again else ''})")


def _hit_totals(hits: list[Any]) -> str:
    counts = Counter(rule for rule, _ in hits)
    return ", ".join(f"{rule}×{n}" for rule, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


class Run:
    """The state one ``fusepass bench e2e`` invocation shares between its phases."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
        self.cuda = self.device == "cuda"
        self.model_name = "tiny-llama" if args.quick and not args.model_given else args.model
        self.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if self.cuda else torch.float32)
        if not self.cuda:
            # Two threads on a busy 2-core machine: 240 ms per tiny forward
            # (threads waiting on each other) against 1 ms with one.
            torch.set_num_threads(args.threads or 1)
        self.backends = [b.strip() for b in args.backends.split(",")]
        # Packages kept out of this run and its child processes: transformers
        # imports an optional kernel package (flash-linear-attention for Gated
        # DeltaNet) in a try block and runs its own PyTorch code when that fails.
        self.hidden = [h.strip() for h in (getattr(args, "hide", None) or "").split(",") if h.strip()]
        for name in self.hidden:
            sys.modules[name] = None  # type: ignore[assignment]
        self.rows: list[dict[str, Any]] = []
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.env = environment(self.device)
        self.copy_gbps = copy_bandwidth(self.device)
        self.layers = _layers(MODELS[self.model_name], args.layers)
        self.model: torch.nn.Module | None = None
        self.started = time.perf_counter()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {text}", file=sys.stderr, flush=True)

    def get_model(self) -> torch.nn.Module:
        if self.model is None:
            t0 = time.perf_counter()
            self.model = quantize(build(self.model_name, self.layers, self.dtype, self.device),
                                  self.args.quantize, self.args.group_size)
            self.weight_bytes = weight_bytes(self.model)
            self.say(f"built {self.model_name} ({self.layers} layers, {self.weight_bytes / 1e9:.2f} GB read per "
                     f"decode step) in {time.perf_counter() - t0:.1f} s")
        return self.model

    def over_budget(self, phase: str, workload: str, backend: str, quiet: bool = False) -> bool:
        """Past ``--max-seconds``: the step is listed as skipped instead of run."""
        limit = self.args.max_seconds
        if not limit or time.perf_counter() - self.started <= limit:
            return False
        if not quiet:
            self.add(phase=phase, workload=workload, backend=backend, ok=None,
                     error=f"skipped: past --max-seconds {limit:.0f}")
        self.say(f"{phase} {workload} {backend}: skipped (past --max-seconds {limit:.0f})")
        return True

    def floor_ms(self) -> float:
        return self.weight_bytes / self.copy_gbps / 1e6

    def add(self, **row: Any) -> dict[str, Any]:
        row = {"model": self.model_name, "layers": self.layers, "dtype": str(self.dtype).replace("torch.", ""),
               "quantize": self.args.quantize or "-", **row, **self.env}
        self.rows.append(row)
        output.write_json(self.out / "e2e.json", self.env, self.rows, **self.meta())
        return row

    def meta(self) -> dict[str, Any]:
        return {"command": self.args.command_line, "copy_gbps": self.copy_gbps, "quick": self.quick}

    def ids(self, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        vocab = self.get_model().config.vocab_size
        return torch.randint(0, vocab, (batch, seq), generator=g).to(self.device)

    def profile(self, fn: Callable[[], Any], workload: str, backend: str) -> dict[str, Any]:
        """With ``--profile`` on CUDA: the call's kernels (plain launches), written beside the table;
        the totals go into the row."""
        if not (self.args.profile and self.cuda):
            return {}
        prof = profile_kernels(fn)
        name = f"profile_{workload.replace(' ', '_')}_{backend}.txt"
        (self.out / name).write_text(render_profile(f"{workload} {backend}", prof))
        self.say(f"{workload} {backend}: {prof['kernels_per_call']:.0f} kernels, {prof['kernel_ms_per_call']:.3f} ms "
                 f"kernel time per call ({name})")
        return {"kernels_per_call": prof["kernels_per_call"], "kernel_ms_per_call": prof["kernel_ms_per_call"],
                "profile": prof}

    def time_calls(self, fn: Callable[[], Any], reps: int) -> Timing:
        """Milliseconds per call: CUDA events around each call, or back-to-back calls on the CPU."""
        if not self.cuda:
            return time_cpu(fn, rep_ms=50.0 * reps, min_samples=reps)
        return time_events(fn, reps)


# A backend "fusepass-no:RULE+RULE" is fusepass without those rules: an A/B of
# rules in one process, against the same Inductor row.  The name "inline"
# among them keeps the ops' launches out of Inductor's code (each op called
# through the dispatcher: ``inline_kernels=False``).  Any backend name but
# eager may end in "@KEY=VALUE[@KEY=VALUE...]": Inductor config patches for
# that row (an A/B of Inductor's options: "fusepass@combo_kernels=1").
VARIANT = "fusepass-no:"
NO_INLINE = "inline"
PATCH = "@"


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("1", "true", "0", "false"):
        return low in ("1", "true")
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def split_patches(backend: str) -> tuple[str, dict[str, Any]]:
    """(the backend name without its "@KEY=VALUE" suffixes, the Inductor patches they ask for)."""
    base, *items = backend.split(PATCH)
    patches = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise ValueError(f"backend {backend!r}: {item!r} is not KEY=VALUE")
        patches[key] = _value(value)
    return base, patches


def fusepass_options(backend: str) -> dict[str, Any] | None:
    """The fusepass options a backend name asks for ({} for "fusepass"), or None
    for a backend that is not fusepass."""
    backend, patches = split_patches(backend)
    if backend == "fusepass":
        return dict(patches)
    if backend.startswith(VARIANT):
        names = [r for r in backend[len(VARIANT):].split("+") if r]
        opts: dict[str, Any] = {"disable_rules": [r for r in names if r != NO_INLINE], **patches}
        if NO_INLINE in names:
            opts["inline_kernels"] = False
        return opts
    return None


def compile_args(backend: str, captured: bool = False) -> dict[str, Any]:
    """``torch.compile``'s backend (and options) for a backend name.  ``captured``:
    the caller captures the compiled step into a CUDA graph itself, so a fusepass
    backend is told so as fusepass's options ask (``inline_kernels=False``, what
    it picks itself under ``mode="reduce-overhead"``), unless the variant or
    ``FUSEPASS_INLINE_KERNELS`` says otherwise."""
    opts = fusepass_options(backend)
    if opts is None:
        name, patches = split_patches(backend)
        return {"backend": name, "options": patches} if patches else {"backend": name}
    told = "inline_kernels" in opts or os.environ.get("FUSEPASS_INLINE_KERNELS")
    if captured and not told:
        opts = {**opts, "inline_kernels": False}
    return {"backend": "fusepass", "options": opts} if opts else {"backend": "fusepass"}


def graphs_compile_args(backend: str) -> dict[str, Any]:
    """``compile_args`` with Inductor's CUDA graphs (``mode="reduce-overhead"``), as ``generate`` compiles:
    torch.compile takes a mode or options, not both, so a variant's options get the mode's own."""
    from torch._inductor import list_mode_options

    args = compile_args(backend)
    if "options" not in args:
        return {**args, "mode": "reduce-overhead"}
    return {**args, "mode": None, "options": {**list_mode_options("reduce-overhead"), **args["options"]}}


def _fresh(model: torch.nn.Module, backend: str, captured: bool = False, **kwargs: Any) -> Any:
    """``model`` compiled with ``backend`` from a clean Dynamo state (eager: the model itself)."""
    torch._dynamo.reset()
    if hasattr(model, "_compiled_call"):  # generate's cached compile of __call__
        del model._compiled_call
    if backend == "eager":
        return model
    return torch.compile(model, dynamic=False, **compile_args(backend, captured), **kwargs)


def _start_report(backend: str) -> None:
    if fusepass_options(backend) is not None:
        import fusepass

        fusepass.reset_reports()


def _report_text(backend: str) -> str | None:
    if fusepass_options(backend) is None:
        return None
    import fusepass

    report = fusepass.last_report()
    print(report, file=sys.stderr)  # the whole report (refusals and their reasons) into the log
    return rewrites(report)
