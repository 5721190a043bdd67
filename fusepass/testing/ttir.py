"""Kernels' TTIR as Inductor's generated code builds it, without a GPU.

An inlined launch (``Launch.traced``) is compiled from Inductor's own code,
which types each argument from its value (torch/_inductor/codegen/wrapper.py,
``triton_utils.signature_of``): a Python float fp64, an int i32 or i64, an
int equal to 1 and None as constants.  An fp32 tile meeting an fp64 scalar
becomes fp64: every element computed in fp64, or a loop-carried value that
changes type and does not compile.

:func:`launch_spec` describes a launch in the test process (under the
interpreter or not); :func:`main`, in a process without TRITON_INTERPRET
(the kernels must be JIT functions), reads such specs pickled on stdin,
builds each kernel's TTIR for sm_90 with Triton's frontend (no GPU, no
ptxas) and prints :func:`fp64_report` as JSON.
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Pointer:
    type: str  # Triton's name of a tensor argument's type: "*bf16"


def launch_spec(launch) -> dict:
    """A picklable description of a ``Launch``: the kernel by module and name,
    tensors as their pointer types, every other argument as its value."""
    import torch
    from torch._inductor.utils import _type_of

    fn = getattr(launch.kernel, "fn", launch.kernel)
    args = {k: Pointer(_type_of(v.dtype)) if isinstance(v, torch.Tensor) else v for k, v in launch.args.items()}
    return {"module": fn.__module__, "name": fn.__name__, "args": args, "num_warps": launch.num_warps}


def inductor_signature(kernel, args: dict) -> tuple[dict, dict]:
    """(signature, constants) as Inductor gives them for these argument values."""
    sig, consts = {}, {}
    for i, p in enumerate(kernel.params):
        v = args[p.name]
        if p.is_constexpr or v is None or (type(v) is int and v == 1):
            sig[p.name], consts[(i,)] = "constexpr", v
        elif isinstance(v, Pointer):
            sig[p.name] = v.type
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, float):
            sig[p.name] = "fp64"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            raise TypeError(f"{kernel.__name__}: no Inductor type for {p.name}={v!r}")
    return sig, consts


def ttir(kernel, sig: dict, consts: dict, num_warps: int, capability: int = 90) -> str:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    backend = CUDABackend(target)
    opts = backend.parse_options({"num_warps": num_warps})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    return str(ASTSource(kernel, sig, consts).make_ir(target, opts, backend.get_codegen_implementation(opts),
                                                      backend.get_module_map(), ctx))


def fp64_report(specs: list[dict]) -> list[dict]:
    """Per distinct specialisation: the kernel, the spec's "case" (the first
    with it, where specs name one), its fp64 arguments, the error
    where it does not build, the lines computing an fp64 tile ("xf64>") and
    the count of other lines in fp64 (a scalar's conversion: one op, not one
    per element)."""
    out, seen = [], set()
    for spec in specs:
        kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
        sig, consts = inductor_signature(kernel, spec["args"])
        key = (spec["module"], spec["name"], tuple(sig.items()), repr(sorted(consts.items())))
        if key in seen:
            continue
        seen.add(key)
        row = {"kernel": spec["name"], "case": spec.get("case"),
               "fp64_args": [k for k, t in sig.items() if t == "fp64"]}
        try:
            text = ttir(kernel, sig, consts, spec["num_warps"])
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build is reported, the others still are
            why = f"{type(exc).__name__}: {exc}" + (f"\n({exc.__cause__})" if exc.__cause__ else "")
            out.append({**row, "error": why[-1500:], "tiles": [], "scalar_ops": 0})
            continue
        body = [ln.strip() for ln in text.splitlines() if "f64" in ln and not ln.lstrip().startswith("tt.func")]
        out.append({**row, "error": None, "tiles": [ln[:160] for ln in body if "xf64>" in ln],
                    "scalar_ops": sum("xf64>" not in ln for ln in body)})
    return out


def main() -> None:
    print(json.dumps(fp64_report(pickle.load(sys.stdin.buffer))))
