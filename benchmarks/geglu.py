"""GeGLU, gelu(g) * u, bf16, at the SwiGLU shapes: tanh GELU (Gemma's
gelu_pytorch_tanh, the form Liger implements) everywhere, exact erf GELU at
one shape, and Phi-3-style fused halves of one [M, 2I] tensor.

    python benchmarks/run.py --ops geglu
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusepass.kernels.gated_act  # noqa: F401  - registers fusepass::geglu
from benchmarks.common import Case, compiled, nbytes

SHAPES = [(4096, 14336), (16384, 11008), (8192, 28672), (1, 14336), (32, 14336)]
FUSED = (4096, 14336)
ERF = (16384, 11008)


def _liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
    except ImportError:
        return None
    return LigerGELUMulFunction.apply  # tanh GELU only


def _providers(approximate: str) -> dict:
    def eager(g, u):
        return F.gelu(g, approximate=approximate) * u

    providers = {
        "eager": eager,
        "inductor": compiled(eager),
        "fusepass": lambda g, u: torch.ops.fusepass.geglu(g, u, approximate),
        "fusepass-compiled": compiled(eager, backend="fusepass"),
    }
    liger = _liger() if approximate == "tanh" else None
    if liger is not None:
        providers["liger"] = liger  # copies the fused halves first (ensure_contiguous)
    return providers


def _case(m: int, n: int, approximate: str, fused: bool) -> Case:
    dtype = torch.bfloat16

    def make_inputs():
        if fused:
            return tuple(torch.randn(m, 2 * n, device="cuda", dtype=dtype).chunk(2, -1))
        return torch.randn(m, n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=dtype)

    def reference(g, u):
        return F.gelu(g.float(), approximate=approximate) * u.float()

    meta = torch.empty(m, n, dtype=dtype, device="meta")
    return Case(
        op="geglu",
        shape=f"M{m}-I{n}" + ("-erf" if approximate == "none" else "") + ("-fused" if fused else ""),
        dtype=dtype,
        make_inputs=make_inputs,
        reference=reference,
        providers=_providers(approximate),
        bytes_moved=nbytes(meta, meta, meta),  # read g and u, write the output
        notes={"approximate": approximate, **({"layout": "halves of [M, 2I]"} if fused else {})},
    )


def cases(quick: bool) -> list[Case]:
    shapes = SHAPES[:1] + SHAPES[3:] if quick else SHAPES
    return (
        [_case(m, n, "tanh", False) for m, n in shapes]
        + [_case(*FUSED, "tanh", True)]
        + ([] if quick else [_case(*ERF, "none", False)])
    )
