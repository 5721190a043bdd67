"""The timed phases of ``fusepass bench e2e``: prefill (one forward, logits
checked first), decode (tokens/s through ``generate`` with CUDA graphs) and
replay (the decode step captured once and replayed back to back; its logits
checked first, against the same references as prefill's, and a step that
fails the check keeps its time in a row marked not ok)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..ops import rel_err
from ..timing import Timing, sync, time_cpu, time_replays
from .run import Run, _fresh, _report_text, _start_report, graphs_compile_args


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
    """The logits of one forward at each length that every backend is checked against (see ``_references``)."""
    def logits(m: torch.nn.Module, t: int) -> torch.Tensor:
        return m(input_ids=run.ids(1, t), use_cache=False, logits_to_keep=1).logits.float()

    return _references(run, model, lengths, logits, "prefill")


def _references(run: Run, model: torch.nn.Module, keys: list[int], logits: Callable[[torch.nn.Module, int], Any],
                phase: str) -> tuple[dict[int, torch.Tensor], dict[int, float], str]:
    """Per key, the logits every backend is checked against (``logits(model, key)``), eager's own error
    against them, and what they are.

    In half precision, eager's logits are themselves off by bf16 rounding over
    every layer (2% at 4 layers is ordinary), so a check against them flags
    any backend whose rounding differs.  The reference is an fp32 copy of the
    model when one fits and converts; a backend passes within twice eager's
    error (or Inductor's, or the dtype's tolerance).  Otherwise eager's own
    logits, as before.
    """
    with torch.no_grad():
        expected = {k: logits(model, k) for k in keys}
    if run.dtype == torch.float32:
        return expected, {}, "eager (fp32)"
    import copy

    try:
        ref_model = copy.deepcopy(model).float()
        with torch.no_grad():
            ref = {k: logits(ref_model, k) for k in keys}
    except Exception as exc:  # noqa: BLE001 - out of memory, a weight type with no fp32 form: eager it is
        run.say(f"{phase}: no fp32 reference ({type(exc).__name__}); checking against eager")
        return expected, {}, f"eager ({str(run.dtype).replace('torch.', '')})"
    finally:
        ref_model = None
        if run.cuda:
            torch.cuda.empty_cache()
    return ref, {k: rel_err(expected[k], ref[k]) for k in keys}, "an fp32 copy of the model"


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
                    cc = CompileConfig(**graphs_compile_args(backend), fullgraph=True)
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
    from fusepass.kernels._common import tolerance

    model = run.get_model()
    prompt = run.args.prompt
    batches = [int(b) for b in run.args.batch.split(",")]
    expected, eager_err, reference = _replay_references(run, model, batches)
    run.say(f"replay: each step's logits checked against {reference}")
    inductor_err: dict[int, float] = {}
    # Eager last: a capture that fails (a host sync inside eager code) must not
    # leave the compiled backends a device in a bad state.
    for backend in sorted(run.backends, key=lambda b: b == "eager"):
        fn = _fresh(model, backend, captured=run.cuda, fullgraph=True)
        _start_report(backend)
        for batch in batches:
            if run.over_budget("replay", f"replay B{batch}", backend):
                continue
            run.say(f"replay B={batch} {backend}: compiling and capturing")
            try:
                with torch.no_grad():
                    step, cache = decode_step(model, fn, run.ids, batch, prompt, prompt + run.args.new_tokens,
                                              run.device)
                    err = rel_err(step().float(), expected[batch])
                    if backend == "inductor":
                        inductor_err[batch] = err
                    limit = max(tolerance(run.dtype).rtol, 2 * eager_err.get(batch, 0.0),
                                2 * inductor_err.get(batch, 0.0))
                    if run.cuda:
                        replays = run.args.replays
                        per = time_replays(step, replays)
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
            # (a step whose logits fail the check keeps its time, marked: the row says both)
            ok = err <= limit
            run.add(phase="replay", workload=f"replay B{batch}", backend=backend, ok=ok, value=per.median * 1e3,
                    p20=per.p20 * 1e3, p80=per.p80 * 1e3, unit="µs/step", tokens_per_s=batch / per.median * 1e3,
                    floor_ms=floor, pct_floor=100 * floor / per.median, rewrites=_report_text(backend), notes=how,
                    rel_err=err, check_limit=limit, **prof,
                    **({} if ok else {"error": f"logits differ from {reference}: {err:.2e} > {limit:.1e}"}))
            run.say(f"replay B={batch} {backend}: {per.median * 1e3:.1f} µs/step (floor {floor * 1e3:.1f} µs)"
                    + ("" if ok else f"; logits differ: {err:.2e} > {limit:.1e}"))
            del cache, step
            if run.cuda:
                torch.cuda.empty_cache()


def _replay_references(run: Run, model: torch.nn.Module,
                       batches: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, float], str]:
    """The decode step's logits at each batch size that every backend is checked against (see
    ``_references``)."""
    prompt = run.args.prompt

    def logits(m: torch.nn.Module, batch: int) -> torch.Tensor:
        step, _cache = decode_step(m, m, run.ids, batch, prompt, prompt + run.args.new_tokens, run.device)
        return step().float()

    return _references(run, model, batches, logits, "replay")


def decode_step(model: torch.nn.Module, fn: Callable[..., Any], ids_of: Callable[..., torch.Tensor], batch: int,
                prompt: int, max_len: int, device: str) -> tuple[Callable[[], torch.Tensor], Any]:
    """(step, cache): one decode step of ``fn`` (``model`` compiled, or the model)
    at position ``prompt`` of a static cache that ``model`` filled with a prompt
    of ``ids_of(batch, prompt)``; every call writes that position again (call
    it under ``torch.no_grad()``)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    model(input_ids=ids_of(batch, prompt), past_key_values=cache, use_cache=True)  # fill it
    ids = ids_of(batch, 1, seed=2)
    pos = torch.tensor([prompt], device=device)
    position_ids = pos.expand(batch, 1)
    rewind = _rewinder(cache, prompt)

    def step() -> torch.Tensor:
        # Every replay writes position `prompt` again: the cache's own
        # write counter (transformers >= 5.x) is set back first.
        rewind()
        return fn(input_ids=ids, past_key_values=cache, position_ids=position_ids,
                  cache_position=pos, use_cache=True).logits

    return step, cache


