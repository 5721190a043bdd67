"""``fusepass tune --step``: the quantized linears' plans chosen by timing a model's decode step.

Timed alone, on a ring of cold copies of one weight (``fusepass tune``), a
plan can rank otherwise than inside the model, where x comes warm from the
kernel before and each launch starts while the one before it ends (PDL).
H200, Llama-3-8B int4, 8 layers, batch 1 (b049d0c): the q / k / v and gate /
up groups' four-row tiles timed 3-4% slower alone than the eight-row ones,
and made the step 3.3% faster (820.0 against 848.9 µs).  So this times the
step itself: the model (one of ``fusepass bench e2e``'s, random weights) is
compiled once with fusepass, its ops called rather than inlined, so that
each call looks its plan up; the step is captured in a CUDA graph and timed.
Then for each plan the step looked up (one-weight linears and groups of
siblings; the largest weights first) each candidate of the tuner is pinned,
the step captured again and timed, and the fastest kept where it beats the
plan in place by more than ``min_gain`` (the step moved 0.3% between two
timings of one plan there): a coordinate descent, one plan at a time, each
timed with the choices made before it.  Kept plans go to the user cache,
marked ``"where": "step"`` with the step's time as their ``us``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch


@dataclass(frozen=True)
class Trial:
    """One timing of the step: ``cfg`` pinned for ``key`` (None: the plans in place)."""

    key: Any
    cfg: Any
    us: float


@dataclass
class Choice:
    """A plan's outcome: the plan it started with, the one kept, the step's time with each."""

    key: Any
    before: Any
    after: Any
    us_before: float
    us_after: float


def search(keys: Iterable[tuple[Any, Any]], candidates: Callable[[Any], list[Any]], measure: Callable[[], float],
           pin: Callable[[Any, Any], None], min_gain: float = 0.005, budget_s: float | None = None,
           say: Callable[[str], None] = print) -> tuple[list[Choice], list[Trial]]:
    """For each (key, plan in place), in order: the step timed with the plan in
    place, then with each other candidate pinned; the fastest kept (pinned)
    where it is faster by more than ``min_gain`` of the step, else the plan in
    place (a key with no other candidate keeps it, untimed).  A candidate that
    fails (compile, launch) is skipped with a line.
    Past ``budget_s`` seconds no new candidate is timed (the plans in place
    stay for the keys not reached)."""
    t0 = time.perf_counter()
    choices: list[Choice] = []
    trials: list[Trial] = []
    last = float("nan")  # the step's time with the plans pinned so far
    for key, start in keys:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            say(f"budget spent: {key} and later keep their plans")
            choices.append(Choice(key, start, start, last, last))
            continue
        others = [cfg for cfg in candidates(key) if cfg != start]
        pin(key, start)
        if not others:  # nothing to try: the plan in place stays, the step is not timed for it
            choices.append(Choice(key, start, start, last, last))
            continue
        us0 = measure()
        trials.append(Trial(key, None, us0))
        best, best_us = start, us0
        for cfg in others:
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                break
            pin(key, cfg)
            try:
                us = measure()
            except Exception as exc:  # noqa: BLE001 - a plan that does not compile or run is skipped
                first = str(exc).splitlines()[0][:100] if str(exc) else ""
                say(f"  {_label(cfg)}: failed ({type(exc).__name__}: {first})")
                continue
            trials.append(Trial(key, cfg, us))
            if us < best_us and us < us0 * (1.0 - min_gain):
                best, best_us = cfg, us
        pin(key, best)
        last = best_us
        choices.append(Choice(key, start, best, us0, best_us))
        say(f"{key}: {_label(start)} {us0:.1f} µs -> {_label(best)} {best_us:.1f} µs")
    return choices, trials


def _label(cfg: Any) -> str:
    return cfg.label() if hasattr(cfg, "label") else str(cfg)


def tune_step(model_name: str, layers: str, fmt: str, group_size: int, batch: int = 1, prompt: int = 128,
              replays: int = 50, min_gain: float = 0.005, budget_s: float | None = None, save: bool = True,
              say: Callable[[str], None] = print,
              candidates: Callable[[Any], list[Any]] | None = None,
              without: Sequence[str] = ()) -> tuple[list[Choice], float, float]:
    """Tune the plans of ``model_name``'s decode step at ``batch`` on the current
    GPU (see the module docstring); (choices, the step's µs with the plans
    found in place, with the plans kept), both timed again at the end.  Without
    a GPU, under the Triton interpreter with the ops' CUDA bodies serving CPU
    tensors (``testing.differential.triton_on_cpu``, the tests): the step
    called once a timing, in fp32, no CUDA graph.  ``candidates``: the plans
    tried for a key (default: the tuner's and the heuristic's).  ``without``:
    rules the step is compiled without (``fusepass bench e2e``'s
    ``fusepass-no:RULE`` variant), whose plans then differ."""
    from fusepass.kernels.dequant_matmul import plans, tuner

    from ..timing import time_replays
    from .models import MODELS, _layers, build, quantize
    from .phases import decode_step
    from .run import VARIANT, _fresh

    from fusepass.kernels._common import interpreting

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreting():
        raise SystemExit("fusepass tune --step: timing needs a CUDA GPU")
    n_layers = _layers(MODELS[model_name], layers)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = quantize(build(model_name, n_layers, dtype, device), fmt, group_size)
    backend = VARIANT + "+".join(without) if without else "fusepass"
    fn = _fresh(model, backend, captured=True, fullgraph=True)  # op calls: each looks its plan up

    def ids_of(b: int, seq: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randint(0, model.config.vocab_size, (b, seq), generator=g).to(device)

    with torch.no_grad():
        step, _cache = decode_step(model, fn, ids_of, batch, prompt, prompt + 8, device)

        def measure() -> float:
            """µs per step: the step captured again (its launches take the plans pinned now), replayed."""
            if device == "cpu":
                t0 = time.perf_counter()
                step()
                return (time.perf_counter() - t0) * 1e6
            return time_replays(step, replays).median * 1e3

        say(f"{model_name}, {n_layers} layers, {fmt}, batch {batch}: compiling and timing the step")
        found = measure()
        rows = batch  # the linears' rows at one token a sequence
        keys = [(p, cfg) for p, cfg in plans.looked_up().items() if p.M == _bucket(rows)]
        keys.sort(key=lambda kc: -kc[0].N * kc[0].K)
        if not keys:
            raise SystemExit(f"fusepass tune --step: the step of {model_name} looked no quantized-linear plan up "
                             f"(--quantize {fmt})")
        say(f"{len(keys)} plans in the step ({found:.1f} µs): "
            + ", ".join(f"M{p.M} N{p.N} K{p.K} {cfg.label()}" for p, cfg in keys))

        def every(p: Any) -> list[Any]:
            return list(dict.fromkeys(tuner.candidates(p) + [plans.heuristic(p)]))

        choices, _ = search(keys, candidates or every, measure, plans.pin, min_gain, budget_s, say)
        for p, cfg in keys:  # the plans found in place, timed again beside the kept ones
            plans.pin(p, cfg)
        before = measure()
        for c in choices:
            plans.pin(c.key, c.after)
        after = measure()
    if save:
        for c in choices:
            if c.after != c.before:
                plans.save(c.key, c.after, after, where="step")
    return choices, before, after


def _bucket(M: int) -> int:
    from fusepass.kernels.dequant_matmul import m_bucket

    return m_bucket(M)
