"""GeGLU, gelu(g) * u, bf16, at the SwiGLU shapes: tanh GELU (Gemma's
gelu_pytorch_tanh, the form Liger implements) everywhere, exact erf GELU at
one shape, and Phi-3-style fused halves of one [M, 2I] tensor.

    fusepass bench --ops geglu
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusepass.kernels.gated_act  # noqa: F401  - registers fusepass::geglu
from fusepass.bench.registry.common import Case, compiled, nbytes

SHAPES = [(4096, 14336), (16384, 11008), (8192, 28672), (1, 14336), (32, 14336)]
FUSED = (4096, 14336)
# The CPU runs the ops' plain-torch paths: small shapes keep `--quick` (CI) in seconds.
CPU_SHAPES = [(256, 2048), (1, 2048)]
CPU_FUSED = (256, 2048)
ERF = (16384, 11008)


def _liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
    except ImportError:
        return None
    return LigerGELUMulFunction.apply  # tanh GELU only


def _providers(approximate: str, device: str) -> dict:
    def eager(g, u):
        return F.gelu(g, approximate=approximate) * u

    providers = {
        "eager": eager,
        "inductor": compiled(eager),
        "fusepass": lambda g, u: torch.ops.fusepass.geglu(g, u, approximate),
        "fusepass-compiled": compiled(eager, backend="fusepass"),
    }
    liger = _liger() if approximate == "tanh" and device == "cuda" else None
    if liger is not None:
        providers["liger"] = liger  # copies the fused halves first (ensure_contiguous)
    return providers


def _case(m: int, n: int, approximate: str, fused: bool, device: str) -> Case:
    dtype = torch.bfloat16

    def make_inputs():
        if fused:
            return tuple(torch.randn(m, 2 * n, device=device, dtype=dtype).chunk(2, -1))
        return torch.randn(m, n, device=device, dtype=dtype), torch.randn(m, n, device=device, dtype=dtype)

    def reference(g, u):
        return F.gelu(g.float(), approximate=approximate) * u.float()

    meta = torch.empty(m, n, dtype=dtype, device="meta")
    return Case(
        op="geglu",
        shape=f"M{m}-I{n}" + ("-erf" if approximate == "none" else "") + ("-fused" if fused else ""),
        dtype=dtype,
        make_inputs=make_inputs,
        reference=reference,
        providers=_providers(approximate, device),
        bytes_moved=nbytes(meta, meta, meta),  # read g and u, write the output
        notes={"approximate": approximate, **({"layout": "halves of [M, 2I]"} if fused else {})},
    )


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    if device != "cuda":
        if quick:  # one case: tanh GELU; the fused halves are swiglu's business in CI
            return [_case(*CPU_SHAPES[0], "tanh", False, device)]
        return ([_case(m, n, "tanh", False, device) for m, n in CPU_SHAPES]
                + [_case(*CPU_FUSED, "tanh", True, device), _case(*CPU_SHAPES[0], "none", False, device)])
    shapes = SHAPES[:1] + SHAPES[3:] if quick else SHAPES
    return (
        [_case(m, n, "tanh", False, device) for m, n in shapes]
        + [_case(*FUSED, "tanh", True, device)]
        + ([] if quick else [_case(*ERF, "none", False, device)])
    )
