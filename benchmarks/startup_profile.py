"""Where a warm start's extra time goes: the start-up child of ``fusepass bench
e2e`` run cold, then warm under cProfile, once per backend, and the functions
whose cumulative time differs most between the two warm profiles.

    python benchmarks/startup_profile.py --model llama3-8b --layers 4 --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fusepass.bench.e2e.models import MODELS
from fusepass.bench.e2e.startup import _CHILD


def _run(child: Path, spec: dict, cache: Path, prof: Path | None, timeout: float) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    cmd = [sys.executable] + (["-m", "cProfile", "-o", str(prof)] if prof else []) + [str(child), json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("FUSEPASS_STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"child exited {proc.returncode}:\n" + "\n".join(proc.stderr.splitlines()[-30:]))
    return {**json.loads(line.split(" ", 1)[1]), "process_s": wall}


def _cumulative(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for (file, line, fn), (_cc, _nc, _tt, ct, _callers) in pstats.Stats(str(path)).stats.items():
        key = f"{file.split('site-packages/')[-1]}:{line}({fn})"
        out[key] = max(out.get(key, 0.0), ct)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--backends", default="inductor,fusepass")
    p.add_argument("--warm", type=int, default=2, help="warm processes per backend (the last one profiled)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    m = MODELS[args.model]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    child = out / "startup_child.py"
    child.write_text(_CHILD)
    profiles, summary = {}, []
    for backend in args.backends.split(","):
        spec = {"class": m["class"], "config": m["config"],
                "fields": {**m["fields"], "num_hidden_layers": args.layers}, "dtype": args.dtype,
                "device": args.device, "backend": backend, "prompt": args.prompt, "quantize": None,
                "group_size": 128, "threads": None, "hide": []}
        cache = Path(tempfile.mkdtemp(prefix=f"startup-{backend}-"))
        r = _run(child, spec, cache, None, args.timeout)
        summary.append((backend, "cold", r["first_call_s"], r["process_s"], r.get("cache")))
        for i in range(args.warm):
            prof = out / f"warm-{backend}.prof" if i == args.warm - 1 else None
            r = _run(child, spec, cache, prof, args.timeout)
            summary.append((backend, "warm" + (" (profiled)" if prof else ""), r["first_call_s"], r["process_s"],
                            r.get("cache")))
        profiles[backend] = _cumulative(out / f"warm-{backend}.prof")
    for row in summary:
        print(f"{row[0]:10s} {row[1]:16s} first call {row[2]:7.2f} s  process {row[3]:7.2f} s  cache {row[4]}")
    names = list(profiles)
    if len(names) == 2:
        a, b = profiles[names[0]], profiles[names[1]]
        diff = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), reverse=True)
        print(f"\n# cumulative s, {names[1]} minus {names[0]} (warm, profiled), largest first")
        for d, k in diff[:args.top]:
            print(f"{d:8.3f}  {a.get(k, 0.0):8.3f} {b.get(k, 0.0):8.3f}  {k[:150]}")
    for name, prof in profiles.items():
        own = sorted(((ct, k) for k, ct in prof.items() if "fusepass/" in k), reverse=True)[:25]
        print(f"\n# {name}: fusepass functions by cumulative s")
        for ct, k in own:
            print(f"{ct:8.3f}  {k[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
