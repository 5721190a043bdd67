"""A decode step's attention over a static cache: fusepass::decode_attention against SDPA as models call it.

    python benchmarks/decode_attention.py [--models all] [--caches 256,4096,32768] [--batches 1,8] [--configs]

For each model's attention shape (query heads, key/value heads, head dim),
static cache length L, written share of the cache and batch, bf16, one query
row: the op with its plan (and with ``--configs`` every block / split the
launch takes), against transformers' SDPA path as a compiled model runs it
(``repeat_kv`` of the cache, then SDPA with the boolean cache mask; eager and
under Inductor).  Outputs are checked against the fp32 reference first (the
op's output buffer poisoned with NaN by a first call on garbage).
CUDA-graph µs.  "floor": the cache rows the mask lets through (keys and
values) at the copy bandwidth measured in the same run.  The table comes
last.
"""

from __future__ import annotations

import argparse

import torch
import triton
from tabulate import tabulate

import fusepass  # noqa: F401 - registers the ops
from fusepass.bench.timing import copy_bandwidth, environment
from fusepass.kernels._common import cdiv
from fusepass.kernels.decode_attention import decode_attention_fwd, plan, reference
from fusepass.patterns.decode_attention import search_gqa

MODELS = {  # name: (query heads, key/value heads, head dim)
    "llama3-8b": (32, 8, 128),
    "qwen3-30b-a3b": (32, 4, 128),
    "qwen3.5 attention": (16, 2, 256),
    "gpt-oss-20b": (64, 8, 64),
}

# transformers' path (repeat_kv, then SDPA with the mask): the rule's own search form
sdpa_path = search_gqa


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="all")
    p.add_argument("--caches", default="256,4096,32768")
    p.add_argument("--written", default="0.5,1.0", help="share of the cache written (the mask lets it through)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--configs", action="store_true")
    p.add_argument("--rep", type=int, default=50)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    env = environment(dev)
    bw = copy_bandwidth(dev)
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, copy {bw:.0f} GB/s")
    models = list(MODELS) if args.models == "all" else args.models.split(",")
    compiled = torch.compile(sdpa_path, dynamic=False)
    rows = []
    torch.manual_seed(0)
    for name in models:
        H, HKV, D = MODELS[name]
        for L in map(int, args.caches.split(",")):
            for share in map(float, args.written.split(",")):
                for B in map(int, args.batches.split(",")):
                    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
                    k = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
                    v = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
                    n = max(1, int(L * share))
                    mask = (torch.arange(L, device=dev) < n)[None, None, None, :].expand(B, 1, 1, L)
                    scale = D ** -0.5
                    ref = reference(q.float(), k.float(), v.float(), mask, scale).float()
                    decode_attention_fwd(q.new_full(q.shape, float("nan")), k, v, mask, scale)  # poison the pool
                    got = decode_attention_fwd(q, k, v, mask, scale)
                    err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
                    want = sdpa_path(q, k, v, mask).transpose(1, 2).float()
                    err_sdpa = (want - ref).abs().max().item() / ref.abs().max().item()
                    floor = 2 * B * HKV * n * D * 2 / (bw * 1e3)  # µs; (bw: GB/s, read + write counted)
                    t_eager = triton.testing.do_bench_cudagraph(lambda: sdpa_path(q, k, v, mask), rep=args.rep)
                    compiled(q, k, v, mask)
                    t_ind = triton.testing.do_bench_cudagraph(lambda: compiled(q, k, v, mask), rep=args.rep)
                    t_op = triton.testing.do_bench_cudagraph(lambda: decode_attention_fwd(q, k, v, mask, scale),
                                                             rep=args.rep)
                    best, best_cfg = t_op, plan(B, HKV, H // HKV, L, D, D, dev)
                    if args.configs:
                        for cfg in _configs(L, best_cfg):
                            try:
                                out = decode_attention_fwd(q, k, v, mask, scale, cfg)
                                if (out.float() - ref).abs().max().item() / ref.abs().max().item() > 2e-2:
                                    print("wrong", name, L, B, cfg)
                                    continue
                                t = triton.testing.do_bench_cudagraph(
                                    lambda: decode_attention_fwd(q, k, v, mask, scale, cfg), rep=args.rep)
                            except Exception as exc:  # noqa: BLE001 - a config out of resources
                                print("failed", cfg, type(exc).__name__)
                                continue
                            if t < best:
                                best, best_cfg = t, cfg
                    rows.append([name, L, f"{share:.2f}", B, f"{floor:.1f}", f"{t_eager * 1e3:.1f}",
                                 f"{t_ind * 1e3:.1f}", f"{t_op * 1e3:.1f}", f"{t_ind / t_op:.2f}x",
                                 f"{best * 1e3:.1f} {best_cfg}", f"{err:.1e} / {err_sdpa:.1e}"])
                    print(*rows[-1], flush=True)
    print(tabulate(rows, headers=["model", "L", "written", "B", "floor µs", "SDPA eager µs", "SDPA Inductor µs",
                                  "fusepass µs", "vs Inductor", "best (BL, split, warps)", "rel err op / SDPA"]))


def _configs(L: int, planned: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(BL, split, warps) to sweep over an L-slot cache, one per distinct launch: a split count is
    rounded to whole blocks a split (as ``launches`` does), so counts past L / BL repeat a launch
    (72 configs a row took 150 s of a 4096-slot sweep's time on an H200 before this)."""
    seen, out = set(), []
    for BL in (16, 32, 64, 128):
        for split in sorted({1, 2, 4, 8, 16, 32, 64, 128, planned[1]}):
            span = cdiv(cdiv(L, split), BL) * BL
            for warps in (4, 8):
                key = (BL, cdiv(L, span), warps)
                if key not in seen:
                    seen.add(key)
                    out.append(key)
    return out


if __name__ == "__main__":
    main()
