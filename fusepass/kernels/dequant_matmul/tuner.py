"""The tuner: the candidate configs of a problem, timed on the GPU.

Run only when asked (``fusepass tune``, ``python -m
fusepass.bench.registry.dequant_matmul --tune``): it compiles a few Triton kernels and times them, which has no
place inside a compile or a model's call.  :func:`tune_and_save` keeps the
fastest in the user cache, where :func:`fusepass.kernels.dequant_matmul.plans.lookup`
finds it.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import Tensor

from fusepass.kernels._common import cdiv, on_device
from fusepass.kernels.dequant_matmul.config import GEMV_MAX_M, CUBLAS, Config, Problem, _pow2, codebook_chunk, valid
from fusepass.kernels.dequant_matmul.launch import _launch
from fusepass.kernels.dequant_matmul.plans import _auto_split, int4_gemv_bk, save

log = logging.getLogger("fusepass")


def candidates(p: Problem) -> list[Config]:
    """The few configs the tuner times for one problem (each a Triton compile on first use: keep it short)."""
    M, N, K, fmt, G, dtype, n_sm = p.M, p.N, p.K, p.fmt, p.group, p.dtype, p.sms
    out: list[Config] = []

    def add(cfg: Config) -> None:
        if valid(cfg, p) and cfg not in out:
            out.append(cfg)

    if M <= GEMV_MAX_M:
        # int8 / fp8: weight bytes per row per tile; 512 is one warp of 16-byte
        # loads on one row.
        bm = _pow2(M)
        shapes = ((8, 512, 4), (4, 512, 4), (16, 512, 8), (8, 1024, 8), (4, 1024, 4), (16, 256, 4), (2, 1024, 4),
                  (2, 512, 4), (1, 1024, 4),
                  # Deeper tiles: more bytes in flight per thread (64-128 against 16-32),
                  # for shapes too small to fill the SMs with resident warps otherwise:
                  # at M = 1 the int8 k/v projection (1024x4096) 4.2 µs against 5.0,
                  # 4096x14336 22.9 against 24.0 (H100, cold, 3c79310).
                  (4, 2048, 8), (2, 2048, 4), (8, 2048, 8), (4, 4096, 8), (2, 4096, 4))
        if (G % 32 == 0 or G in (2, 4, 8, 16)) if fmt == "int4" else (fmt in ("nf4", "fp4") and codebook_chunk(G)):
            # A 16-byte chunk of each row per thread (one or two chunks per thread
            # and row, 2-8 warps): the tile depth follows (int4_gemv_bk).  The
            # code books run the int4 loop (gemv._dequant_gemv_kernel).
            shapes = ()
            for bn, warps, chunks in ((8, 4, 1), (4, 4, 1), (16, 4, 1), (8, 2, 1), (4, 2, 1), (8, 8, 1),
                                      (4, 8, 1), (2, 4, 1), (4, 4, 2), (8, 4, 2), (4, 2, 2), (2, 4, 2)):
                if bm * bn > 32 or (M == 1 and bn < 4 and chunks == 1):
                    continue
                bk = int4_gemv_bk(K, G, warps, chunks)
                if 4 * bk > 5 * K and warps > 1:  # mostly past K: fewer warps cover it
                    continue
                auto = _auto_split(cdiv(N, bn), K, bk, n_sm)
                for split in sorted({1, auto}):
                    add(Config("gemv", BN=bn, BK=bk, split=split, warps=warps))
        for bn, kbytes, warps in shapes:
            bk = kbytes
            if K % bk and bk > 1024:  # a deep tile only where it divides K (a masked K breaks the 16-byte loads)
                continue
            # int8 / fp8 keep a [BM, BN, BK] fp32 sum: at most 64 registers per thread.
            if bm * bn * bk > 64 * 32 * warps:
                continue
            if M == 1 and bn < 4 and kbytes < 2048:
                continue
            auto = _auto_split(cdiv(N, bn), K, bk, n_sm)
            for split in sorted({1, auto}):
                add(Config("gemv", BN=bn, BK=bk, split=split, warps=warps))
        if M >= 4 and dtype != torch.float32:
            for bn in (64, 128):
                bk = min(64, G) if fmt == "int4" else 64
                for perm in ((0, 1) if fmt == "int4" else (0,)):
                    add(Config("mm", BM=16, BN=bn, BK=bk, split=_auto_split(cdiv(N, bn), K, bk, n_sm), stages=4,
                               perm=perm))
        if dtype != torch.float32 and (fmt != "int4" or G % 32 == 0):
            # The transposed tensor-core kernel with x's rows padded to 16: the
            # dequantisation per weight value is what a GEMV does, the products
            # go to the tensor cores instead of one FMA per value per row.
            for bn in (64, 128):
                bk = min(128, G) if fmt == "int4" else 128
                auto = _auto_split(cdiv(N, bn), K, bk, n_sm)
                for split in sorted({1, auto, max(1, auto // 2)}):
                    add(Config("mmt", BM=16, BN=bn, BK=bk, split=split, warps=4, stages=3))
        return out
    if dtype == torch.float32:
        return [CUBLAS]
    bm_small = min(64, max(16, _pow2(M)))
    shapes = [(bm_small, 64, 64, 4, 4), (bm_small, 128, 64, 4, 3), (bm_small, 64, 128, 4, 3),
              (bm_small, 128, 128, 8, 3)]
    if M >= 128:
        shapes += [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 3), (128, 128, 128, 8, 3)]
    if fmt == "int4" and M <= 64:
        # int4 at M = 16-64 ran 1.4-2.5x gemlite's A16W4 time with the tiles
        # above (H100, 6ccee15): narrower tiles (more programs, fewer registers
        # per thread for the two unpacked halves), eight warps, half the split.
        shapes += [(bm_small, 32, 128, 4, 3), (bm_small, 32, 64, 4, 4), (bm_small, 64, 64, 8, 3),
                   (bm_small, 64, 128, 8, 4)]
    for bm, bn, bk, warps, stages in shapes:
        if fmt == "int4":
            bk = min(bk, G)
        progs = cdiv(M, bm) * cdiv(N, bn)
        auto = _auto_split(progs, K, bk, n_sm)
        splits = {1, auto, max(1, auto // 2)} if fmt == "int4" and M <= 64 else {1, auto}
        for split in sorted(splits):
            for perm in ((0, 1) if fmt == "int4" else (0,)):
                add(Config("mm", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=stages, perm=perm))
    if M <= 64:
        # The product transposed (the weight tile as the dot's A operand); int4
        # and the code books also with their scales loaded one and two tiles ahead, and from 32 rows
        # with x copied into the tile's K order first (int8 at every M).
        for bn, warps in ((64, 4), (128, 4), (128, 8)):
            for bk in ((64, 128) if fmt in ("int4", "nf4", "fp4") else (128, 256)):
                for split in (1, 2, 4, 8):
                    for ahead in ((0, 1, 2) if fmt in ("int4", "nf4", "fp4") else (0,)):
                        for xperm in ((0, 1) if (fmt in ("int4", "nf4", "fp4") and bm_small >= 32 and ahead == 2)
                                      or fmt == "int8"
                                      else (0,)):
                            add(Config("mmt", BM=bm_small, BN=bn, BK=min(bk, G) if fmt == "int4" else bk,
                                       split=split, warps=warps, stages=3, ahead=ahead, xperm=xperm))
    elif M <= 256:
        # Row blocks of 128; the winners of the H100 sweep at M = 128-256 (int4
        # 1.2-2.4x faster than dequantise + cuBLAS, int8 1.1-1.3x than `mm`).
        for bn, warps in ((64, 4), (128, 8)):
            for bk in (64, 128):
                for split in (1, 2, 4):
                    add(Config("mmt", BM=128, BN=bn, BK=min(bk, G) if fmt == "int4" else bk, split=split,
                               warps=warps, stages=3))
    if M >= 64:
        add(CUBLAS)
    return out


def _time_us(fn, reps: int = 10) -> float:
    """GPU time of one call: a sleep kernel first lets the host queue all the
    launches, so host overhead does not pad the small kernels' times.

    The sleep has to outlast the host's queueing.  A fixed 1M-cycle sleep
    (about 0.6 ms) can end before ten split-K calls (a workspace allocation
    and two launches each) are queued; that is the likely reason the tuner
    ranked an int4 config that runs 11.5 µs in a CUDA graph below one that
    runs 21.7 µs (H100, commit 98cc3cf).  So the sleep is timed too, and
    doubled until the host finished queueing before it ended."""
    pre, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    fn()
    fn()
    best = float("inf")
    cycles, tries = 1_000_000, 0
    while tries < 3:
        pre.record()
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        if host_ms > pre.elapsed_time(start) and cycles < 1 << 30:
            cycles *= 2  # the GPU waited for the host: not a GPU time
            continue
        tries += 1
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def _precompile(compile_one, cands: list[Config]) -> None:
    """Compile the candidates on a thread pool (the Triton compiler's C++ passes
    and ptxas run in parallel); where Triton has no asynchronous compile mode,
    the timing loop compiles them one by one instead."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    try:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            with AsyncCompileMode(pool, ignore_errors=True):
                for cfg in cands:
                    try:
                        compile_one(cfg)
                    except Exception:  # noqa: BLE001 - reported by the timing loop
                        pass
    except Exception as exc:  # noqa: BLE001 - an optimisation only
        log.info("fusepass: parallel compile of dequant_matmul configs failed: %s", exc)


