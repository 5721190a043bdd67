"""bitsandbytes NF4 linears with and without double quantization, compiled as a user compiles them:
fusepass (double quantization's absmax expanded in the graph by one Inductor kernel, then the code
books' GEMV loop) against Inductor (bitsandbytes' gemm_4bit, opaque to it) and eager; six layers
called in turn (cold weights: 6 x 33 MB against a 50 MB L2), CUDA-graph time per layer, M = 1.

    python benchmarks/bnb_compiled.py                (a CUDA GPU, bitsandbytes)
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from triton.testing import do_bench_cudagraph

import fusepass


class Stack(torch.nn.Module):
    def __init__(self, n, k, nested, copies=6):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(copies):
            lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                    compress_statistics=nested)
            lin.weight = bnb.nn.Params4bit(torch.randn(n, k) / k ** 0.5, requires_grad=False, quant_type="nf4",
                                           compress_statistics=nested)
            self.layers.append(lin)

    def forward(self, x):
        return tuple(lin(x) for lin in self.layers)


def _time(model: Stack, x: torch.Tensor, backend: str, ref) -> tuple[float, float, object]:
    """(µs per layer, largest relative error against eager, fusepass's bitsandbytes rewrites)."""
    torch._dynamo.reset()
    fusepass.reset_reports()
    fn = model if backend == "eager" else torch.compile(model, backend=backend, dynamic=False)
    out = fn(x)
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(out, ref))
    hits = fusepass.last_report().count("dequant_matmul_bnb") if backend == "fusepass" else "-"
    return do_bench_cudagraph(lambda: fn(x), rep=200) * 1000 / len(model.layers), err, hits


def main() -> None:
    from tabulate import tabulate

    rows = []
    for n, k in ((14336, 4096), (4096, 14336)):
        for nested in (False, True):
            model = Stack(n, k, nested).cuda().eval()
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            with torch.no_grad():
                ref = model(x)
                res = {b: _time(model, x, b, ref) for b in ("eager", "inductor", "fusepass")}
            rows.append([f"{n}x{k}", "double quant" if nested else "plain", *(res[b][0] for b in res),
                         res["inductor"][0] / res["fusepass"][0], res["fusepass"][2], max(r[1] for r in res.values())])
            print(rows[-1], flush=True)
    print(tabulate(rows, headers=["NxK", "absmax", "eager µs", "inductor µs", "fusepass µs", "inductor / fusepass",
                                  "fusepass rewrites", "max rel. error"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
