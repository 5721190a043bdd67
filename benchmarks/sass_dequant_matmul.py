"""Static look at the dequant_matmul kernels on a machine without a GPU: each
config compiled for sm_90 (Triton's own ptxas), its registers, spills, shared
memory, and the instructions of its innermost loop per weight value.

    python benchmarks/sass_dequant_matmul.py --fmt int4 --group 128 --M 1 --N 4096 --K 4096 \
        --config gemv:BN=8,BK=1024,split=1,warps=4 [--dump]

The hot loop's instruction count per weight value (divided by the values one
thread converts per iteration) is what bounds an int4 kernel that is not
bound by memory: an H100 SM issues 128 thread-instructions per clock and must
take ~18 int4 values per clock to read 2 TB/s.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Sm90:
    """Enough of Triton's driver interface for ``kernel.warmup`` to compile for an H100."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _bin(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> str:
    """cuobjdump's resource line: registers, stack, shared memory, spills."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:\d+.*", out)
    return m.group(0) if m else out.strip()


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse(text: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """(address, opcode with modifiers, operands) per instruction, and each label's instruction index."""
    out, labels = [], {}
    for line in text.splitlines():
        lab = re.match(r"^\s*(\.L_\w+):", line)
        if lab:
            labels[lab.group(1)] = len(out)
            continue
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return out, labels


def loops(instrs, labels) -> list[tuple[int, int]]:
    """(start, end) index ranges of backward branches (loop bodies), innermost first."""
    found = []
    for i, (_, op, args) in enumerate(instrs):
        if op.startswith("BRA"):
            m = re.search(r"\((\.L_\w+)\)", args)
            if m and labels.get(m.group(1), i + 1) <= i:
                found.append((labels[m.group(1)], i))
    return sorted(found, key=lambda r: r[1] - r[0])


def histogram(instrs, lo=0, hi=None) -> collections.Counter:
    c = collections.Counter()
    for _, op, _ in instrs[lo:hi]:
        if op.startswith("NOP"):
            continue
        c[op.split(".")[0]] += 1
    return c


def compile_config(fmt, group, M, N, K, dtype, cfg, x_dtype=None):
    """The compiled kernel (Triton CompiledKernel) of one config, built by the op's own launcher."""
    from fusepass.formats import LIBRARY_FORMATS
    from fusepass.kernels.dequant_matmul import launch

    compiled = []
    real_run = launch._run
    # Compile as the GPU would run it: the inline-PTX code conversions where the GPU takes them
    # (launch.gemv_asm for the GEMV), tensor-core dots in 16 bit.
    asm = launch.gemv_asm(fmt, group, N, cfg) if cfg.kind == "gemv" else cfg.kind == "mmt"  # (as the launcher)

    def capture(*a, **kw):
        if isinstance(a[0], triton.runtime.jit.JITFunction):  # _run(kernel, grid, warmup, *args, **meta)
            kernel, grid, _, *args = a
            meta = dict(kw)
            if "ASM" in meta:
                meta["ASM"] = asm
            if "DOT_F32" in meta:
                meta["DOT_F32"] = dtype == torch.float32
            compiled.append(kernel.warmup(*args, grid=grid, **meta))
        else:  # a Launch
            lch = a[0]
            if "ASM" in lch.args:
                lch.args["ASM"] = asm
            if "DOT_F32" in lch.args:
                lch.args["DOT_F32"] = dtype == torch.float32
            compiled.append(lch.kernel.warmup(**lch.args, grid=lch.grid, **lch._meta()))

    launch._run = capture
    try:
        from fusepass.bench.registry.dequant_matmul import quantize as _q  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    try:
        x = torch.randn(M, K, dtype=dtype)
        g_idx = None
        if fmt in LIBRARY_FORMATS:  # (the GPTQ loop is chosen at run time from g_idx: both compile)
            from fusepass.testing.library_layouts import library_inputs

            x, w, s, z, g_idx, _ = library_inputs(fmt, M, N, K, dtype, group=group)
        elif fmt == "int4":
            w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
            s = torch.rand(N, K // group, dtype=dtype)
            z = torch.rand(N, K // group, dtype=dtype)
        else:
            w = torch.zeros(N, K, dtype=torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
            s = torch.rand(N, dtype=dtype)
            z = None
        out = torch.empty(M, N, dtype=dtype)
        launch._launch(x, w, s, z, None, out, fmt, group if fmt != "gptq4" and fmt != "gptq4_v1" else 0, cfg,
                       warmup=True, sum_here=True, g_idx=g_idx)
    finally:
        launch._run = real_run
    return compiled


def parse_config(text: str):
    from fusepass.kernels.dequant_matmul import Config

    kind, _, rest = text.partition(":")
    kw = {}
    for part in filter(None, rest.split(",")):
        k, v = part.split("=")
        kw[k] = int(v)
    return Config(kind, **kw)


def report(kernel, values_per_iter: int | None = None, dump: bool = False, n_loops: int = 3) -> str:
    text = sass(kernel.asm["cubin"])
    instrs, labels = parse(text)
    lines = [f"{kernel.name}: {resources(kernel.asm['cubin'])}, {len(instrs)} instructions"]
    found = loops(instrs, labels)
    for lo, hi in found[:n_loops]:
        h = histogram(instrs, lo, hi + 1)
        n = sum(h.values())
        per = f", {n / values_per_iter:.2f} per value ({values_per_iter} values per thread)" if values_per_iter else ""
        lines.append(f"  loop [{lo}, {hi}]: {n} instructions{per}")
        lines.append("    " + " ".join(f"{k}:{v}" for k, v in h.most_common()))
    if dump:
        lines.append(text)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fmt", default="int4")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--M", type=int, default=1)
    p.add_argument("--N", type=int, default=4096)
    p.add_argument("--K", type=int, default=4096)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--config", action="append", required=True, help="kind:BN=..,BK=..,BM=..,split=..,warps=..,stages=..")
    p.add_argument("--dump", action="store_true")
    p.add_argument("--loops", type=int, default=3, help="loops shown, innermost (shortest) first; the mmt kernel's "
                   "K loop comes after the split-K sum's at small BM")
    args = p.parse_args(argv)
    driver.set_active(_Sm90())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    for text in args.config:
        cfg = parse_config(text)
        threads = 32 * cfg.warps
        if cfg.kind == "gemv":
            vals = cfg.BN * cfg.BK // threads
        elif cfg.kind in ("mm", "mmt"):
            vals = cfg.BN * cfg.BK // threads
        else:
            vals = None
        for k in compile_config(args.fmt, args.group, args.M, args.N, args.K, dtype, cfg):
            print(f"== {cfg.label()} {args.fmt} g{args.group} M{args.M} N{args.N} K{args.K} {args.dtype}")
            print(report(k, vals, args.dump, args.loops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
