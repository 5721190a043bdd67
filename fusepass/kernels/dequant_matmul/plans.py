"""Plans: which ``Config`` runs a ``Problem``, looked up, never measured here.

The lookup takes, in order: a plan measured on this machine (``fusepass
tune`` writes them to the user cache, ``FUSEPASS_DEQUANT_MATMUL_CACHE``,
default ``~/.cache/fusepass/dequant_matmul.json``), a plan shipped for this
GPU (``plans/<gpu>.json`` beside this file, measured on that GPU by
``python -m fusepass.bench.registry.dequant_matmul --tune``), then the heuristic.  It reads files
once and runs nothing on the GPU, so a rule's ``check`` can ask it while
compiling, the op asks it when it runs, and both get the same answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import asdict
from pathlib import Path

import torch

from fusepass.formats import KERNEL_DTYPES, LIBRARY_FORMATS
from fusepass.kernels._common import cdiv
from fusepass.kernels.dequant_matmul.config import (GEMV_MAX_M, CUBLAS, Config, Problem, _k_split, _pow2, codebook_chunk,
                                                    valid)

log = logging.getLogger("fusepass")

PLANS_DIR = Path(__file__).with_name("plans")


def _auto_split(programs: int, K: int, BK: int, n_sm: int) -> int:
    """K slices that bring ``programs`` to about four per SM (one slice when N alone does)."""
    want = max(1, (4 * n_sm) // max(1, programs))
    return max(1, min(want, K // BK, 16))


def _balanced_split(tiles: int, K: int, BK: int, n_sm: int) -> int:
    """K slices for ``tiles`` output tiles of K / BK steps each, where a
    program's time is bound by its SM's instruction issue: the busiest SM's K
    steps, ceil(programs / SMs) x (steps a slice + 2 for its partial sum's
    store and reload), least, with at least 1.5 programs per SM where a split
    of 16 or fewer allows it (148 programs on 132 SMs took 66 µs where 296
    took 32).  H200, int4 M 16 / 64: the measured fastest split, or one within
    3% of it, at the six MLP shapes timed (1.7-2 programs per SM; 288 programs
    of 13 steps took 33.0 µs where 256 of 14 took 26.7, bdce73c)."""
    k_tiles = cdiv(K, BK)
    best = None
    for s in range(1, min(16, k_tiles) + 1):
        k_split, n, _ = _k_split(K, BK, s)  # the slices a split of s gives
        steps = k_split // BK
        programs = tiles * n
        few = programs < 1.5 * n_sm and tiles * min(16, k_tiles) >= 1.5 * n_sm
        cost = (few, cdiv(programs, n_sm) * (steps + (2 if n > 1 else 0)), n)
        if best is None or cost < best[0]:
            best = (cost, n)
    return best[1]


def int4_gemv_bk(K: int, G: int, warps: int, chunks: int = 1) -> int:
    """The int4 GEMV's tile depth: each of the ``32 * warps`` threads holds
    ``chunks`` chunks of 16 bytes (32 values; fewer for G < 32) of every row of
    the block, so that no thread holds a copy of another's chunk."""
    per_chunk = 32 if G >= 32 else G
    return 32 * warps * chunks * per_chunk


