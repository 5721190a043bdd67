"""SwiGLU, silu(g) * u, bf16: the MLP shapes of Llama-2-7B (I = 11008),
Llama-3-8B / Mistral-7B (14336) and Llama-2-70B (28672), decode-sized M, and
Phi-3's fused projection (g and u the halves of one [M, 2I] tensor).

    fusepass bench --ops swiglu
    python -m fusepass.bench.registry.swiglu --sweep      # the kernel's block / warps grid
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


from fusepass.bench.registry.common import Case, compiled, nbytes
from fusepass.kernels import gated_act  # registers fusepass::swiglu

SHAPES = [(4096, 14336), (16384, 11008), (8192, 28672), (1, 14336), (32, 14336)]
FUSED = (4096, 14336)
# The CPU runs the ops' plain-torch paths: small shapes keep `--quick` (CI) in seconds.
CPU_SHAPES = [(256, 2048), (1, 2048)]
CPU_FUSED = (256, 2048)


def _liger():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerSiLUMulFunction.apply


def _eager(g, u):
    return F.silu(g) * u


def _reference(g, u):
    return F.silu(g.float()) * u.float()


def _providers(device: str) -> dict:
    providers = {
        "eager": _eager,
        "inductor": compiled(_eager),
        "fusepass": lambda g, u: torch.ops.fusepass.swiglu(g, u),
        "fusepass-compiled": compiled(_eager, backend="fusepass"),
    }
    liger = _liger() if device == "cuda" else None
    if liger is not None:
        providers["liger"] = liger  # copies the fused halves first (ensure_contiguous)
    return providers


def _case(m: int, n: int, fused: bool, device: str) -> Case:
    dtype = torch.bfloat16

    def make_inputs():
        if fused:
            return tuple(torch.randn(m, 2 * n, device=device, dtype=dtype).chunk(2, -1))
        return torch.randn(m, n, device=device, dtype=dtype), torch.randn(m, n, device=device, dtype=dtype)

    meta = torch.empty(m, n, dtype=dtype, device="meta")
    return Case(
        op="swiglu",
        shape=f"M{m}-I{n}" + ("-fused" if fused else ""),
        dtype=dtype,
        make_inputs=make_inputs,
        reference=_reference,
        providers=_providers(device),
        bytes_moved=nbytes(meta, meta, meta),  # read g and u, write the output
        notes={"layout": "halves of [M, 2I]"} if fused else {},
    )


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    if device != "cuda":
        shapes = CPU_SHAPES[:1] if quick else CPU_SHAPES
        return [_case(m, n, False, device) for m, n in shapes] + [_case(*CPU_FUSED, True, device)]
    shapes = SHAPES[:1] + SHAPES[3:] if quick else SHAPES
    return [_case(m, n, False, device) for m, n in shapes] + [_case(*FUSED, True, device)]


def sweep() -> None:
    """GB/s of the kernel over (columns per program, warps) at the benchmark shapes."""
    import triton.testing
    from tabulate import tabulate

    from fusepass.bench.timing import copy_bandwidth

    bw = copy_bandwidth("cuda")
    print(f"# {torch.cuda.get_device_name()}  copy {bw:.0f} GB/s")
    rows = []
    for m, n in SHAPES:
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        u, out = torch.randn_like(g), torch.empty_like(g)
        auto = gated_act._launch_config(m, n, 2, gated_act._sm_count(g.device))
        for block in (256, 512, 1024, 2048, 4096, 8192, 16384):
            for warps in (1, 2, 4, 8, 16):
                if block < 32 * warps or block > 32 * warps * 64:
                    continue
                ms = triton.testing.do_bench(
                    lambda: gated_act.swiglu_fwd(g, u, out=out, block=block, num_warps=warps), return_mode="median"
                )
                gbps = 3 * g.nbytes / ms / 1e6
                mark = "*" if (block, warps) == (auto, gated_act._num_warps(auto)) else ""
                rows.append([f"M{m}-I{n}", block, warps, f"{ms * 1e3:.1f}", f"{gbps:.0f}", f"{100 * gbps / bw:.0f}%", mark])
    print(tabulate(rows, headers=["shape", "block", "warps", "µs", "GB/s", "% copy", "heuristic"]))


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
