"""Mixture-of-Experts blocks, bf16: fusepass's router and experts ops against
Inductor on transformers' ``grouped_mm`` and ``batched_mm`` experts forms of
the same block, and the weight-read floor.

Blocks (random weights, built from transformers' own modules):
Qwen3-30B-A3B's sparse block (128 experts, top-8, hidden 2048, expert
intermediate 768; softmax router, renormalised) and gpt-oss-20b's (32
experts, top-4, hidden 2880, intermediate 2880; top-k-then-softmax router
with a bias, transposed interleaved experts with biases and the clamped
activation).

    fusepass bench --ops moe [--quick]               # the registry entry (cases() below)
    python -m fusepass.bench.registry.moe --out DIR              # GPU: checks, CUDA-graph times, plan sweep, table last
    TRITON_INTERPRET=1 python -m fusepass.bench.registry.moe --cpu-smoke --out DIR   # the same on tiny shapes, CPU
    python -m fusepass.bench.registry.moe --ptx all              # no GPU: the kernels compiled for sm90, registers, loads

What the script does, in one process:
1. the copy bandwidth (a 2 GiB bf16 ``copy_``, bytes read + written per second);
2. per block and token count T: the router op against the fp32 reference
   (logits; ids exactly against the reference selection from the op's own
   logits), the experts op against the fp32 reference (the models' bf16
   roundings) on the op's routing, the whole op pair replayed in a CUDA graph
   against its eager result, and transformers' grouped_mm form against the
   reference on the same routing;
3. CUDA-graph times: fusepass (router + experts, the plan the op picks),
   Inductor on the grouped_mm and batched_mm forms (batched_mm up to T = 64:
   it gathers T * k expert matrices), and the floor: the bytes of the experts
   the tokens chose (and the router's weight) at the copy bandwidth;
4. int4 experts (group 128, asymmetric) at T = 1 against the bf16 op;
5. the plan sweep: the experts op's paths (and decode tiles at T <= 8) timed
   per T; the fastest per T printed as a ``plans.PLANS`` entry;
6. the table.
"""

from __future__ import annotations

import dataclasses

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch


from fusepass.bench.registry.common import Case, compiled
from fusepass.kernels.moe import decode, experts as ex, prefill, router as rt  # (the package registers the ops)
from fusepass.kernels.moe._tiles import cdiv_pow2

ops = torch.ops.fusepass

MODELS = {
    "qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768, kind="softmax", renorm=True, act="silu", layout="halves",
                          transposed=False, bias=False, alpha=0.0, limit=0.0),
    "gpt-oss-20b": dict(E=32, k=4, H=2880, I=2880, kind="topk_softmax", renorm=False, act="gpt_oss",
                        layout="interleaved", transposed=True, bias=True, alpha=1.702, limit=7.0),
}
SMOKE_DIMS = {"qwen3-30b-a3b": dict(E=8, k=2, H=64, I=32), "gpt-oss-20b": dict(E=4, k=2, H=64, I=48)}
TS = (1, 8, 64, 512, 4096)
GPT_OSS_TS = (1, 8, 512)
SMOKE_TS = (1, 3, 17)
BATCHED_MAX_T = 64  # batched_mm gathers T * k * 3 * H * I weights: 25 GB at T = 512 (Qwen3-30B-A3B dims)
GROUP = 128


# -- blocks -----------------------------------------------------------------------------


class Block:
    """One sparse MoE block: transformers' router and experts modules, and the op arguments."""

    def __init__(self, name: str, device: str, dtype=torch.bfloat16, smoke: bool = False, seed: int = 0):
        m = dict(MODELS[name])
        if smoke:
            m.update(SMOKE_DIMS[name])
        self.name, self.m = name, m
        self.group = 16 if smoke else GROUP  # int4 experts' group size
        E, k, H, I = m["E"], m["k"], m["H"], m["I"]
        if name.startswith("qwen3"):
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
            cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                                 norm_topk_prob=True)
            block = Qwen3MoeSparseMoeBlock(cfg)
            self.gate, self.experts = block.gate, block.experts
        else:
            from transformers import GptOssConfig
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
            cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
            block = GptOssMLP(cfg)
            self.gate, self.experts = block.router, block.experts
        self.module = block.to(device=device, dtype=dtype)
        self.module.requires_grad_(False)
        gen = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            for p in block.parameters():  # N(0, 0.02): router logits of std ~0.9 at H = 2048
                p.normal_(0.0, 0.02, generator=gen)

    def quantized(self):
        """The experts in int4 (group 128, asymmetric), made once."""
        if not hasattr(self, "_int4"):
            self._int4 = quantized_experts(self)
        return self._int4

    def router_args(self, x):
        m = self.m
        return (x, self.gate.weight, getattr(self.gate, "bias", None), None, m["kind"], m["k"], m["renorm"], 1, 1,
                1.0, x.dtype, x.dtype)

    def expert_weights(self):
        e = self.experts
        return (e.gate_up_proj, e.down_proj, getattr(e, "gate_up_proj_bias", None), getattr(e, "down_proj_bias", None))

    def op_tail(self):
        m = self.m
        return (m["act"], m["layout"], m["transposed"])

    def fusepass(self, x, quant=None):
        w, ids, _ = ops.moe_router(*self.router_args(x))
        return self.experts_op(x, ids, w, quant)

    def experts_op(self, x, ids, w, quant=None):
        m = self.m
        w1, w2, b1, b2 = self.expert_weights()
        if quant is None:
            return ops.moe_experts(x, ids, w, w1, w2, b1, b2, None, None, None, None, *self.op_tail(), "none", 0,
                                   m["alpha"], m["limit"])
        q1, s1, z1, q2, s2, z2 = quant
        return ops.moe_experts(x, ids, w, q1, q2, b1, b2, s1, z1, s2, z2, *self.op_tail(), "int4", self.group,
                               m["alpha"], m["limit"])

    def hf_form(self, impl: str):
        """transformers' router then its ``impl`` experts function, as one function to compile."""
        from transformers.integrations import moe as hf_moe
        fwd = {"grouped_mm": hf_moe.grouped_mm_experts_forward, "batched_mm": hf_moe.batched_mm_experts_forward}[impl]
        gate, experts = self.gate, self.experts

        def form(x):
            _, w, ids = gate(x)
            return fwd(experts, x, ids, w)
        return form

    def reference(self, x, ids, w, quant=None):
        """fp32 experts with the models' bf16 roundings, on the given routing."""
        w1, w2, b1, b2 = self.expert_weights()
        m = self.m
        if quant is None:
            return ex.moe_experts_reference(x, ids, w, w1, w2, b1, b2, None, None, None, None, m["act"], m["layout"],
                                            m["transposed"], "none", 0, m["alpha"], m["limit"])
        q1, s1, z1, q2, s2, z2 = quant
        return ex.moe_experts_reference(x, ids, w, q1, q2, b1, b2, s1, z1, s2, z2, m["act"], m["layout"], False,
                                        "int4", self.group, m["alpha"], m["limit"])

    def floor_bytes(self, ids, quant=None) -> int:
        """Bytes of the experts the tokens chose, and of the router's weight."""
        m = self.m
        active = torch.unique(ids[(ids >= 0) & (ids < m["E"])]).numel()
        per_expert = 3 * m["H"] * m["I"] * 2 + (2 * m["I"] + m["H"]) * 2 * m["bias"]
        if quant is not None:
            per_expert = sum(t[0].numel() * t.element_size() for t in quant if t is not None)
        return active * per_expert + self.gate.weight.numel() * 2


