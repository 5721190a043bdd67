"""The quantization libraries' 4-bit layouts through ``fusepass::dequant_matmul``,
against the libraries' own kernels: Llama-3-8B's projection shapes (N x K =
4096x4096, 14336x4096, 4096x14336), M = 1, 16, 64, bf16 activations.

    format     weight (quantized by)                               fusepass is handed
    nf4, fp4   bitsandbytes quantize_4bit, blocksize 64, fp32      the codes and absmax as stored
               absmax (compress_statistics=False)
    nf4-dq     the same with double quantization (uint8 absmax     the absmax's bytes, nested absmax, code
               codes, fp32 nested absmax per 256 blocks, offset)   and offset (dequant_matmul_bnb._replace)
    hqq4       HQQ Quantizer, 4 bits, group 64, axis=1 (its        W_q, scale and zero as HQQLinear keeps
               plain-PyTorch backend), scale/zero bf16             them (the rule's reshape to [N, K / G])
    gptq4      round-to-nearest, group 128, symmetric (zero 8),   qweight, qzeros, scales, g_idx, wf
               GPTQ's packing; gptq4-act: act-order g_idx
    int4       fusepass.quantize's Int4Linear, group 64           its buffers (the reference point: HQQ
                                                                   no slower than our own int4 of its group)

Providers: ``fusepass`` (the op, as the rule calls it), ``bnb``
(``bitsandbytes.matmul_4bit`` with its QuantState on the same codes: its
GEMV kernel at M = 1, dequantize + cuBLAS above), ``cublas-bf16``
(``F.linear`` on the dequantized bf16 weight; ``aten-bf16`` on the CPU),
``hqq-torch`` (HQQ's own ``Quantizer.dequantize`` then the matmul: its
plain-PyTorch backend's forward), ``inductor`` (the plain-torch dequant form
the rules match, compiled; HQQ, GPTQ, int4).  Each is checked against the
fp32 dequantize-then-matmul reference before it is timed.

    python -m fusepass.bench.registry.dequant_library --gpu-run --out DIR   # H100: ~2 minutes
    python -m fusepass.bench.registry.dequant_library --cpu-smoke --out DIR # every path, tiny shapes
    fusepass bench --ops dequant_library [--quick]                          # the registry's suite

Each fusepass row names the op's plan (``plan``): HQQ's, GPTQ's and the code
books' layouts run GEMV loops of their own (kernels.dequant_matmul.gemv) to
M = 8 (the code books to 4), beyond that the tensor-core kernel (the code
books and HQQ on word tiles, GPTQ value by value).  The table ends with the
HQQ and GPTQ times over fusepass's own int4 of the same weight.

``--gpu-run`` times each provider in a CUDA graph on cold weights (the
weight and copies of it called in turn, ``tuner.cold_copies``: three L2s'
worth, as a model's layers are read) and gives each row its weight-read
floor: the bytes the op reads (codes, absmax, nested absmax and its code
table, scales, zeros, g_idx) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fusepass.bench.registry.common import Case, compiled, lazy, nbytes
from fusepass.formats import bnb_absmax, dequantize
from fusepass.kernels import dequant_matmul  # noqa: F401 - registers fusepass::dequant_matmul

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)
MS = [1, 16, 64]
FORMATS = ("nf4", "nf4-dq", "fp4", "hqq4", "int4", "gptq4", "gptq4-act")
BNB_FORMATS = ("nf4", "nf4-dq", "fp4")
BLOCK = 64  # bitsandbytes' blocksize, HQQ's and int4's group
GPTQ_GROUP = 128
# fusepass bench (the registry suite, which shares ten GPU minutes with every entry): two shapes, M 1 and 16,
# no Inductor compiles.  The whole grid, cold weights and floors: --gpu-run.
SUITE_SHAPES = [(4096, 4096), (14336, 4096)]
SUITE_MS = [1, 16]
CPU_SHAPES = [(128, 256)]
CPU_MS = [1, 16]
# Inductor compiles take 5-15 s each on the H100: --gpu-run compiles at these (N, K, M) only (--inductor all: every)
GPU_INDUCTOR_AT = {(4096, 4096, 1)}


def _bnb_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _hqq_available() -> bool:
    return importlib.util.find_spec("hqq") is not None


# -- weights: one per (format, shape), every provider's operands ------------------------------


class Weight:
    """One quantized [N, K] weight: per provider (its function of (x, *operands), its operands),
    the fp32 dequantized weight (the reference) and the bytes the op reads."""

    def __init__(self, fmt: str, N: int, K: int, ref: torch.Tensor, nbytes: int, providers: dict):
        self.fmt, self.N, self.K, self.ref, self.nbytes, self.providers = fmt, N, K, ref, nbytes, providers


def _bnb_weight(fmt: str, w: torch.Tensor, device: str) -> Weight:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    from fusepass.patterns.dequant_matmul_bnb import _replace

    N, K = w.shape
    quant_type, nested = fmt[:3], fmt.endswith("-dq")
    packed, state = bf.quantize_4bit(w, blocksize=BLOCK, quant_type=quant_type, compress_statistics=nested)
    rule = _replace(N, K, BLOCK, quant_type, False, nested)  # what the rule puts in the graph
    if nested:  # the rule's operands: nested absmax, uint8 absmax codes, their code table, the offset
        ops = (packed, state.state2.absmax, state.absmax, state.state2.code, state.offset)
        absmax = bnb_absmax(*ops[1:])
    else:
        ops = (packed, state.absmax)
        absmax = state.absmax
    ref = dequantize(packed.view(N, K // 2), absmax.view(N, K // BLOCK), None, quant_type, BLOCK)
    providers = {"fusepass": (rule, ops)}
    if device == "cuda" or _bnb_cpu_matmul():
        providers["bnb"] = (lambda x, p, st: bnb.matmul_4bit(x, p.t(), st), (packed, state))
    return Weight(fmt, N, K, ref, nbytes(*ops), providers)


@functools.cache
def _bnb_cpu_matmul() -> bool:
    """bitsandbytes' matmul_4bit on CPU tensors (its CPU backend): run once on a tiny weight."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf

        p, st = bf.quantize_4bit(torch.randn(64, 128, dtype=torch.bfloat16), blocksize=BLOCK, quant_type="nf4")
        bnb.matmul_4bit(torch.randn(2, 128, dtype=torch.bfloat16), p.t(), st)
        return True
    except Exception as exc:  # noqa: BLE001 - only that provider is skipped
        print(f"# bitsandbytes matmul_4bit unavailable on CPU ({type(exc).__name__}: {exc}): bnb rows skipped")
        return False


