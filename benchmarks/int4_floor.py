"""Quantized linears against the memory floor, in whole stacks of layers.

Stacks of four SwiGLU MLP blocks (``down(silu(gate(x)) * up(x))``, hidden H,
intermediate I) at model shapes in and outside the shipped plan table, and
four blocks of Llama-3-8B's attention projections (``o(q(x) + cat(k(x),
v(x), k(x), v(x)))``), each quantized with ``fusepass.quantize`` (int4 with
groups of 128, int8, fp8), compiled with ``backend="fusepass"``, checked
against the same quantized model in fp32 (no further from it than twice the
bf16 model run eagerly is), and timed as one CUDA graph of
the compiled call (``do_bench_cudagraph``).  The floor of a row is every byte
of its quantized weights, scales and zero points read once at the copy
bandwidth measured in the same run; the bf16 model under Inductor is the
baseline (its floor: the bf16 weights).  gemlite (A16W4 HQQ-style int4, A16W8
int8) runs the same stack where it imports (``--gemlite``; its autotuning
costs seconds per new M).

    python benchmarks/int4_floor.py --out DIR [--stacks 3584x18944,...] [--ms 1,16,64]
        [--formats bf16,int4,int8,fp8] [--gemlite] [--inductor-quantized] [--budget 240]
    TRITON_INTERPRET=1 python benchmarks/int4_floor.py --cpu-smoke --out /tmp/x

Plans: the user cache is left out (``FUSEPASS_DEQUANT_MATMUL_CACHE`` set
empty), so every shape runs the shipped plan or, outside the table, the
heuristic -- what a compile gets where nothing was tuned.  ``--user-plans``
keeps the user cache (the plans ``fusepass tune`` measured).

Prints one line per (stack, format, M, backend) as it goes, then the table:
time, floor and % of the floor, the ratio to bf16 under Inductor and to int8,
and the relative error against the fp32 model (eager bf16's beside it).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, kind, hidden, intermediate); "mlp": a SwiGLU MLP, "attn": Llama-3-8B's q/k/v/o
STACKS = {
    "qwen2-7b": ("mlp", 3584, 18944),       # the first stack: not in the plan table
    "qwen2.5-14b": ("mlp", 5120, 13824),    # the second
    "llama3-8b": ("mlp", 4096, 14336),      # in the table
    "llama3-8b-attn": ("attn", 4096, 1024),  # q, o 4096x4096; k, v 1024x4096 (in the table)
    "gemma2-9b": ("mlp", 3584, 14336),      # not in the table
    "mistral-nemo": ("mlp", 5120, 14336),   # not in the table
}
SMOKE_STACKS = {"tiny-mlp": ("mlp", 256, 512), "tiny-attn": ("attn", 256, 64)}
BLOCKS = 4
GROUP = 128


class MLP(nn.Module):
    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attn(nn.Module):
    """The projections of one attention layer (no attention itself): q and o
    [h, h], k and v [kv, h]; k and v are tiled back to h so that o reads them."""

    def __init__(self, h: int, kv: int) -> None:
        super().__init__()
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, kv, bias=False)
        self.v = nn.Linear(h, kv, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.reps = h // (2 * kv)

    def forward(self, x):
        kv = torch.cat([self.k(x), self.v(x)], dim=-1)
        return self.o(self.q(x) + kv.repeat(1, self.reps))


class Stack(nn.Module):
    def __init__(self, kind: str, h: int, i: int, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(h, i) if kind == "mlp" else Attn(h, i) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build(kind: str, h: int, i: int, device: str, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    m = Stack(kind, h, i)
    with torch.no_grad():
        for lin in m.modules():
            if isinstance(lin, nn.Linear):
                # unit-variance outputs: activations stay O(1) through the stack
                lin.weight.normal_(0, lin.in_features ** -0.5)
    return m.to(device=device, dtype=torch.bfloat16).eval()


def nbytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gemlite_stack(model: Stack, fmt: str, device: str):
    """The stack with each quantized linear run by gemlite, or None."""
    try:
        from gemlite.helper import A16W4_HQQ_INT, A16W8_INT8
    except Exception:  # noqa: BLE001 - optional peer
        return None
    from fusepass.formats import unpack_int4

    layers = {}
    for name, mod in model.named_modules():
        if not hasattr(mod, "scale"):
            continue
        if fmt == "int4":
            layers[name] = A16W4_HQQ_INT(device=device, dtype=torch.bfloat16).from_weights(
                unpack_int4(mod.weight), mod.scale, mod.zero, bias=None)
        elif fmt == "int8":
            layers[name] = A16W8_INT8(device=device, dtype=torch.bfloat16).from_weights(
                mod.weight, bias=None, scales=mod.scale.view(-1, 1))
        else:
            return None

    def run(x):
        for bi, b in enumerate(model.blocks):
            p = f"blocks.{bi}."
            if isinstance(b, MLP):
                x = layers[p + "down"](F.silu(layers[p + "gate"](x)) * layers[p + "up"](x))
            else:
                kv = torch.cat([layers[p + "k"](x), layers[p + "v"](x)], dim=-1)
                x = layers[p + "o"](layers[p + "q"](x) + kv.repeat(1, b.reps))
        return x

    return run


def _backend(name: str):
    """A backend by name; fusepass's own function where the package is not installed
    (its entry point registers the name only for an installed package)."""
    if name == "fusepass":
        from fusepass.backend import fusepass_backend

        return fusepass_backend
    return name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="folder for the table and JSON (default: $OUT, else a new folder under <tmp>/fusepass-bench/)")
    p.add_argument("--stacks", default=",".join(STACKS), help=f"comma list of {', '.join(STACKS)}")
    p.add_argument("--ms", default="1,16,64")
    p.add_argument("--formats", default="bf16,int4,int8,fp8")
    p.add_argument("--gemlite", action="store_true", help="also time gemlite's int4 and int8 layers")
    p.add_argument("--inductor-quantized", action="store_true",
                   help="also compile the quantized stacks with Inductor (slow kernels, long compiles)")
    p.add_argument("--user-plans", action="store_true",
                   help="use the user cache's plans (fusepass tune) too; default: shipped plans and the heuristic")
    p.add_argument("--rep", type=float, default=50.0, help="ms of CUDA-graph replays per timing")
    p.add_argument("--budget", type=float, default=1e9, help="seconds; later rows are skipped")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny stacks on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if not args.user_plans:
        os.environ["FUSEPASS_DEQUANT_MATMUL_CACHE"] = ""
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    from fusepass.bench.output import default_out

    out_dir = Path(args.out or default_out("int4_floor"))
    out_dir.mkdir(parents=True, exist_ok=True)

    import fusepass
    from fusepass.bench.timing import copy_bandwidth, environment, time_cpu, time_graph

    stacks = SMOKE_STACKS if smoke else {k: STACKS[k] for k in args.stacks.split(",")}
    ms = (1, 3) if smoke else tuple(int(v) for v in args.ms.split(","))
    formats = args.formats.split(",")
    copy_gbps = copy_bandwidth(device)
    env = environment(device)
    print(f"# {env.get('device', device)}  torch {torch.__version__}  copy {copy_gbps:.0f} GB/s  "
          f"commit {env.get('commit', '?')}", flush=True)
    t0 = time.time()
    rows: list[dict] = []

    def timed(fn, x) -> float:
        with torch.no_grad():
            if smoke:
                return time_cpu(lambda: fn(x), rep_ms=20).median * 1e3
            return time_graph(lambda: fn(x), rep_ms=args.rep).median * 1e3

    for name, (kind, h, i) in stacks.items():
        for fmt in formats:
            if time.time() - t0 > args.budget:
                print(f"# budget spent: {name} {fmt} and later skipped", flush=True)
                break
            model = build(kind, h, i, device)
            if fmt != "bf16":
                summary = fusepass.quantize(model, fmt=fmt, group_size=GROUP)
                assert not summary.skipped, summary
            weight_bytes = nbytes(model)
            floor_us = weight_bytes / copy_gbps / 1e3
            backends = ["inductor"] if fmt == "bf16" else ["fusepass"] + (["inductor"] if args.inductor_quantized else [])
            runners = {b: torch.compile(model, backend=_backend(b)) for b in backends}
            # The reference: the same (quantized) model in fp32; a row passes when it is no
            # further from it than twice the bf16 model run eagerly is.
            ref32 = copy.deepcopy(model).float()
            if args.gemlite and fmt in ("int4", "int8") and not smoke:
                gem = gemlite_stack(model, fmt, device)
                if gem is not None:
                    runners["gemlite"] = gem
            for M in ms:
                torch.manual_seed(M)
                x = torch.randn(M, h, device=device, dtype=torch.bfloat16)
                with torch.no_grad():
                    eager = model(x)
                    ref = ref32(x.float())
                err_eager = rel_err(eager, ref)
                for backend, fn in runners.items():
                    row = dict(stack=name, shape=f"{h}x{i}", fmt=fmt, M=M, backend=backend, floor_us=floor_us,
                               weight_mb=weight_bytes / 1e6)
                    try:
                        tc = time.time()
                        with torch.no_grad():
                            y = fn(x)
                        row["first_call_s"] = time.time() - tc
                        row["err"] = rel_err(y, ref)
                        row["err_eager"] = err_eager
                        row["ok"] = bool(torch.isfinite(y).all()) and row["err"] <= max(2 * err_eager, 1e-3)
                        row["us"] = timed(fn, x)
                        row["pct_floor"] = 100 * floor_us / row["us"]
                    except Exception as exc:  # noqa: BLE001 - reported in the table
                        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    if backend == "fusepass" and hasattr(fusepass, "last_report"):
                        try:
                            rep = fusepass.last_report()
                            row["rewrites"] = str(getattr(rep, "summary", lambda: "")() if callable(
                                getattr(rep, "summary", None)) else "")[:200]
                        except Exception:  # noqa: BLE001
                            pass
                    rows.append(row)
                    print(f"{name} {fmt} M{M} {backend}: " + (f"{row['us']:.1f} µs, floor {floor_us:.1f} µs "
                          f"({row['pct_floor']:.0f}%), err {row['err']:.1e}, first call {row['first_call_s']:.1f} s"
                          if "us" in row else row.get("error", "?")) + f" [{time.time() - t0:.0f} s]", flush=True)
            del runners, model, ref32
            torch._dynamo.reset()
            if not smoke:
                torch.cuda.empty_cache()

    # -- the table --------------------------------------------------------------------
    def find(stack, fmt, M, backend):
        for r in rows:
            if (r["stack"], r["fmt"], r["M"], r["backend"]) == (stack, fmt, M, backend) and "us" in r:
                return r
        return None

    lines = [f"# {env.get('device', device)}, torch {torch.__version__}, copy {copy_gbps:.0f} GB/s, "
             f"{BLOCKS} blocks a stack, int4 g{GROUP}; µs of one CUDA graph of the compiled stack",
             "| stack | H x I | fmt | M | backend | µs | floor µs | % of floor | x bf16 Inductor | x int8 | err (eager) | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['stack']} | {r['shape']} | {r['fmt']} | {r['M']} | {r['backend']} | - | "
                         f"{r['floor_us']:.1f} | - | - | - | - | {r.get('error', 'FAIL')} |")
            continue
        base = find(r["stack"], "bf16", r["M"], "inductor")
        i8 = find(r["stack"], "int8", r["M"], r["backend"]) if r["fmt"] != "int8" else None
        vs_bf16 = f"{base['us'] / r['us']:.2f}x" if base else "-"
        vs_i8 = f"{r['us'] / i8['us']:.2f}" if i8 else "-"
        lines.append(f"| {r['stack']} | {r['shape']} | {r['fmt']} | {r['M']} | {r['backend']} | {r['us']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['pct_floor']:.0f}% | {vs_bf16} | {vs_i8} | {r['err']:.1e} ({r['err_eager']:.1e}) | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    table = "\n".join(lines)
    print("\n" + table)
    (out_dir / "int4_floor.md").write_text(table + "\n")
    (out_dir / "int4_floor.json").write_text(json.dumps(dict(env=env, copy_gbps=copy_gbps, rows=rows), indent=1))
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        print(f"# {len(bad)} rows failed their check or did not run", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
