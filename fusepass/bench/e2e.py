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
  with no launch gaps.  On the CPU: compiled step called back to back.  With
  ``decode`` in the same run, each decode row also says how much of its step
  lies outside the graph (generate's own work per token).
- ``startup``: compile plus first forward, each in a fresh Python process
  sharing an Inductor (and Triton) cache folder: the first process finds it
  empty (cold), the second warm.  fusepass is not imported beforehand: the
  entry point imports it, as for a user.

Next to every decode and replay row: the weight-read floor, the bytes of every
parameter and buffer (the input embedding excluded: a step reads B rows of it)
over the copy bandwidth measured in the same run, and the row's share of it.
Next to every fusepass row: the rewrite report's totals (hits per rule).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from . import output
from .ops import rel_err
from .timing import Timing, copy_bandwidth, environment, profile_kernels, render_profile, sync, time_cpu

# Configs of real checkpoints (config.json's fields that shape the compute).
MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "class": "LlamaForCausalLM", "config": "LlamaConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       bos_token_id=128000, eos_token_id=128001),
    },
    "qwen3-8b": {
        "class": "Qwen3ForCausalLM", "config": "Qwen3Config", "norm_offset": 1.0,
        "fields": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       bos_token_id=151643, eos_token_id=151645),
    },
    # Qwen3.5-9B's text model: 8 x (3 Gated DeltaNet layers, 1 gated attention
    # layer); the layer types follow from the depth (every 4th is attention),
    # so --layers 4 keeps the 3:1 pattern.  Norms are zero-centred (1 + w).
    "qwen3.5-9b": {
        "class": "Qwen3_5ForCausalLM", "config": "Qwen3_5TextConfig", "norm_offset": 0.0,
        "fields": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, hidden_act="silu",
                       linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32, max_position_embeddings=262144,
                       rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25},
                       eos_token_id=248044),
    },
    # --quick: fusepass.models' tiny Llama, on the CPU, for CI.
    "tiny-llama": {
        "class": "LlamaForCausalLM", "config": "LlamaConfig", "norm_offset": 1.0,
        "fields": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    },
    # The hybrid at tiny size (CPU smoke test of the Gated DeltaNet path: --quick --model tiny-qwen3.5).
    "tiny-qwen3.5": {
        "class": "Qwen3_5ForCausalLM", "config": "Qwen3_5TextConfig", "norm_offset": 0.0,
        "fields": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25}),
    },
}
PHASES = ("prefill", "decode", "replay", "startup")
BACKENDS = ("eager", "inductor", "fusepass")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# -- the model ---------------------------------------------------------------------

def _layers(spec: dict[str, Any], layers: str | int) -> int:
    full = spec["fields"]["num_hidden_layers"]
    return full if str(layers) == "full" else min(int(layers), full)