def _hqq_weight(w: torch.Tensor, device: str) -> Weight:
    from hqq.core.quantize import Quantizer

    from fusepass.patterns.dequant_matmul_hqq import _replace, search

    N, K = w.shape
    w_q, meta = Quantizer.quantize(w, nbits=4, group_size=BLOCK, axis=1, optimize=True, bitpack=True,
                                   compute_dtype=torch.bfloat16, device=device)
    # HQQLinear keeps scale and zero in the compute dtype: [N K / G, 1], one per group row
    meta["scale"], meta["zero"] = meta["scale"].to(torch.bfloat16), meta["zero"].to(torch.bfloat16)
    meta["compute_dtype"] = torch.bfloat16
    ops = (w_q, meta["scale"], meta["zero"])
    ref = dequantize(w_q, meta["scale"].view(N, K // BLOCK), meta["zero"].view(N, K // BLOCK), "hqq4", BLOCK)

    def hqq_torch(x, w_q, meta):  # HQQLinear.forward_pytorch: matmul(x, dequantize().t())
        return torch.matmul(x, Quantizer.dequantize(w_q, meta).t())

    providers = {"fusepass": (_replace, ops), "hqq-torch": (hqq_torch, (w_q, meta)),
                 "inductor": (lazy(lambda: compiled(search)), ops)}
    return Weight("hqq4", N, K, ref, nbytes(*ops), providers)


def _gptq_weight(fmt: str, w: torch.Tensor) -> Weight:
    """GPTQ's packing of a round-to-nearest symmetric quantization (zero 8, gptqmodel's v2 zero points),
    groups of 128 along K; ``gptq4-act``: the groups are those of a random column order (act-order),
    so g_idx is a permutation's groups and the weight stays in the model's column order."""
    from fusepass.patterns.dequant_matmul_gptq import _int32, _replace, search

    N, K = w.shape
    device = w.device
    wf_ = w.float()
    if fmt == "gptq4-act":
        gen = torch.Generator(device="cpu").manual_seed(K)
        perm = torch.randperm(K, generator=gen).to(device)
    else:
        perm = torch.arange(K, device=device)
    wp = wf_[:, perm].view(N, K // GPTQ_GROUP, GPTQ_GROUP)
    scale = (wp.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)  # [N, groups], as stored rounded
    qp = (wp / scale.float()[..., None]).round().add(8).clamp(0, 15).view(N, K).to(torch.int64)
    q = torch.empty_like(qp)
    q[:, perm] = qp
    g_idx = torch.empty(K, dtype=torch.int32, device=device)
    g_idx[perm] = (torch.arange(K, device=device) // GPTQ_GROUP).to(torch.int32)
    shifts = torch.arange(0, 32, 4, device=device, dtype=torch.int64)
    qweight = _int32((q.t().reshape(K // 8, 8, N) << shifts[None, :, None]).sum(1))  # [K / 8, N]
    qzeros = _int32((torch.full((K // GPTQ_GROUP, N // 8, 8), 8, dtype=torch.int64, device=device) << shifts).sum(-1))
    scales = scale.t().contiguous()  # [groups, N]
    wf = torch.arange(0, 32, 4, dtype=torch.int32, device=device).unsqueeze(0)
    ops = (qweight, qzeros, scales, g_idx, wf)
    ref = dequantize(qweight, scales, qzeros, "gptq4", 0, g_idx=g_idx)
    providers = {"fusepass": (_replace("gptq4"), ops), "inductor": (lazy(lambda: compiled(search)), ops)}
    return Weight(fmt, N, K, ref, nbytes(qweight, qzeros, scales, g_idx), providers)


def _int4_weight(w: torch.Tensor) -> Weight:
    from fusepass.bench.registry.dequant_matmul import _dequant_form
    from fusepass.quantize import Int4Linear

    N, K = w.shape
    lin = torch.nn.Linear(K, N, bias=False, device=w.device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    q = Int4Linear(lin, group_size=BLOCK)
    ops = (q.weight, q.scale, q.zero)
    ref = dequantize(q.weight, q.scale, q.zero, "int4", BLOCK)

    def op(x, w, s, z):
        return torch.ops.fusepass.dequant_matmul(x, w, s, z, None, "int4", BLOCK)

    form = _dequant_form("int4", BLOCK)
    providers = {"fusepass": (op, ops), "inductor": (lazy(lambda: compiled(form)), ops)}
    return Weight("int4", N, K, ref, nbytes(*ops), providers)


@functools.cache
def _source(N: int, K: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(N * 7 + K)
    return (torch.randn(N, K, device=device, generator=gen) * 0.02).to(torch.bfloat16)


def make_weight(fmt: str, N: int, K: int, device: str) -> Weight:
    """``fmt``'s quantization of the shape's random bf16 weight, with every provider that can run here."""
    w = _source(N, K, device)
    if fmt in BNB_FORMATS:
        wt = _bnb_weight(fmt, w, device)
    elif fmt == "hqq4":
        wt = _hqq_weight(w, device)
    elif fmt.startswith("gptq4"):
        wt = _gptq_weight(fmt, w)
    else:
        wt = _int4_weight(w)
    w_bf16 = wt.ref.to(torch.bfloat16)  # the unquantized model's linear at the same numerics
    wt.providers["cublas-bf16" if device == "cuda" else "aten-bf16"] = (lambda x, w: F.linear(x, w), (w_bf16,))
    return wt


def _available(fmt: str) -> bool:
    if fmt in BNB_FORMATS:
        return _bnb_available()
    return _hqq_available() if fmt == "hqq4" else True


# -- the registry's cases -----------------------------------------------------------------


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    """``fusepass bench``: warm weights, the registry's timers (the whole grid with cold weights and
    floors is ``--gpu-run``).  The CPU's quick run: one tiny shape, no Inductor compiles."""
    shapes, ms = (CPU_SHAPES, CPU_MS) if device == "cpu" else (SUITE_SHAPES, SUITE_MS)
    out = []
    for fmt in FORMATS:
        if not _available(fmt):
            continue
        for N, K in shapes:
            wt = make_weight(fmt, N, K, device)
            for M in ms:
                out.append(_case(wt, M, device))
    return out


def _case(wt: Weight, M: int, device: str) -> Case:
    def make_inputs():
        return (torch.randn(M, wt.K, device=device, dtype=torch.bfloat16),)

    def reference(x):
        return x.float() @ wt.ref.t()

    providers = {name: _bound(fn, ops) for name, (fn, ops) in wt.providers.items() if name != "inductor"}
    return Case(op="dequant_library", shape=f"{wt.fmt}-M{M}-N{wt.N}-K{wt.K}", dtype=torch.bfloat16,
                make_inputs=make_inputs, reference=reference, providers=providers, bytes_moved=wt.nbytes,
                notes={"fmt": wt.fmt, "M": str(M), "N": str(wt.N), "K": str(wt.K)})


def _bound(fn, ops):
    return lambda x: fn(x, *ops)


# -- the standalone run: --gpu-run (H100) / --cpu-smoke -------------------------------------


def _tensors(obj):
    """The tensors of a provider's operands (tuples, HQQ's meta dict, bitsandbytes' QuantState)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)
    elif hasattr(obj, "__dict__") and type(obj).__name__ == "QuantState":
        yield from _tensors(vars(obj))


def time_us(fn, ops, x, device: str, rep_ms: float) -> tuple[float, int]:
    """(µs per call, copies): on CUDA replays of a CUDA graph calling ``fn`` on the operands and
    copies of them in turn (cold: each read from memory, not the L2), else back-to-back CPU calls."""
    from fusepass.bench.timing import time_cpu, time_graph
    from fusepass.kernels.dequant_matmul.tuner import cold_copies

    if device != "cuda":
        return time_cpu(lambda: fn(x, *ops), rep_ms).median * 1e3, 1
    ring = [ops] + [copy.deepcopy(ops) for _ in range(cold_copies(nbytes(*_tensors(ops)), x.device) - 1)]

    def calls():
        for o in ring:
            fn(x, *o)
    return time_graph(calls, rep_ms).median * 1e3 / len(ring), len(ring)


def _plan(fmt: str, M: int, N: int, K: int, device: str) -> str:
    """The op's plan for this row: "gemv" (the formats' own loops), "tensor-core", "dequant+cublas";
    "reference" off CUDA."""
    from fusepass.kernels.dequant_matmul import dequant_matmul_plan

    op_fmt = {"nf4-dq": "nf4", "gptq4-act": "gptq4"}.get(fmt, fmt)
    group = 0 if op_fmt == "gptq4" else BLOCK
    return dequant_matmul_plan(M, N, K, op_fmt, group, torch.bfloat16, device)


def run(device: str, shapes, ms, formats, inductor: str, rep_ms: float, deadline: float, log) -> list[dict]:
    """Check then time every provider of every (shape, format, M); cuBLAS bf16 once per (shape, M)."""
    rows = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for N, K in shapes:
        bf16_done = set()
        for fmt in formats:
            if not _available(fmt):
                log(f"# {fmt}: library not installed, skipped")
                continue
            if time.time() > deadline:
                log(f"# out of time before {fmt} N{N} K{K}")
                return rows
            t0 = time.time()
            wt = make_weight(fmt, N, K, device)
            sync()
            log(f"# {fmt} N{N} K{K}: weight built in {time.time() - t0:.1f} s, {wt.nbytes / 1e6:.2f} MB read per call")
            for M in ms:
                torch.manual_seed(M)
                x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
                ref = x.float() @ wt.ref.t()
                for name, (fn, ops) in wt.providers.items():
                    if name.endswith("-bf16"):
                        if M in bf16_done:
                            continue
                        bf16_done.add(M)
                    if name == "inductor" and not (inductor == "all" or (inductor == "some" and (
                            (N, K, M) in GPU_INDUCTOR_AT if device == "cuda" else M == min(ms)))):
                        continue
                    if time.time() > deadline:
                        log(f"# out of time at {fmt} N{N} K{K} M{M} {name}")
                        break
                    row = {"fmt": fmt, "N": N, "K": K, "M": M, "provider": name, "bytes": wt.nbytes}
                    if name == "fusepass":
                        row["plan"] = _plan(fmt, M, N, K, device)
                    t1 = time.time()
                    try:
                        out = fn(x, *ops)
                        sync()
                        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                        row["rel_err"] = err
                        if not err <= 1e-2:  # bf16 output against fp32: a few bf16 ulps in norm
                            row["error"] = f"wrong result: rel err {err:.1e}; not timed"
                        del out
                        if "error" not in row:
                            row["us"], row["copies"] = time_us(fn, ops, x, device, rep_ms)
                    except Exception as exc:  # noqa: BLE001 - a provider that cannot run is reported
                        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                        if device == "cuda":  # a failed capture can leave an error pending: clear it
                            try:
                                torch.cuda.synchronize()
                            except Exception:  # noqa: BLE001
                                pass
                    row["seconds"] = round(time.time() - t1, 2)
                    rows.append(row)
                    log(json.dumps(row))
            del wt
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], bw: float) -> str:
    """format, shape, M, floor µs, fusepass µs, % of floor, bnb µs, fusepass speed-up over bnb, cuBLAS bf16 µs."""
    from tabulate import tabulate

    by: dict = {}
    bf16 = {}
    for r in rows:
        val = r.get("us", "FAIL" if "error" in r else None)
        if r["provider"].endswith("-bf16"):
            bf16[(r["N"], r["K"], r["M"])] = val
            continue
        by.setdefault((r["fmt"], r["N"], r["K"], r["M"]), {"bytes": r["bytes"]})[r["provider"]] = val
    order = {f: i for i, f in enumerate(FORMATS)}
    lines = []

    def f1(v):
        return f"{v:.1f}" if isinstance(v, float) else (v or "-")

    for (fmt, N, K, M), v in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2], order[kv[0][0]], kv[0][3])):
        floor = v["bytes"] / bw / 1e3
        fp, bnb = v.get("fusepass"), v.get("bnb")
        other = v.get("hqq-torch")
        lines.append([fmt, f"{N}x{K}", M, f"{floor:.1f}", f1(fp),
                      f"{100 * floor / fp:.0f}%" if isinstance(fp, float) else "-", f1(bnb),
                      f"{bnb / fp:.2f}x" if isinstance(fp, float) and isinstance(bnb, float) else "-",
                      f1(bf16.get((N, K, M))), f1(v.get("inductor")), f1(other)])
    head = ["format", "NxK", "M", "floor µs", "fusepass µs", "% of floor", "bnb µs", "fp/bnb speed-up",
            "cuBLAS bf16 µs", "inductor µs", "hqq-torch µs"]
    text = tabulate(lines, headers=head)
    # HQQ's and GPTQ's layouts against fusepass's own int4 (group 64; GPTQ's is 128, fewer
    # scale bytes) of the same weight: the op's time on each
    for lib in ("hqq4", "gptq4", "gptq4-act"):
        cmp = []
        for (fmt, N, K, M), v in by.items():
            own = by.get(("int4", N, K, M), {}).get("fusepass")
            if fmt == lib and isinstance(v.get("fusepass"), float) and isinstance(own, float):
                cmp.append(f"{N}x{K} M{M} {v['fusepass'] / own:.2f}")
        if cmp:
            text += f"\n{lib} / int4-g64 fusepass time (<= 1: no slower): " + ", ".join(sorted(cmp))
    return text


def main(argv=None) -> int:
    from fusepass.bench.timing import copy_bandwidth, environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpu-run", action="store_true", help="the whole grid on the GPU, cold weights")
    mode.add_argument("--cpu-smoke", action="store_true", help="every path on a tiny shape on the CPU")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--ms", default=None)
    p.add_argument("--shapes", default=None, help="NxK list")
    p.add_argument("--inductor", choices=("none", "some", "all"), default="some",
                   help="Inductor compiles: some = 4096x4096 M1 on the GPU, the smallest M on the CPU")
    p.add_argument("--rep", type=float, default=None, help="ms of timing per provider")
    p.add_argument("--budget", type=float, default=130, help="seconds before no new timing starts")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    t_start = time.time()
    device = "cuda" if args.gpu_run else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / "dequant_library_log.txt", "a")

    def log(msg):
        logf.write(msg + "\n")
        logf.flush()
        print(msg, flush=True)

    env = environment(device)
    bw = copy_bandwidth(device)
    log(f"# {env['device']}  torch {env['torch']}  triton {env['triton']}  commit {env['commit']}  "
        f"copy {bw:.0f} GB/s (read + write)")
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else SHAPES if args.gpu_run else CPU_SHAPES)
    ms = [int(m) for m in args.ms.split(",")] if args.ms else (MS if args.gpu_run else CPU_MS)
    rep = args.rep or (5.0 if args.gpu_run else 20.0)
    rows = run(device, shapes, ms, args.formats.split(","), args.inductor, rep, t_start + args.budget, log)
    text = table(rows, bw)
    failed = [r for r in rows if "error" in r]
    head = (f"dequant_library on {env['device']} (commit {env['commit']}): µs per call, "
            + ("CUDA-graph replays, cold weights" if args.gpu_run else "CPU back-to-back calls: not a speed claim")
            + f"; floor = bytes read at the copy rate {bw:.0f} GB/s; {len(rows)} rows, {len(failed)} failed, "
            f"{time.time() - t_start:.0f} s")
    (out_dir / "dequant_library.json").write_text(json.dumps(
        {"env": env, "copy_gbps": bw, "command": " ".join(sys.argv), "rows": rows}, indent=1))
    (out_dir / "dequant_library_table.txt").write_text(head + "\n" + text + "\n")
    for r in failed:
        log(f"FAILED {r['fmt']} {r['N']}x{r['K']} M{r['M']} {r['provider']}: {r['error']}")
    log(head + "\n" + text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
