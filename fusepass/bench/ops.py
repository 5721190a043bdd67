"""``fusepass bench``: check and time every registered op against its providers.

The registry is the package :mod:`fusepass.bench.registry`: each
``registry/<op>.py`` with a ``cases(quick: bool = False, device: str =
"cuda") -> list[Case]`` function is an entry (``Case`` is in
``registry/common.py``); a new file joins by being there (``--registry DIR``
reads another folder of such files instead).  Every provider
of a case is first run on the case's inputs and compared with its fp32
reference (relative error norm against the dtype's tolerance); one that fails
or raises is reported, not timed.  The rest are timed in the same process:
on CUDA, replays of a CUDA graph (GPU time, which gives the GB/s) and plain
launches (``do_bench``); on the CPU, back-to-back calls.  Each row carries
median and p20/p80, GB/s or TFLOP/s, the share of the copy bandwidth measured
in the same run, and the device, versions and commit.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from . import output
from .timing import copy_bandwidth, environment, sync, time_graph, time_plain

# ms per timer per provider on full runs.  do_bench_cudagraph captures a graph
# of calls lasting about this long and replays it ten times: at 100 ms a
# provider cost about 1.1 s of timing (the norms and activations' 130 rows 145
# s of a 179 s run, H100), and the suite needed about 640 s at 25 ms, summed over
# its parts (commits 1e572c0/9fab920).  At 10 ms each replay is still a thousand calls of a 10-µs
# kernel; calls longer than 10 ms (eager GDN loops) get one per replay.
DEFAULT_REP_MS = 10.0

# Files in the registry folder that are not entries.
_NOT_ENTRIES = {"common", "__init__", "run"}
PACKAGE_REGISTRY = Path(__file__).resolve().parent / "registry"


def find_registry(path: str | None = None) -> Path:
    """The registry folder: ``--registry``, ``FUSEPASS_BENCHMARKS``, else the package's own."""
    chosen = path or os.environ.get("FUSEPASS_BENCHMARKS")
    if not chosen:
        return PACKAGE_REGISTRY
    if not Path(chosen).is_dir():
        raise SystemExit(f"fusepass bench: no registry folder at {chosen}")
    return Path(chosen).resolve()


def entry_names(registry: Path = PACKAGE_REGISTRY) -> list[str]:
    return sorted(p.stem for p in registry.glob("*.py")  # a script without cases() (a GPU check) is no entry
                  if p.stem not in _NOT_ENTRIES and not p.stem.startswith(("_", "sweep"))
                  and "\ndef cases(" in p.read_text())


def load_entry(registry: Path, name: str) -> Any:
    if registry == PACKAGE_REGISTRY:
        return importlib.import_module(f"fusepass.bench.registry.{name}")
    # Another folder's entry, by its path (it imports Case from fusepass.bench.registry.common).
    spec = importlib.util.spec_from_file_location(f"_fusepass_registry_{name}", registry / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def entry_cases(module: Any, quick: bool, device: str) -> list[Any]:
    params = inspect.signature(module.cases).parameters
    if "device" in params:
        return list(module.cases(quick=quick, device=device))
    if device != "cuda":  # an entry from before the device argument: its inputs are CUDA tensors
        raise RuntimeError(f"cases() takes no device argument, so it cannot run on {device}")
    return list(module.cases(quick))


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def rel_err(out: Any, ref: Any) -> float:
    """Worst relative error norm over the outputs (inf when a shape differs or a value is not finite)."""
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, refs):
        if not isinstance(r, torch.Tensor):
            continue
        if not isinstance(o, torch.Tensor) or o.shape != r.shape:
            return float("inf")
        o64, r64 = o.detach().double(), r.detach().double()
        if not torch.isfinite(o64).all():
            return float("inf")
        worst = max(worst, ((o64 - r64).norm() / r64.norm().clamp_min(1e-30)).item())
    return worst


def tolerance_for(case: Any) -> float:
    from fusepass.kernels._common import tolerance

    limit = getattr(case, "tolerance", None)
    return limit if limit is not None else tolerance(case.dtype).rtol


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"