def build(name: str, layers: str | int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """The model from its config, random weights made on ``device`` (norm weights drawn too, not ones)."""
    import transformers as tf

    spec = MODELS[name]
    fields = {**spec["fields"], "num_hidden_layers": _layers(spec, layers)}
    try:
        config = getattr(tf, spec["config"])(**fields)
        cls = getattr(tf, spec["class"])
    except AttributeError as exc:
        raise SystemExit(f"fusepass bench e2e: transformers {tf.__version__} has no {exc.name}: "
                         f"{name} needs a newer transformers") from exc
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.normal_(0.0, 0.1).add_(spec["norm_offset"] if "Gated" not in type(module).__name__
                                                      else 1.0)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model.eval()


def quantize(model: torch.nn.Module, fmt: str | None, group_size: int) -> torch.nn.Module:
    if not fmt:
        return model
    if fmt == "torchao-int8":  # torchao's int8 weight-only tensor subclass, lm_head kept in bf16 as below
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError as exc:
            raise SystemExit("fusepass bench e2e: --quantize torchao-int8 needs torchao (pip install torchao)") from exc
        quantize_(model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and not fqn.endswith("lm_head"))
        return model
    import fusepass

    if not hasattr(fusepass, "quantize"):
        raise SystemExit("fusepass bench e2e: --quantize needs fusepass.quantize, which this version lacks")
    print(fusepass.quantize(model, fmt=fmt, group_size=group_size), file=sys.stderr)  # in place; a summary
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """What one decode step reads: every parameter and buffer once, the input embedding excluded
    (B rows of it are read) unless the output layer shares it."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    total = sum(_nbytes(t) for t in tensors.values())
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not embed:
        total -= _nbytes(embed)
    return total


def _nbytes(t: torch.Tensor) -> int:
    """Storage bytes; a tensor subclass (torchao's quantized weights) counts the tensors it holds."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def rewrites(report: Any) -> str:
    """The report's totals: hits per rule, graphs (from cache), refusals."""
    cached = sum(1 for g in report.graphs if g.cache == "hit")
    text = _hit_totals([(h.rule, h.where) for h in report.hits])
    return (f"{text} ({len(report.graphs)} graph(s){f', {cached} from cache' if cached else ''}"
            f"{f', {len(report.refusals)} refused' if report.refusals else ''})")


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
        self.dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if self.cuda else torch.float32)
        if not self.cuda:
            # Two threads on a busy 2-core machine: 240 ms per tiny forward
            # (threads waiting on each other) against 1 ms with one.
            torch.set_num_threads(args.threads or 1)
        self.backends = [b.strip() for b in args.backends.split(",")]
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
        fn()  # one more warm-up call: lazy allocations, first-launch costs
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return Timing.from_samples(samples)


def _fresh(model: torch.nn.Module, backend: str, **kwargs: Any) -> Any:
    """``model`` compiled with ``backend`` from a clean Dynamo state (eager: the model itself)."""
    torch._dynamo.reset()
    if hasattr(model, "_compiled_call"):  # generate's cached compile of __call__
        del model._compiled_call
    if backend == "eager":
        return model
    return torch.compile(model, backend=backend, dynamic=False, **kwargs)


def _start_report(backend: str) -> None:
    if backend == "fusepass":
        import fusepass

        fusepass.reset_reports()


def _report_text(backend: str) -> str | None:
    if backend != "fusepass":
        return None
    import fusepass

    report = fusepass.last_report()
    print(report, file=sys.stderr)  # the whole report (refusals and their reasons) into the log
    return rewrites(report)


# -- phases ------------------------------------------------------------------------

def phase_prefill(run: Run) -> None:
    from fusepass.kernels._common import tolerance

    model = run.get_model()
    lengths = [int(t) for t in run.args.prefill.split(",")]
    reps = 3 if run.quick else 10
    expected, eager_err, reference = _prefill_references(run, model, lengths)
    run.say(f"prefill: logits checked against {reference}")
    inductor_err: dict[int, float] = {}
    for backend in run.backends:
        fn = _fresh(model, backend)
        for t in lengths:
            if run.over_budget("prefill", f"prefill B1 T{t}", backend):
                continue
            _start_report(backend)  # one graph per length (fixed shapes): its own totals
            ids = run.ids(1, t)
            call = lambda: fn(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
            run.say(f"prefill T={t} {backend}: compiling and checking")
            try:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    logits = call().logits.float()
                    sync(run.device)
                    first_s = time.perf_counter() - t0
                    err = rel_err(logits, expected[t])
                    if backend == "inductor":
                        inductor_err[t] = err
                    limit = max(tolerance(run.dtype).rtol, 2 * eager_err.get(t, 0.0), 2 * inductor_err.get(t, 0.0))
                    ok = err <= limit
                    timing = run.time_calls(call, reps) if ok else None
                    prof = run.profile(call, f"prefill B1 T{t}", backend) if ok else {}
            except Exception as exc:  # noqa: BLE001 - one backend failing must not end the run
                run.add(phase="prefill", workload=f"prefill B1 T{t}", backend=backend, ok=False,
                        error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                run.say(f"prefill T={t} {backend}: FAILED {type(exc).__name__}")
                continue
            row = run.add(phase="prefill", workload=f"prefill B1 T{t}", backend=backend, ok=ok, rel_err=err,
                          check_limit=limit, first_call_s=round(first_s, 2), rewrites=_report_text(backend), **prof,
                          **({} if timing is None else dict(
                              value=timing.median, p20=timing.p20, p80=timing.p80, unit="ms",
                              tokens_per_s=t / timing.median * 1e3)),
                          **({} if ok else {"error": f"logits differ from eager: {err:.2e} > {limit:.1e}; not timed"}))
            run.say(f"prefill T={t} {backend}: " + (f"{row['value']:.2f} ms" if ok else row["error"]))


def _prefill_references(run: Run, model: torch.nn.Module,
                        lengths: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, float], str]:
    """The logits every backend is checked against, eager's own error against them, and what they are.

    In half precision, eager's logits are themselves off by bf16 rounding over
    every layer (2% at 4 layers is ordinary), so a check against them flags
    any backend whose rounding differs.  The reference is an fp32 copy of the
    model when one fits and converts; a backend passes within twice eager's
    error (or Inductor's, or the dtype's tolerance).  Otherwise eager's own
    logits, as before.
    """
    expected: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for t in lengths:
            expected[t] = model(input_ids=run.ids(1, t), use_cache=False, logits_to_keep=1).logits.float()
    if run.dtype == torch.float32:
        return expected, {}, "eager (fp32)"
    import copy

    try:
        ref_model = copy.deepcopy(model).float()
        with torch.no_grad():
            ref = {t: ref_model(input_ids=run.ids(1, t), use_cache=False, logits_to_keep=1).logits.float()
                   for t in lengths}
    except Exception as exc:  # noqa: BLE001 - out of memory, a weight type with no fp32 form: eager it is
        run.say(f"prefill: no fp32 reference ({type(exc).__name__}); checking against eager")
        return expected, {}, f"eager ({str(run.dtype).replace('torch.', '')})"
    finally:
        ref_model = None
        if run.cuda:
            torch.cuda.empty_cache()
    return ref, {t: rel_err(expected[t], ref[t]) for t in lengths}, "an fp32 copy of the model"


def phase_decode(run: Run) -> None:
    from transformers import CompileConfig, StaticCache

    model = run.get_model()
    prompt, new = run.args.prompt, run.args.new_tokens
    reps = 2 if run.quick else 3
    for backend in run.backends:
        for batch in [int(b) for b in run.args.batch.split(",")]:
            if run.over_budget("decode", f"decode B{batch}", backend):
                continue
            _fresh(model, "eager")  # each batch size compiles afresh, at static shapes
            _start_report(backend)
            ids = run.ids(batch, prompt)
            try:
                cache = StaticCache(config=model.config, max_cache_len=prompt + new)
                kwargs: dict[str, Any] = dict(do_sample=False, past_key_values=cache, pad_token_id=0,
                                              attention_mask=torch.ones_like(ids))
                if backend == "eager":
                    kwargs["disable_compile"] = True
                else:
                    cc = CompileConfig(backend=backend, mode="reduce-overhead", fullgraph=True)
                    cc._compile_all_devices = not run.cuda or None  # transformers compiles on CUDA only unless asked
                    kwargs["compile_config"] = cc

                def generate(n: int) -> float:
                    cache.reset()
                    sync(run.device)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
                    sync(run.device)
                    assert out.shape == (batch, prompt + n), f"generate returned {tuple(out.shape)}"
                    return time.perf_counter() - t0

                run.say(f"decode B={batch} {backend}: warm-up generate (compiles)")
                from torch._dynamo.utils import counters

                graphs = counters["stats"]["unique_graphs"]
                skips = counters["inductor"]["cudagraph_skips"]
                first_s = generate(new)
                skips = counters["inductor"]["cudagraph_skips"] - skips if run.cuda else 0  # none to take on a CPU
                if backend != "eager" and counters["stats"]["unique_graphs"] == graphs:
                    raise RuntimeError("generate compiled nothing: this transformers did not take its compile "
                                       "path (static cache + compile_config)")
                generate(1)
                full, one = [], []
                for _ in range(reps):
                    full.append(generate(new))
                    one.append(generate(1))
            except Exception as exc:  # noqa: BLE001
                run.add(phase="decode", workload=f"decode B{batch}", backend=backend, ok=False,
                        error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                run.say(f"decode B={batch} {backend}: FAILED {type(exc).__name__}: {exc}")
                continue
            steps = new - 1
            diffs = [(f - o) / steps * 1e3 for f, o in zip(full, one)]
            if min(diffs) <= 0:
                run.add(phase="decode", workload=f"decode B{batch}", backend=backend, ok=None,
                        error=f"a generate of {new} tokens was not slower than one of 1: noise exceeds the decode "
                              "time; raise --new-tokens")
                run.say(f"decode B={batch} {backend}: not measurable (noise), raise --new-tokens")
                continue
            per_step = Timing.from_samples(diffs)
            floor = run.floor_ms()
            row = run.add(
                phase="decode", workload=f"decode B{batch}", backend=backend, ok=True,
                value=batch / per_step.median * 1e3, p20=batch / per_step.p80 * 1e3, p80=batch / per_step.p20 * 1e3,
                unit="tok/s", step_ms=per_step.median, floor_ms=floor, pct_floor=100 * floor / per_step.median,
                floor_tok_s=batch / floor * 1e3, first_generate_s=round(first_s, 2),
                generate_n_s=statistics.median(full), generate_1_s=statistics.median(one),
                rewrites=_report_text(backend),
                notes=f"prompt {prompt}, {new} new tokens; tok/s = B*(N-1)/(t(N new) - t(1 new))"
                      + (f"; CUDA graphs skipped {skips} time(s) (TORCH_LOGS=perf_hints says why)" if skips else ""),
                cudagraph_skips=skips,
            )
            if skips:
                run.say(f"decode B={batch} {backend}: Inductor skipped CUDA graphs {skips} time(s)")
            run.say(f"decode B={batch} {backend}: {row['value']:.0f} tok/s ({per_step.median:.3f} ms/step, "
                    f"floor {floor:.3f} ms)")


def phase_replay(run: Run) -> None:
    from transformers import StaticCache

    model = run.get_model()
    prompt = run.args.prompt
    # Eager last: a capture that fails (a host sync inside eager code) must not
    # leave the compiled backends a device in a bad state.
    for backend in sorted(run.backends, key=lambda b: b == "eager"):
        fn = _fresh(model, backend, fullgraph=True)
        _start_report(backend)
        for batch in [int(b) for b in run.args.batch.split(",")]:
            if run.over_budget("replay", f"replay B{batch}", backend):
                continue
            run.say(f"replay B={batch} {backend}: compiling and capturing")
            try:
                cache = StaticCache(config=model.config, max_cache_len=prompt + run.args.new_tokens)
                with torch.no_grad():
                    model(input_ids=run.ids(batch, prompt), past_key_values=cache, use_cache=True)  # fill it
                    ids = run.ids(batch, 1, seed=2)
                    pos = torch.tensor([prompt], device=run.device)
                    position_ids = pos.expand(batch, 1)
                    rewind = _rewinder(cache, prompt)

                    def step() -> torch.Tensor:
                        # Every replay writes position `prompt` again: the cache's own
                        # write counter (transformers >= 5.x) is set back first.
                        rewind()
                        return fn(input_ids=ids, past_key_values=cache, position_ids=position_ids,
                                  cache_position=pos, use_cache=True).logits

                    if run.cuda:
                        stream = torch.cuda.Stream()
                        stream.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(stream):
                            for _ in range(3):
                                step()
                        torch.cuda.current_stream().wait_stream(stream)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            step()
                        replays = run.args.replays
                        for _ in range(10):
                            graph.replay()

                        def replay_k() -> None:
                            for _ in range(replays):
                                graph.replay()

                        per = run.time_calls(replay_k, 5)
                        per = Timing(per.median / replays, per.p20 / replays, per.p80 / replays)
                        how = f"one CUDA graph of the step, {replays} replays between two events, 5 times"
                        prof = run.profile(step, f"replay B{batch}", backend)
                    else:
                        per = time_cpu(step, rep_ms=200)
                        how = "cpu: the compiled step called back to back (no CUDA graphs)"
                        prof = {}
            except Exception as exc:  # noqa: BLE001
                run.add(phase="replay", workload=f"replay B{batch}", backend=backend, ok=False,
                        error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                run.say(f"replay B={batch} {backend}: FAILED {type(exc).__name__}: {exc}")
                continue
            floor = run.floor_ms()
            run.add(phase="replay", workload=f"replay B{batch}", backend=backend, ok=True, value=per.median * 1e3,
                    p20=per.p20 * 1e3, p80=per.p80 * 1e3, unit="µs/step", tokens_per_s=batch / per.median * 1e3,
                    floor_ms=floor, pct_floor=100 * floor / per.median, rewrites=_report_text(backend), notes=how,
                    **prof)
            run.say(f"replay B={batch} {backend}: {per.median * 1e3:.1f} µs/step (floor {floor * 1e3:.1f} µs)")
            del cache, step
            if run.cuda:
                del graph, replay_k
                torch.cuda.empty_cache()


def _rewinder(cache: Any, position: int) -> Callable[[], None]:
    """A function that sets a static cache's write position back to ``position``.

    Recent transformers keep it in a tensor per layer (``cumulative_length``,
    advanced by every update: replaying a step would write past the end);
    older ones take ``cache_position`` from the call and need nothing.
    """
    counters = [layer.cumulative_length for layer in getattr(cache, "layers", [])
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def rewind() -> None:
        for c in counters:
            c.fill_(position)

    return rewind


# The child of the startup phase: builds the model the parent describes and
# times compile + first forward.  It imports neither fusepass nor this module:
# for backend="fusepass" the entry point imports fusepass, as for a user.
_CHILD = r"""
import json, sys, time
t_process = time.perf_counter()
import torch, transformers as tf
spec = json.loads(sys.argv[1])
if spec["threads"]:
    torch.set_num_threads(spec["threads"])
cls, config = getattr(tf, spec["class"]), getattr(tf, spec["config"])(**spec["fields"])
torch.manual_seed(0)
dtype = getattr(torch, spec["dtype"])
with torch.device(spec["device"]):
    model = cls._from_config(config, dtype=dtype).eval()
if spec["quantize"]:
    import fusepass
    fusepass.quantize(model, fmt=spec["quantize"], group_size=spec["group_size"])  # in place
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, config.vocab_size, (1, spec["prompt"]), generator=g).to(spec["device"])
sync = torch.cuda.synchronize if spec["device"] == "cuda" else (lambda: None)
sync()
t0, c0 = time.perf_counter(), time.process_time()
with torch.no_grad():
    compiled = torch.compile(model, backend=spec["backend"], dynamic=False)
    compiled(input_ids=ids, use_cache=False, logits_to_keep=1)
sync()
first, cpu = time.perf_counter() - t0, time.process_time() - c0
from torch._dynamo.utils import counters
result = {"first_call_s": first, "first_call_cpu_s": cpu, "setup_s": t0 - t_process,
          "aot_autograd_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
          "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"]}
if spec["backend"] == "fusepass":
    import fusepass
    r = fusepass.last_report()
    result["hits"] = sorted((h.rule, h.where) for h in r.hits)
    result["cache"] = [g.cache for g in r.graphs]
    result["notes"] = [n for g in r.graphs for n in g.notes]
print("FUSEPASS_STARTUP " + json.dumps(result))
"""


def startup_child(spec: dict[str, Any], cache_dir: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("FUSEPASS_STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}")
    return {**json.loads(line.split(" ", 1)[1]), "process_s": wall}


def phase_startup(run: Run) -> None:
    spec_model = MODELS[run.model_name]
    backends = [b for b in run.backends if b != "eager"]
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for i in range(run.args.repeat):
        for backend in backends:  # interleaved: drift on a shared machine hits both alike
            if run.over_budget("startup", f"startup pair {i + 1}", backend, quiet=True):
                continue
            spec = {"class": spec_model["class"], "config": spec_model["config"],
                    "fields": {**spec_model["fields"], "num_hidden_layers": run.layers},
                    "dtype": str(run.dtype).replace("torch.", ""), "device": run.device, "backend": backend,
                    "prompt": run.args.prompt, "quantize": run.args.quantize, "group_size": run.args.group_size,
                    "threads": None if run.cuda else torch.get_num_threads()}
            folder = Path(tempfile.mkdtemp(prefix="fusepass-startup-"))
            try:
                for kind in ("cold", "warm"):
                    run.say(f"startup {backend} {kind} ({i + 1}/{run.args.repeat}): fresh process")
                    try:
                        r = startup_child(spec, folder, run.args.child_timeout)
                    except Exception as exc:  # noqa: BLE001
                        run.say(f"startup {backend} {kind}: FAILED {exc}")
                        samples.setdefault((backend, kind), []).append({"error": str(exc)[:200]})
                        break
                    samples.setdefault((backend, kind), []).append(r)
                    run.say(f"startup {backend} {kind}: first call {r['first_call_s']:.2f} s "
                            f"(process {r['process_s']:.1f} s)")
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    for (backend, kind), rs in samples.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            run.add(phase="startup", workload=f"startup {kind}", backend=backend, ok=False, error=rs[0]["error"])
            continue
        t = Timing.from_samples([r["first_call_s"] for r in good])
        last = good[-1]
        ok = True
        note = ""
        if backend == "fusepass":
            cold_hits = [r.get("hits") for r in samples.get((backend, "cold"), []) if "error" not in r]
            ok = all(r.get("hits") == cold_hits[0] for r in good) if cold_hits else True
            if kind == "warm":
                ok = ok and all(r.get("cache") and all(c == "hit" for c in r["cache"]) for r in good)
                note = "report restored from the cache" if ok else "warm report differs from cold (see JSON)"
        run.add(phase="startup", workload=f"startup {kind}", backend=backend, ok=ok, value=t.median, p20=t.p20,
                p80=t.p80, unit="s", runs=len(good), samples=[round(r["first_call_s"], 3) for r in good],
                cpu_s=statistics.median(r["first_call_cpu_s"] for r in good),
                process_s=statistics.median(r["process_s"] for r in good),
                aot_autograd_cache_hits=last["aot_autograd_cache_hits"],
                fx_graph_cache_hits=last["fx_graph_cache_hits"],
                rewrites=(f"{_hit_totals(last['hits'])} (cache {','.join(last['cache'])})" if "hits" in last else None),
                notes=note or f"compile + first forward B1 T{run.args.prompt}, fresh process, median of {len(good)}")


# -- output ------------------------------------------------------------------------

def _vs_inductor(rows: list[dict[str, Any]]) -> None:
    """Speed-up over Inductor per workload (>1: faster), from the rows' own unit."""
    ind = {r["workload"]: r for r in rows if r["backend"] == "inductor" and r.get("value")}
    for r in rows:
        i = ind.get(r["workload"])
        if not i or not r.get("value"):
            continue
        faster_is_higher = r["unit"] in ("tok/s",)
        r["vs_inductor"] = r["value"] / i["value"] if faster_is_higher else i["value"] / r["value"]


def _host_time(rows: list[dict[str, Any]]) -> None:
    """Where one run has both, a decode row gets its step's time outside the GPU work:
    the step through ``generate`` minus the same step replayed from one CUDA graph."""
    replay = {(r["backend"], r["workload"].split()[-1]): r for r in rows
              if r["phase"] == "replay" and r.get("value")}
    for r in rows:
        if r["phase"] != "decode" or not r.get("step_ms"):
            continue
        rp = replay.get((r["backend"], r["workload"].split()[-1]))
        if rp:
            r["host_ms_per_step"] = r["step_ms"] - rp["value"] / 1e3


def render(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if r.get("value") is None:
            lines.append([r["workload"], r["backend"], "-", "-", "-", r.get("error", ""), r.get("rewrites") or ""])
            continue
        fmt = ".0f" if r["unit"] == "tok/s" else (".2f" if r["unit"] in ("s", "ms") else ".1f")
        value = f"{r['value']:{fmt}} {r['unit']} ({r['p20']:{fmt}}-{r['p80']:{fmt}})"
        floor = ""
        if r.get("floor_ms") is not None:
            floor = f"{r['pct_floor']:.0f}% of floor ({r['floor_ms'] * 1e3:.0f} µs)"
        if r.get("cpu_s") is not None:  # startup: the process's CPU time too (steadier on a shared machine)
            value += f", cpu {r['cpu_s']:.2f} s"
        if r.get("host_ms_per_step") is not None:  # decode: what generate adds to the replayed step
            value += f", {r['step_ms']:.2f} ms/step of which {r['host_ms_per_step']:.2f} outside the graph"
        check = ("ok" if r.get("ok") else "FAIL") + (f" {r['rel_err']:.1e}" if r.get("rel_err") is not None else "")
        lines.append([r["workload"], r["backend"], value,
                      f"{r['vs_inductor']:.3f}x" if r.get("vs_inductor") else "-", floor, check,
                      r.get("rewrites") or ""])
    return output.table(lines, ["workload", "backend", "median (p20-p80)", "vs inductor", "weight-read floor",
                                "check", "fusepass rewrites"])


def main(args: argparse.Namespace) -> int:
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
    unknown = [p for p in phases if p not in PHASES] + [b for b in args.backends.split(",") if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"fusepass bench e2e: unknown phase(s)/backend(s) {unknown}; phases {PHASES}, "
                         f"backends {BACKENDS}")
    if args.quantize and args.quantize != "torchao-int8":
        import fusepass

        if not hasattr(fusepass, "quantize"):
            raise SystemExit("fusepass bench e2e: --quantize needs fusepass.quantize, which this version lacks")

    run = Run(args)
    print(f"# fusepass bench e2e on {run.env['device']}: torch {run.env['torch']}, transformers "
          f"{run.env['transformers']}, commit {run.env['commit']}")
    print(f"# {run.model_name}, {run.layers} layer(s), {run.dtype}, {run.device}; copy bandwidth "
          f"{run.copy_gbps:.0f} GB/s; phases {','.join(phases)}", flush=True)
    print(f"# {args.command_line}", flush=True)
    for phase in phases:
        t0 = time.perf_counter()
        {"prefill": phase_prefill, "decode": phase_decode, "replay": phase_replay, "startup": phase_startup}[phase](run)
        run.say(f"phase {phase} done in {time.perf_counter() - t0:.1f} s")
    _vs_inductor(run.rows)
    _host_time(run.rows)

    meta = {**run.meta(), "seconds": round(time.perf_counter() - run.started, 1)}
    output.write_json(run.out / "e2e.json", run.env, run.rows, **meta)
    output.write_csv(run.out / "e2e.csv", run.rows)
    text = render(run.rows)
    header = (f"fusepass bench e2e: {run.model_name}, {run.layers} layer(s), {run.dtype}"
              f"{', ' + args.quantize if args.quantize else ''} on {run.env['device']}\n"
              f"torch {run.env['torch']}, transformers {run.env['transformers']}, commit {run.env['commit']}; "
              f"copy bandwidth {run.copy_gbps:.0f} GB/s\n{args.command_line}\n\n")
    (run.out / "e2e_table.txt").write_text(header + text + "\n")
    if output.plots_available():
        path = output.e2e_plot(run.out, run.rows, run.env["device"])
        plot_note = f"plot: {path.name}" if path else "no plot (no Inductor row to compare with)"
    else:
        plot_note = ("plots skipped: matplotlib is not installed (pip install 'fusepass[bench]'; then "
                     f"`fusepass bench plot --out {run.out}` draws them from the JSON)")
    print(text)
    print(f"\nwrote {run.out}/e2e_table.txt, e2e.json, e2e.csv; {plot_note}; {meta['seconds']} s")
    failed = [r for r in run.rows if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} row(s) failed: " + "; ".join(f"{r['workload']} {r['backend']}: {r.get('error', 'check')}"
                                                           for r in failed), file=sys.stderr)
    return 1 if any(r["backend"] == "fusepass" for r in failed) else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=list(MODELS), default=None,
                   help="default llama3-8b (tiny-llama with --quick)")
    p.add_argument("--layers", default="4", help="decoder layers (default 4), or 'full' for the whole depth")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list (default: eager,inductor,fusepass)")
    p.add_argument("--quick", action="store_true", help="the tiny model on the CPU, a few shapes (CI)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quantize", choices=["int8", "int4", "torchao-int8"], default=None,
                   help="weight-only quantization: int8/int4 through fusepass.quantize, torchao-int8 through "
                        "torchao's Int8WeightOnlyConfig (lm_head stays bf16 in both)")
    p.add_argument("--group-size", type=int, default=128)
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
    p.add_argument("--out", default="bench-out", help="folder for e2e_table.txt, e2e.json/.csv and the plot")
    p.set_defaults(func=main)
