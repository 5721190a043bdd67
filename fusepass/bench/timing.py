"""Timers, the copy-bandwidth ceiling and the run's environment, shared by
``fusepass bench`` and ``fusepass bench e2e``.

On CUDA every figure comes from Triton's timers: ``do_bench_cudagraph``
(replays of a CUDA graph holding the call: the GPU time alone) and
``do_bench`` (plain launches, CPU launch cost included).  On the CPU there are
no graphs: calls run back to back, timed with ``time.perf_counter`` in blocks
of at least a millisecond.  Quantiles are always (median, p20, p80).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

QUANTILES = [0.5, 0.2, 0.8]


@dataclass
class Timing:
    """Milliseconds per call: median, p20, p80."""

    median: float
    p20: float
    p80: float

    @classmethod
    def of(cls, values: list[float] | tuple[float, ...] | float) -> Timing:
        if isinstance(values, (int, float)):
            return cls(float(values), float(values), float(values))
        return cls(*map(float, values))

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        qs = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
        return cls(statistics.median(samples), qs[1], qs[7])


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_cpu(fn: Callable[[], Any], rep_ms: float = 100.0, min_samples: int = 5) -> Timing:
    """Back-to-back calls on the CPU, in blocks of >= 1 ms; ms per call."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(1e-3 / one))
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(samples) < min_samples or (time.perf_counter() < deadline and len(samples) < 1000):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e3)
    return Timing.from_samples(samples)


def time_plain(fn: Callable[[], Any], device: str | torch.device, rep_ms: float) -> Timing:
    """Plain calls: ``do_bench`` on CUDA (L2 flushed, events per call), back-to-back loops on the CPU."""
    if torch.device(device).type != "cuda":
        return time_cpu(fn, rep_ms)
    import triton.testing

    return Timing.of(triton.testing.do_bench(fn, rep=rep_ms, quantiles=QUANTILES))


def time_graph(fn: Callable[[], Any], rep_ms: float) -> Timing:
    """Replays of a CUDA graph of ``fn`` (``do_bench_cudagraph``): GPU time alone."""
    import triton.testing

    return Timing.of(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=QUANTILES))


def time_events(fn: Callable[[], Any], reps: int) -> Timing:
    """CUDA: milliseconds per call, CUDA events around each of ``reps`` calls
    after one warm-up call (lazy allocations, first-launch costs)."""
    fn()
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


def time_replays(fn: Callable[[], Any], replays: int, reps: int = 5) -> Timing:
    """CUDA: milliseconds per call of ``fn`` captured once in a CUDA graph
    (:func:`captured`) and replayed ``replays`` times between two events, ``reps`` times."""
    replay = captured(fn)
    for _ in range(10):
        replay()

    def replay_k() -> None:
        for _ in range(replays):
            replay()

    per = time_events(replay_k, reps)
    return Timing(per.median / replays, per.p20 / replays, per.p80 / replays)


def captured(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` captured in one CUDA graph after three warm-up calls on a side stream; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(device: str | torch.device) -> float:
    """Device-to-device ``copy_`` of a large bf16 buffer, bytes read + written per second, in GB/s.

    CUDA: 1 GiB, CUDA-graph time (the same timer as the ops' GB/s).  CPU:
    64 MiB, back-to-back copies.
    """
    device = torch.device(device)
    numel = (1 << 29) if device.type == "cuda" else (1 << 25)
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        ms = time_graph(lambda: dst.copy_(src), rep_ms=200).median
    else:
        ms = time_cpu(lambda: dst.copy_(src), rep_ms=200).median
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * numel * 2 / ms / 1e6


def commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``FUSEPASS_COMMIT``."""
    if os.environ.get("FUSEPASS_COMMIT"):
        return os.environ["FUSEPASS_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):  # not a checkout (an installed wheel, the device copy)
        return "unknown"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: say so, do not fail the run
        return "-"


def environment(device: str | torch.device) -> dict[str, str]:
    """What a figure is only good for: the device, the versions, the commit."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} threads visible, " \
               f"torch uses {torch.get_num_threads()})"
    return {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
    }


# Kernel names -> what they are, for the profile's breakdown (first match wins;
# names starting "triton_" are Inductor's whatever ops they quote: see _kind).
_KINDS = [
    ("fusepass quantized linear", ("_dequant_", "_splitk_reduce")),
    ("fusepass GDN", ("_gdn_",)),
    ("fusepass norm/activation", ("_rms_norm", "_gated_act")),
    ("fusepass projections of one x", ("_linear_siblings",)),
    ("fusepass MoE", ("_moe_",)),
    ("fusepass attention", ("_decode_attention",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("cuBLAS/CUTLASS matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "splitkreduce")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
]


def _kind(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):  # Inductor's, whatever ops its name quotes (a fusepass op it feeds, too)
        return "Inductor-generated"
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other aten")


def profile_kernels(fn: Callable[[], Any], calls: int = 3) -> dict[str, Any]:
    """Every GPU kernel of ``calls`` plain calls of ``fn`` (torch.profiler), per call.

    Returns the kernel count and summed kernel time per call, the GPU's busy
    span (first kernel start to last kernel end, so ``span - busy`` is the
    time between kernels), totals per kind of kernel and the kernels taking
    the most time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    per_name: dict[str, list[float]] = {}
    spans: list[float] = []
    count = 0
    for _ in range(calls):  # one profile per call: its kernels' span is the call's
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        count += len(events)
        for e in events:
            per_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        if events:
            spans.append(max(e.time_range.end for e in events) - min(e.time_range.start for e in events))
    kinds: dict[str, list[float]] = {}
    for name, ts in per_name.items():
        k = kinds.setdefault(_kind(name), [0.0, 0.0])
        k[0] += sum(ts) / calls / 1e3
        k[1] += len(ts) / calls
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    busy = sum(sum(ts) for ts in per_name.values()) / calls / 1e3
    return {
        "kernels_per_call": count / calls,
        "kernel_ms_per_call": busy,
        "span_ms_per_call": statistics.median(spans) / 1e3 if spans else 0.0,
        "kinds": {k: {"ms": round(v[0], 4), "kernels": round(v[1], 1)}
                  for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
        "top": [{"kernel": name[:120], "kind": _kind(name), "calls": len(ts) / calls,
                 "ms": round(sum(ts) / calls / 1e3, 4)} for name, ts in top],
    }


def render_profile(title: str, prof: dict[str, Any]) -> str:
    """The profile as text: totals, then per kind, then the top kernels."""
    from .output import table

    head = (f"{title}: {prof['kernels_per_call']:.0f} kernels per call, {prof['kernel_ms_per_call']:.3f} ms of "
            f"kernel time, GPU span {prof['span_ms_per_call']:.3f} ms (plain launches)")
    kinds = table([[k, f"{v['ms']:.3f}", f"{v['kernels']:.0f}"] for k, v in prof["kinds"].items()],
                  ["kind", "ms/call", "kernels/call"])
    top = table([[t["kernel"][:80], t["kind"], f"{t['calls']:.0f}", f"{t['ms']:.3f}"] for t in prof["top"]],
                ["kernel", "kind", "calls/call", "ms/call"])
    return f"{head}\n{kinds}\n\n{top}\n"