def run_case(case: Any, device: str, rep_ms: float, env: dict[str, Any], copy_gbps: float,
             providers: set[str] | None, progress: output.Progress) -> list[dict[str, Any]]:
    base = {"op": case.op, "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""),
            "bytes_moved": case.bytes_moved, "flops": getattr(case, "flops", None) or None,
            "notes": dict(case.notes)}
    names = [p for p in case.providers if providers is None or p in providers]
    try:
        torch.manual_seed(0)
        inputs = case.make_inputs()
        ref = case.reference(*inputs)
    except Exception as exc:  # noqa: BLE001 - an entry that cannot build its inputs is reported
        for name in names:
            progress.step(f"{case.op} {case.shape} {name}")
        return [{**base, "provider": p, "ok": False, "error": f"inputs/reference: {_error_text(exc)}", **env}
                for p in names]
    limit = tolerance_for(case)
    rows = []
    for name in names:
        fn = case.providers[name]
        row = {**base, "provider": name, **env, "tolerance": limit}
        progress.step(f"{case.op} {case.shape} {name}")
        t0 = time.perf_counter()
        try:
            out = fn(*inputs)
            sync(device)
            row["first_call_s"] = round(time.perf_counter() - t0, 3)  # compile included, if any
            err = rel_err(out, ref)
            del out
            row.update(rel_err=err, ok=err <= limit)
            if not row["ok"]:
                row["error"] = f"wrong result: relative error {err:.2e} > {limit:.1e}; not timed"
                row["seconds"] = round(time.perf_counter() - t0, 3)
                rows.append(row)
                continue
            call = lambda: fn(*inputs)  # noqa: E731
            plain = time_plain(call, device, rep_ms)
            graph = time_graph(call, rep_ms) if device == "cuda" else None
        except Exception as exc:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
            row.update(ok=False, error=_error_text(exc), seconds=round(time.perf_counter() - t0, 3))
            if os.environ.get("FUSEPASS_BENCH_TRACEBACK"):
                traceback.print_exc()
            rows.append(row)
            continue
        # Wall time of this provider in the run: first call (compile, autotuning), check and timing.
        row["seconds"] = round(time.perf_counter() - t0, 3)
        best = graph or plain  # GB/s from the GPU time where there is one
        row.update(
            plain_us=plain.median * 1e3, plain_p20_us=plain.p20 * 1e3, plain_p80_us=plain.p80 * 1e3,
            graph_us=graph.median * 1e3 if graph else None,
            graph_p20_us=graph.p20 * 1e3 if graph else None,
            graph_p80_us=graph.p80 * 1e3 if graph else None,
            time_us=best.median * 1e3, timer="cuda-graph replays" if graph else f"{device}: back-to-back calls",
            gbps=case.bytes_moved / best.median / 1e6 if case.bytes_moved else None,
            tflops=row["flops"] / best.median / 1e9 if row["flops"] else None,
            copy_gbps=copy_gbps,
        )
        row["pct_copy"] = 100 * row["gbps"] / copy_gbps if row["gbps"] else None
        rows.append(row)
    inductor = next((r for r in rows if r["provider"] == "inductor" and r.get("time_us")), None)
    for r in rows:
        r["vs_inductor"] = inductor["time_us"] / r["time_us"] if inductor and r.get("time_us") else None
    del inputs, ref
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _fmt(v: Any, spec: str, default: str = "-") -> str:
    return default if v is None else format(v, spec)


def render(rows: list[dict[str, Any]], device: str) -> str:
    gpu = device == "cuda"
    lines = []
    for r in rows:
        if r.get("error") or r.get("skipped"):
            check = r.get("skipped") or r["error"]
        else:
            check = f"ok {r['rel_err']:.1e}"
        t = (f"{_fmt(r.get('graph_us'), '.1f')} ({_fmt(r.get('graph_p20_us'), '.1f')}-"
             f"{_fmt(r.get('graph_p80_us'), '.1f')})") if gpu else None
        p = (f"{_fmt(r.get('plain_us'), '.1f')} ({_fmt(r.get('plain_p20_us'), '.1f')}-"
             f"{_fmt(r.get('plain_p80_us'), '.1f')})")
        rate = _fmt(r.get("tflops"), ".1f") + " TF/s" if r.get("tflops") else _fmt(r.get("gbps"), ".0f")
        lines.append([r["op"], r["shape"], r["provider"], *([t] if gpu else []), p, rate,
                      _fmt(r.get("pct_copy"), ".0f") + ("%" if r.get("pct_copy") is not None else ""),
                      _fmt(r.get("vs_inductor"), ".2f") + ("x" if r.get("vs_inductor") else ""), check])
    headers = ["op", "shape", "provider", *(["graph µs (p20-p80)"] if gpu else []), "plain µs (p20-p80)",
               "GB/s", "% copy", "vs inductor", "check"]
    return output.table(lines, headers)