def quantize_int4(w: torch.Tensor, group: int = GROUP):
    """[E, N, K] -> (uint8 [E, N, K // 2], scale, zero [E, N, K // group]) bf16, asymmetric round to nearest."""
    E, N, K = w.shape
    g = w.float().view(E, N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp_min(1e-8)
    z = (-lo / s).round().clamp(0, 15)
    q = (g / s[..., None] + z[..., None]).round().clamp(0, 15).to(torch.uint8).view(E, N, K)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), s.to(torch.bfloat16), z.to(torch.bfloat16)


def quantized_experts(block: Block):
    w1, w2, _, _ = block.expert_weights()
    if block.m["transposed"]:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    q1, s1, z1 = quantize_int4(w1, block.group)
    q2, s2, z2 = quantize_int4(w2, block.group)
    return q1, s1, z1, q2, s2, z2


# -- measurement ---------------------------------------------------------------------------


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def timer(device: str, rep_ms: float):
    if device == "cuda":
        import triton.testing

        def cuda_time(fn) -> float:
            return triton.testing.do_bench_cudagraph(fn, rep=rep_ms) * 1e3  # µs
        return cuda_time
    from fusepass.bench.timing import time_cpu

    return lambda fn: time_cpu(fn, rep_ms=5, min_samples=2).median * 1e3


def copy_bandwidth(device: str, smoke: bool) -> float:
    """Bytes read + written per second by a large bf16 copy_ (GB/s)."""
    n = (1 << 20) if smoke else (1 << 30)  # 2 GiB of bf16 on the GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    us = timer(device, 50)(lambda: dst.copy_(src))
    return 2 * n * 2 / us / 1e3


def graph_check(block: Block, x: torch.Tensor, device: str) -> float:
    """The op pair captured in a CUDA graph and replayed on new inputs, against eager (0.0 = bitwise)."""
    if device != "cuda":
        return 0.0
    static_x = x.clone()
    block.fusepass(static_x)  # compiles, and creates the router's counter pool before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block.fusepass(static_x)
    worst = 0.0
    for seed in (1, 2):
        new = torch.randn(x.shape, generator=torch.Generator(device).manual_seed(seed), device=device).to(x.dtype)
        static_x.copy_(new)
        graph.replay()
        worst = max(worst, (static_out.float() - block.fusepass(new).float()).abs().max().item())
    return worst


def check(block: Block, x: torch.Tensor) -> dict:
    """The router and experts ops against fp32 references, and transformers' grouped_mm form on the op's routing."""
    args = block.router_args(x)
    w, ids, logits = ops.moe_router(*args)
    ref_logits = rt.moe_router_reference(*args)[2]
    ref_w, ref_ids = rt.router_select_reference(logits, None, *args[4:10], x.dtype)
    out = block.experts_op(x, ids, w)
    ref = block.reference(x, ids, w)
    from transformers.integrations import moe as hf_moe
    hf = hf_moe.grouped_mm_experts_forward(block.experts, x, ids, w)
    return dict(logits_err=rel(logits, ref_logits), ids_equal=bool(torch.equal(ids, ref_ids)),
                weights_err=rel(w, ref_w), experts_err=rel(out, ref), hf_grouped_mm_err=rel(hf, ref),
                ok=bool(torch.equal(ids, ref_ids)) and rel(logits, ref_logits) < 1.6e-2 and rel(out, ref) < 1.6e-2
                and rel(w, ref_w) < 1.6e-2)


