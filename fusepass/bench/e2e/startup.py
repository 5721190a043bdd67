"""The startup phase of ``fusepass bench e2e``: compile plus first forward,
each in a fresh process, cold (an empty cache folder) then warm."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..timing import Timing
from .models import MODELS
from .run import Run, _hit_totals


# The child of the startup phase: builds the model the parent describes and
# times compile + first forward.  It imports neither fusepass nor this module:
# for backend="fusepass" the entry point imports fusepass, as for a user.
_CHILD = r"""
import faulthandler, json, sys, time
t_process = time.perf_counter()
spec = json.loads(sys.argv[1])
if spec.get("watchdog"):  # a hung child prints every thread's stack and exits, before the parent kills it
    faulthandler.dump_traceback_later(spec["watchdog"], exit=True)
for name in spec.get("hide", ()):
    sys.modules[name] = None  # as the parent: transformers falls back to its own code
import torch, transformers as tf
if spec["threads"]:
    torch.set_num_threads(spec["threads"])
cls, config = getattr(tf, spec["class"]), getattr(tf, spec["config"])(**spec["fields"])
torch.manual_seed(0)
dtype = getattr(torch, spec["dtype"])
with torch.device(spec["device"]):
    model = cls._from_config(config, dtype=dtype).eval()
if spec["quantize"]:
    from fusepass.bench.e2e.models import quantize
    quantize(model, spec["quantize"], spec["group_size"])  # in place
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
    spec = {**spec, "watchdog": max(1.0, 0.9 * timeout - 5)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("FUSEPASS_STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        # the stack a hang's watchdog printed, or the error's last lines
        tail = "\n".join(proc.stderr.strip().splitlines()[-40:])
        raise RuntimeError(f"child exited {proc.returncode} after {wall:.1f} s:\n{tail}")
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
                    "threads": None if run.cuda else torch.get_num_threads(), "hide": run.hidden}
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