def time_split(rows: list[dict[str, Any]], top: int = 5) -> str:
    """Where the run's time went: seconds per entry, and the slowest first calls (compiles, autotuning)."""
    per_op: dict[str, float] = {}
    for r in rows:
        per_op[r["op"]] = per_op.get(r["op"], 0.0) + (r.get("seconds") or 0.0)
    slow = sorted((r for r in rows if r.get("first_call_s")), key=lambda r: -r["first_call_s"])[:top]
    return ("time per entry: " + ", ".join(f"{op} {s:.0f} s" for op, s in per_op.items())
            + "; slowest first calls: " + ", ".join(f"{r['provider']} {r['shape']} {r['first_call_s']:.1f} s"
                                                   for r in slow))


def main(args: argparse.Namespace) -> int:
    import fusepass  # noqa: F401 - registers the ops

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusepass bench: --device cuda, but no CUDA device is visible")
    if device == "cpu":
        torch.set_num_threads(args.threads or 1)  # stable on a busy machine: see fusepass.bench.e2e.Run
    rep_ms = args.rep if args.rep is not None else (20.0 if args.quick else DEFAULT_REP_MS)
    registry = find_registry(args.registry)
    names = entry_names(registry)
    wanted = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else names
    unknown = [o for o in wanted if o not in names]
    if unknown:
        raise SystemExit(f"fusepass bench: unknown op(s) {unknown}; the registry at {registry} has {names}")
    providers = {p.strip() for p in args.providers.split(",")} if args.providers else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command_line

    torch.manual_seed(0)
    env = {**environment(device)}
    copy_gbps = copy_bandwidth(device)
    print(f"# fusepass bench on {env['device']}: torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    print(f"# measured copy bandwidth: {copy_gbps:.0f} GB/s (bytes read + written); registry {registry}")
    if device == "cpu":
        print(f"# {output.CPU_NOTE}")
    print(f"# {command}", flush=True)

    rows: list[dict[str, Any]] = []
    entries: list[tuple[str, list[Any]]] = []
    for name in wanted:
        try:
            entries.append((name, entry_cases(load_entry(registry, name), args.quick, device)))
        except Exception as exc:  # noqa: BLE001 - one broken entry must not stop the others
            rows.append({"op": name, "shape": "-", "dtype": "-", "provider": "-", "ok": False,
                         "error": f"entry failed to load: {_error_text(exc)}", **env})
    total = sum(len([p for p in c.providers if providers is None or p in providers]) for _, cs in entries for c in cs)
    progress = output.Progress(total, "fusepass bench")
    started = time.perf_counter()
    meta = {"command": command, "copy_gbps": copy_gbps, "quick": args.quick}
    for name, cases in entries:
        for case in cases:
            if args.max_seconds and time.perf_counter() - started > args.max_seconds:
                rows.append({"op": case.op, "shape": case.shape, "provider": "-", "ok": None,
                             "skipped": f"skipped: past --max-seconds {args.max_seconds:.0f}", **env})
                progress.note(f"skipped {case.op} {case.shape}: past --max-seconds")
                continue
            rows += run_case(case, device, rep_ms, env, copy_gbps, providers, progress)
            # Written as the run goes: a run cut short still leaves its figures.
            output.write_json(out / "results.json", env, rows, **meta)
    progress.close()
    meta["seconds"] = round(time.perf_counter() - started, 1)

    output.write_json(out / "results.json", env, rows, **meta)
    output.write_csv(out / "results.csv", rows)
    text = render(rows, device)
    header = (f"fusepass bench: {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}\n"
              f"copy bandwidth {copy_gbps:.0f} GB/s; "
              f"{'GB/s from CUDA-graph time' if device == 'cuda' else 'CPU: back-to-back calls'}"
              f"; vs inductor = Inductor's time / this time\n{command}\n"
              + (f"{output.CPU_NOTE}\n" if device == "cpu" else "") + "\n")
    (out / "table.txt").write_text(header + text + "\n")
    if output.plots_available():
        plots = output.replot(out)
        plot_note = f"plots: {', '.join(p.name for p in plots)}"
    else:
        plot_note = ("plots skipped: matplotlib is not installed (pip install 'fusepass[bench]'; then "
                     f"`fusepass bench plot --out {out}` draws them from the JSON)")

    failed = [r for r in rows if r.get("ok") is False]
    ours = [r for r in failed if str(r.get("provider", "")).startswith("fusepass") or r.get("provider") == "-"]
    print(text)
    if device == "cpu":
        print(f"\n{output.CPU_NOTE}")
    print(f"\nwrote {out}/table.txt, results.json, results.csv; {plot_note}; {meta['seconds']} s")
    print(time_split(rows))
    if failed:
        print(f"{len(failed)} provider(s) failed their check or did not run "
              f"({len(ours)} of them fusepass's or an entry's): see the check column", file=sys.stderr)
    return 1 if ours else 0