def sweep(block: Block, x: torch.Tensor, ids, w, time_us, smoke: bool) -> dict[str, float]:
    """The experts op's paths (and tiles) on one routing: µs per candidate."""
    T = x.shape[0]
    m = block.m
    w1, w2, b1, b2 = block.expert_weights()
    args = (x, ids, w, w1, w2, b1, b2, None, None, None, None, m["act"], m["layout"], m["transposed"], "none", 0,
            m["alpha"], m["limit"])
    cands: dict[str, tuple] = {}
    if T * m["k"] <= 512:
        base = decode.decode_heuristic(T, m["k"], m["H"], m["I"], m["transposed"], 132, 0,
                                       dot=decode.dot_down_fits(x.dtype, w2.dtype, "none", m["transposed"]),
                                       plain16=w1.element_size() == 2)
        cands["decode"] = ("decode", base)
        if m["transposed"] and base.dot2:  # the FMA loops' tiles, as the candidates below vary them
            base = decode.decode_heuristic(T, m["k"], m["H"], m["I"], m["transposed"], 132, 0)
            cands["decode-fma"] = ("decode", base)
        if not smoke and T <= 8:
            KP = 1 << (m["k"] - 1).bit_length()
            # products summed elementwise, reduced across K at the end
            cands["decode-defer"] = ("decode", decode.DecodeConfig(
                BM=base.BM, BN=16, BK=4096 // (16 * base.BM), BN2=base.BN2, BK2=max(16, 4096 // (KP * base.BN2)),
                defer=True, defer2=True))
            for bn, bk in ((16, 512), (4, 2048)):
                cands[f"decode-BN{bn}-BK{bk}"] = ("decode", decode.DecodeConfig(
                    BM=base.BM, BN=bn, BK=bk // base.BM, BN2=base.BN2, BK2=base.BK2, defer=False, defer2=False))
            for bn2 in (2, 8) if not m["transposed"] else (32,):
                cands[f"decode-down-BN{bn2}"] = ("decode", decode.DecodeConfig(
                    BM=base.BM, BN=base.BN, BK=base.BK, BN2=bn2, BK2=max(16, 8192 // (KP * bn2)), defer=False,
                    defer2=False))
            if not m["transposed"] and T == 1 and base.ahead2:
                # Runs 27-28 (H200, 0edb38a / b938d84): gate_up 4 rows whole (K 2048 a step) 27.4 µs
                # against 29.8 for 16 x 256; 24 down tiles (1-4 rows, 256-1024 deep, summed each step or at
                # the end, 4-8 warps) lost to 4 x 128.  Run 32 (c8ddf0a): that down tile loading its next
                # K tile ahead 26.0 against 27.6 without (now the heuristic's, ``base``).
                cands["decode-down-noahead"] = ("decode", dataclasses.replace(base, ahead2=False))
                dn = {"BN4-BK64": (4, 64, 4), "BN4-BK256-W8": (4, 256, 8), "BN2-BK128": (2, 128, 4),
                      "BN8-BK64": (8, 64, 4)}
                for name, (bn2, bk2, wd) in dn.items():
                    cands[f"decode-down-{name}-ahead"] = ("decode", dataclasses.replace(
                        base, BN2=bn2, BK2=min(bk2, 1 << (m["I"] - 1).bit_length()), warps2=wd))
                for bn, bk in ((4, 1024), (4, 512), (2, 1024)):
                    bk = min(bk, 1 << (m["H"] - 1).bit_length())
                    cands[f"decode-up-BN{bn}-BK{bk}-ahead"] = ("decode", dataclasses.replace(
                        base, BN=bn, BK=bk, defer=False, ahead=True))
            if not m["transposed"] and 1 < T <= 8:  # the look-ahead on the heuristic's few-token tiles
                cands["decode-ahead"] = ("decode", dataclasses.replace(base, ahead=True))
                cands["decode-ahead2"] = ("decode", dataclasses.replace(base, ahead2=True))
                cands["decode-ahead-ahead2"] = ("decode", dataclasses.replace(base, ahead=True, ahead2=True))
            # K split over programs: wide column tiles (whole 128-byte lines of a
            # transposed weight's rows) with as many programs as narrow ones.
            for bn2, split in ((32, 4), (64, 4), (64, 8), (16, 2)) if m["transposed"] else ((16, 2), (16, 4)):
                for warps2 in (4, 8):
                    cands[f"decode-down-BN{bn2}-S{split}-W{warps2}"] = ("decode", dataclasses.replace(
                        base, BN2=bn2, BK2=max(8, 8192 // (KP * bn2)), defer2=False, split2=split, warps2=warps2))
            if m["transposed"]:  # the down kernel on the tensor cores (pipelined loads), K split
                for bn2, bk2, split, warps2, stages2 in ((64, 64, 4, 4, 3), (64, 64, 8, 4, 3), (64, 128, 8, 4, 3),
                                                         (64, 64, 16, 4, 3), (128, 64, 8, 4, 3), (128, 64, 8, 8, 4),
                                                         (128, 32, 16, 4, 4), (32, 128, 4, 4, 3), (256, 32, 8, 8, 3),
                                                         (32, 64, 8, 4, 4)):
                    cands[f"decode-dot-BN{bn2}-BK{bk2}-S{split}-W{warps2}-s{stages2}"] = ("decode", dataclasses.replace(
                        base, BN2=bn2, BK2=bk2, defer2=False, split2=split, warps2=warps2, dot2=True, stages2=stages2))
                # with the gate_up tile the last sweep found faster (BN16 BK512, summed every tile)
                cands["decode-up-BK512-dot-BN64-BK64-S8"] = ("decode", dataclasses.replace(
                    base, BK=512 // base.BM, defer=False, BN2=64, BK2=64, defer2=False, split2=8, dot2=True, stages2=3))
    if T * m["k"] >= 16:
        base = prefill.sorted_heuristic(T, m["k"], m["E"], 0)
        cands["sorted"] = ("sorted", base)
        if not smoke:
            for bm in (16, 32, 64, 128):
                if bm != base.BM:
                    cands[f"sorted-BM{bm}"] = ("sorted", prefill.SortedConfig(
                        BM=bm, BN=64 if bm < 128 else 128, BK=64, warps=4 if bm < 128 else 8, stages=3,
                        BN2=64 if bm < 128 else 128, BK2=64, warps2=4 if bm < 128 else 8, stages2=3))
        if x.is_cuda and ex._grouped_mm_ok(x.dtype, "none", x.device):
            cands["grouped_mm"] = ("grouped_mm", None)
    times = {}
    ref = None
    # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): its
    # errors compound through the block's roundings.
    limit = 5e-2 if smoke else 1.6e-2
    for name, (plan, cfg) in cands.items():
        try:
            out = ex.experts_fwd(*args, plan=plan, cfg=cfg)
            ref = block.reference(x, ids, w) if ref is None else ref
            err = rel(out, ref)
            if err > limit:
                print(f"#   {name}: wrong result ({err:.2e}), not timed")
                continue
            times[name] = time_us(lambda: ex.experts_fwd(*args, plan=plan, cfg=cfg))
        except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
            print(f"#   {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return times


def sweep_router(block: Block, x, time_us, smoke: bool) -> dict[str, float]:
    """The router at decode sizes: the heuristic's launch against the one-pass
    top-k (rank), fewer warps and wider expert blocks; each candidate's ids
    exactly the heuristic's and its weights within bf16's table of them."""
    args = block.router_args(x)
    T, H = x.shape
    E = block.m["E"]
    base = rt.router_heuristic(T, E, H)
    cands = {"router": base, "router-rounds": replace(base, rank=False), "router-rank": replace(base, rank=True)}
    if not smoke:
        for warps in (1, 2):
            cands[f"router-w{warps}"] = replace(base, warps=warps)
            cands[f"router-rank-w{warps}"] = replace(base, warps=warps, rank=True)
        for be in (2, 4):
            cands[f"router-rank-BE{be}"] = replace(base, BE=be, BK=max(16, min(4096 // (base.BT * be), H)), rank=True)
    cands = {n: c for n, c in cands.items() if not c.rank or rt.rank_fits(c.BT, cdiv_pow2(E), c.warps)}
    ref_w, ref_ids, _ = rt.router_fwd(*args, cfg=base)
    times = {}
    for name, cfg in cands.items():
        try:
            tw, tid, _ = rt.router_fwd(*args, cfg=cfg)
            if not torch.equal(tid, ref_ids) or rel(tw, ref_w) > 1e-2:
                print(f"#   {name}: other ids or weights than the heuristic's launch, not timed")
                continue
            times[name] = time_us(lambda: rt.router_fwd(*args, cfg=cfg))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            print(f"#   {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return times


def sweep_int4(block: Block, x, ids, w, quant, time_us, smoke: bool) -> dict[str, float]:
    """int4 experts at T = 1: decode tiles (the weight bytes per tile are a
    quarter of bf16's at the same shape, so wider and deeper tiles)."""
    m = block.m
    q1, s1, z1, q2, s2, z2 = quant
    _, _, b1, b2 = block.expert_weights()
    args = (x, ids, w, q1, q2, b1, b2, s1, z1, s2, z2, m["act"], m["layout"], False, "int4", block.group,
            m["alpha"], m["limit"])
    base = decode.decode_heuristic(x.shape[0], m["k"], m["H"], m["I"], False, 132, block.group)
    cands = {"decode": base}
    if not smoke:
        # int4 chunks: one 16-byte chunk per thread and row at BK = 1024 x warps
        for bn, bk, warps in ((2, 1024, 1), (8, 1024, 1), (4, 2048, 2), (2, 2048, 2), (1, 1024, 1), (4, 1024, 2),
                              (4, 2048, 4), (8, 2048, 4)):
            cands[f"up-BN{bn}-BK{bk}-w{warps}"] = replace(base, BN=bn, BK=bk, warps=warps)
        for bn2, bk2, warps2 in ((4, 256, 2), (1, 256, 2), (2, 128, 1), (4, 128, 1), (2, 512, 4), (4, 128, 2)):
            cands[f"down-BN{bn2}-BK{bk2}-w{warps2}"] = replace(base, BN2=bn2, BK2=bk2, warps2=warps2,
                                                               ahead2=False, whole2=False)
        # down's chunk loop loading its next tile ahead (the heuristic's before whole2, 4 x 128 on two warps: 127
        # registers, sm_90; the same tile without it above); 256 deep: three steps over I = 768 instead of six
        for bn2, bk2, warps2 in ((2, 128, 2), (8, 128, 2), (4, 128, 4), (2, 256, 2), (2, 256, 4), (4, 256, 4),
                                 (8, 128, 4)):
            cands[f"down-BN{bn2}-BK{bk2}-w{warps2}-ahead"] = replace(base, BN2=bn2, BK2=bk2, warps2=warps2,
                                                                     ahead2=True, whole2=False)
        # down's chunk loop unrolled over all of I, every tile's loads before the first sum (whole2: one
        # round trip a program, where the look-ahead's 128-deep tiles take six, two tiles in flight); and
        # one masked tile of 1024 codes over I = 768, not unrolled
        for bn2, bk2, warps2 in ((4, 128, 2), (4, 128, 4), (4, 256, 4), (2, 128, 2), (8, 128, 4), (4, 256, 2),
                                 (2, 256, 2)):
            cands[f"down-BN{bn2}-BK{bk2}-w{warps2}-whole"] = replace(base, BN2=bn2, BK2=bk2, warps2=warps2,
                                                                     whole2=True)
        for bn2 in (4, 2):
            cands[f"down-BN{bn2}-BK1024-w4"] = replace(base, BN2=bn2, BK2=1024, warps2=4, ahead2=False,
                                                       whole2=False)
        # (down's K split over 2-3 programs a tile lost at every tile: 15.8-18.4 µs against 14.0 for
        # the experts, H200, 40d0686; not swept)
    ref = block.reference(x, ids, w, quant)
    times = {}
    for name, cfg in cands.items():
        try:
            err = rel(ex.experts_fwd(*args, plan="decode", cfg=cfg), ref)
            if err > (5e-2 if smoke else 1.6e-2):
                print(f"#   int4 {name}: wrong result ({err:.2e}), not timed")
                continue
            times[name] = time_us(lambda: ex.experts_fwd(*args, plan="decode", cfg=cfg))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            print(f"#   int4 {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return times


def run(args) -> dict:
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    time_us = timer(device, args.rep)
    import triton
    env = dict(torch=torch.__version__, triton=triton.__version__,
               device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               commit=os.environ.get("FUSEPASS_COMMIT", "unknown"))
    print(f"# {env}")
    t0 = time.time()
    bw = copy_bandwidth(device, smoke)
    print(f"# copy bandwidth {bw:.0f} GB/s (bytes read + written)")
    rows, sweeps = [], {}
    # The table first for every (model, T), the sweeps after it while the budget lasts.
    for sweeping in (False, True):
        if sweeping and args.no_sweep:
            break
        for name in args.models.split(","):
            block = Block(name, device, smoke=smoke)
            ts = SMOKE_TS if smoke else (TS if name.startswith("qwen3") else GPT_OSS_TS)
            for T in [t for t in ts if not args.ts or t in args.ts]:
                if time.time() - t0 > args.budget:
                    print(f"# budget spent: {name} T={T} {'sweep' if sweeping else 'row'} and later skipped")
                    break
                x = torch.randn(T, block.m["H"], generator=torch.Generator().manual_seed(T)).to(device, torch.bfloat16)
                with torch.no_grad():
                    w, ids, _ = ops.moe_router(*block.router_args(x))
                    if sweeping:
                        sweeps[(name, T)] = sweep(block, x, ids, w, time_us, smoke)
                        if T <= 8:
                            sweeps[(name + "-router", T)] = sweep_router(block, x, time_us, smoke)
                        if T == 1 and not block.m["transposed"]:
                            sweeps[(name + "-int4", T)] = sweep_int4(block, x, ids, w, block.quantized(), time_us,
                                                                     smoke)
                        continue
                    row = measure(block, x, ids, w, bw, time_us, smoke)
                rows.append(row)
                print("# " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
            del block
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"# {time.time() - t0:.0f} s")
    return dict(env=env, copy_gbps=bw, rows=rows, sweeps={f"{k[0]}:T{k[1]}": v for k, v in sweeps.items()})


def measure(block: Block, x, ids, w, bw: float, time_us, smoke: bool) -> dict:
    """One row of the table: checks, and the CUDA-graph times of every contender
    (a contender that fails is reported in the row, the run goes on)."""
    T = x.shape[0]
    m = block.m
    row = dict(model=block.name, T=T, plan=ex.moe_experts_plan(T, m["E"], m["H"], m["I"], m["k"], x.dtype, "none",
                                                              x.device), ok=False, graph_err=None,
               floor_us=block.floor_bytes(ids) / bw / 1e3)
    errors = []

    def attempt(what: str, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported in the row
            errors.append(f"{what}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}")
            print(f"# {block.name} T={T} {errors[-1]}", flush=True)

    attempt("check", lambda: row.update(check(block, x)))
    attempt("graph", lambda: row.update(graph_err=graph_check(block, x, x.device.type)))
    attempt("fusepass", lambda: row.update(fusepass_us=time_us(lambda: block.fusepass(x))))
    attempt("router", lambda: row.update(router_us=time_us(lambda: ops.moe_router(*block.router_args(x)))))
    for impl in ["grouped_mm"] + (["batched_mm"] if T <= BATCHED_MAX_T else []):
        def inductor(impl=impl):
            fn = compiled(block.hf_form(impl), backend="eager") if smoke else compiled(block.hf_form(impl))
            fn(x)
            row[f"inductor_{impl}_us"] = time_us(lambda: fn(x))
        attempt(f"inductor {impl}", inductor)
    if T == 1 and not m["transposed"]:
        def int4():
            quant = block.quantized()
            row["int4_err"] = rel(block.experts_op(x, ids, w, quant), block.reference(x, ids, w, quant))
            row["int4_us"] = time_us(lambda: block.fusepass(x, quant))
            row["int4_floor_us"] = block.floor_bytes(ids, quant) / bw / 1e3
        attempt("int4", int4)
    from fusepass.kernels._common import kernel_fallbacks

    fallbacks = {op: why for op, why in kernel_fallbacks().items() if op.startswith("moe")}
    if fallbacks:  # a kernel that failed ran as the plain-torch body: its times are not the kernels'
        errors.append(f"kernel fallbacks: {fallbacks}")
    row["errors"] = errors
    return row


def table(result: dict) -> str:
    from tabulate import tabulate

    head = ["model", "T", "plan", "floor", "fusepass", "x floor", "router", "ind. grouped_mm", "ind. batched_mm",
            "int4", "int4 / bf16", "check"]
    body = []
    for r in result["rows"]:
        f = r.get("fusepass_us")
        good = r.get("ok") and r.get("graph_err") == 0 and not r.get("errors")
        body.append([r["model"], r["T"], r["plan"], f"{r['floor_us']:.1f}", _us(f),
                     f"{f / r['floor_us']:.2f}" if f else "-", _us(r.get("router_us")),
                     _us(r.get("inductor_grouped_mm_us")), _us(r.get("inductor_batched_mm_us")),
                     _us(r.get("int4_us")), f"{r['int4_us'] / f:.2f}" if r.get("int4_us") and f else "-",
                     ("ok" if good else "FAIL") + (f" {r['experts_err']:.1e}" if "experts_err" in r else "")])
    lines = [tabulate(body, head, tablefmt="github")]
    best = {}
    for key, times in result["sweeps"].items():
        if times:
            name = min(times, key=times.get)
            best[key] = name
            ranked = sorted(times.items(), key=lambda i: i[1])
            lines.append(f"sweep {key}: " + ", ".join(f"{n} {t:.1f}" for n, t in ranked))
    lines.append("fastest path per (model, T): " + json.dumps(best))
    return "\n".join(lines)


def _us(v) -> str:
    return f"{v:.1f}" if v else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for moe.json and moe.txt")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--ts", type=lambda s: [int(v) for v in s.split(",")], default=None)
    p.add_argument("--rep", type=float, default=30.0, help="ms of replays per timing")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--ptx", choices=("decode", "sorted", "router", "misc", "all"), default=None,
                   help="only compile the kernels for sm90 (no GPU needed) and report registers, spills, loads")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds; later entries (the table's rows first, then the sweeps) are skipped")
    args = p.parse_args(argv)
    if args.ptx:
        if os.environ.get("TRITON_INTERPRET") == "1":
            p.error("--ptx compiles the kernels: unset TRITON_INTERPRET")
        return ptx_report(None if args.ptx == "all" else args.ptx)
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
    result = run(args)
    text = table(result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "moe.txt").write_text(text + "\n")
    print(text)
    return 0 if all(r.get("ok") and r.get("graph_err") == 0 and not r.get("errors") for r in result["rows"]) else 1


# -- the kernels compiled for an H100 without one (--ptx) -----------------------------------
#
# A weight stream lives or dies by its loads being 16-byte vectors: a
# transposed weight tile multiplied as [BN, BK] compiled to two-byte loads
# (``ld.global.b16``), found so before any GPU time was spent.  Arguments are
# specialised as a launch on real tensors specialises them: pointers 16-byte
# aligned, sizes and strides multiples of 16 (Qwen3-30B-A3B and gpt-oss dims
# are), each weight layout's unit stride the constant 1.  Registers, stack
# and local memory come from the cubin (``cuobjdump -res-usage``, shipped
# with Triton).

# Integer arguments that are multiples of 16 at the models' sizes.
DIV16 = {"stride_xm", "stride_x2m", "stride_h2m", "stride_we", "stride_wn", "stride_wk", "stride_se", "stride_sn",
         "stride_be", "stride_hm", "stride_om", "stride_ym", "stride_gm", "stride_wm", "K", "N", "I", "H", "E"}
BF16, I64, I32, F32, U8 = "*bf16", "*i64", "*i32", "*fp32", "*u8"
NARROW_MAX = 8
NARROW_MAX_INT4 = 2 * 16 + NARROW_MAX


def compile_sm90(fn, types: dict, consts: dict, warps: int = 4, stages: int = 3, unit: str = "stride_wk"):
    """Compile ``fn`` for sm90; ``unit`` names the argument specialised to 1 (the weights' unit stride)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts)
    if unit in fn.arg_names:
        consts.setdefault(unit, 1)
    for param in fn.params:  # constexprs left to their defaults stay constexprs
        if param.is_constexpr and param.has_default:
            consts.setdefault(param.name, param.default)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in DIV16)}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(kernel) -> dict:
    """Registers, stack (spills) and local memory from the cubin; load widths from the PTX."""
    import triton

    out = {"loads": dict(Counter(re.findall(r"ld\.global[.\w]*", kernel.asm["ptx"])))}
    out["pdl"] = tuple(kernel.asm["ptx"].count(f"griddepcontrol.{op}") for op in ("wait", "launch_dependents"))
    # global -> shared copies: .cg moves 16 bytes, .ca 4 or 8
    out["cp_async"] = dict(Counter(re.findall(r"cp\.async\.c[ag]\.shared\.global", kernel.asm["ptx"])))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m:
        out.update(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))
    return out


def narrow_loads(res: dict) -> int:
    """Loads of one or two bytes (a vector load is .v2/.v4 or 8+ bytes)."""
    return sum(n for op, n in res["loads"].items() if op.endswith((".b8", ".b16")) and ".v" not in op)


def decode_up(fmt="none", halves=True, act="silu", BM=1, BN=16, BK=256, BS=8, defer=True, bias=False, trans=False,
              group=128, warps=4, pdl=False, ahead=False):
    w = {"none": BF16, "int8": "*i8", "fp8": U8, "int4": U8}[fmt]
    types = dict(x=BF16, x2=I32, ids=I64, w=w, bias=BF16, scale=BF16, zero=BF16, h=BF16)
    consts = dict(ACT=act, HALVES=halves, FMT=fmt, G=group if fmt == "int4" else 0, HAS_ZERO=fmt == "int4",
                  HAS_BIAS=bias, ALPHA=1.702, LIMIT=7.0, BS=BS, BM=BM, BN=BN, BK=BK, DEFER=defer, TRANS=trans,
                  PDL=pdl, AHEAD=ahead)
    vb = decode.int4_chunk(fmt, trans, group, BK)
    consts.update(VB=vb, ASM=vb >= 4)
    return compile_sm90(decode._moe_decode_up_kernel, types, consts, warps, unit="stride_wn" if trans else "stride_wk")


def decode_down(fmt="none", KP=8, BN=4, BK=128, defer=True, bias=False, trans=False, group=128, warps=4, pdl=False,
                split=False, dot=False, stages=3, ahead=False, KT=0):
    w = {"none": BF16, "int8": "*i8", "fp8": U8, "int4": U8}[fmt]
    types = dict(h=BF16, h2=I32, ids=I64, tw=BF16, w=w, bias=BF16, scale=BF16, zero=BF16, out=BF16, part=F32,
                 ctr=I32)
    consts = dict(ROUND_W=True, FMT=fmt, G=group if fmt == "int4" else 0, HAS_ZERO=fmt == "int4", HAS_BIAS=bias,
                  KP=max(16, KP) if dot else KP, BN=BN, BK=BK, DEFER=defer, TRANS=trans, PDL=pdl, SPLIT=split,
                  DOT=dot, KE=KP if dot else 1, AHEAD=ahead, KT=KT)
    vb = decode.int4_chunk(fmt, trans, group, BK)
    consts.update(VB=vb, ASM=vb >= 4)
    return compile_sm90(decode._moe_decode_down_kernel, types, consts, warps, stages,
                        unit="stride_wn" if trans else "stride_wk")


def ptx_kernels(only: str | None):
    groups = {
        "decode": [  # the heuristic's tiles at the two models' dims, and the deferred-sum form
            ("decode up, Qwen3 T1", lambda: decode_up(BN=8, BK=1024, defer=False)),
            ("decode up, Qwen3 T8 (BM 2)", lambda: decode_up(BM=2, BN=8, BK=1024, BS=64, defer=False)),
            ("decode up, gpt-oss T1 (transposed, interleaved)", lambda: decode_up(
                BN=16, BK=512, defer=False, halves=False, act="gpt_oss", bias=True, BS=4, trans=True)),
            ("decode up, int4 g128 (chunks, BN4 BK1024 1 warp)", lambda: decode_up(fmt="int4", BN=4, BK=1024,
                                                                                   defer=False, warps=1)),
            ("decode up, int8", lambda: decode_up(fmt="int8", BN=8, BK=1024, defer=False)),
            ("decode up, fp8", lambda: decode_up(fmt="fp8", BN=8, BK=1024, defer=False)),
            ("decode up, deferred sum BN16 BK256", lambda: decode_up()),
            ("decode down, Qwen3 T1", lambda: decode_down(BN=4, BK=256, defer=False)),
            ("decode down, Qwen3 T8", lambda: decode_down(BN=16, BK=64, defer=False)),
            ("decode down, gpt-oss T1 (transposed)", lambda: decode_down(KP=4, BN=16, BK=256, defer=False, bias=True,
                                                                         trans=True)),
            ("decode down, gpt-oss T1 (transposed), K split, BN64 BK32", lambda: decode_down(
                KP=4, BN=64, BK=32, defer=False, bias=True, trans=True, split=True)),
            ("decode down, gpt-oss T1 (transposed), K split, BN128 BK16 8 warps", lambda: decode_down(
                KP=4, BN=128, BK=16, defer=False, bias=True, trans=True, split=True, warps=8)),
            ("decode down, gpt-oss T1 (transposed), tl.dot, K split, BN64 BK64 3 stages", lambda: decode_down(
                KP=4, BN=64, BK=64, defer=False, bias=True, trans=True, split=True, dot=True)),
            ("decode down, gpt-oss T1 (transposed), tl.dot, K split, BN128 BK64 4 stages", lambda: decode_down(
                KP=4, BN=128, BK=64, defer=False, bias=True, trans=True, split=True, dot=True, stages=4)),
            ("decode down, int4 g128 (chunks, BN2 BK128 1 warp)", lambda: decode_down(fmt="int4", BN=2, BK=128,
                                                                                     defer=False, warps=1)),
            ("decode down, deferred sum BN4 BK128", lambda: decode_down()),
            ("decode up, Qwen3 T1, PDL", lambda: decode_up(BN=8, BK=1024, defer=False, pdl=True)),
            ("decode down, Qwen3 T1, PDL", lambda: decode_down(BN=4, BK=256, defer=False, pdl=True)),
            ("decode down, int4 g128, PDL", lambda: decode_down(fmt="int4", BN=2, BK=128, defer=False, warps=1,
                                                                pdl=True)),
        ],
        "sorted": [
            (f"sorted {which}, BM{bm}{' transposed' if trans else ''}", lambda which=which, bm=bm, trans=trans:
             compile_sm90(*_sorted(which, bm, trans), warps=8 if bm >= 128 else 4,
                          unit="stride_wn" if trans else "stride_wk"))
            for which in ("up", "down") for bm, trans in ((16, False), (128, False), (64, True))
        ],
        "router": [
            ("router T1 (split over experts)", lambda: compile_sm90(rt._moe_router_kernel, _ROUTER_TYPES,
                                                                     _router())),
            ("router T1, one-pass top-k", lambda: compile_sm90(rt._moe_router_kernel, _ROUTER_TYPES,
                                                                _router(RANK=True))),
            ("router T1, one-pass top-k, PDL", lambda: compile_sm90(rt._moe_router_kernel, _ROUTER_TYPES,
                                                                     _router(RANK=True, PDL=True, RELEASE=True))),
            ("router T64 (tl.dot)", lambda: compile_sm90(rt._moe_router_kernel, _ROUTER_TYPES, _router(
                SPLIT=False, USE_DOT=True, BT=32, BE=128, BK=64))),
        ],
        "misc": [
            ("align", lambda: compile_sm90(prefill._moe_align_kernel, dict(
                ids=I64, sorted_slots=I32, pos_of_slot=I32, block_expert=I32, expert_end=I32),
                dict(BM=64, NBINS=256, CH=1024, BMP=64))),
            ("sum", lambda: compile_sm90(prefill._moe_sum_kernel, dict(
                y=BF16, ids=I64, pos_of_slot=I32, tw=BF16, bias=BF16, out=BF16),
                dict(ROUND_W=True, EPILOGUE=False, HAS_BIAS=False, KP=8, BN=1024))),
        ],
    }
    for name, items in groups.items():
        if only in (None, name):
            yield from items


_ROUTER_TYPES = dict(x=BF16, w=BF16, bias=BF16, cbias=F32, ctr=I32, logits=BF16, tw=BF16, tid=I64)


def _router(**over):
    base = dict(KIND="softmax", TOP_K=8, RENORM=True, NG=1, TG=1, SCALING=1.0, HAS_BIAS=False, HAS_CB=False,
                SPLIT=True, USE_DOT=False, F32=False, BT=1, BE=1, BEA=128, BK=2048, KP=8, RANK=False)
    return {**base, **over}


def _sorted(which: str, BM: int, trans: bool):
    if which == "up":
        types = dict(x=BF16, sorted_slots=I32, block_expert=I32, w=BF16, bias=BF16, scale=BF16, zero=BF16, h=BF16)
        consts = dict(ACT="gpt_oss" if trans else "silu", HALVES=not trans, FMT="none", G=0, HAS_ZERO=False,
                      HAS_BIAS=trans, ALPHA=1.702, LIMIT=7.0, F32=False, TRANS=trans, BM=BM, BN=64, BK=64)
        return prefill._moe_sorted_up_kernel, types, consts
    types = dict(h=BF16, sorted_slots=I32, block_expert=I32, tw=BF16, w=BF16, bias=BF16, scale=BF16, zero=BF16,
                 y=BF16)
    consts = dict(ROUND_W=True, FMT="none", G=0, HAS_ZERO=False, HAS_BIAS=trans, F32=False, TRANS=trans, BM=BM,
                  BN=64, BK=64)
    return prefill._moe_sorted_down_kernel, types, consts


def ptx_report(only: str | None) -> int:
    """Every MoE kernel compiled for sm90 here (no GPU needed): registers, spills
    and load widths; 1 when one fails, spills or reads weights element by element."""
    import triton

    print(f"# triton {triton.__version__}, target sm90")
    bad = 0
    for name, build in ptx_kernels(only):
        try:
            res = resources(build())
        except Exception as exc:  # noqa: BLE001 - every kernel is reported
            print(f"{name:52s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            bad += 1
            continue
        spills = res.get("stack", 0) + res.get("local", 0)
        # int4 chunks read their group's scale and zero point per row and chunk:
        # two 2-byte loads a row (of 2048 codes), not the weights.
        if "tl.dot" in name:
            # the weights through the pipeline's 16-byte copies to shared memory; the
            # loads left are the ids', routing weights' and bias's (16 rows of them)
            cp = res["cp_async"]
            bad += spills > 0 or not cp.get("cp.async.cg.shared.global") or bool(cp.get("cp.async.ca.shared.global"))
        else:
            bad += spills > 0 or narrow_loads(res) > (NARROW_MAX_INT4 if "int4" in name else NARROW_MAX)
        # PDL kernels wait once; the others carry no grid-dependency instruction at all.
        wait, release = res["pdl"]
        bad += wait != ("PDL" in name)
        pdl = f"  pdl wait {wait} release {release}" if wait or release else ""
        print(f"{name:52s} regs {res.get('regs', '?'):>3}  spill {spills:>4}  narrow loads {narrow_loads(res):>3}  "
              f"{res['loads']}{pdl}" + (f"  {res['cp_async']}" if res["cp_async"] else ""))
    return 1 if bad else 0



# -- the registry entry (`fusepass bench --ops moe`) ------------------------------------------


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    """Qwen3-30B-A3B's and gpt-oss-20b's blocks at decode and prefill T (tiny dims
    on CPU): fusepass's op pair, Inductor on transformers' grouped_mm form
    ("inductor") and batched_mm form; the reference is fp32 with the models' bf16
    roundings on the op's routing convention (ties to the lower expert index).
    bytes_moved counts every expert's weights once (the floor at T >= 64; at
    T = 1 the active ones are k of E)."""
    smoke = device == "cpu"
    out = []
    for name, full in (("qwen3-30b-a3b", TS), ("gpt-oss-20b", GPT_OSS_TS)):
        ts = (1, 17) if smoke else ((1, 64) if quick else full)
        holder: dict = {}

        def block(name=name, holder=holder) -> Block:
            if "b" not in holder:
                holder["b"] = Block(name, device, smoke=smoke)
            return holder["b"]

        for T in ts:
            def make_inputs(T=T, block=block):
                b = block()
                return (torch.randn(T, b.m["H"], device=device, dtype=torch.bfloat16),)

            def reference(x, block=block):
                b = block()
                w, ids, _ = rt.moe_router_reference(*b.router_args(x))
                return b.reference(x, ids, w)

            providers = {
                "fusepass": lambda x, block=block: block().fusepass(x),
                "inductor": _lazy_form("grouped_mm", block, smoke),
            }
            if T <= BATCHED_MAX_T:
                providers["inductor-batched_mm"] = _lazy_form("batched_mm", block, smoke)
            m = MODELS[name] if not smoke else {**MODELS[name], **SMOKE_DIMS[name]}
            out.append(Case(op="moe", shape=f"{name}-T{T}", dtype=torch.bfloat16, make_inputs=make_inputs,
                            reference=reference, providers=providers,
                            bytes_moved=m["E"] * 3 * m["H"] * m["I"] * 2,
                            notes={"T": str(T), "E": str(m["E"]), "k": str(m["k"]), "H": str(m["H"]),
                                   "I": str(m["I"])}))
    return out


def _lazy_form(impl: str, block, smoke: bool):
    fn = {}

    def call(x):
        if "f" not in fn:
            form = block().hf_form(impl)
            fn["f"] = compiled(form, backend="eager") if smoke else compiled(form)
        return fn["f"](x)
    return call


if __name__ == "__main__":
    sys.exit(main())