def cold_copies(nbytes: int, device: torch.device, limit: int = 16) -> int:
    """How many copies of ``nbytes`` of weights, called in turn, read each from
    memory and not from the L2, as a model's layers are read: three L2s' worth,
    at most ``limit`` and a quarter of the free memory (at least one).

    Timed on one weight, a weight that fits the L2 (every int4 and int8 shape
    of Llama-3-8B on an H100, 50 MB) is read from it after the first call, and
    the tuner ranked configs by that: the int4 k/v projection's plan (1024x4096,
    M = 1) ran 8.3 µs on cold weights against 3.9 for the best candidate
    (benchmarks/sweep_dequant_matmul_small_m.py, commit 1cf3eea)."""
    nbytes = max(1, nbytes)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(limit, cdiv(3 * l2, nbytes), free // 4 // nbytes))


def _cold_ring(weight: Tensor, scale: Tensor, zero: Tensor | None,
               limit: int = 16) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """The weight and its copies, ``cold_copies`` in all."""
    nbytes = sum(t.numel() * t.element_size() for t in (weight, scale, zero) if t is not None)
    copies = [(weight.clone(), scale.clone(), zero.clone() if zero is not None else None)
              for _ in range(cold_copies(nbytes, weight.device, limit) - 1)]
    return [(weight, scale, zero), *copies]


def tune(p: Problem, weight: Tensor | None = None, scale: Tensor | None = None, zero: Tensor | None = None,
         configs: list[Config] | None = None) -> tuple[Config, list[tuple[Config, float]]]:
    """Time ``configs`` (default: :func:`candidates`) at ``p.M`` rows of random x
    against this weight (default: a random one of ``p``'s shape on the current
    GPU), read from memory (see _cold_ring); (fastest, all times in µs per call)."""
    M, N, K, fmt, G, dtype = p.M, p.N, p.K, p.fmt, p.group, p.dtype
    if weight is None:
        weight, scale, zero = _random_weight(N, K, fmt, G, torch.device("cuda", torch.cuda.current_device()))
    device = weight.device
    x = torch.randn(M, K, dtype=dtype, device=device)
    out = torch.empty(M, N, dtype=dtype, device=device)
    cands = configs or candidates(p)
    times: list[tuple[Config, float]] = []
    with on_device(weight):
        ring = _cold_ring(weight, scale, zero)

        def calls(cfg: Config) -> None:
            for w, s, z in ring:
                _launch(x, w, s, z, None, out, fmt, G, cfg)

        _precompile(lambda cfg: _launch(x, weight, scale, zero, None, out, fmt, G, cfg, warmup=True), cands)
        for cfg in cands:
            try:
                us = _time_us(lambda: calls(cfg), reps=max(2, 16 // len(ring))) / len(ring)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
                log.info("fusepass: dequant_matmul config %s failed: %s", cfg.label(), exc)
                continue
            times.append((cfg, us))
    if not times:
        raise RuntimeError(f"no dequant_matmul config ran for {p.key}")
    return min(times, key=lambda t: t[1])[0], times


def tune_and_save(p: Problem) -> tuple[Config, float]:
    """Tune ``p`` on the current GPU and keep the fastest plan in the user cache; (plan, µs per call)."""
    best, times = tune(p)
    us = dict(times)[best]
    log.info("fusepass: dequant_matmul %s -> %s (%.1f µs)", p.key, best.label(), us)
    save(p, best, us)
    return best, us


def _random_weight(N: int, K: int, fmt: str, G: int, device: torch.device):
    if fmt == "int4":
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
        s = torch.rand(N, K // G, device=device, dtype=torch.bfloat16)
        return w, s, torch.full_like(s, 8.0)
    s = torch.rand(N, device=device, dtype=torch.bfloat16)
    if fmt == "int8":
        return torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device), s, None
    return torch.randn(N, K, device=device).to(torch.float8_e4m3fn), s, None
