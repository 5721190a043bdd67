"""Writing a run: the terminal table, JSON, CSV and PNG plots in one folder.

Plots need matplotlib (``pip install fusepass[bench]``); without it they are
skipped with a note, everything else is written.  The progress bar uses tqdm
when it is installed and the output is a terminal; otherwise one line per
step goes to stderr, which reads well in a log.
"""

from __future__ import annotations

import csv
import json
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from tabulate import tabulate

# Said wherever a CPU run's figures appear: there the ops run their plain-torch
# implementations, which exist for tests, matching and reports; Inductor's C++
# kernels beat them, and that says nothing about the GPU kernels.
CPU_NOTE = ("CPU run: fusepass's ops run their plain-torch implementations (the test path), not the Triton "
            "kernels; these timings test that path and are not a speed claim")
CPU_TITLE = "CPU test path, not a speed claim"


def is_cpu(env: dict[str, Any]) -> bool:
    return env.get("device_type", "cuda" if "CPU" not in env.get("device", "") else "cpu") == "cpu"


def _wrapped(title: str, width: int) -> str:
    """A plot title in lines that fit the figure (matplotlib cuts a long one off at the edge)."""
    return "\n".join(textwrap.wrap(title, width))


def device_title(env: dict[str, Any]) -> str:
    """The device as a plot title names it."""
    return f"{env['device']}; {CPU_TITLE}" if is_cpu(env) else env["device"]


def default_out(kind: str) -> str:
    """A fresh folder for a run's files, outside any checkout: ``<tmp>/fusepass-bench/<kind>-<time>``."""
    import tempfile

    return str(Path(tempfile.gettempdir()) / "fusepass-bench" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def write_json(path: Path, env: dict[str, Any], rows: list[dict[str, Any]], **extra: Any) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"env": env, **extra, "rows": rows}, indent=1, default=str))
    tmp.replace(path)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in r.items()})
    tmp.replace(path)


def table(rows: list[list[Any]], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, disable_numparse=True)


class Progress:
    """tqdm on a terminal, plain lines elsewhere (logs of unattended runs)."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar = None
        self.total, self.done, self.desc = total, 0, desc
        self.started = time.perf_counter()
        try:
            from tqdm import tqdm

            if sys.stderr.isatty():
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
        except ImportError:
            pass

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what[:60], refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}, {time.perf_counter() - self.started:.1f} s] {self.desc}: {what}",
                  file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plots_available() -> bool:
    return _pyplot() is not None


def bandwidth_plots(folder: Path, rows: list[dict[str, Any]], copy_gbps: float, device: str) -> list[Path]:
    """One PNG per op: GB/s against bytes moved per call, a line per provider, the copy ceiling drawn."""
    plt = _pyplot()
    written: list[Path] = []
    by_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("gbps"):
            by_op[r["op"]].append(r)
    for op, op_rows in by_op.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        by_provider: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in op_rows:
            by_provider[r["provider"]].append((r["bytes_moved"], r["gbps"]))
        for provider, points in sorted(by_provider.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=provider)
        ax.axhline(copy_gbps, color="black", linestyle="--", linewidth=1,
                   label=f"copy_ (measured): {copy_gbps:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes moved per call (inputs read once, outputs written once)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(_wrapped(f"{op}: bandwidth against size ({device})", 80), fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / f"bandwidth_{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def speedup_plot(path: Path, workloads: Iterable[tuple[str, dict[str, float]]], title: str) -> Path | None:
    """Horizontal grouped bars: for each workload, each provider's speed-up over Inductor."""
    plt = _pyplot()
    workloads = [(w, s) for w, s in workloads if s]
    if not workloads:
        return None
    providers = sorted({p for _, s in workloads for p in s})
    height = 0.8 / max(len(providers), 1)
    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.22 * len(workloads) * max(len(providers), 1)))
    for i, provider in enumerate(providers):
        ys = [j + i * height for j in range(len(workloads))]
        xs = [s.get(provider, 0.0) for _, s in workloads]
        ax.barh(ys, xs, height=height, label=provider)
    ax.set_yticks([j + height * (len(providers) - 1) / 2 for j in range(len(workloads))])
    ax.set_yticklabels([w for w, _ in workloads], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("speed-up over Inductor (>1: faster)")
    ax.set_title(_wrapped(title, 90), fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replot(folder: Path) -> list[Path]:
    """Draw the plots of a run from its JSON (for a run made where matplotlib was missing)."""
    import json

    if not plots_available():
        raise SystemExit("fusepass bench plot: matplotlib is not installed (pip install 'fusepass[bench]')")
    written: list[Path] = []
    ops = folder / "results.json"
    if ops.is_file():
        data = json.loads(ops.read_text())
        rows, device = data["rows"], device_title(data["env"])
        written += bandwidth_plots(folder, rows, data["copy_gbps"], device)
        by_case: dict[str, dict[str, float]] = {}
        for r in rows:
            by_case.setdefault(f"{r['op']} {r['shape']}", {})
            if r.get("vs_inductor") and r["provider"] != "inductor":
                by_case[f"{r['op']} {r['shape']}"][r["provider"]] = r["vs_inductor"]
        path = speedup_plot(folder / "speedup.png", list(by_case.items()),
                            f"speed-up over Inductor per workload ({device})")
        written += [path] if path else []
    e2e = folder / "e2e.json"
    if e2e.is_file():
        data = json.loads(e2e.read_text())
        written += [p for p in [e2e_plot(folder, data["rows"], device_title(data["env"]))] if p]
    return written


def e2e_plot(folder: Path, rows: list[dict[str, Any]], device: str) -> Path | None:
    workloads: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("vs_inductor") and r["backend"] != "inductor":
            workloads.setdefault(r["workload"], {})[r["backend"]] = r["vs_inductor"]
    if not rows:
        return None
    title = f"{rows[0]['model']} x{rows[0]['layers']} layers: speed-up over Inductor ({device})"
    return speedup_plot(folder / "e2e_speedup.png", list(workloads.items()), title)