def _rewinder(cache: Any, position: int) -> Callable[[], None]:
    """A function that sets a static cache's write position back to ``position``.

    Recent transformers keep it in a tensor per layer (``cumulative_length``,
    advanced by every update: replaying a step would write past the end);
    older ones take ``cache_position`` from the call and need nothing.
    Sliding-window layers also count in a Python int (``cumulative_length_int``)
    that Dynamo guards on: left to grow, every call recompiled, the fourth
    inside the CUDA-graph capture, where the step's ``torch.tensor(..., device=
    "cuda")`` calls fail (gpt-oss-20b, transformers 5.17: "Cannot copy between
    CPU and CUDA tensors during CUDA graph capture").

    The counters are set in one launch (a fill a layer put a ~1 µs kernel a
    layer into every backend's replayed step: 48 of them in Qwen3-30B-A3B's,
    H200, which is the harness's time, not the model's).
    """
    layers = getattr(cache, "layers", [])
    counters = [layer.cumulative_length for layer in layers
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    ints = [layer for layer in layers if isinstance(getattr(layer, "cumulative_length_int", None), int)]
    values = {(c.device, c.dtype): torch.full_like(c, position) for c in counters}
    sources = [values[c.device, c.dtype] for c in counters]

    def rewind() -> None:
        if counters:
            torch._foreach_copy_(counters, sources)
        for layer in ints:
            layer.cumulative_length_int = position

    return rewind
