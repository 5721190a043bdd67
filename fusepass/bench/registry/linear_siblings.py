"""Projections of one x (q / k / v, gate / up) at decode sizes, bf16: the
three ``F.linear`` calls eagerly and under Inductor (cuBLAS, one launch a
weight) against ``fusepass::linear_siblings`` (one launch).  Shapes: the q /
k / v of Qwen3-30B-A3B (hidden 2048) and Llama-3-8B (4096) at 1 and 4 rows.
The weights are hot here (the per-op registry times repeated calls on one
input); ``benchmarks/linear_siblings.py`` times cold weights and the
quantized groups.

    fusepass bench --ops linear_siblings
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusepass.bench.registry.common import Case, compiled, nbytes
from fusepass.kernels import linear_siblings  # noqa: F401 - registers fusepass::linear_siblings

GROUPS = {"qwen3-30b-a3b-qkv": (2048, (4096, 512, 512)), "llama3-8b-qkv": (4096, (4096, 1024, 1024))}
ROWS = (1, 4)
CPU_GROUPS = {"small-qkv": (256, (256, 64, 64))}


def _eager(x, w0, w1, w2):
    return F.linear(x, w0), F.linear(x, w1), F.linear(x, w2)


def _reference(x, w0, w1, w2):
    return tuple(x.float() @ w.float().t() for w in (w0, w1, w2))


def _case(name: str, K: int, Ns: tuple[int, ...], M: int, device: str) -> Case:
    dtype = torch.bfloat16

    def make_inputs():
        return (torch.randn(M, K, device=device, dtype=dtype),
                *(torch.randn(n, K, device=device, dtype=dtype) * 0.02 for n in Ns))

    weights = [torch.empty(n, K, dtype=dtype, device="meta") for n in Ns]
    outs = [torch.empty(M, n, dtype=dtype, device="meta") for n in Ns]
    return Case(
        op="linear_siblings",
        shape=f"{name}-M{M}",
        dtype=dtype,
        make_inputs=make_inputs,
        reference=_reference,
        providers={
            "eager": _eager,
            "inductor": compiled(_eager),
            "fusepass": lambda x, *ws: tuple(torch.ops.fusepass.linear_siblings(x, list(ws), [None] * len(ws))),
            "fusepass-compiled": compiled(_eager, backend="fusepass"),
        },
        bytes_moved=nbytes(torch.empty(M, K, dtype=dtype, device="meta"), *weights, *outs),
        notes={"weights": "hot (repeated calls)"},
    )


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    groups = GROUPS if device == "cuda" else CPU_GROUPS
    rows = ROWS[:1] if quick else ROWS
    return [_case(name, K, Ns, M, device) for name, (K, Ns) in groups.items() for M in rows]