def _int4_gemv(M: int, N: int, K: int, G: int, n_sm: int, warps: int = 4) -> Config:
    # Four warps (or ``warps``), one 16-byte chunk per thread and row (4096
    # values per tile), fewer warps where K is shorter, or where the rows alone
    # make too few programs and K must be split into more slices than whole
    # tiles allow; eight rows (four at M = 2) per program: 128 registers, four
    # programs per SM, 64 KB of loads in flight per SM (sm_90 compile,
    # benchmarks/sass_dequant_matmul.py).
    bn = 8 if M == 1 else 4
    few = cdiv(N, 8) * max(1, K // int4_gemv_bk(K, G, warps)) < 2 * n_sm
    if M == 1 and K <= 4096 and few and cdiv(N, 4) >= n_sm:
        # Too few programs of eight rows (a k/v projection): four rows a
        # program over the whole of K, no K slices (split-K's second pass
        # costs more than its programs give).  H200, 1024x4096 g128, cold
        # (f379d12): 3.85 µs (3.57 per code, the shipped plan) against 5.35
        # for eight rows, one warp, four slices.
        warps = 4
        while warps > 1 and 4 * int4_gemv_bk(K, G, warps) > 5 * K:
            warps //= 2
        return Config("gemv", BN=4, BK=int4_gemv_bk(K, G, warps), warps=warps, split=1)
    while warps > 1 and (4 * int4_gemv_bk(K, G, warps) > 5 * K  # at most a fifth of the tile past K
                         or cdiv(N, bn) * max(1, K // int4_gemv_bk(K, G, warps)) < 2 * n_sm):
        warps //= 2
    bk = int4_gemv_bk(K, G, warps)
    return Config("gemv", BN=bn, BK=bk, warps=warps, split=_auto_split(cdiv(N, bn), K, bk, n_sm))


def _hqq_gemv(M: int, N: int, K: int, n_sm: int) -> Config:
    # HQQ's pairs of rows (gemv._hqq_gemv) as the int4 GEMV: a 16-byte chunk per
    # thread and pair (16 values of each row: groups of 16 or more; smaller
    # groups give a thread several chunks), eight pairs per program at M = 1,
    # 8 x 16 bytes in flight per thread as int4's eight rows; fewer warps where
    # K is short or the pairs and whole tiles make too few programs.  Timed
    # as chosen, not swept (H200, 05d6c3f): 8.0 / 11.1 µs at M = 1 / 4 on
    # 4096x4096 g64, 0.97-1.22x fusepass int4's time at M = 1.
    bn = 8 if M == 1 else max(1, 8 // _pow2(M))
    warps = 4
    while warps > 1 and (4 * 512 * warps > 5 * K or cdiv(N // 2, bn) * max(1, K // (512 * warps)) < 2 * n_sm):
        warps //= 2
    bk = 512 * warps
    return Config("gemv", BN=bn, BK=bk, warps=warps, split=_auto_split(cdiv(N // 2, bn), K, bk, n_sm))


def _gptq_gemv(M: int, N: int, K: int, n_sm: int) -> Config:
    # GPTQ's words (gemv._gptq_gemv): 128 columns, one 16-byte load of four
    # words per thread and word row, eight word rows of a thread in flight per
    # tile at M = 1 (128 bytes, as the int4 GEMV), four at more rows (their
    # sums take the registers); the split brings the grid to about four
    # programs per SM.  Timed as chosen, not swept (H200, 05d6c3f): 9.9 /
    # 14.7 µs at M = 1 / 4 on 4096x4096 g128, 1.3-1.5x fusepass int4's time
    # at M = 1 (act-order: 18.3 / 22.6).
    bk = max(32, min(256 if M == 1 else 128, _pow2(K)))
    return Config("gemv", BN=128, BK=bk, warps=4, split=_auto_split(cdiv(N, 128), K, bk, n_sm))


def _library_mmt(p: Problem) -> Config | None:
    """The code books (NF4 / FP4) from five rows to 256 and HQQ from nine (on a
    large weight): the transposed kernel on words; None where no tile of 128,
    64 or 32 is ``valid`` (whole tiles of K, within or across blocks; HQQ's
    rows paired).  H200, blocks of 64, Llama-3-8B's shapes, cold (e76ba96 /
    b711263): NF4 17.1-48.6 µs at M = 4 against the GEMV's 14.5-43.7, 17.3-49.1
    at M = 8 against 27.6-86.8; HQQ 32.3-105.1 at M = 4-8 against its pairs
    GEMV's 11.4-62.7, 33.0-105.3 at M = 16 against the value-by-value ``mm``'s
    52.8-191.8.

    The code books' tiles: the absmax two tiles ahead, four warps, 64 rows (128
    64 deep at M = 32; 64 deep beyond), twice the balanced split: the fastest or
    within 1% of it of 34-72 configs at M = 8, 16, 32 on 4096x14336 and at
    M = 16, 32 on 14336x4096 (M = 64-256 not swept), 0.89-0.98x the time of
    int4's heuristic tiles on the same weights (41.8 against 47.4 µs at M = 16
    on 4096x14336; H200, 768b90f, benchmarks/sweep_dequant_library.py).  HQQ
    takes int4's tiles (its heuristic below), not swept."""
    M, N, K, n_sm = p.M, p.N, p.K, p.sms
    hqq = p.fmt == "hqq4"
    if not ((8 if hqq else 4) < M <= 256 and (N >= 2048 or not hqq) and p.dtype != torch.float32):
        return None
    bm = min(64 if M <= 64 else 128, max(16, _pow2(M)))
    codes = p.fmt in ("nf4", "fp4")
    bn = (128 if bm == 32 else 64) if codes else (128 if N >= 3072 and M <= 64 else 64)
    for bk in ((128, 64, 32) if not codes or bm == 16 else (64, 32)):
        split = _balanced_split(cdiv(N, bn) * cdiv(M, bm), K, bk, n_sm)
        if codes:
            cfg = Config("mmt", BM=bm, BN=bn, BK=bk, warps=4, stages=3, ahead=2, split=min(16, 2 * split, cdiv(K, bk)))
        else:
            cfg = Config("mmt", BM=bm, BN=bn, BK=bk, warps=8 if bm > 16 and bn == 128 else 4, stages=3,
                         ahead=1 if bm == 16 else 2, xperm=int(bm == 64), split=split)
        if valid(cfg, p):
            return cfg
    return None


def heuristic(p: Problem) -> Config:
    """The plan when there is no measured one (no entry for this GPU, the interpreter)."""
    M, N, K, fmt, G, dtype, n_sm = p.M, p.N, p.K, p.fmt, p.group, p.dtype, p.sms
    if fmt in LIBRARY_FORMATS:
        # The GEMV for a few rows (HQQ's, GPTQ's and the code books' with loops of their own),
        # the tensor-core kernel to 256 rows in 16-bit (the code books and HQQ on
        # words, _library_mmt; GPTQ value by value), dequantise + cuBLAS beyond;
        # timed in BENCHMARKS.md, only the code books' tiles swept.
        tc = _library_mmt(p) if fmt in ("nf4", "fp4", "hqq4") else None
        if tc is not None:
            return tc
        if M <= GEMV_MAX_M and fmt == "hqq4" and N % 2 == 0:
            return _hqq_gemv(M, N, K, n_sm)
        if M <= GEMV_MAX_M and fmt.startswith("gptq4"):
            return _gptq_gemv(M, N, K, n_sm)
        if M <= GEMV_MAX_M and fmt in ("nf4", "fp4") and codebook_chunk(G):
            # The code books run the int4 GEMV loop, a shuffle per value for
            # the conversion: the int4 GEMV's tiles, two warps at one row on
            # a weight taller than deep.  H200, NF4 blocks of 64, cold
            # (91db983): 17.3 / 21.5 µs against 18.9 / 21.9 with four warps
            # on 14336x4096 / 18944x3584; on 4096x14336 and 3584x18944 four
            # warps were faster (18.2 against 19.6, 21.6 against 23.8).
            return _int4_gemv(M, N, K, G, n_sm, 2 if M == 1 and N > K else 4)
        if M <= GEMV_MAX_M:
            bn = 8 if M == 1 else max(1, 8 // _pow2(M))
            return Config("gemv", BN=bn, BK=256, split=_auto_split(cdiv(N, bn), K, 256, n_sm), warps=4)
        if dtype == torch.float32 or M > 256:
            return CUBLAS
        bm = min(64, max(16, _pow2(M)))
        return Config("mm", BM=bm, BN=64, BK=64, split=_auto_split(cdiv(M, bm) * cdiv(N, 64), K, 64, n_sm),
                      warps=4, stages=3)
    if M > (2 if fmt == "int4" else 1) and N >= 2048 and (fmt != "int4" or G % 32 == 0) and dtype != torch.float32 \
            and M <= 64:
        # A few rows to 64 on a large weight: the transposed kernel (rows padded
        # to 16) ran 0.67-0.90x the GEMV's time, cold, at int4 M = 4-8 and int8 /
        # fp8 M = 2-8 on Llama-3-8B's 4096- and 14336-row shapes (H100, 33abe0c
        # and 0e2b217), and won 26 of 27 keys of M = 16-64.  Tiles of 128 rows:
        # fewer fixed instructions per value in the loop (sm_90: int4 4.6 per
        # value against 5.4 at 64 rows); the split brings the grid to about
        # two programs per SM.
        bk = min(128, G) if fmt == "int4" else 128
        bm = min(64, max(16, _pow2(M)))
        bn = 128 if N >= 4096 else 64
        if fmt == "int4" and bk == 128:
            # int4: the scales loaded a tile ahead at 16 rows, two with eight
            # warps beyond, and there x copied into the tile's K order first.
            # The fastest of 45 configs at 11 of 12 keys (M 16 and 64,
            # Llama-3-8B's, Qwen2-7B's and a 5120x13824 MLP's shapes; H200,
            # 491bb10) was this tile; x's copy 43.9 against 48.9 µs at M 64 on
            # 14336x4096, level on 4096x14336, slower at M 16 (bdce73c).  Not
            # timed on the H100, which takes the same choice.
            bn = 128 if N >= 3072 else 64  # (3584x18944: 32.3 µs at M 16 against 35.0 with 64 rows)
            return Config("mmt", BM=bm, BN=bn, BK=bk, warps=8 if bm > 16 and bn == 128 else 4, stages=3,
                          ahead=1 if bm == 16 else 2, xperm=int(bm == 64),
                          split=_balanced_split(cdiv(N, bn) * cdiv(M, bm), K, bk, n_sm))
        return Config("mmt", BM=bm, BN=bn, BK=bk, warps=4, stages=3,
                      split=max(1, _auto_split(cdiv(N, bn) * cdiv(M, bm), K, bk, n_sm) // 2))
    if M <= GEMV_MAX_M:
        if fmt == "int4" and (G % 32 == 0 or G in (2, 4, 8, 16)):
            # int4 at one token: eight rows, two warps (2048 values a tile) below
            # K = 16384.  H200, g128, cold, six MLP shapes, the zero point off each
            # chunk's sum (bf367f9): the fastest of 18 configs at three shapes,
            # within 5% of it at the other three (3584x18944 17.9 µs against
            # 17.0, 5120x13824 19.2 against 18.2).  The code books keep four
            # warps above (not measured).
            return _int4_gemv(M, N, K, G, n_sm, 2 if M == 1 and K < 16384 else 4)
        bk = 512
        bn = 8 if M == 1 else max(1, 8 // _pow2(M))
        return Config("gemv", BN=bn, BK=bk, split=_auto_split(cdiv(N, bn), K, bk, n_sm), warps=4)
    if dtype == torch.float32 or M > 256:
        return CUBLAS
    bm = min(64 if M <= 64 else 128, max(16, _pow2(M)))
    if fmt != "int4" or G % 32 == 0:
        # The transposed kernel won 16 of 18 keys at M = 128-256 on the H100
        # (cold weights, Llama-3-8B shapes), mostly with these tiles; the split is
        # half the one that brings the grid to four programs per SM.
        bk = min(128, G) if fmt == "int4" else 128
        return Config("mmt", BM=bm, BN=64, BK=bk, warps=4, stages=3,
                      split=max(1, _auto_split(cdiv(N, 64) * cdiv(M, bm), K, bk, n_sm) // 2))
    bk = min(64, G) if fmt == "int4" else 64
    bn = 64 if M <= 64 else 128
    progs = cdiv(M, bm) * cdiv(N, bn)
    return Config("mm", BM=bm, BN=bn, BK=bk, split=_auto_split(progs, K, bk, n_sm), warps=4, stages=3)


# -- the plan files ---------------------------------------------------------------

_lock = threading.Lock()
_shipped: dict[str, dict[str, dict]] = {}  # GPU name -> its shipped plans
_user: dict[str, dict] | None = None  # the user cache, read once
_looked_up: dict[Problem, Config] = {}


def shipped_path(gpu: str) -> Path:
    """The shipped plan file of a GPU: its name, lower case, other characters as dashes."""
    return PLANS_DIR / (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json")


def cache_path() -> Path | None:
    env = os.environ.get("FUSEPASS_DEQUANT_MATMUL_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusepass" / "dequant_matmul.json"


def read(path: Path | None) -> dict[str, dict]:
    """The ``plans`` of a plan file ({key: Config fields and the measured "us"})."""
    if path is None or not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("plans", {}))
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("fusepass: ignoring unreadable plan file %s (%s)", path, exc)
        return {}


def _user_plans() -> dict[str, dict]:
    global _user
    if _user is None:
        _user = read(cache_path())
    return _user


def _shipped_plans(gpu: str) -> dict[str, dict]:
    plans = _shipped.get(gpu)
    if plans is None:
        plans = _shipped[gpu] = read(shipped_path(gpu))
    return plans


def from_entry(entry: dict) -> Config:
    return Config(**{k: v for k, v in entry.items() if k in Config.__dataclass_fields__})


def lookup(p: Problem) -> Config:
    """The plan for ``p``: measured here, shipped for this GPU, or the heuristic."""
    cfg = _looked_up.get(p)
    if cfg is not None:
        return cfg
    with _lock:
        entry = _user_plans().get(p.key) or _shipped_plans(p.gpu).get(p.key)
        cfg = from_entry(entry) if entry is not None else None
        if cfg is None or not valid(cfg, p):
            cfg = heuristic(p)
        _looked_up[p] = cfg
    return cfg


def looked_up() -> dict[Problem, Config]:
    """The problems this process looked a plan up for so far, with the plan each got."""
    with _lock:
        return dict(_looked_up)


def pin(p: Problem, cfg: Config | None) -> None:
    """Make later lookups of ``p`` in this process return ``cfg`` (``fusepass tune
    --step`` trying a plan in a model; None: read the plan files again).  A
    graph that inlined the op keeps the plan it chose; op calls look it up at
    every call."""
    with _lock:
        if cfg is None:
            _looked_up.pop(p, None)
        else:
            _looked_up[p] = cfg


def measured(p: Problem) -> dict | None:
    """The plan file entry for ``p`` (with its measured "us"), if any."""
    with _lock:
        return _user_plans().get(p.key) or _shipped_plans(p.gpu).get(p.key)


def save(p: Problem, cfg: Config, us: float, where: str | None = None) -> None:
    """Keep a measured plan in the user cache (and in memory: later lookups in
    this process see it; compiled graphs that chose the old one recompile, as
    :func:`fingerprint` changes).  ``us``: the kernel's time, or with ``where``
    what was timed instead ("step": a model's decode step)."""
    entry = {**asdict(cfg), "us": round(us, 2), **({"where": where} if where else {})}
    with _lock:
        _user_plans()[p.key] = entry
        _looked_up.clear()
        path = cache_path()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = read(path)
            data[p.key] = entry
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"plans": dict(sorted(data.items()))}, indent=0))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("fusepass: could not save the dequant_matmul plan to %s (%s)", path, exc)


def fingerprint() -> str:
    """A digest of every plan a lookup may return: compiled graphs keep the
    plans they chose, so the compile cache's key includes it."""
    h = hashlib.sha256()
    with _lock:
        for path in sorted(PLANS_DIR.glob("*.json")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        h.update(json.dumps(_user_plans(), sort_keys=True).encode())
    return h.hexdigest()


def reset() -> None:
    """Forget the files read (tests; a cache written by another process)."""
    global _user
    with _lock:
        _user = None
        _shipped.clear()
        _looked_up.clear()


_PLAN_NAMES = {"gemv": "gemv", "mm": "tensor-core", "mmt": "tensor-core", "cublas": "dequant+cublas"}


def plan_name(cfg: Config) -> str:
    """"gemv" or "tensor-core" (fused kernels), or "dequant+cublas" (the weight dequantised, then ``torch.mm``)."""
    return _PLAN_NAMES[cfg.kind]


def dequant_matmul_plan(M: int, N: int, K: int, fmt: str, group_size: int, dtype: torch.dtype,
                        device: torch.device | str) -> str:
    """How the op runs this shape: :func:`plan_name` of its plan, or "reference"
    (fp64 and other dtypes, and non-CUDA devices run plain torch)."""
    device = torch.device(device)
    if dtype not in KERNEL_DTYPES or device.type != "cuda":
        return "reference"
    return plan_name(lookup(Problem.of(M, N, K, fmt, group_size, dtype, device)))
