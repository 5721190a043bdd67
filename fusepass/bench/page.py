"""BENCHMARKS.md from one run's files: ``python -m fusepass.bench.page DIR [--out BENCHMARKS.md]``.

``DIR`` holds what ``fusepass bench --out`` and ``fusepass bench e2e --out``
wrote (``benchmarks/gpu_results.sh`` puts every part of the GPU suite under
one folder): each ``results.json`` found below it is a per-op run, each
``e2e.json`` a whole-model run.  The page has one table per op (shapes by
providers, fusepass against Inductor and the copy bandwidth) and one per
whole-model run (workloads by backend), each followed by the device, the
versions, the commit and the command its figures came from.  Nothing on the
page is typed by hand: to change a figure, run the command again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from .output import CPU_NOTE, is_cpu

# Providers in the order the columns show them; others (peers) follow, then fusepass's.
_FIRST = ("eager", "inductor", "inductor-max-autotune")
_UNITS = {"tok/s": ".0f", "s": ".2f", "ms": ".2f"}

INTRO = """\
# Benchmarks

Every figure on this page comes from one run of the GPU suite
(`bash benchmarks/gpu_results.sh`), regenerated with
`python -m fusepass.bench.page <its output folder> --out BENCHMARKS.md`.
Each table names the device, the software versions, the commit and the
command its figures came from; the JSON of the run has every sample.

Per op, times are µs per call from CUDA-graph replays (`do_bench_cudagraph`:
GPU time, no launch cost), each provider checked against an fp32 reference
first ("fails its check": wrong result, not timed); "vs Inductor" is
Inductor's time over fusepass's (above 1: fusepass faster); GB/s counts each
input read once and each output written once, against the copy bandwidth
measured in the same run. Whole models are random-weight `transformers`
models built from the checkpoints' configs (`fusepass bench e2e --help`).
"""


def load(folder: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-op runs, whole-model runs) found under ``folder``, in path order."""
    ops = [json.loads(p.read_text()) | {"path": str(p)} for p in sorted(folder.rglob("results.json"))]
    e2e = [json.loads(p.read_text()) | {"path": str(p)} for p in sorted(folder.rglob("e2e.json"))]
    return ops, e2e


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    if r.get("ok") is False:
        return "fails its check" if "wrong result" in str(r.get("error", "")) else "failed"
    t = r.get("graph_us") if r.get("graph_us") is not None else r.get("time_us")
    return "—" if t is None else f"{t:.1f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(run: dict[str, Any]) -> str:
    env = run.get("env", {})
    parts = [env.get("device", "?"), f"torch {env.get('torch', '?')}", f"Triton {env.get('triton', '?')}"]
    if env.get("transformers") not in (None, "-"):
        parts.append(f"transformers {env['transformers']}")
    parts.append(f"commit {env.get('commit', '?')}")
    if env.get("date"):
        parts.append(env["date"])
    if run.get("copy_gbps"):
        parts.append(f"copy bandwidth {run['copy_gbps']:.0f} GB/s")
    cpu = f" {CPU_NOTE} (times: back-to-back calls)." if is_cpu(env) else ""
    return f"{', '.join(parts)}.{cpu}\n\n    {run.get('command', '?')}"


def _fusepass_provider(providers: list[str]) -> str | None:
    ours = [p for p in providers if p.startswith("fusepass")]
    return "fusepass-compiled" if "fusepass-compiled" in ours else (ours[0] if ours else None)


def op_section(op: str, rows: list[dict[str, Any]], run: dict[str, Any]) -> str:
    """One op's table: a row per shape, a column per provider."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    providers: list[str] = []
    for r in rows:
        if r.get("provider") in (None, "-"):
            continue
        by_shape[r["shape"]][r["provider"]] = r
        if r["provider"] not in providers:
            providers.append(r["provider"])
    ordered = ([p for p in _FIRST if p in providers]
               + [p for p in providers if p not in _FIRST and not p.startswith("fusepass")]
               + [p for p in providers if p.startswith("fusepass")])
    out_rows = []
    for shape, cells in by_shape.items():
        ours = _fusepass_provider([p for p in ordered if p in cells and cells[p].get("time_us")])
        mine = cells.get(ours) if ours else None
        vs = f"{mine['vs_inductor']:.2f}x" if mine and mine.get("vs_inductor") else "—"
        rate = (f"{mine['gbps']:.0f} ({mine['pct_copy']:.0f}%)" if mine and mine.get("gbps") and mine.get("pct_copy")
                else "—")
        out_rows.append([shape, *(_cell(cells.get(p)) for p in ordered), vs, rate])
    headers = ["shape", *ordered, "fusepass vs Inductor", "GB/s (% copy), fusepass"]
    skipped = [r for r in rows if r.get("skipped")]
    note = f"\n\n{len(skipped)} case(s) skipped by the run's time limit." if skipped else ""
    return f"### {op}\n\n{_table(headers, out_rows)}{note}\n\n{provenance(run)}\n"


def e2e_section(run: dict[str, Any]) -> str:
    rows = run["rows"]
    first = rows[0]
    quant = f", {first['quantize']}" if first.get("quantize") not in (None, "-") else ""
    title = f"### {first['model']}, {first['layers']} layer(s), {first['dtype']}{quant}"
    backends: list[str] = []
    by_workload: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by_workload[r["workload"]][r["backend"]] = r
        if r["backend"] not in backends:
            backends.append(r["backend"])
    out_rows = []
    for workload, cells in by_workload.items():
        line = [workload]
        for b in backends:
            r = cells.get(b)
            if r is None:
                line.append("—")
            elif r.get("value") is None:
                line.append("failed" if r.get("ok") is False else "not measured")
            else:
                fmt = _UNITS.get(r["unit"], ".1f")
                extra = f", {r['pct_floor']:.0f}% of floor" if r.get("pct_floor") is not None else ""
                line.append(f"{r['value']:{fmt}} {r['unit']}{extra}")
        ours = cells.get("fusepass")
        line.append(f"{ours['vs_inductor']:.2f}x" if ours and ours.get("vs_inductor") else "—")
        line.append((ours or {}).get("rewrites") or "—")
        out_rows.append(line)
    table = _table(["workload", *backends, "fusepass vs Inductor", "fusepass rewrites"], out_rows)
    return f"{title}\n\n{table}\n\n{provenance(run)}\n"


def render(ops: list[dict[str, Any]], e2e: list[dict[str, Any]]) -> str:
    parts = [INTRO]
    if ops:
        parts.append("## Per op (`fusepass bench`)\n")
        for run in ops:
            by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in run["rows"]:
                by_op[r["op"]].append(r)
            parts += [op_section(op, rows, run) for op, rows in by_op.items()]
    if e2e:
        parts.append("## Whole models (`fusepass bench e2e`)\n")
        parts += [e2e_section(run) for run in e2e if run.get("rows")]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusepass.bench.page", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a run's output folder (results.json and e2e.json files anywhere below it)")
    p.add_argument("--out", default=None, help="write the page here (default: print it)")
    args = p.parse_args(argv)
    ops, e2e = load(Path(args.folder))
    if not ops and not e2e:
        raise SystemExit(f"no results.json or e2e.json under {args.folder}")
    text = render(ops, e2e)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {len(ops)} per-op run(s), {len(e2e)} whole-model run(s)")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
