"""The rows of a ``fusepass bench e2e`` run compared and rendered: speed-up
over Inductor, the host's share of a decode step, the table."""

from __future__ import annotations

import sys
import time
from typing import Any

from .. import output
from .run import Run, fusepass_options


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


def finish(run: Run) -> int:
    """Compare, write the run's files, print the table; the exit status (1 when a fusepass row failed)."""
    _vs_inductor(run.rows)
    _host_time(run.rows)
    args = run.args
    meta = {**run.meta(), "seconds": round(time.perf_counter() - run.started, 1)}
    output.write_json(run.out / "e2e.json", run.env, run.rows, **meta)
    output.write_csv(run.out / "e2e.csv", run.rows)
    text = render(run.rows)
    header = (f"fusepass bench e2e: {run.model_name}, {run.layers} layer(s), {run.dtype}"
              f"{', ' + args.quantize if args.quantize else ''} on {run.env['device']}\n"
              f"torch {run.env['torch']}, transformers {run.env['transformers']}, commit {run.env['commit']}; "
              f"copy bandwidth {run.copy_gbps:.0f} GB/s\n{args.command_line}\n"
              + ("" if run.cuda else f"{output.CPU_NOTE}\n") + "\n")
    (run.out / "e2e_table.txt").write_text(header + text + "\n")
    if output.plots_available():
        path = output.e2e_plot(run.out, run.rows, output.device_title(run.env))
        plot_note = f"plot: {path.name}" if path else "no plot (no Inductor row to compare with)"
    else:
        plot_note = ("plots skipped: matplotlib is not installed (pip install 'fusepass[bench]'; then "
                     f"`fusepass bench plot --out {run.out}` draws them from the JSON)")
    print(text)
    if not run.cuda:
        print(f"\n{output.CPU_NOTE}")
    print(f"\nwrote {run.out}/e2e_table.txt, e2e.json, e2e.csv; {plot_note}; {meta['seconds']} s")
    failed = [r for r in run.rows if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} row(s) failed: " + "; ".join(f"{r['workload']} {r['backend']}: {r.get('error', 'check')}"
                                                           for r in failed), file=sys.stderr)
    return 1 if any(fusepass_options(r["backend"]) is not None for r in failed) else 0
