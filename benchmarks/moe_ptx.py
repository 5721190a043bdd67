"""The MoE kernels compiled for an H100 (sm90) on a machine without a GPU:
registers, spills and the width of every global load, from Triton's PTX and
the cubin (``cuobjdump -res-usage``, shipped with Triton).

A weight stream lives or dies by its loads being 16-byte vectors: a
transposed weight tile multiplied as [BN, BK] compiled to two-byte loads
(``ld.global.b16``), found here before any GPU time was spent.

    python benchmarks/moe_ptx.py [--only decode|sorted|router|misc]

Exits 1 when a kernel fails to compile, spills, or makes more than
NARROW_MAX one- or two-byte loads (a bias, a scale or a routing weight per
row; a weight tile read element by element makes dozens).

Arguments are specialised as a launch on real tensors specialises them:
pointers 16-byte aligned, sizes and strides multiples of 16 (Qwen3-30B-A3B
and gpt-oss dims are), the unit stride of each weight layout a constant 1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusepass.kernels.moe import decode, prefill, router  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
# Integer arguments that are multiples of 16 at the models' sizes.
DIV16 = {"stride_xm", "stride_we", "stride_wn", "stride_wk", "stride_se", "stride_sn", "stride_be", "stride_hm",
         "stride_om", "stride_ym", "stride_gm", "stride_wm", "K", "N", "I", "H", "E"}
BF16, I64, I32, F32, U8 = "*bf16", "*i64", "*i32", "*fp32", "*u8"
NARROW_MAX = 8


def compile_sm90(fn, types: dict, consts: dict, warps: int = 4, stages: int = 3, unit: str = "stride_wk"):
    """Compile ``fn`` for sm90; ``unit`` names the argument specialised to 1 (the weights' unit stride)."""
    consts = dict(consts)
    if unit in fn.arg_names:
        consts.setdefault(unit, 1)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in DIV16)}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=SM90, options=dict(num_warps=warps, num_stages=stages))


def resources(kernel) -> dict:
    """Registers, stack (spills) and local memory from the cubin; load widths from the PTX."""
    out = {"loads": dict(Counter(re.findall(r"ld\.global[.\w]*", kernel.asm["ptx"])))}
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
              group=128, warps=4):
    w = {"none": BF16, "int8": "*i8", "fp8": U8, "int4": U8}[fmt]
    types = dict(x=BF16, ids=I64, w=w, bias=BF16, scale=BF16, zero=BF16, h=BF16)
    consts = dict(ACT=act, HALVES=halves, FMT=fmt, G=group if fmt == "int4" else 0, HAS_ZERO=fmt == "int4",
                  HAS_BIAS=bias, ALPHA=1.702, LIMIT=7.0, BS=BS, BM=BM, BN=BN, BK=BK, DEFER=defer, TRANS=trans)
    return compile_sm90(decode._moe_decode_up_kernel, types, consts, warps, unit="stride_wn" if trans else "stride_wk")


def decode_down(fmt="none", KP=8, BN=4, BK=128, defer=True, bias=False, trans=False, group=128, warps=4):
    w = {"none": BF16, "int8": "*i8", "fp8": U8, "int4": U8}[fmt]
    types = dict(h=BF16, ids=I64, tw=BF16, w=w, bias=BF16, scale=BF16, zero=BF16, out=BF16)
    consts = dict(ROUND_W=True, FMT=fmt, G=group if fmt == "int4" else 0, HAS_ZERO=fmt == "int4", HAS_BIAS=bias,
                  KP=KP, BN=BN, BK=BK, DEFER=defer, TRANS=trans)
    return compile_sm90(decode._moe_decode_down_kernel, types, consts, warps,
                        unit="stride_wn" if trans else "stride_wk")


def cases(only: str | None):
    groups = {
        "decode": [
            ("decode up, Qwen3 T1", lambda: decode_up()),
            ("decode up, Qwen3 T8 (BM 2)", lambda: decode_up(BM=2, BK=128, BS=64)),
            ("decode up, gpt-oss T1 (transposed, interleaved)", lambda: decode_up(
                halves=False, act="gpt_oss", bias=True, BS=4, trans=True)),
            ("decode up, int4 g128", lambda: decode_up(fmt="int4")),
            ("decode up, int8", lambda: decode_up(fmt="int8")),
            ("decode up, fp8", lambda: decode_up(fmt="fp8")),
            ("decode up, no defer BK1024 w8", lambda: decode_up(defer=False, BK=1024, warps=8)),
            ("decode down, Qwen3 T1", lambda: decode_down()),
            ("decode down, gpt-oss T1 (transposed)", lambda: decode_down(KP=4, BN=16, bias=True, trans=True,
                                                                         warps=8)),
            ("decode down, int4 g128", lambda: decode_down(fmt="int4")),
        ],
        "sorted": [
            (f"sorted {which}, BM{bm}{' transposed' if trans else ''}", lambda which=which, bm=bm, trans=trans:
             compile_sm90(*_sorted(which, bm, trans), warps=8 if bm >= 128 else 4,
                          unit="stride_wn" if trans else "stride_wk"))
            for which in ("up", "down") for bm, trans in ((16, False), (128, False), (64, True))
        ],
        "router": [
            ("router T1 (split over experts)", lambda: compile_sm90(router._moe_router_kernel, _ROUTER_TYPES,
                                                                     _router())),
            ("router T64 (tl.dot)", lambda: compile_sm90(router._moe_router_kernel, _ROUTER_TYPES, _router(
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
                SPLIT=True, USE_DOT=False, F32=False, BT=1, BE=1, BEA=128, BK=2048, KP=8)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("decode", "sorted", "router", "misc"), default=None)
    args = p.parse_args(argv)
    print(f"# triton {triton.__version__}, target sm90")
    bad = 0
    for name, build in cases(args.only):
        try:
            res = resources(build())
        except Exception as exc:  # noqa: BLE001 - every kernel is reported
            print(f"{name:52s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            bad += 1
            continue
        spills = res.get("stack", 0) + res.get("local", 0)
        bad += spills > 0 or narrow_loads(res) > NARROW_MAX
        print(f"{name:52s} regs {res.get('regs', '?'):>3}  spill {spills:>4}  narrow loads {narrow_loads(res):>3}  "
              f"{res['loads']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
